package upstream

import (
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// A breaker the entry drops leaves its fleet, so that the fleet's pushes
// stop reaching it: when a reload turns breakers off, and when the entry
// is destroyed.
func TestDroppedBreakersLeaveTheFleet(t *testing.T) {
	sm := breaker.NewSharedMemory(nil, 1)
	joined := func(key string) int { return sm.Counts(key).Joined }

	reg := NewRegistry(nil)
	reg.breakerOpts = []breaker.Option{breaker.WithStore(sm.Instance("gw0"))}
	old := startPool(t, reg, Config{Static: targets("10.1.11.1:8000"), Breaker: &breaker.Settings{}})
	finish(mustPick(t, old, ""), proxy.AttemptSuccess)
	if n := joined("10.1.11.1:8000"); n != 1 {
		t.Fatalf("%d breakers joined, want 1", n)
	}
	reload(t, old, Config{Static: targets("10.1.11.1:8000")})
	if n := joined("10.1.11.1:8000"); n != 0 {
		t.Fatalf("%d breakers joined after breakers were turned off, want 0", n)
	}

	reg.Models.Learn("llama")
	p := startPool(t, reg, Config{Static: targets("10.1.11.2:8000"), ScopeModel: true, Breaker: &breaker.Settings{}})
	finish(mustPick(t, p, "llama"), proxy.AttemptSuccess)
	if n := joined("10.1.11.2:8000|llama"); n != 1 {
		t.Fatalf("%d breakers joined, want 1", n)
	}
	p.Deactivate()
	p.Release()
	if n := joined("10.1.11.2:8000|llama"); n != 0 {
		t.Fatalf("%d breakers joined after the entry was destroyed, want 0", n)
	}
}
