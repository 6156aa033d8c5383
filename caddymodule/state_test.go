package caddymodule

import (
	"strings"
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/internal/registry"
)

// TestTenantControllerLivesWhileAConfigWithTenantsDoes: a reload's new
// config takes the controller (tenants' windows and breakers) before the
// old one releases it, so it survives; it goes with the last config that
// has tenants (it used to live for the whole process).
func TestTenantControllerLivesWhileAConfigWithTenantsDoes(t *testing.T) {
	if _, ok := shared.tenants.Peek(""); ok {
		t.Skip("another test holds the tenant controller")
	}
	build := func() *App {
		a := &App{Tenants: &TenantsConfig{Keys: []TenantKey{{SHA256: strings.Repeat("ef", 32), Tenant: "acme"}}},
			Tiers: []TierConfig{{Name: "default"}}, claims: new(registry.Claims)}
		tn, err := newTenancy(a)
		if err != nil {
			t.Fatal(err)
		}
		a.tenancy = tn
		return a
	}
	old := build()
	next := build()
	if old.tenancy.ctl != next.tenancy.ctl {
		t.Fatal("two configs with tenants got two controllers")
	}
	_ = old.Cleanup()
	if ctl, ok := shared.tenants.Peek(""); !ok || ctl != next.tenancy.ctl {
		t.Fatal("the controller went with the reload's old config")
	}
	_ = next.Cleanup()
	if _, ok := shared.tenants.Peek(""); ok {
		t.Fatal("the controller outlived every config with tenants")
	}
}
