package breaker_test

import (
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/breaker/breakertest"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// BenchmarkClosedAllowDone measures the hot path, a permit and a successful
// record in the closed state, under parallel load. Run with -cpu 1,2,8.
//
//   - defaults: consecutive-failures rule only; Done reads no clock.
//   - all_rules: every rule on (failure ratio, slow TTFT, slow ratio,
//     failures within a window): Done reads the system clock and counts the
//     request in the rolling window's current bucket, shared by all
//     goroutines.
//   - *_fleet: the same, joined to a Fleet (SharedMemory) whose count is
//     zero: a success reads the fleet's flag and calls nothing. Issue 10
//     wants these within 1.1× of the local cases.
func BenchmarkClosedAllowDone(b *testing.B) {
	allRules := breaker.Settings{Failures: 10, FailureRatio: 0.5, SlowTTFT: 5 * time.Second, SlowRatio: 0.5}
	cases := []struct {
		name  string
		s     breaker.Settings
		fleet bool
	}{
		{"defaults", breaker.Settings{}, false},
		{"all_rules", allRules, false},
		{"defaults_fleet", breaker.Settings{}, true},
		{"all_rules_fleet", allRules, true},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			var opts []breaker.Option
			if c.fleet {
				opts = append(opts, breaker.WithStore(breakertest.NewSharedMemory(nil, 1).Instance("gw0")))
			}
			br := breaker.New("up1", c.s, opts...)
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					p, ok := br.Allow()
					if !ok {
						b.Fatal("refused")
					}
					p.Done(breaker.Success, 300*time.Millisecond, "")
				}
			})
			if br.State() != breaker.Closed {
				b.Fatal("not closed")
			}
		})
	}
}

// BenchmarkOpenAllow measures a refusal by an open breaker during its
// cooldown: what every request pays per open upstream it skips.
func BenchmarkOpenAllow(b *testing.B) {
	br := breaker.New("up1", breaker.Settings{})
	br.ForceOpen(time.Hour, "bench")
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, ok := br.Allow(); ok {
				b.Fatal("allowed")
			}
		}
	})
}

// BenchmarkSystemClockNow is the floor under the all_rules case and
// BenchmarkOpenAllow: one clock.Real.Now per operation. It depends on the
// host (vDSO clock_gettime: ~20 ns on bare metal; several times that in
// some VMs).
func BenchmarkSystemClockNow(b *testing.B) {
	var c clock.Reader = clock.Real
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		var t time.Time
		for pb.Next() {
			t = c.Now()
		}
		_ = t
	})
}

// BenchmarkObservedAllow measures a refusal by a breaker that TripObserved
// opened, with its cooldown over: what every request pays per saturated
// upstream it skips. It takes no lock and reads no clock.
func BenchmarkObservedAllow(b *testing.B) {
	br := breaker.New("up1", breaker.Settings{OpenFor: time.Nanosecond, MinOpen: -1})
	br.TripObserved("bench")
	time.Sleep(time.Millisecond) // the cooldown is over
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, ok := br.Allow(); ok {
				b.Fatal("allowed")
			}
		}
	})
}
