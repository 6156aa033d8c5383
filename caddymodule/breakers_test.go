package caddymodule

import (
	"context"
	"errors"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// breakerHandler is a handler with breakers on, over fresh upstream
// addresses (breakers are process-wide, keyed by address).
func breakerHandler(t *testing.T, cfg *BreakerConfig, dials ...string) *Handler {
	t.Helper()
	initMetrics()
	h := staticHandler(t, func(*Handler) reverseproxy.Selector { return new(reverseproxy.FirstSelection) }, dials...)
	h.Breaker = cfg
	h.gen = configGen.Add(1)
	s := cfg.settings(time.Minute)
	h.breakerSettings = &s
	h.breakers, h.stateMu = new(sync.Map), new(sync.Mutex)
	t.Cleanup(h.releaseBreakers)
	return h
}

func pickErr(b balancer, model string) (proxy.Upstream, error) {
	return b.Pick(httptest.NewRecorder(), httptest.NewRequest("POST", "/", nil), proxy.PickRequest{Info: proxy.RequestInfo{Model: model}})
}

func fail(up proxy.Upstream) {
	up.Done(&proxy.AttemptReport{Upstream: up.Addr, Outcome: proxy.AttemptHTTP5xx, Status: 503})
}

func TestOpenBreakerRemovesUpstreamBeforeSelection(t *testing.T) {
	h := breakerHandler(t, nil, "10.1.0.1:8000", "10.1.0.2:8000")
	b := balancer{h: h}
	for range 3 { // default: 3 consecutive failures
		up, err := pickErr(b, "")
		if err != nil || up.Addr != "10.1.0.1:8000" {
			t.Fatalf("pick %v %v", up.Addr, err)
		}
		fail(up)
	}
	if st := h.breakerFor("10.1.0.1:8000", "").b.State(); st != breaker.Open {
		t.Fatalf("state %v after 3 failures", st)
	}
	before := testutil.ToFloat64(metrics.shortCircuited.WithLabelValues("10.1.0.1:8000"))
	up, err := pickErr(b, "")
	if err != nil || up.Addr != "10.1.0.2:8000" {
		t.Fatalf("with the first open, the policy 'first' must get the second: %v %v", up.Addr, err)
	}
	up.Done(&proxy.AttemptReport{Outcome: proxy.AttemptSuccess})
	if got := testutil.ToFloat64(metrics.shortCircuited.WithLabelValues("10.1.0.1:8000")) - before; got != 1 {
		t.Fatalf("short_circuited grew by %v, want 1", got)
	}
	if got := testutil.ToFloat64(metrics.breakerState.WithLabelValues("10.1.0.1:8000", "")); got != 2 {
		t.Fatalf("breaker_state gauge %v, want 2 (open)", got)
	}
}

func TestAllBreakersOpenGivesRetryAfterWithoutUpstream(t *testing.T) {
	h := breakerHandler(t, &BreakerConfig{ConsecutiveFailures: 1, OpenFor: 30000000000, MinOpen: 30000000000}, "10.1.1.1:8000")
	b := balancer{h: h}
	up, _ := pickErr(b, "")
	fail(up)
	_, err := pickErr(b, "")
	var ue *proxy.UnavailableError
	if !errors.As(err, &ue) || !ue.CircuitOpen || !errors.Is(err, proxy.ErrNoUpstream) {
		t.Fatalf("err %v", err)
	}
	// 30s cooldown jittered by ±20%.
	if ue.RetryAfter < 23*time.Second || ue.RetryAfter > 37*time.Second {
		t.Fatalf("RetryAfter %v", ue.RetryAfter)
	}
}

func TestNeutral4xxAndStreamTimeoutLeaveBreakerClosed(t *testing.T) {
	h := breakerHandler(t, nil, "10.1.2.1:8000")
	b := balancer{h: h}
	for _, o := range []proxy.AttemptOutcome{proxy.AttemptCanceled, proxy.AttemptHTTP4xx, proxy.AttemptInbandError4xx,
		proxy.AttemptStreamTimeout, proxy.AttemptCanceled, proxy.AttemptHTTP4xx, proxy.AttemptStreamTimeout} {
		up, err := pickErr(b, "")
		if err != nil {
			t.Fatal(err)
		}
		up.Done(&proxy.AttemptReport{Outcome: o})
	}
	snap := h.breakerFor("10.1.2.1:8000", "").b.Snapshot()
	if snap.State != breaker.Closed || snap.ConsecutiveFailures != 0 || snap.FailuresInWindow != 0 {
		t.Fatalf("snapshot %+v", snap)
	}
}

func TestRetryAfterOpensBreakerForThatLong(t *testing.T) {
	h := breakerHandler(t, nil, "10.1.3.1:8000", "10.1.3.2:8000")
	b := balancer{h: h}
	up, _ := pickErr(b, "")
	up.Done(&proxy.AttemptReport{Outcome: proxy.AttemptHTTP429, Status: 429, RetryAfter: 2 * time.Second})
	br := h.breakerFor("10.1.3.1:8000", "").b
	if br.State() != breaker.Open {
		t.Fatalf("a 429 with Retry-After should exclude the upstream; state %v", br.State())
	}
	if until := br.Snapshot().OpenUntil; time.Until(until) > 2*time.Second || time.Until(until) < time.Second {
		t.Fatalf("open until %v from now, want ~2s", time.Until(until))
	}
	if up, _ := pickErr(b, ""); up.Addr != "10.1.3.2:8000" {
		t.Fatalf("picked %s", up.Addr)
	}
}

func TestScopeModelKeepsBreakersApart(t *testing.T) {
	learnModel("llama")
	learnModel("qwen")
	h := breakerHandler(t, &BreakerConfig{Scope: "model", ConsecutiveFailures: 1}, "10.1.4.1:8000")
	b := balancer{h: h}
	up, _ := pickErr(b, "llama")
	fail(up)
	if _, err := pickErr(b, "llama"); err == nil {
		t.Fatal("llama's breaker should be open")
	}
	if _, err := pickErr(b, "qwen"); err != nil {
		t.Fatalf("qwen on the same upstream should pass: %v", err)
	}
}

func TestBreakerStateSurvivesHandlerReplacement(t *testing.T) {
	old := breakerHandler(t, &BreakerConfig{ConsecutiveFailures: 1, OpenFor: 60000000000, MinOpen: 60000000000}, "10.1.5.1:8000")
	up, _ := pickErr(balancer{h: old}, "")
	fail(up)
	// A reload: the new handler takes its reference before the old one
	// releases its own.
	next := breakerHandler(t, &BreakerConfig{ConsecutiveFailures: 5}, "10.1.5.1:8000")
	_ = next.breakerFor("10.1.5.1:8000", "")
	old.releaseBreakers()
	e := next.breakerFor("10.1.5.1:8000", "")
	if e.b.State() != breaker.Open {
		t.Fatalf("state after reload %v, want open", e.b.State())
	}
	if e.b.Settings().ConsecutiveFailures != 5 {
		t.Fatalf("new settings not applied: %+v", e.b.Settings())
	}
}

func Test4xxDoesNotResetARunOfFailures(t *testing.T) {
	h := breakerHandler(t, nil, "10.1.6.1:8000")
	b := balancer{h: h}
	for _, o := range []proxy.AttemptOutcome{proxy.AttemptHTTP5xx, proxy.AttemptHTTP5xx, proxy.AttemptHTTP4xx, proxy.AttemptHTTP5xx} {
		up, err := pickErr(b, "")
		if err != nil {
			t.Fatal(err)
		}
		up.Done(&proxy.AttemptReport{Outcome: o})
	}
	if st := h.breakerFor("10.1.6.1:8000", "").b.State(); st != breaker.Open {
		t.Fatalf("5xx, 5xx, 400, 5xx left the breaker %v; the client's 400 must not reset the run", st)
	}
}

// eventRecorder is a Caddy event handler that keeps what it sees.
type eventRecorder struct {
	mu     sync.Mutex
	events []caddy.Event
}

func (r *eventRecorder) Handle(_ context.Context, e caddy.Event) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, e)
	return nil
}

