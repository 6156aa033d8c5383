package breaker_test

import (
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// TestExactlyOneProbeWhenManyArriveAtOnce: in each of 1,000 rounds, 64
// goroutines released by one barrier reach an open breaker whose cooldown
// is over; exactly one of them becomes the probe.
func TestExactlyOneProbeWhenManyArriveAtOnce(t *testing.T) {
	const rounds, callers = 1000, 64
	clk := newClock()
	b := breaker.New("up1", breaker.Settings{}, breaker.WithClock(clk), noJitter)
	for round := range rounds {
		for range 3 {
			p, _ := b.Allow()
			p.Done(breaker.Failure, 0, "")
		}
		if b.State() != breaker.Open {
			t.Fatalf("round %d: state %s, want open", round, b.State())
		}
		clk.Advance(time.Minute)

		var ready, done sync.WaitGroup
		start := make(chan struct{})
		var probes, permits atomic.Int32
		var winner breaker.Permit
		ready.Add(callers)
		done.Add(callers)
		for range callers {
			go func() {
				defer done.Done()
				ready.Done()
				<-start
				p, ok := b.Allow()
				if !ok {
					return
				}
				permits.Add(1)
				if p.Probe() {
					probes.Add(1)
					winner = p
				}
			}()
		}
		ready.Wait()
		close(start)
		done.Wait()
		if probes.Load() != 1 || permits.Load() != 1 {
			t.Fatalf("round %d: %d permits, %d probes; want exactly one probe", round, permits.Load(), probes.Load())
		}
		// Alternate endings so rounds cover both re-open and close.
		if round%2 == 0 {
			winner.Done(breaker.Failure, 0, "")
			b.Reset()
		} else {
			b.ForceClose("")
			winner.Done(breaker.Failure, 0, "") // stale: ignored
		}
		if b.State() != breaker.Closed {
			t.Fatalf("round %d: not closed after reset", round)
		}
	}
}

// TestConcurrentUse hammers one breaker with every operation at once; run
// with -race. Invariants: probes in flight never exceed the limit, and the
// listener sees a consistent chain of transitions.
func TestConcurrentUse(t *testing.T) {
	clk := newClock()
	var mu sync.Mutex
	last := breaker.Closed
	chained := true
	s := breaker.Settings{HalfOpenProbes: 2, FailureRatio: 0.5, MinRequests: 5, SlowTTFT: time.Second,
		SlowRatio: 0.5, Failures: 5, MinOpen: -1, OpenFor: time.Millisecond, MaxOpen: 10 * time.Millisecond}
	b := breaker.New("up1", s, breaker.WithClock(clk), breaker.WithListener(func(tr breaker.Transition) {
		mu.Lock()
		if tr.From != last {
			chained = false
		}
		last = tr.To
		mu.Unlock()
	}))
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), 1))
			for range 3000 {
				switch n := r.IntN(100); {
				case n < 1:
					clk.Advance(time.Millisecond)
				case n < 2:
					b.ExtendOpen(time.Duration(r.IntN(5))*time.Millisecond, "")
				case n == 2 && g == 0:
					b.Reset()
				case n == 3 && g == 1:
					b.SetSettings(s)
				case n < 6:
					_ = b.Snapshot()
					_ = b.RetryAt()
				case n < 8:
					if b.ProbeDue() {
						p, _ := b.AllowProbe()
						p.Done(breaker.Outcome(r.IntN(3)), 0, "")
					}
				default:
					p, ok := b.Allow()
					if ok && b.Snapshot().ProbesInFlight > 2 {
						t.Error("more than HalfOpenProbes probes in flight")
					}
					p.Done(breaker.Outcome(r.IntN(3)), time.Duration(r.IntN(2000))*time.Millisecond, "")
				}
			}
		}()
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	if !chained {
		t.Error("listener saw transitions out of order")
	}
	if last != b.State() {
		t.Errorf("listener's last state %s, breaker %s", last, b.State())
	}
}
