package fleet

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/internal/redistest"
)

// TestLimitsInFlightIsTheFleets: two requests of a max_concurrent tenant on
// two gateways are two in flight on either gateway's view; a settlement,
// and a dead gateway's lease expiring, bring it down; a tenant without
// max_concurrent takes no leases and counts 0 (the admin API asks only
// for those with max_concurrent); local mode is
// ErrDegraded, not a count.
func TestLimitsInFlightIsTheFleets(t *testing.T) {
	s := redistest.Start(t, redistest.Options{})
	cfg := admission.Config{
		Tiers:       []admission.Tier{{Name: "t", MaxConcurrent: 3}, {Name: "open", RPM: 100}},
		DefaultTier: "t",
		Tenants:     []admission.TenantConfig{{ID: "loose", Tier: "open"}},
	}
	gws := limitsFleet(t, s.Addr(), 2, cfg, Config{}, LimitsConfig{})
	inflight := func(g *limitsGateway) map[string]int {
		t.Helper()
		n, err := g.l.InFlight(context.Background(), []string{"acme", "loose"})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	a := limAdmit(t, gws[0].ctl, "acme")
	limAdmit(t, gws[1].ctl, "acme") // never settled: its gateway dies
	limAdmit(t, gws[1].ctl, "loose")
	for _, g := range gws {
		n := inflight(g)
		if n["acme"] != 2 {
			t.Fatalf("%s: %v in flight, want acme's 2 over the fleet", g.InstanceID(), n)
		}
		if n["loose"] != 0 {
			t.Fatalf("%s: %v, want 0 for a tenant without max_concurrent (it takes no leases)", g.InstanceID(), n)
		}
	}
	a.Settle(admission.Usage{}, 0)
	if n := inflight(gws[1]); n["acme"] != 1 {
		t.Fatalf("after a settlement: %v, want acme 1", n)
	}
	gws[1].l.Close() // no more renewals
	waitFor(t, "the dead gateway's lease expired", 2*testLeaseTTL, func() bool { return inflight(gws[0])["acme"] == 0 })

	s.Stop()
	waitFor(t, "local mode", 2*time.Second, gws[0].Degraded)
	if _, err := gws[0].l.InFlight(context.Background(), []string{"acme"}); !errors.Is(err, ErrDegraded) {
		t.Fatalf("InFlight in local mode: %v, want ErrDegraded", err)
	}
}
