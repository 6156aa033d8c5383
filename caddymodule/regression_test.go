package caddymodule

// Regression tests for defects found in review: each failed before its fix.

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// A half-open probe that is a healthy user stream (first token at once)
// lasting longer than first_byte_timeout re-opens the breaker: the permit is
// held until the stream ends, and the breaker fails probes older than
// ProbeTimeout (= first_byte_timeout).
func TestLongHealthyProbeStreamClosesBreaker(t *testing.T) {
	cfg := &BreakerConfig{ConsecutiveFailures: 1, OpenFor: caddy.Duration(50 * time.Millisecond),
		MinOpen: caddy.Duration(50 * time.Millisecond), MaxOpen: caddy.Duration(time.Second), RecoverySuccesses: 1}
	h := breakerHandler(t, cfg, "10.9.0.1:8000")
	s := cfg.settings(100 * time.Millisecond) // first_byte_timeout 100ms
	h.breakerSettings = &s
	b := balancer{h: h}
	up, _ := pickErr(b, "")
	fail(up)
	time.Sleep(100 * time.Millisecond)
	probe, err := pickErr(b, "")
	if err != nil {
		t.Fatal(err)
	}
	// The stream's first token comes after 5ms (the proxy commits it);
	// it keeps streaming for 200ms.
	probe.Committed(5 * time.Millisecond)
	time.Sleep(200 * time.Millisecond)
	_, _ = pickErr(b, "") // any other request meanwhile
	probe.Done(&proxy.AttemptReport{Upstream: probe.Addr, Outcome: proxy.AttemptSuccess, TTFT: 5 * time.Millisecond, Committed: true})
	snap := h.breakerFor("10.9.0.1:8000", "").b.Snapshot()
	if snap.State != breaker.Closed {
		t.Fatalf("healthy probe stream (ttft 5ms) left breaker %v; last failure %q", snap.State, snap.LastFailure)
	}
}

// After Cleanup (reload), a request still running on the old handler takes
// new references (scope model / dynamic upstreams) that nobody releases.
func TestOldHandlerTakesNoBreakerRefsAfterCleanup(t *testing.T) {
	old := breakerHandler(t, &BreakerConfig{Scope: "model"}, "10.9.1.1:8000")
	old.releaseBreakers()                         // Cleanup ran: the config was replaced
	up, err := pickErr(balancer{h: old}, "llama") // a request whose body was still uploading
	if err != nil {
		t.Fatal(err)
	}
	up.Done(&proxy.AttemptReport{Outcome: proxy.AttemptSuccess})
	// The new config never used this key; the old handler will not run Cleanup again.
	if n, ok := breakerPool.References("10.9.1.1:8000|llama"); ok {
		t.Fatalf("entry still referenced %d time(s) after its only config was cleaned up: never destroyed", n)
	}
}

// The old handler, still serving, re-applies its settings over the new
// config's when it meets a key it had not used yet.
func TestOldHandlerDoesNotRevertNewSettings(t *testing.T) {
	old := breakerHandler(t, &BreakerConfig{Scope: "model", ConsecutiveFailures: 1}, "10.9.2.1:8000")
	next := breakerHandler(t, &BreakerConfig{Scope: "model", ConsecutiveFailures: 5}, "10.9.2.1:8000")
	_ = next.breakerFor("10.9.2.1:8000", "llama")
	_ = old.breakerFor("10.9.2.1:8000", "llama") // an in-flight request on the old config
	if got := next.breakerFor("10.9.2.1:8000", "llama").b.Settings().ConsecutiveFailures; got != 5 {
		t.Fatalf("new config's consecutive_failures 5 replaced by the old config's %d", got)
	}
}

type httpScheme struct{}

func (httpScheme) RoundTrip(r *http.Request) (*http.Response, error) {
	r.URL.Scheme = "http"
	return http.DefaultTransport.RoundTrip(r)
}

