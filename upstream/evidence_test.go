package upstream

import (
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// An upstream's shared evidence, as the admin API shows it beside every
// handler's breaker: a run of refused connections through one handler,
// which a long stream begun before the run and ending well does not
// break, nor date as a sign of life, and an answer to a newer attempt
// through another handler does; the Retry-After the upstream asked for. Handlers
// with breakers off add to it too.
func TestUpstreamEvidenceIsSharedAndSettingsFree(t *testing.T) {
	clk := clocktest.New(simT0)
	reg := NewRegistry(nil)
	reg.UseClock(clk)
	const addr = "10.7.3.1:8000"
	gen := reg.NextGeneration()
	a := startPool(t, reg, Config{Generation: gen, Key: "a", Handler: "a", Static: targets(addr),
		Breaker: &breaker.Settings{ConsecutiveFailures: 10}})
	off := startPool(t, reg, Config{Generation: gen, Key: "off", Handler: "off", Static: targets(addr)})
	e, _ := reg.Entry(addr)

	longStream := mustPick(t, a, "")
	clk.Advance(time.Second)
	for range 2 {
		finish(mustPick(t, a, ""), proxy.AttemptConnectError)
	}
	runStart := simT0.Add(time.Second)
	finish(mustPick(t, off, ""), proxy.AttemptConnectError)
	clk.Advance(time.Second)
	finish(longStream, proxy.AttemptSuccess)
	ev := e.Evidence()
	if ev.DownRun != 3 || !ev.DownSince.Equal(runStart) || ev.Recent.Down != 3 || ev.Recent.Requests != 4 {
		t.Fatalf("after 3 refused connections and an older stream ending well: %+v, want a run of 3 since %v", ev, runStart)
	}
	if !ev.LastSignOfLife.IsZero() {
		t.Fatalf("last sign of life %v, want none: the only answer was to an attempt older than the run", ev.LastSignOfLife)
	}
	up := mustPick(t, off, "")
	up.Done(&proxy.AttemptReport{Upstream: addr, Outcome: proxy.AttemptHTTP5xx, Status: 503, RetryAfter: 30 * time.Second})
	ev = e.Evidence()
	if ev.DownRun != 0 || !ev.DownSince.IsZero() || !ev.LastSignOfLife.Equal(simT0.Add(2*time.Second)) {
		t.Fatalf("after a newer attempt was answered: %+v, want the run ended and a sign of life at %v", ev, simT0.Add(2*time.Second))
	}
	if want := simT0.Add(32 * time.Second); !ev.RetryAfterUntil.Equal(want) {
		t.Fatalf("retry-after until %v, want %v", ev.RetryAfterUntil, want)
	}
	if st := a.BreakerState(addr, ""); st != "open" {
		t.Fatalf("handler a's breaker after the upstream's Retry-After (heard from a handler with breakers off): %s, want open", st)
	}
	views := reg.Breakers()
	if len(views) != 1 || views[0].UpstreamEvidence != ev {
		t.Fatalf("admin view %+v, want handler a's breaker with the upstream's evidence %+v", views, ev)
	}
}
