package caddymodule

import (
	"context"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

func TestParseUpstreamAddr(t *testing.T) {
	cases := []struct{ in, dial, scheme string }{
		{"10.0.0.1:8000", "10.0.0.1:8000", ""},
		{"http://10.0.0.1:8000", "10.0.0.1:8000", "http"},
		{"https://vllm.internal", "vllm.internal:443", "https"},
		{"http://vllm.internal", "vllm.internal:80", "http"},
		{"h2c://10.0.0.1:8000", "10.0.0.1:8000", "h2c"},
		{"[::1]:8000", "[::1]:8000", ""},
		{"unix//run/vllm.sock", "unix//run/vllm.sock", ""},
	}
	for _, tc := range cases {
		dial, scheme, err := parseUpstreamAddr(tc.in)
		if err != nil || dial != tc.dial || scheme != tc.scheme {
			t.Errorf("parseUpstreamAddr(%q) = %q, %q, %v; want %q, %q", tc.in, dial, scheme, err, tc.dial, tc.scheme)
		}
	}
}

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

// startedApp is an llm_proxy app that has started, emitting to events.
func startedApp(t *testing.T, ctx caddy.Context, events *caddyevents.App, pools ...*upstream.Pool) *App {
	t.Helper()
	a := &App{ctx: ctx, logger: zap.NewNop(), events: events}
	for _, p := range pools {
		a.adopt(p)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Stop() })
	return a
}

// TestTransitionEmitsCaddyEventAndCountsIt: a breaker transition becomes a
// Caddy event through the newest started app, naming the handler whose
// breaker it is, and a counted metric.
func TestTransitionEmitsCaddyEventAndCountsIt(t *testing.T) {
	initMetrics()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	events := new(caddyevents.App)
	if err := events.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	rec := new(eventRecorder)
	if err := events.On("llm_proxy_breaker_open", rec); err != nil {
		t.Fatal(err)
	}
	const addr = "10.1.7.1:8000"
	s := breaker.Settings{ConsecutiveFailures: 1}
	pool, err := shared.upstreams.NewPool(upstream.Config{Key: t.Name(), Handler: "site-a", Named: true, Static: []upstream.Target{{Addr: addr}}, Breaker: &s})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Release()
	startedApp(t, ctx, events, pool)

	before := testutil.ToFloat64(metrics.breakerTransitions.WithLabelValues(addr, "closed", "open"))
	up, err := pool.Pick(httptest.NewRecorder(), httptest.NewRequest("POST", "/", nil), proxy.PickRequest{})
	if err != nil {
		t.Fatal(err)
	}
	up.Done(&proxy.AttemptReport{Upstream: addr, Outcome: proxy.AttemptHTTP5xx, Status: 503})
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if len(rec.events) != 1 || rec.events[0].Name() != "llm_proxy_breaker_open" {
		t.Fatalf("events %v", rec.events)
	}
	if d := rec.events[0].Data; d["upstream"] != addr || d["handler"] != "site-a" || d["from"] != "closed" || d["to"] != "open" {
		t.Fatalf("event data %v", d)
	}
	if got := testutil.ToFloat64(metrics.breakerTransitions.WithLabelValues(addr, "closed", "open")) - before; got != 1 {
		t.Fatalf("transitions_total grew by %v", got)
	}
	if v, _ := gathered(t, "caddy_llm_proxy_breaker_state", map[string]string{"pool": t.Name(), "upstream": addr, "model": ""}); v != float64(breaker.Open) {
		t.Fatalf("breaker_state = %v, want %d (open)", v, breaker.Open)
	}
}

// TestAppStartAndStopHandOverSettings: a config's breaker settings reach a
// shared upstream only when its app starts, and go back to the older
// running config when it stops (its start failed elsewhere).
func TestAppStartAndStopHandOverSettings(t *testing.T) {
	const addr = "10.1.8.1:8000"
	build := func(failures int) *upstream.Pool {
		s := breaker.Settings{ConsecutiveFailures: failures}
		p, err := shared.upstreams.NewPool(upstream.Config{Key: t.Name(), Static: []upstream.Target{{Addr: addr}}, Breaker: &s})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Release)
		return p
	}
	ctx := caddy.Context{Context: context.Background()}
	old := build(3)
	startedApp(t, ctx, nil, old)
	got := func() int {
		b := liveBreaker(addr)
		if b == nil {
			t.Fatal("no breaker")
		}
		return b.Settings().ConsecutiveFailures
	}
	next := build(1)
	if n := got(); n != 3 {
		t.Fatalf("after provisioning a new config: consecutive_failures %d, want the running config's 3", n)
	}
	a := &App{ctx: ctx, logger: zap.NewNop()}
	a.adopt(next)
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	if n := got(); n != 1 {
		t.Fatalf("after the new config started: consecutive_failures %d, want 1", n)
	}
	_ = a.Stop()
	if n := got(); n != 3 {
		t.Fatalf("after the new config stopped: consecutive_failures %d, want the old config's 3", n)
	}
}

