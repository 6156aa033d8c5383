package live

import (
	"testing"

	"go.uber.org/zap"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// limits is a tenant limit store that only names itself.
type limits struct {
	admission.LimitStore
	name string
}

func budget(t *testing.T, size int64) *proxy.BodyBudget {
	t.Helper()
	b, err := proxy.NewBodyBudget(size, 0)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func tenants(ctl *admission.Controller, rpm int, store admission.LimitStore) *Tenants {
	return &Tenants{Controller: ctl, Config: admission.Config{Tiers: []admission.Tier{{Name: "default", RPM: rpm}}}, Limits: store}
}

// TestOnlyTheNewestStartedConfigIsInForce: a reload's new config puts its
// settings in force and the old one's stop changes nothing; a config whose
// start failed (stopped while it is the newest) puts the running one's
// back, and after the last stop nothing points at any config.
func TestOnlyTheNewestStartedConfigIsInForce(t *testing.T) {
	ctl, err := admission.NewController(admission.Config{Tiers: []admission.Tier{{Name: "default"}}}, clock.Real, nil)
	if err != nil {
		t.Fatal(err)
	}
	reg := upstream.NewRegistry(nil)
	var changes []*Config
	o := New(reg, func(c *Config) { changes = append(changes, c) })

	oldStore, newStore := breaker.NewMemoryStore(), breaker.NewMemoryStore()
	oldLimits, newLimits := &limits{name: "old"}, &limits{name: "new"}
	old := &Config{Logger: zap.NewNop(), BreakerStore: oldStore, Bodies: budget(t, 64), Tenants: tenants(ctl, 100, oldLimits)}
	next := &Config{Logger: zap.NewNop(), BreakerStore: newStore, Bodies: budget(t, 32), TenantLabels: true, Tenants: tenants(ctl, 7, newLimits)}
	inForce := func(when string, want *Config, rpm int, store breaker.Store, lim admission.LimitStore) {
		t.Helper()
		if o.Newest() != want {
			t.Errorf("%s: a config other than the expected one is in force", when)
		}
		var bodies *proxy.BodyBudget
		if want != nil {
			bodies = want.Bodies
		}
		if o.Bodies() != bodies || o.TenantLabels() != (want != nil && want.TenantLabels) {
			t.Errorf("%s: body budget or tenant labels of another config", when)
		}
		if reg.BreakerStore() != store {
			t.Errorf("%s: upstream breakers use another store", when)
		}
		if ti, _ := ctl.Tier("acme", ""); ti.RPM != rpm {
			t.Errorf("%s: rpm %d, want %d", when, ti.RPM, rpm)
		}
		if ctl.LimitStore() != lim {
			t.Errorf("%s: tenant limits counted in %v, want %v", when, ctl.LimitStore(), lim)
		}
		if n := len(changes); n == 0 || changes[n-1] != want {
			t.Errorf("%s: the last change reported is not the config in force", when)
		}
	}

	if err := o.Start(old); err != nil {
		t.Fatal(err)
	}
	inForce("old started", old, 100, oldStore, oldLimits)
	if err := o.Start(next); err != nil {
		t.Fatal(err)
	}
	inForce("new started", next, 7, newStore, newLimits)
	if err := o.Stop(next); err != nil {
		t.Fatal(err)
	}
	inForce("new failed", old, 100, oldStore, oldLimits)

	if err := o.Start(next); err != nil {
		t.Fatal(err)
	}
	n := len(changes)
	if err := o.Stop(old); err != nil {
		t.Fatal(err)
	}
	if len(changes) != n {
		t.Error("the old config's stop after a reload changed what is in force")
	}
	inForce("reloaded", next, 7, newStore, newLimits)
	if err := o.Stop(next); err != nil {
		t.Fatal(err)
	}
	inForce("all stopped", nil, 7, nil, nil)
}

// TestStartRefusedByTheTenantsChangesNothing: tiers the controller refuses
// fail the start and leave the running config in force.
func TestStartRefusedByTheTenantsChangesNothing(t *testing.T) {
	ctl, err := admission.NewController(admission.Config{Tiers: []admission.Tier{{Name: "default"}}}, clock.Real, nil)
	if err != nil {
		t.Fatal(err)
	}
	o := New(upstream.NewRegistry(nil), nil)
	running := &Config{Logger: zap.NewNop(), Bodies: budget(t, 64), Tenants: tenants(ctl, 100, nil)}
	if err := o.Start(running); err != nil {
		t.Fatal(err)
	}
	bad := &Config{Logger: zap.NewNop(), Bodies: budget(t, 32), TenantLabels: true,
		Tenants: &Tenants{Controller: ctl, Config: admission.Config{Tiers: []admission.Tier{{Name: "default"}, {Name: "default"}}}}}
	if err := o.Start(bad); err == nil {
		t.Fatal("a config with two tiers named default started")
	}
	if o.Newest() != running || o.Bodies() != running.Bodies || o.TenantLabels() {
		t.Fatal("a refused start changed what is in force")
	}
	if ti, _ := ctl.Tier("acme", ""); ti.RPM != 100 {
		t.Fatalf("rpm %d after a refused start, want 100", ti.RPM)
	}
	if err := o.Stop(bad); err != nil {
		t.Fatal(err)
	}
	if o.Newest() != running {
		t.Fatal("stopping a config that never started changed what is in force")
	}
}
