package breaker_test

import (
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// An upstream's shared record counts each outcome once by class, ignores
// neutral ones, and forgets what left its window.
func TestOutcomesCountByClassWithinTheWindow(t *testing.T) {
	clk := newClock()
	o := breaker.NewOutcomes(10*time.Second, clk)
	for _, out := range []breaker.Outcome{breaker.Success, breaker.Failure, breaker.Down, breaker.Neutral, breaker.Success} {
		o.Record(out)
	}
	if got, want := o.Counts(), (breaker.OutcomeCounts{Requests: 4, Failures: 2, Down: 1}); got != want {
		t.Fatalf("counts %+v, want %+v", got, want)
	}
	clk.Advance(5 * time.Second)
	o.Record(breaker.Down)
	clk.Advance(6 * time.Second)
	if got, want := o.Counts(), (breaker.OutcomeCounts{Requests: 1, Failures: 1, Down: 1}); got != want {
		t.Fatalf("counts 11 s on %+v, want %+v (the first four forgotten)", got, want)
	}
}

func BenchmarkOutcomesRecord(b *testing.B) {
	o := breaker.NewOutcomes(10*time.Second, nil)
	b.ReportAllocs()
	for b.Loop() {
		o.Record(breaker.Failure)
	}
}