// TestUpstreamIdleTimeoutDefaultsBelowServerKeepAlive: without a keepalive
// setting the transport drops idle connections after 4s (uvicorn closes
// them after 5s) and keeps up to 256 per upstream (Caddy's 32 re-dialled
// most of a burst); configured ones are kept.
func TestUpstreamIdleTimeoutDefaultsBelowServerKeepAlive(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	for _, tc := range []struct {
		name     string
		raw      string
		want     time.Duration
		wantIdle int
	}{
		{"no transport", "", DefaultUpstreamIdleTimeout, DefaultUpstreamMaxIdleConns},
		{"transport without keepalive", `{"protocol":"http","dial_timeout":1000000000}`, DefaultUpstreamIdleTimeout, DefaultUpstreamMaxIdleConns},
		{"keepalive without idle", `{"protocol":"http","keep_alive":{"max_idle_conns_per_host":8}}`, DefaultUpstreamIdleTimeout, 8},
		{"configured idle", `{"protocol":"http","keep_alive":{"idle_timeout":90000000000}}`, 90 * time.Second, DefaultUpstreamMaxIdleConns},
		{"keep-alive off", `{"protocol":"http","keep_alive":{"enabled":false}}`, DefaultUpstreamIdleTimeout, DefaultUpstreamMaxIdleConns},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := new(Handler)
			if tc.raw != "" {
				h.TransportRaw = []byte(tc.raw)
			}
			tr, err := newTransport(ctx, h)
			if err != nil {
				t.Fatal(err)
			}
			if got := tr.Transport.IdleConnTimeout; got != tc.want {
				t.Errorf("idle timeout %v, want %v", got, tc.want)
			}
			if got := tr.Transport.MaxIdleConnsPerHost; got != tc.wantIdle {
				t.Errorf("idle connections per upstream %d, want %d", got, tc.wantIdle)
			}
		})
	}
}

// TestPlainHTTPUpstreamsUseTheGatewaysClient: http:// requests go over
// internal/h1 with the transport's settings, unless the transport asks for
// what only net/http does; https:// requests always go to Caddy's.
func TestPlainHTTPUpstreamsUseTheGatewaysClient(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	for _, tc := range []struct {
		name, raw string
		h1        bool
		client    string
	}{
		{"no transport", "", true, ""},
		{"upstream_client builtin", "", true, UpstreamClientBuiltin},
		{"upstream_client net_http", "", false, UpstreamClientNetHTTP},
		{"upstream_client net_http with a transport", `{"protocol":"http","dial_timeout":1000000000}`, false, UpstreamClientNetHTTP},
		{"timeouts and keep-alive", `{"protocol":"http","dial_timeout":1000000000,"response_header_timeout":2000000000,"keep_alive":{"max_idle_conns_per_host":8}}`, true, ""},
		{"h2c", `{"protocol":"http","versions":["h2c"]}`, false, ""},
		{"forward proxy", `{"protocol":"http","forward_proxy_url":"http://127.0.0.1:3128"}`, false, ""},
		{"max conns per host", `{"protocol":"http","max_conns_per_host":4}`, false, ""},
		{"compression on", `{"protocol":"http","compression":true}`, false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := &Handler{UpstreamClient: tc.client}
			if tc.raw != "" {
				h.TransportRaw = []byte(tc.raw)
			}
			tr, err := newTransport(ctx, h)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tr.cleanup(h.ownTransport) }()
			if (tr.h1 != nil) != tc.h1 {
				t.Fatalf("h1 client %v, want %v", tr.h1 != nil, tc.h1)
			}
			if tr.h1 == nil {
				return
			}
			if tr.h1.IdleTimeout != tr.Transport.IdleConnTimeout || tr.h1.MaxIdlePerHost != tr.Transport.MaxIdleConnsPerHost ||
				tr.h1.ResponseHeaderTimeout != tr.Transport.ResponseHeaderTimeout || tr.h1.ReadBufferSize != tr.Transport.ReadBufferSize {
				t.Fatalf("h1 settings %+v differ from the transport's", tr.h1)
			}
		})
	}
	t.Run("an unknown upstream_client is refused", func(t *testing.T) {
		if _, err := newTransport(ctx, &Handler{UpstreamClient: "curl"}); err == nil || !strings.Contains(err.Error(), "upstream_client") {
			t.Fatalf("err %v", err)
		}
	})
	t.Run("proxy_protocol is refused", func(t *testing.T) {
		h := &Handler{TransportRaw: []byte(`{"protocol":"http","proxy_protocol":"v2"}`)}
		if _, err := newTransport(ctx, h); err == nil || !strings.Contains(err.Error(), "proxy_protocol") {
			t.Fatalf("err %v, want proxy_protocol refused", err)
		}
	})
	t.Run("HTTP_PROXY in the environment", func(t *testing.T) {
		t.Setenv("HTTP_PROXY", "http://127.0.0.1:3128")
		tr, err := newTransport(ctx, new(Handler))
		if err != nil {
			t.Fatal(err)
		}
		if tr.h1 != nil {
			t.Fatal("requests would bypass HTTP_PROXY")
		}
	})
}
