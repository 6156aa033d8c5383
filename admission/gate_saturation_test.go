package admission

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// poolSignal is a settable pool signal for GateConfig.Saturated.
type poolSignal struct{ on atomic.Bool }

func (s *poolSignal) saturated() bool { return s.on.Load() }

func saturatedGate(capacity func() int) (*Gate, *poolSignal, *clocktest.Fake, *recObserver) {
	sig := new(poolSignal)
	sig.on.Store(true)
	clock, obs := newFakeClock(), newRec()
	g := NewGate(GateConfig{Capacity: capacity, Saturated: sig.saturated}, clock, obs)
	return g, sig, clock, obs
}

// TestSaturatedPoolRefusesSheddableTiers: with the pool signal on, a tier
// of priority < 0 is refused at once with 429 saturated, even though the
// capacity is unlimited and nothing is in flight.
func TestSaturatedPoolRefusesSheddableTiers(t *testing.T) {
	for _, capacity := range []func() int{nil, fixed(0), fixed(8)} {
		g, _, _, obs := saturatedGate(capacity)
		_, _, err := g.Acquire(context.Background(), "b", shed)
		var r *Refusal
		if !errors.As(err, &r) || r.Code != CodeSaturated || r.Status != 429 || r.RetryAfter != time.Second {
			t.Fatalf("got %v, want a 429 saturated refusal", err)
		}
		if !strings.Contains(r.Message, "queue or KV-cache threshold") {
			t.Errorf("message %q does not say why the pool is saturated", r.Message)
		}
		if obs.lastDecision() != "b/shed/saturated" || !g.Saturated() {
			t.Fatalf("decision %q, Saturated %v", obs.lastDecision(), g.Saturated())
		}
	}
}

// TestSaturatedPoolQueuesByPriorityAndAdmitsWhenTheSignalClears: tiers of
// priority ≥ 0 wait while the signal is on, and are admitted, highest
// first, when it clears and the gate is pumped (the glue does after each
// scrape); their wait is the queue time.
func TestSaturatedPoolQueuesByPriorityAndAdmitsWhenTheSignalClears(t *testing.T) {
	g, sig, clock, obs := saturatedGate(fixed(1))
	lowCh := enqueue(t, g, "l", low)
	highCh := enqueue(t, g, "h", high)
	clock.Advance(2 * time.Second)
	if !g.Saturated() {
		t.Fatal("pumped while the signal is on: a request left the queue")
	}
	queued(t, g, 2)

	sig.on.Store(false)
	if !g.Saturated() { // capacity 1: the head takes it, the pool is full again
		t.Fatal("after the head was admitted the capacity of 1 should be full")
	}
	a := <-highCh
	if a.err != nil || a.waited != 2*time.Second {
		t.Fatalf("high: waited %s, %v", a.waited, a.err)
	}
	if obs.lastDecision() != "h/high/queued_admitted" {
		t.Fatalf("decision %q", obs.lastDecision())
	}
	queued(t, g, 1)
	a.rel()
	b := <-lowCh
	if b.err != nil {
		t.Fatalf("low: %v", b.err)
	}
	b.rel()
}

// TestSaturatedPoolWithUnlimitedCapacityStillQueues: unlimited capacity
// does not bypass the pool signal; clearing it admits every waiter.
func TestSaturatedPoolWithUnlimitedCapacityStillQueues(t *testing.T) {
	g, sig, _, _ := saturatedGate(nil)
	chs := []chan acquired{enqueue(t, g, "a", low), enqueue(t, g, "b", mid), enqueue(t, g, "c", high)}
	sig.on.Store(false)
	if g.Saturated() {
		t.Fatal("signal cleared, capacity unlimited: still saturated")
	}
	for _, ch := range chs {
		if a := <-ch; a.err != nil {
			t.Fatalf("%s: %v", a.name, a.err)
		}
	}
}

// TestReleaseReChecksThePoolSignal: a release under capacity does not
// admit the queue's head while the pool signal is on.
func TestReleaseReChecksThePoolSignal(t *testing.T) {
	g, sig, _, _ := saturatedGate(fixed(4))
	sig.on.Store(false)
	rel := mustAcquire(t, g, "holder", low)
	sig.on.Store(true)
	ch := enqueue(t, g, "w", low)
	rel()
	queued(t, g, 1)
	select {
	case a := <-ch:
		t.Fatalf("admitted by a release while saturated: %v", a.err)
	default:
	}
	sig.on.Store(false)
	g.Saturated()
	if a := <-ch; a.err != nil {
		t.Fatal(a.err)
	}
}

// TestSaturatedQueueTimesOut: a request queued behind the pool signal is
// refused at its tier's queue_timeout, never admitted late.
func TestSaturatedQueueTimesOut(t *testing.T) {
	g, sig, clock, _ := saturatedGate(nil)
	tier := Tier{Name: "std", QueueTimeout: time.Second}
	ch := enqueue(t, g, "a", tier)
	clock.Advance(time.Second)
	sig.on.Store(false)
	g.Saturated()
	if a := <-ch; refusalCode(a.err) != CodeQueueTimeout {
		t.Fatalf("got %v, want queue_timeout", a.err)
	}
}

// TestAcquireSlotWithPoolSignalAllocatesNothing: consulting the pool signal
// keeps the admission hot path allocation-free.
func TestAcquireSlotWithPoolSignalAllocatesNothing(t *testing.T) {
	sig := new(poolSignal)
	g := NewGate(GateConfig{Capacity: fixed(4), Saturated: sig.saturated}, newFakeClock(), nil)
	tier := Tier{Name: "std"}
	var slot Slot
	ctx := context.Background()
	if n := testing.AllocsPerRun(1000, func() {
		if _, err := g.AcquireSlot(ctx, "acme", tier, &slot); err != nil {
			t.Fatal(err)
		}
		slot.Release()
	}); n != 0 {
		t.Fatalf("AcquireSlot + Release allocate %v times, want 0", n)
	}
}
