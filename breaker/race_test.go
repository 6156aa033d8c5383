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
				case n == 8:
					b.TripObserved("saturated")
				case n < 11:
					b.Observe(breaker.Observation(r.IntN(3)), "")
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

// TestObservedTripNeverAdmits hammers a breaker that only observations trip
// (no trip rule can fire) with TripObserved and Observe concurrent with
// Allow/Done, AllowProbe, ProbeDue, RetryAt and Snapshot; run with -race.
// Invariants: no probe permit is ever given, to users or synthetic probes,
// and the listener sees a consistent chain of transitions.
func TestObservedTripNeverAdmits(t *testing.T) {
	clk := newClock()
	var mu sync.Mutex
	last := breaker.Closed
	chained := true
	s := breaker.Settings{ConsecutiveFailures: -1, MinOpen: -1, OpenFor: time.Millisecond, MaxOpen: 10 * time.Millisecond}
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
			r := rand.New(rand.NewPCG(uint64(g), 2))
			for range 3000 {
				switch n := r.IntN(100); {
				case n < 2:
					clk.Advance(time.Millisecond)
				case n < 4:
					b.TripObserved("saturated")
				case n < 20:
					b.Observe(breaker.Observation(r.IntN(3)), "")
				case n < 24:
					_ = b.Snapshot()
					_ = b.RetryAt()
					_ = b.Observed()
				case n < 30:
					if b.ProbeDue() {
						t.Error("probe due on a breaker only observations trip")
					}
					if p, ok := b.AllowProbe(); ok {
						t.Error("synthetic probe admitted")
						p.Done(breaker.Success, 0, "")
					}
				default:
					p, ok := b.Allow()
					if ok && p.Probe() {
						t.Error("user call admitted as a probe")
					}
					p.Done(breaker.Outcome(r.IntN(3)), 0, "")
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

// TestConcurrentHealthyObservationsCloseOnce: in each round, 64 goroutines
// released by one barrier observe an observed breaker whose cooldown is
// over as healthy; with RecoverySuccesses 64 it half-opens once, counts each
// observation once, and closes once.
func TestConcurrentHealthyObservationsCloseOnce(t *testing.T) {
	const rounds, observers = 200, 64
	clk := newClock()
	var mu sync.Mutex
	var trs []breaker.Transition
	b := breaker.New("up1", breaker.Settings{RecoverySuccesses: observers}, breaker.WithClock(clk), noJitter,
		breaker.WithListener(func(tr breaker.Transition) {
			mu.Lock()
			trs = append(trs, tr)
			mu.Unlock()
		}))
	for round := range rounds {
		b.TripObserved("saturated")
		clk.Advance(time.Minute)
		var ready, done sync.WaitGroup
		start := make(chan struct{})
		ready.Add(observers)
		done.Add(observers)
		for range observers {
			go func() {
				defer done.Done()
				ready.Done()
				<-start
				b.Observe(breaker.ObservedHealthy, "")
				p, ok := b.Allow()
				if ok && p.Probe() {
					t.Error("probe permit while observed")
				}
				p.Done(breaker.Neutral, 0, "")
			}()
		}
		ready.Wait()
		close(start)
		done.Wait()
		mu.Lock()
		got := trs
		trs = nil
		mu.Unlock()
		if len(got) != 3 || got[1].To != breaker.HalfOpen || got[2].To != breaker.Closed ||
			got[2].Reason != "64 consecutive healthy observations" {
			t.Fatalf("round %d: transitions %+v", round, got)
		}
		if b.State() != breaker.Closed || b.Observed() {
			t.Fatalf("round %d: state %s, observed %v", round, b.State(), b.Observed())
		}
	}
}
