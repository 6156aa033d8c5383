package caddymodule

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"

	"github.com/llmproxy/caddy-llm-proxy/internal/registry"
)

// provisionedApp is an app as Provision leaves it, with a body budget of
// bodies bytes and, when labels, tenants whose admissions are labelled by
// tenant id.
func provisionedApp(t *testing.T, bodies int64, labels bool) *App {
	t.Helper()
	a := &App{MaxBufferedBodies: bodies, MetricsTenantLabel: labels, claims: new(registry.Claims), logger: zap.NewNop()}
	t.Cleanup(func() { _ = a.Cleanup() })
	b, err := bodyBudgetFor(a.claims, bodies)
	if err != nil {
		t.Fatal(err)
	}
	a.bodies = b
	if labels {
		a.Tenants = &TenantsConfig{Keys: []TenantKey{{SHA256: strings.Repeat("cd", 32), Tenant: "acme"}}}
		a.Tiers = []TierConfig{{Name: "default"}}
		if a.tenancy, err = newTenancy(a); err != nil {
			t.Fatal(err)
		}
	}
	return a
}

// bodyLimitGauge is caddy_llm_proxy_buffered_body_limit_bytes now.
func bodyLimitGauge() float64 { return testutil.ToFloat64(bodyMemory[1].(prometheus.GaugeFunc)) }

// TestFailedStartLeavesTheRunningConfigInForce: a config whose start fails
// elsewhere (Caddy stops its llm_proxy app when another app of it fails)
// leaves the body budget gauges and the admission metrics' tenant label as
// the running config set them, and a first config that fails leaves none.
func TestFailedStartLeavesTheRunningConfigInForce(t *testing.T) {
	initMetrics()
	running := provisionedApp(t, 64<<20, false)
	if err := running.Start(); err != nil {
		t.Fatal(err)
	}
	failed := provisionedApp(t, 32<<20, true)
	if err := failed.Start(); err != nil {
		t.Fatal(err)
	}
	if got := bodyLimitGauge(); got != 32<<20 {
		t.Fatalf("after the new config started: body limit gauge %v, want %v", got, 32<<20)
	}
	if err := failed.Stop(); err != nil {
		t.Fatal(err)
	}
	if got := bodyLimitGauge(); got != 64<<20 {
		t.Errorf("after the new config failed: body limit gauge %v, want the running config's %v", got, 64<<20)
	}
	if got := tenantLabel("acme"); got != "" {
		t.Errorf("after the new config failed: admissions labelled tenant=%q, want none (the running config has no metrics_tenant_label)", got)
	}
	if err := running.Stop(); err != nil {
		t.Fatal(err)
	}

	first := provisionedApp(t, 16<<20, true)
	if err := first.Start(); err != nil {
		t.Fatal(err)
	}
	if err := first.Stop(); err != nil {
		t.Fatal(err)
	}
	if got := bodyLimitGauge(); got != 0 {
		t.Errorf("after the only config failed: body limit gauge %v, want 0", got)
	}
	if got := tenantLabel("acme"); got != "" {
		t.Errorf("after the only config failed: admissions labelled tenant=%q, want none", got)
	}
}