func TestTransitionEmitsCaddyEventAndCountsIt(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	app := new(caddyevents.App)
	if err := app.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	rec := new(eventRecorder)
	if err := app.On("llm_proxy_breaker_open", rec); err != nil {
		t.Fatal(err)
	}
	setCurrent(ctx, zap.NewNop(), app)
	defer setCurrent(caddy.Context{}, nil, nil)

	h := breakerHandler(t, &BreakerConfig{ConsecutiveFailures: 1}, "10.1.7.1:8000")
	before := testutil.ToFloat64(metrics.breakerTransitions.WithLabelValues("10.1.7.1:8000", "closed", "open"))
	up, _ := pickErr(balancer{h: h}, "")
	fail(up)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if len(rec.events) != 1 || rec.events[0].Name() != "llm_proxy_breaker_open" {
		t.Fatalf("events %v", rec.events)
	}
	if d := rec.events[0].Data; d["upstream"] != "10.1.7.1:8000" || d["from"] != "closed" || d["to"] != "open" {
		t.Fatalf("event data %v", d)
	}
	if got := testutil.ToFloat64(metrics.breakerTransitions.WithLabelValues("10.1.7.1:8000", "closed", "open")) - before; got != 1 {
		t.Fatalf("transitions_total grew by %v", got)
	}
}