// A breaker that opens after its entry was destroyed (an in-flight attempt
// of the old config fails after Cleanup) starts a probe loop that no one can
// stop: it probes the removed upstream forever.
func TestNoProbeLoopAfterEntryDestroyed(t *testing.T) {
	var probes atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		probes.Add(1)
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	cfg := &BreakerConfig{ConsecutiveFailures: 1, OpenFor: caddy.Duration(20 * time.Millisecond),
		MinOpen: caddy.Duration(20 * time.Millisecond), Probe: &ActiveProbe{URI: "/health", Interval: caddy.Duration(20 * time.Millisecond)}}
	h := breakerHandler(t, cfg, addr)
	e := h.breakerFor(addr, "")
	e.setProber(&prober{addr: addr, transport: httpScheme{}, probe: *cfg.Probe, timeout: time.Second})
	up, err := pickErr(balancer{h: h}, "")
	if err != nil {
		t.Fatal(err)
	}
	h.releaseBreakers() // reload removed this upstream: entry destroyed
	if _, ok := breakerPool.References(addr); ok {
		t.Fatal("entry should be gone")
	}
	fail(up) // the old config's in-flight attempt fails afterwards
	time.Sleep(300 * time.Millisecond)
	n1 := probes.Load()
	time.Sleep(300 * time.Millisecond)
	if n2 := probes.Load(); n2 > n1 {
		t.Fatalf("destroyed entry still probing: %d then %d probes", n1, n2)
	}
}

// scope model: one breaker entry (and one reference held until Cleanup) per
// client-chosen model name, without bound.
func TestScopeModelBreakersAreBounded(t *testing.T) {
	resetBreakerModels()
	defer resetBreakerModels()
	h := breakerHandler(t, &BreakerConfig{Scope: "model"}, "10.9.3.1:8000")
	b := balancer{h: h}
	for i := range 5000 {
		up, err := pickErr(b, fmt.Sprintf("junk-%d", i))
		if err != nil {
			t.Fatal(err)
		}
		up.Done(&proxy.AttemptReport{Outcome: proxy.AttemptHTTP4xx})
	}
	n := 0
	breakerPool.Range(func(k, _ any) bool {
		if strings.HasPrefix(k.(string), "10.9.3.1:8000|") {
			n++
		}
		return true
	})
	if n > maxBreakerModels+1 {
		t.Fatalf("%d breaker entries from client-chosen model names", n)
	}
}

type rotatingSource struct{ n atomic.Int64 }

func (s *rotatingSource) GetUpstreams(*http.Request) ([]*reverseproxy.Upstream, error) {
	i := s.n.Add(1)
	return []*reverseproxy.Upstream{{Dial: fmt.Sprintf("10.%d.%d.%d:8000", 50+i/65536, (i/256)%256, i%256)}}, nil
}

// Dynamic upstreams (pod IPs that churn): every address ever returned keeps
// a target, a breaker entry and a pool reference until the config is replaced.
func TestDynamicTargetsAreForgotten(t *testing.T) {
	h := breakerHandler(t, nil)
	h.dynamic = new(rotatingSource)
	h.selector = new(reverseproxy.FirstSelection)
	b := balancer{h: h}
	for range 3000 {
		up, err := pickErr(b, "")
		if err != nil {
			t.Fatal(err)
		}
		up.Done(&proxy.AttemptReport{Outcome: proxy.AttemptSuccess})
	}
	n := 0
	h.dynamicTargets.Range(func(_, _ any) bool { n++; return true })
	if n > maxDynamicTargets+1 || len(h.breakerKeys) > maxDynamicTargets+1 {
		t.Fatalf("%d dynamic targets and %d breaker refs kept for addresses no longer returned", n, len(h.breakerKeys))
	}
}

// The hedger of an old handler takes a tracker reference after Cleanup.
func TestOldHandlerTakesNoTrackerRefsAfterCleanup(t *testing.T) {
	initMetrics()
	h := &Handler{poolKey: "review-pool", trackers: new(sync.Map), stateMu: new(sync.Mutex), breakers: new(sync.Map),
		Hedge: &HedgeConfig{After: caddyDur(time.Second)}}
	if err := h.provisionHedging(); err != nil {
		t.Fatal(err)
	}
	_ = h.Cleanup()
	info := proxy.RequestInfo{Model: "review-model", Stream: true}
	h.hedger.Observe(info, time.Second) // a request finishing on the old handler
	key := fmt.Sprintf("ttft|%s|%s|%t", h.poolKey, modelLabel(info.Model), info.Stream)
	if n, ok := hedgePool.References(key); ok {
		t.Fatalf("tracker referenced %d time(s) after Cleanup: leaked", n)
	}
}

