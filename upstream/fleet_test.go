package upstream

import (
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/breaker/breakertest"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// A breaker the entry drops leaves its fleet, so that the fleet's pushes
// stop reaching it: when a reload turns breakers off, and when the entry
// is destroyed.
func TestDroppedBreakersLeaveTheFleet(t *testing.T) {
	sm := breakertest.NewSharedMemory(nil, 1)
	// Breakers are named in a store by upstream and policy.
	pol := policyFingerprint(&breaker.Settings{}, nil, false)
	joined := func(key string) int { return sm.Counts(key).Joined }

	reg := NewRegistry(nil)
	reg.breakerOpts = append(reg.breakerOpts, breaker.WithStore(sm.Instance("gw0")))
	old := startPool(t, reg, Config{Static: targets("10.1.11.1:8000"), Breaker: &breaker.Settings{}})
	finish(mustPick(t, old, ""), proxy.AttemptSuccess)
	if n := joined("10.1.11.1:8000~" + pol); n != 1 {
		t.Fatalf("%d breakers joined, want 1", n)
	}
	reload(t, old, Config{Static: targets("10.1.11.1:8000")})
	if n := joined("10.1.11.1:8000~" + pol); n != 0 {
		t.Fatalf("%d breakers joined after breakers were turned off, want 0", n)
	}

	reg.Models.Learn("llama")
	p := startPool(t, reg, Config{Static: targets("10.1.11.2:8000"), ScopeModel: true, Breaker: &breaker.Settings{}})
	finish(mustPick(t, p, "llama"), proxy.AttemptSuccess)
	if n := joined("10.1.11.2:8000~" + policyFingerprint(&breaker.Settings{}, nil, true) + "|llama"); n != 1 {
		t.Fatalf("%d breakers joined, want 1", n)
	}
	p.Deactivate()
	p.Release()
	if n := joined("10.1.11.2:8000~" + policyFingerprint(&breaker.Settings{}, nil, true) + "|llama"); n != 0 {
		t.Fatalf("%d breakers joined after the entry was destroyed, want 0", n)
	}
}

// SetBreakerStore builds the breakers again with the new store, an open
// one staying open until its end; back to no store, the same. A breaker
// created while its store says the key is open starts open, and its
// transition reaches the observer.
func TestSetBreakerStoreRebuildsTheBreakers(t *testing.T) {
	sm := breakertest.NewSharedMemory(nil, 1)
	obs := newFakeObserver()
	reg := NewRegistry(obs)
	const addr = "10.1.12.1:8000"
	p := startPool(t, reg, Config{Static: targets(addr), Breaker: &breaker.Settings{}})
	finish(mustPick(t, p, ""), proxy.AttemptSuccess)
	before := breakerOf(t, reg, addr, "")
	before.ForceOpen(time.Minute, "maintenance")
	until := before.Snapshot().OpenUntil

	gw0 := sm.Instance("gw0")
	n := obs.count()
	reg.SetBreakerStore(gw0)
	fleetB := breakerOf(t, reg, addr, "")
	if fleetB == before || sm.Counts(fleetB.StoreKey()).Joined != 1 {
		t.Fatalf("not rebuilt with the store: same %v, joined %d", fleetB == before, sm.Counts(fleetB.StoreKey()).Joined)
	}
	s := fleetB.Snapshot()
	if s.State != breaker.Open || !s.OpenUntil.Equal(until) {
		t.Fatalf("rebuilt breaker %+v, want open until %v", s, until)
	}
	if !s.Forced {
		t.Fatalf("rebuilt breaker %+v, want the operator's open still forced", s)
	}
	// The verdict did not change: no transition is reported (the
	// breaker_state gauge reads the breakers at each scrape).
	for _, ev := range obs.eventsSince(n) {
		if strings.HasPrefix(ev, "transition") {
			t.Fatalf("rebuilding with the store reported %q", ev)
		}
	}
	reg.SetBreakerStore(gw0) // the same store: nothing changes
	if breakerOf(t, reg, addr, "") != fleetB {
		t.Fatal("setting the same store rebuilt the breakers")
	}
	// Shared now: another gateway's verdict reaches it.
	other := breaker.New(addr, breaker.Settings{}, breaker.WithStore(sm.Instance("gw1")), breaker.WithStoreKey(fleetB.StoreKey()))
	other.ForceOpen(time.Hour, "drain")
	if s := fleetB.Snapshot(); !s.OpenUntil.After(until.Add(50 * time.Minute)) {
		t.Fatalf("the other gateway's verdict did not arrive: %+v", s)
	}

	reg.SetBreakerStore(nil)
	local := breakerOf(t, reg, addr, "")
	if local == fleetB || sm.Counts(fleetB.StoreKey()).Joined != 1 {
		t.Fatalf("not rebuilt without the store: joined %d", sm.Counts(fleetB.StoreKey()).Joined)
	}
	if s := local.Snapshot(); s.State != breaker.Open || !s.OpenUntil.Equal(fleetB.Snapshot().OpenUntil) {
		t.Fatalf("local breaker %+v", s)
	}

	// A new upstream whose key the store has open: created open, without
	// a deadlock on the entry's lock, and observed.
	const addr2 = "10.1.12.2:8000"
	sm.Instance("gw1").PutOpen(addr2+"~"+policyFingerprint(&breaker.Settings{}, nil, false), time.Now().Add(time.Minute), "open elsewhere")
	reg.SetBreakerStore(gw0)
	p2 := startPool(t, reg, Config{Static: targets(addr2, "10.1.12.3:8000"), Breaker: &breaker.Settings{}})
	p2.holdBreakers()
	if s := breakerOf(t, reg, addr2, "").Snapshot(); s.State != breaker.Open {
		t.Fatalf("breaker of a key open in the store: %+v", s)
	}
	if st, ok := obs.gauge(addr2, ""); !ok || st != breaker.Open {
		t.Fatalf("gauge %v %v, want open", st, ok)
	}
}
