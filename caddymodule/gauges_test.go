package caddymodule

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/registry"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// testGate is the shared gate of a pool of one upstream with capacity 1,
// as a handler (or a fallback) of its own gets it.
func testGate(t *testing.T, key, addr string) *admission.Gate {
	t.Helper()
	pool, err := shared.upstreams.NewPool(upstream.Config{Key: key, Static: []upstream.Target{{Addr: addr}}})
	if err != nil {
		t.Fatal(err)
	}
	claims := new(registry.Claims)
	t.Cleanup(func() { claims.Release(); pool.Release() })
	sg, _, err := (&AdmissionConfig{Capacity: 1}).gate(new(App), claims, key, pool, nil, false)
	if err != nil {
		t.Fatal(err)
	}
	return sg
}

// TestTierGaugesSumOverEveryGate: two handlers (two pools, two gates) serve
// one tier; caddy_llm_proxy_inflight and queue_depth of the tier count the
// requests of both, not whichever gate reported last.
func TestTierGaugesSumOverEveryGate(t *testing.T) {
	initMetrics()
	tier := admission.Tier{Name: "t-" + t.Name(), QueueTimeout: time.Minute}
	a := testGate(t, t.Name()+"-a", "10.20.3.1:8000")
	b := testGate(t, t.Name()+"-b", "10.20.3.2:8000")
	inflight := func() float64 { return testutil.ToFloat64(metrics.inflight.WithLabelValues(tier.Name)) }
	queued := func() float64 { return testutil.ToFloat64(metrics.queueDepth.WithLabelValues(tier.Name)) }

	relA, _, err := a.Acquire(context.Background(), "acme", tier)
	if err != nil {
		t.Fatal(err)
	}
	relB, _, err := b.Acquire(context.Background(), "acme", tier)
	if err != nil {
		t.Fatal(err)
	}
	if v := inflight(); v != 2 {
		t.Fatalf("inflight = %v with one request in flight through each of two gates, want 2", v)
	}
	// One request queued behind each full gate.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{}, 2)
	for _, g := range []*admission.Gate{a, b} {
		go func() {
			if rel, _, err := g.Acquire(ctx, "acme", tier); err == nil {
				rel()
			}
			done <- struct{}{}
		}()
	}
	deadline := time.Now().Add(5 * time.Second)
	for queued() != 2 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if v := queued(); v != 2 {
		t.Fatalf("queue_depth = %v with one request queued at each of two gates, want 2", v)
	}
	cancel()
	<-done
	<-done
	if v := queued(); v != 0 {
		t.Fatalf("queue_depth = %v after both queued requests left, want 0", v)
	}
	relA()
	if v := inflight(); v != 1 {
		t.Fatalf("inflight = %v after one of two requests ended, want 1", v)
	}
	relB()
	if v := inflight(); v != 0 {
		t.Fatalf("inflight = %v after both requests ended, want 0", v)
	}
}

// gathered sums the samples of the metric family name whose labels
// include labels, from a registry holding every collector of the module;
// found is false when no series matches.
func gathered(t *testing.T, name string, labels map[string]string) (sum float64, found bool) {
	t.Helper()
	r := prometheus.NewRegistry()
	if err := registerMetrics(r); err != nil {
		t.Fatal(err)
	}
	fams, err := r.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if have[k] != v {
					continue series
				}
			}
			found = true
			switch {
			case m.Gauge != nil:
				sum += m.GetGauge().GetValue()
			case m.Counter != nil:
				sum += m.GetCounter().GetValue()
			case m.Histogram != nil:
				sum += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return sum, found
}

