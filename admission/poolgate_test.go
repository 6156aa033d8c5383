package admission

import (
	"context"
	"sync/atomic"
	"testing"
)

// fakePool is a PoolView with settable health and signal.
type fakePool struct {
	closed    atomic.Int64
	saturated atomic.Bool
}

func (p *fakePool) ClosedUpstreams() int { return int(p.closed.Load()) }
func (p *fakePool) Saturated() bool      { return p.saturated.Load() }
func (p *fakePool) Holds(string) bool    { return true }

// TestPoolGateCapacityFollowsClosedUpstreams: per_upstream 2 over three
// closed upstreams admits 6; with one closed, 2; a reload's settings (a
// fixed capacity of 1) apply at once; the pool signal refuses sheddable
// tiers even below capacity.
func TestPoolGateCapacityFollowsClosedUpstreams(t *testing.T) {
	pool := new(fakePool)
	pool.closed.Store(3)
	g := NewPoolGate(GateSettings{PerUpstream: 2, Pool: pool}, nil, nil, nil)
	tier := Tier{Name: "std"}
	shed := Tier{Name: "batch", Priority: -1}
	admit := func(n int) (rels []func()) {
		for range n {
			rel, _, err := g.Acquire(context.Background(), "acme", shed)
			if err != nil {
				break
			}
			rels = append(rels, rel)
		}
		return rels
	}
	releaseAll := func(rels []func()) {
		for _, r := range rels {
			r()
		}
	}
	if rels := admit(10); len(rels) != 6 {
		t.Fatalf("per_upstream 2 × 3 closed upstreams admitted %d, want 6", len(rels))
	} else {
		releaseAll(rels)
	}
	pool.closed.Store(1)
	if rels := admit(10); len(rels) != 2 {
		t.Fatalf("per_upstream 2 × 1 closed upstream admitted %d, want 2", len(rels))
	} else {
		releaseAll(rels)
	}
	pool.closed.Store(0)
	if rels := admit(10); len(rels) != 2 {
		t.Fatalf("with no closed upstream admitted %d, want one upstream's worth, 2", len(rels))
	} else {
		releaseAll(rels)
	}
	g.SetSettings(GateSettings{Capacity: 1, Pool: pool})
	if rels := admit(10); len(rels) != 1 {
		t.Fatalf("after SetSettings to capacity 1 admitted %d, want 1", len(rels))
	} else {
		releaseAll(rels)
	}
	pool.saturated.Store(true)
	if _, _, err := g.Acquire(context.Background(), "acme", shed); err == nil {
		t.Fatal("a saturated pool admitted a sheddable tier")
	}
	if !g.Saturated() {
		t.Fatal("the gate does not report its saturated pool")
	}
	pool.saturated.Store(false)
	rel, _, err := g.Acquire(context.Background(), "acme", tier)
	if err != nil {
		t.Fatalf("the pool signal cleared, yet: %v", err)
	}
	rel()
}
