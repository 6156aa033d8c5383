package upstream

import (
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// rotatingSource returns a new address on every call (pods that churn).
func rotatingSource() (Source, func(i int64) string) {
	var n atomic.Int64
	addr := func(i int64) string { return fmt.Sprintf("10.%d.%d.%d:8000", 50+i/65536, (i/256)%256, i%256) }
	return func(*http.Request) ([]Target, error) {
		return targets(addr(n.Add(1))), nil
	}, addr
}

// Regression: every address a dynamic source ever returned kept a member,
// an entry and a reference until the config was replaced.
func TestDynamicUpstreamsAreForgotten(t *testing.T) {
	obs := newFakeObserver()
	reg := NewRegistry(obs)
	src, addr := rotatingSource()
	p := startPool(t, reg, Config{Key: "dynamic:rotating", Source: src, Breaker: &breaker.Settings{}})
	for range 3 * maxDynamic {
		finish(mustPick(t, p, ""), proxy.AttemptSuccess)
	}
	if n := p.nDynamic.Load(); n > maxDynamic+1 {
		t.Fatalf("%d dynamic members kept for addresses no longer returned", n)
	}
	if n := reg.entries.Len(); n > maxDynamic+1 {
		t.Fatalf("%d entries kept for addresses no longer returned", n)
	}
	if n := len(p.mem.addrs()); n > maxDynamic+1 {
		t.Fatalf("%d addresses remembered for the next reload", n)
	}
	if _, ok := reg.Entry(addr(1)); ok {
		t.Fatalf("the first address %s is still held", addr(1))
	}
	if created, gone := obs.countPrefix("created "), obs.countPrefix("gone "); created-gone > maxDynamic+1 {
		t.Fatalf("%d breaker gauges left for %d breakers created", created-gone, created)
	}
}

// An address the source stopped returning is forgotten after dynamicTTL,
// however few addresses the pool holds.
func TestDynamicUpstreamForgottenAfterTTL(t *testing.T) {
	reg := NewRegistry(nil)
	var current atomic.Value
	current.Store("10.3.0.1:8000")
	src := func(*http.Request) ([]Target, error) { return targets(current.Load().(string)), nil }
	p := startPool(t, reg, Config{Key: "dynamic:ttl", Source: src})
	finish(mustPick(t, p, ""), proxy.AttemptSuccess)
	current.Store("10.3.0.2:8000")
	finish(mustPick(t, p, ""), proxy.AttemptSuccess)
	if _, ok := reg.Entry("10.3.0.1:8000"); !ok {
		t.Fatal("an address forgotten at once, before its TTL")
	}
	// Age the first address past the TTL, and the last sweep past its period.
	v, _ := p.dynamic.Load("10.3.0.1:8000")
	past := time.Now().Add(-2 * dynamicTTL).UnixNano()
	v.(*member).lastSeen.Store(past)
	p.lastSweep.Store(past)
	finish(mustPick(t, p, ""), proxy.AttemptSuccess)
	if _, ok := reg.Entry("10.3.0.1:8000"); ok {
		t.Fatal("an address the source stopped returning outlived its TTL")
	}
	if _, ok := reg.Entry("10.3.0.2:8000"); !ok {
		t.Fatal("the address the source returns was forgotten")
	}
}

// Dynamic upstreams: a reload of the same source keeps their breakers,
// even before the new config asks the source.
func TestDynamicBreakersSurviveReload(t *testing.T) {
	reg := NewRegistry(nil)
	cfg := Config{Key: "dynamic:test-source", Breaker: &breaker.Settings{ConsecutiveFailures: 1, OpenFor: time.Minute, MinOpen: time.Minute},
		Source: func(*http.Request) ([]Target, error) { return targets("10.9.7.1:8000"), nil }}
	old := startPool(t, reg, cfg)
	fail(mustPick(t, old, ""))
	next := reload(t, old, cfg)
	if st := next.BreakerState("10.9.7.1:8000", ""); st != "open" {
		t.Fatalf("after the reload, before the source is asked, the breaker is %q", st)
	}
	if _, err := pickModel(next, ""); err == nil {
		t.Fatal("the dynamic upstream's open breaker was lost in the reload")
	}
	if n := reg.EntryRefs("10.9.7.1:8000"); n != 1 {
		t.Fatalf("entry held %d times, want 1", n)
	}
}

// The settings of the newest started config reach a dynamic upstream it
// meets after starting.
func TestDynamicUpstreamTakesActivePoolSettings(t *testing.T) {
	reg := NewRegistry(nil)
	src := func(*http.Request) ([]Target, error) { return targets("10.3.1.1:8000"), nil }
	p := startPool(t, reg, Config{Key: "dynamic:settings", Source: src, Breaker: &breaker.Settings{ConsecutiveFailures: 4}})
	mustPick(t, p, "").Done(nil)
	if got := breakerOf(t, reg, "10.3.1.1:8000", "").Settings().ConsecutiveFailures; got != 4 {
		t.Fatalf("consecutive_failures %d, want 4", got)
	}
}