// TestTenantBreakerStateFollowsAReloadedTier: a tenant whose breaker is open
// is moved from one tier to another by a reload; the gauge counts its
// breaker under the new tier only, and nothing goes negative when the
// breaker closes.
func TestTenantBreakerStateFollowsAReloadedTier(t *testing.T) {
	tenant := "acme-" + t.Name()
	build := func(tier string) *App {
		a := &App{Tenants: &TenantsConfig{Keys: []TenantKey{{SHA256: strings.Repeat("cd", 32), Tenant: tenant}}},
			Tiers:           []TierConfig{{Name: "default"}, {Name: "free", Breaker: &BreakerConfig{}}, {Name: "gold", Breaker: &BreakerConfig{}}},
			TenantOverrides: []TenantOverride{{ID: tenant, Tier: tier}}}
		a.claims = new(registry.Claims)
		t.Cleanup(func() { _ = a.Cleanup() })
		tn, err := newTenancy(a)
		if err != nil {
			t.Fatal(err)
		}
		a.tenancy, a.logger = tn, zap.NewNop()
		return a
	}
	state := func(tier, st string) float64 {
		v, found := gathered(t, "caddy_llm_proxy_tenant_breaker_state", map[string]string{"tier": tier, "state": st})
		if !found {
			t.Fatalf("no caddy_llm_proxy_tenant_breaker_state{tier=%q,state=%q} series", tier, st)
		}
		return v
	}
	free := build("free")
	if err := free.Start(); err != nil {
		t.Fatal(err)
	}
	defer free.Stop()
	ctl := free.tenancy.ctl
	ctl.TenantBreaker(tenant).ForceOpen(time.Hour, "test")
	if v := state("free", "open"); v != 1 {
		t.Fatalf("tenant_breaker_state{tier=free,state=open} = %v with the tenant's breaker open, want 1", v)
	}

	// The reload moves the tenant to gold while its breaker is open; its
	// next request (refused: the breaker is open) is admitted under gold.
	gold := build("gold")
	if err := gold.Start(); err != nil {
		t.Fatal(err)
	}
	defer gold.Stop()
	if err := free.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, r := ctl.Reserve(admission.Request{Tenant: tenant}); r == nil || r.Code != admission.CodeTenantCircuitOpen {
		t.Fatalf("request of a tenant with an open breaker: refusal %+v, want %s", r, admission.CodeTenantCircuitOpen)
	}
	if free, gold := state("free", "open"), state("gold", "open"); free != 0 || gold != 1 {
		t.Fatalf("after the reload: open tenant breakers free %v, gold %v; want 0 and 1", free, gold)
	}
	ctl.TenantBreaker(tenant).ForceClose("test")
	for _, tier := range []string{"free", "gold"} {
		for _, st := range []string{"open", "half_open"} {
			if v := state(tier, st); v != 0 {
				t.Errorf("after the breaker closed: tenant_breaker_state{tier=%s,state=%s} = %v, want 0", tier, st, v)
			}
		}
	}
}

// TestBreakerStateHasAPoolLabel: two pools share an upstream; with every
// upstream of the first pool open, min by (pool) of breaker_state says so
// for that pool alone, and a stopped config's pools have no series.
func TestBreakerStateHasAPoolLabel(t *testing.T) {
	initMetrics()
	const a, b, c = "10.20.5.1:8000", "10.20.5.2:8000", "10.20.5.3:8000"
	s := breaker.Settings{ConsecutiveFailures: 1}
	newPool := func(addrs ...string) *upstream.Pool {
		var ts []upstream.Target
		for _, addr := range addrs {
			ts = append(ts, upstream.Target{Addr: addr})
		}
		p, err := shared.upstreams.NewPool(upstream.Config{Key: poolKeyOf(upstreamPool(addrs...), nil), Static: ts, Breaker: &s})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Release)
		return p
	}
	p1, p2 := newPool(a, b), newPool(b, c)
	app := &App{ctx: caddy.Context{Context: context.Background()}, logger: zap.NewNop()}
	app.adopt(p1)
	app.adopt(p2)
	if err := app.Start(); err != nil {
		t.Fatal(err)
	}
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = app.Stop()
		}
	})
	for _, addr := range []string{a, b} {
		// An operator's drain: every handler's breaker on the upstream.
		e, ok := shared.upstreams.Entry(addr)
		if !ok {
			t.Fatalf("no entry for %s", addr)
		}
		if _, ok := e.Drain(time.Hour, "test"); !ok {
			t.Fatalf("no breakers for %s", addr)
		}
	}
	min := func(pool string) float64 {
		m := -1.0
		for _, addr := range []string{a, b, c} {
			v, found := gathered(t, "caddy_llm_proxy_breaker_state", map[string]string{"pool": pool, "upstream": addr})
			if found && (m < 0 || v < m) {
				m = v
			}
		}
		return m
	}
	pool1, pool2 := a+","+b, b+","+c
	if v := min(pool1); v != float64(breaker.Open) {
		t.Errorf("min breaker_state of pool %s (every upstream open) = %v, want 2", pool1, v)
	}
	if v := min(pool2); v != float64(breaker.Closed) {
		t.Errorf("min breaker_state of pool %s (one upstream closed) = %v, want 0", pool2, v)
	}
	if v, found := gathered(t, "caddy_llm_proxy_breaker_state", map[string]string{"pool": pool2, "upstream": b}); !found || v != float64(breaker.Open) {
		t.Errorf("breaker_state{pool=%s,upstream=%s} = %v (found %v): the shared upstream's breaker, want 2", pool2, b, v, found)
	}
	stopped = true
	if err := app.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, found := gathered(t, "caddy_llm_proxy_breaker_state", map[string]string{"upstream": a}); found {
		t.Error("a stopped config's pool still has breaker_state series")
	}
}

// upstreamPool is a Caddy upstream list of addrs.
func upstreamPool(addrs ...string) reverseproxy.UpstreamPool {
	var out reverseproxy.UpstreamPool
	for _, a := range addrs {
		out = append(out, &reverseproxy.Upstream{Dial: a})
	}
	return out
}
