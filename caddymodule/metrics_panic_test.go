package caddymodule

import (
	"context"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// A running pool has a caddy_llm_proxy_pool_panic series at 0 from the
// first scrape (a dashboard or alert sees 0, not "no data"); in panic mode
// it reads 1 and every pick counts in caddy_llm_proxy_panic_requests_total;
// leaving panic mode sets it back to 0; a pool of no running config has no
// series.
func TestPanicMetrics(t *testing.T) {
	initMetrics()
	addrs := []string{"10.19.1.1:8000", "10.19.1.2:8000", "10.19.1.3:8000"}
	var ts []upstream.Target
	for _, a := range addrs {
		ts = append(ts, upstream.Target{Addr: a})
	}
	key := poolKeyOf(upstreamPool(addrs...), nil)
	label := poolLabel(key)
	p, err := shared.upstreams.NewPool(upstream.Config{Key: key, Static: ts, Breaker: &breaker.Settings{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Release)
	app := &App{ctx: caddy.Context{Context: context.Background()}, logger: zap.NewNop()}
	app.adopt(p)
	if err := app.Start(); err != nil {
		t.Fatal(err)
	}
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = app.Stop()
		}
	})
	gauge := func() float64 {
		t.Helper()
		v, found := gathered(t, "caddy_llm_proxy_pool_panic", map[string]string{"pool": label})
		if !found {
			t.Fatalf("no caddy_llm_proxy_pool_panic series for pool %q", label)
		}
		return v
	}
	if v := gauge(); v != 0 {
		t.Fatalf("caddy_llm_proxy_pool_panic = %v before any pick, want 0", v)
	}
	before, _ := gathered(t, "caddy_llm_proxy_panic_requests_total", map[string]string{"pool": label})

	e0, _ := shared.upstreams.Entry(addrs[0])
	e1, _ := shared.upstreams.Entry(addrs[1])
	pick := func() {
		t.Helper()
		up, err := p.Pick(nil, nil, proxy.PickRequest{})
		if err != nil {
			t.Fatal(err)
		}
		up.Done(nil)
	}
	pick() // creates the upstreams' breakers
	p.Breakers(e0)[""].ForceOpen(0, "maintenance")
	p.Breakers(e1)[""].Eject("outlier", 0.5)
	for range 5 {
		pick()
	}
	if v := gauge(); v != 1 {
		t.Fatalf("caddy_llm_proxy_pool_panic = %v in panic, want 1", v)
	}
	after, found := gathered(t, "caddy_llm_proxy_panic_requests_total", map[string]string{"pool": label})
	if !found || after-before != 5 {
		t.Fatalf("caddy_llm_proxy_panic_requests_total grew by %v (found %v), want 5", after-before, found)
	}
	p.Breakers(e0)[""].ForceClose("back")
	pick()
	if v := gauge(); v != 0 {
		t.Fatalf("caddy_llm_proxy_pool_panic = %v after the pool recovered, want 0", v)
	}
	stopped = true
	if err := app.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, found := gathered(t, "caddy_llm_proxy_pool_panic", map[string]string{"pool": label}); found {
		t.Fatal("caddy_llm_proxy_pool_panic still has a series for a pool of no running config")
	}
}