// A reload that turns active probing on while a breaker is open: user
// traffic is now refused (ActiveProbing) but no probe loop is started (only
// a transition to open starts one), so the breaker stays open for good.
func TestReloadEnablingProbeRecoversOpenBreaker(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(200) }))
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	tr := new(reverseproxy.HTTPTransport)
	if err := tr.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	short := caddy.Duration(30 * time.Millisecond)
	old := breakerHandler(t, &BreakerConfig{ConsecutiveFailures: 1, OpenFor: short, MinOpen: short}, addr)
	up, _ := pickErr(balancer{h: old}, "")
	fail(up) // open
	next := breakerHandler(t, &BreakerConfig{ConsecutiveFailures: 1, OpenFor: short, MinOpen: short,
		Probe: &ActiveProbe{URI: "/", Interval: short}}, addr)
	next.transport = tr
	_ = next.breakerFor(addr, "") // Provision of the new config
	old.releaseBreakers()
	time.Sleep(500 * time.Millisecond) // the healthy upstream would be probed and closed by now
	if _, err := pickErr(balancer{h: next}, ""); err != nil {
		t.Fatalf("healthy upstream still refused long after its cooldown: %v (state %v)", err, next.breakerFor(addr, "").b.State())
	}
}

// scope model: a model no upstream has served yet still gets a breaker of
// its own, so one broken model does not black out another.
func TestScopeModelUnservedModelsHaveTheirOwnBreakers(t *testing.T) {
	resetBreakerModels()
	h := breakerHandler(t, &BreakerConfig{Scope: "model", ConsecutiveFailures: 1}, "10.9.4.1:8000")
	b := balancer{h: h}
	up, err := pickErr(b, "fresh-model-b")
	if err != nil {
		t.Fatal(err)
	}
	fail(up)
	if _, err := pickErr(b, "fresh-model-a"); err != nil {
		t.Fatalf("model a refused after model b's failure: %v", err)
	}
}

// scope model: a reload keeps every model's breaker of the pool, not only
// those the new config happens to see traffic for.
func TestScopeModelBreakersSurviveReload(t *testing.T) {
	cfg := &BreakerConfig{Scope: "model", ConsecutiveFailures: 1, OpenFor: caddyDur(time.Minute), MinOpen: caddyDur(time.Minute)}
	mk := func() *Handler {
		h := breakerHandler(t, cfg, "10.9.5.1:8000")
		h.holdBreakers() // as Provision does
		return h
	}
	old := mk()
	up, err := pickErr(balancer{h: old}, "reload-model")
	if err != nil {
		t.Fatal(err)
	}
	fail(up)
	next := mk()
	old.releaseBreakers()
	if _, err := pickErr(balancer{h: next}, "reload-model"); err == nil {
		t.Fatal("the model's open breaker was lost in the reload")
	}
}

// Dynamic upstreams: a reload of the same source keeps their breakers.
func TestDynamicBreakersSurviveReload(t *testing.T) {
	cfg := &BreakerConfig{ConsecutiveFailures: 1, OpenFor: caddyDur(time.Minute), MinOpen: caddyDur(time.Minute)}
	mk := func() *Handler {
		h := breakerHandler(t, cfg)
		h.poolKey = "dynamic:test-source"
		h.dynamic = fakeSource{dials: []string{"10.9.7.1:8000"}}
		h.holdBreakers() // as Provision does
		return h
	}
	old := mk()
	up, err := pickErr(balancer{h: old}, "")
	if err != nil {
		t.Fatal(err)
	}
	fail(up)
	next := mk()
	old.releaseBreakers()
	if _, err := pickErr(balancer{h: next}, ""); err == nil {
		t.Fatal("the dynamic upstream's open breaker was lost in the reload")
	}
}

// A breaker no config uses any more takes its gauge series with it.
func TestDestroyedBreakerLeavesNoGauge(t *testing.T) {
	h := breakerHandler(t, nil, "10.9.6.1:8000")
	_ = h.breakerFor("10.9.6.1:8000", "")
	h.releaseBreakers()
	if n := testutil.CollectAndCount(metrics.breakerState, "caddy_llm_proxy_breaker_state"); n > 0 {
		found := false
		ch := make(chan prometheus.Metric, 1024)
		metrics.breakerState.Collect(ch)
		close(ch)
		for m := range ch {
			if strings.Contains(m.Desc().String(), "") {
				var pb dto.Metric
				_ = m.Write(&pb)
				for _, l := range pb.Label {
					if l.GetName() == "upstream" && l.GetValue() == "10.9.6.1:8000" {
						found = true
					}
				}
			}
		}
		if found {
			t.Fatal("breaker_state still reports a destroyed breaker")
		}
	}
}

// resetBreakerModels forgets the process-wide unserved model names.
func resetBreakerModels() {
	breakerModels.Range(func(k, _ any) bool {
		breakerModels.Delete(k)
		return true
	})
	breakerModels.n.Store(0)
}
