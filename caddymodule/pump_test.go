package caddymodule

import (
	"context"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/registry"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// TestBreakerClosingAdmitsTheQueue: per_upstream 1 over two upstreams, one
// of them open: capacity 1, taken, and one request queued. When the open
// breaker closes, the queued request is admitted at once (the registry's
// observer pumps the gates), not at the next release.
func TestBreakerClosingAdmitsTheQueue(t *testing.T) {
	const a, b = "10.20.9.1:8000", "10.20.9.2:8000"
	s := breaker.Settings{ConsecutiveFailures: 1}
	key := t.Name()
	pool, err := shared.upstreams.NewPool(upstream.Config{Key: key, Static: []upstream.Target{{Addr: a}, {Addr: b}}, Breaker: &s})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Release()
	app := &App{ctx: caddy.Context{Context: context.Background()}, logger: zap.NewNop()}
	app.adopt(pool)
	claims := new(registry.Claims)
	defer claims.Release()
	g, want, err := (&AdmissionConfig{PerUpstream: 1}).gate(new(App), claims, key, pool, nil, false)
	if err != nil {
		t.Fatal(err)
	}
	app.adoptGate(g, want)
	if err := app.Start(); err != nil {
		t.Fatal(err)
	}
	defer app.Stop()
	br := liveBreaker(a)
	br.ForceOpen(time.Hour, "test")

	tier := admission.Tier{Name: "std", QueueTimeout: time.Minute}
	rel, _, err := g.Acquire(context.Background(), "acme", tier)
	if err != nil {
		t.Fatal(err)
	}
	defer rel()
	admitted := make(chan func(), 1)
	go func() {
		if rel, _, err := g.Acquire(context.Background(), "acme", tier); err == nil {
			admitted <- rel
		}
	}()
	select {
	case r := <-admitted:
		r()
		t.Fatal("a second request was admitted over a capacity of 1")
	case <-time.After(100 * time.Millisecond):
	}
	br.ForceClose("test")
	select {
	case r := <-admitted:
		r()
	case <-time.After(5 * time.Second):
		t.Fatal("the queued request was not admitted when the breaker closed and capacity grew to 2")
	}
}
