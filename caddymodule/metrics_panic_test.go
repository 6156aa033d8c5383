package caddymodule

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// A pool that enters panic mode sets caddy_llm_proxy_pool_panic to 1 and
// counts each pick in caddy_llm_proxy_panic_requests_total; leaving it sets
// the gauge back to 0. Both are registered with the other collectors.
func TestPanicMetrics(t *testing.T) {
	reg := upstream.NewRegistry(upstreamObserver{})
	addrs := []upstream.Target{{Addr: "10.19.1.1:8000"}, {Addr: "10.19.1.2:8000"}, {Addr: "10.19.1.3:8000"}}
	const key = "panic-metrics-pool"
	p, err := reg.NewPool(upstream.Config{Key: key, Static: addrs, Breaker: &breaker.Settings{}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Release()
	p.Activate()
	defer p.Deactivate()
	e0, _ := reg.Entry(addrs[0].Addr)
	e1, _ := reg.Entry(addrs[1].Addr)
	e0.Breakers()[""].ForceOpen(0, "maintenance")
	e1.Breakers()[""].Eject("outlier", 0.5)
	for range 5 {
		up, err := p.Pick(nil, nil, proxy.PickRequest{})
		if err != nil {
			t.Fatal(err)
		}
		up.Done(nil)
	}
	if v := testutil.ToFloat64(poolPanic.WithLabelValues(key)); v != 1 {
		t.Fatalf("caddy_llm_proxy_pool_panic = %v, want 1", v)
	}
	if v := testutil.ToFloat64(panicRequests.WithLabelValues(key)); v != 5 {
		t.Fatalf("caddy_llm_proxy_panic_requests_total = %v, want 5", v)
	}
	e0.Breakers()[""].ForceClose("back")
	up, err := p.Pick(nil, nil, proxy.PickRequest{})
	if err != nil {
		t.Fatal(err)
	}
	up.Done(nil)
	if v := testutil.ToFloat64(poolPanic.WithLabelValues(key)); v != 0 {
		t.Fatalf("caddy_llm_proxy_pool_panic = %v after the pool recovered, want 0", v)
	}
	pr := prometheus.NewRegistry()
	if err := registerMetrics(pr); err != nil {
		t.Fatal(err)
	}
	mfs, err := pr.Gather()
	if err != nil {
		t.Fatal(err)
	}
	found := map[string]bool{}
	for _, mf := range mfs {
		found[mf.GetName()] = true
	}
	for _, n := range []string{"caddy_llm_proxy_pool_panic", "caddy_llm_proxy_panic_requests_total"} {
		if !found[n] {
			t.Errorf("%s is not registered", n)
		}
	}
}
