package admission

import (
	"context"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/registry"
)

// addrPool is a fakePool that holds some dial addresses.
type addrPool struct {
	fakePool
	addrs []string
}

func (p *addrPool) Holds(addr string) bool { return slices.Contains(p.addrs, addr) }

// TestWakePumpsOnlyTheGatesOfTheUpstreamsPools: two gates, per_upstream 1,
// over pools {a} and {b}, each with its one slot taken and a request
// queued. Both pools' upstreams come back (capacity 2), which the gates
// learn only when pumped. Wake("a") admits the request queued at a's gate
// at once and leaves b's gate alone: its request stays queued until
// Wake("b").
func TestWakePumpsOnlyTheGatesOfTheUpstreamsPools(t *testing.T) {
	set := NewGateSet()
	claims := new(registry.Claims)
	defer claims.Release()
	pa, pb := &addrPool{addrs: []string{"a"}}, &addrPool{addrs: []string{"b"}}
	gate := func(key string, p *addrPool) *Gate {
		g, err := set.Acquire(claims, key, func() (*Gate, error) {
			return NewPoolGate(GateSettings{PerUpstream: 1, Pool: p}, nil, nil, nil), nil
		}, nil)
		if err != nil {
			t.Fatal(err)
		}
		return g
	}
	ga, gb := gate("pool a", pa), gate("pool b", pb)
	tier := Tier{Name: "std", QueueTimeout: time.Minute}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, g := range []*Gate{ga, gb} {
		rel, _, err := g.Acquire(ctx, "acme", tier)
		if err != nil {
			t.Fatal(err)
		}
		defer rel()
		go func() {
			if rel, _, err := g.Acquire(ctx, "acme", tier); err == nil {
				defer rel()
				<-ctx.Done()
			}
		}()
	}
	counts := func(g *Gate) (inflight, queued int) {
		g.mu.Lock()
		defer g.mu.Unlock()
		if c := g.tiers["std"]; c != nil {
			queued = c.queued
		}
		return g.inflight, queued
	}
	for deadline := time.Now().Add(5 * time.Second); ; runtime.Gosched() {
		_, qa := counts(ga)
		_, qb := counts(gb)
		if qa == 1 && qb == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("queued requests: %d at a's gate, %d at b's; want 1 and 1", qa, qb)
		}
	}
	pa.closed.Store(2)
	pb.closed.Store(2)

	set.Wake("a")
	if in, q := counts(ga); in != 2 || q != 0 {
		t.Errorf("a's gate after Wake(a): %d in flight, %d queued; want its queued request admitted (2, 0)", in, q)
	}
	if in, q := counts(gb); in != 1 || q != 1 {
		t.Errorf("b's gate after Wake(a): %d in flight, %d queued; want it left alone (1, 1)", in, q)
	}
	set.Wake("b")
	if in, q := counts(gb); in != 2 || q != 0 {
		t.Errorf("b's gate after Wake(b): %d in flight, %d queued; want its queued request admitted (2, 0)", in, q)
	}
}
