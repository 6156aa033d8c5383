package caddymodule

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/internal/registry"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// testGate is the shared gate of a pool of one upstream with capacity 1,
// as a handler (or a fallback) of its own gets it.
func testGate(t *testing.T, key, addr string) *admission.Gate {
	t.Helper()
	pool, err := reg.NewPool(upstream.Config{Key: key, Static: []upstream.Target{{Addr: addr}}})
	if err != nil {
		t.Fatal(err)
	}
	claims := new(registry.Claims)
	t.Cleanup(func() { claims.Release(); pool.Release() })
	sg, _, err := (&AdmissionConfig{Capacity: 1}).gate(claims, key, pool, nil, false)
	if err != nil {
		t.Fatal(err)
	}
	return sg.g
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
