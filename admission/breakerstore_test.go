package admission

import (
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/breaker/breakertest"
)

// TestTenantBreakerSharedByAFleet: two gateways' controllers share a
// breaker store; the tenant's own failures, two on each gateway, trip its
// breaker for both (the fleet's count reaches the threshold of 3 where
// neither gateway's does), and the other tenant is untouched.
func TestTenantBreakerSharedByAFleet(t *testing.T) {
	cfg := oneTier(Tier{Name: "t", Breaker: &breaker.Settings{}})
	a, clk, _ := newCtl(t, cfg)
	b, _, _ := newCtl(t, cfg)
	b.clock = clk
	sm := breakertest.NewSharedMemory(clk, 1)
	a.SetBreakerStore(sm.Instance("gw-a"))
	b.SetBreakerStore(sm.Instance("gw-b"))

	fail := Usage{Verdict: VerdictFailure}
	run(t, a, "x", 10, fail, 0)
	run(t, b, "x", 10, fail, 0)
	if _, r := a.Reserve(Request{Tenant: "x"}); r != nil {
		t.Fatalf("open after 2 of 3 failures: %v", r)
	}
	if got := sm.Counts(TenantBreakerKey("x")).Consecutive; got != 2 {
		t.Fatalf("the fleet counts %d consecutive failures of tenant x, want 2", got)
	}
	run(t, a, "x", 10, fail, 0)
	for name, c := range map[string]*Controller{"a": a, "b": b} {
		_, r := c.Reserve(Request{Tenant: "x"})
		if r == nil || r.Code != CodeTenantCircuitOpen {
			t.Fatalf("gateway %s: %v, want tenant_circuit_open (the fleet's count reached 3)", name, r)
		}
		tk, r := c.Reserve(Request{Tenant: "y"})
		if r != nil {
			t.Fatalf("gateway %s: another tenant refused: %v", name, r)
		}
		tk.Cancel()
	}
	if v := view(b, "x"); v.Breaker == nil || v.Breaker.State != breaker.Open {
		t.Fatalf("gateway b's view of x: %+v", v.Breaker)
	}
}

// TestTenantBreakerMovesToANewStore: a breaker built before the fleet store
// was set is rebuilt with it on the tenant's next request, and setting the
// same store again changes nothing.
func TestTenantBreakerMovesToANewStore(t *testing.T) {
	c, clk, _ := newCtl(t, oneTier(Tier{Name: "t", Breaker: &breaker.Settings{}}))
	run(t, c, "x", 10, Usage{Verdict: VerdictFailure}, 0)
	first := c.TenantBreaker("x")
	if first == nil || first.Key() != "x" {
		t.Fatalf("local breaker %v, want key x", first)
	}
	sm := breakertest.NewSharedMemory(clk, 1)
	inst := sm.Instance("gw")
	c.SetBreakerStore(inst)
	run(t, c, "x", 10, Usage{Verdict: VerdictFailure}, 0)
	second := c.TenantBreaker("x")
	if second == first || second.Key() != TenantBreakerKey("x") {
		t.Fatalf("breaker not rebuilt with the store: %v", second)
	}
	c.SetBreakerStore(inst)
	run(t, c, "x", 10, Usage{Verdict: VerdictSuccess}, 0)
	if c.TenantBreaker("x") != second {
		t.Fatal("setting the same store rebuilt the breaker")
	}
}
