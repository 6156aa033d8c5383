package caddymodule

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
	"github.com/llmproxy/caddy-llm-proxy/saturation"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

func init() {
	caddy.RegisterModule(placeholderCapture{})
}

// placeholderCapture is a test-only middleware that records, after the
// next handler returns, the {http.llm_proxy.*} placeholder named by the
// request's X-Capture header.
type placeholderCapture struct{}

var captured sync.Map // X-Capture value → the placeholder's value ("<unset>" when unset)

func (placeholderCapture) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.llm_proxy_test_capture", New: func() caddy.Module { return new(placeholderCapture) }}
}

func (placeholderCapture) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	err := next.ServeHTTP(w, r)
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	v, ok := repl.Get("http.llm_proxy.saturation")
	if !ok {
		v = "<unset>"
	}
	captured.Store(r.Header.Get("X-Capture"), fmt.Sprint(v))
	return err
}

// mockVLLM serves a vLLM /metrics (waiting, 2 by default; 1 running;
// KV-cache 50%) and a chat completion; it counts scrapes and records their
// User-Agent.
type mockVLLM struct {
	*httptest.Server
	waiting atomic.Int64
	scrapes atomic.Int64
	agent   atomic.Value
}

func newMockVLLM(t *testing.T) *mockVLLM {
	m := new(mockVLLM)
	m.waiting.Store(2)
	m.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			m.scrapes.Add(1)
			m.agent.Store(r.Header.Get("User-Agent"))
			w.Header().Set("Content-Type", "text/plain; version=0.0.4")
			fmt.Fprintf(w, "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} %d\n"+
				"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 1\n"+
				"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.5\n", m.waiting.Load())
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	}))
	t.Cleanup(m.Close)
	return m
}

// satJSON is saturation.View as a client reads it.
type satJSON struct {
	Upstream   string     `json:"upstream"`
	ScrapedAt  *time.Time `json:"scraped_at"`
	AgeSeconds float64    `json:"age_seconds"`
	LastError  string     `json:"last_error"`
	Score      float64    `json:"score"`
	ScoreKnown bool       `json:"score_known"`
	Signals    []struct {
		Signal string   `json:"signal"`
		Value  *float64 `json:"value"`
		State  string   `json:"state"`
	} `json:"signals"`
}

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// runConfig loads a whole Caddy config in this process, as `caddy run`
// does, and stops it when the test ends.
func runConfig(t *testing.T, listen string, handlers ...string) {
	t.Helper()
	runConfigWithApp(t, listen, "", handlers...)
}

// runConfigWithApp is runConfig with an llm_proxy app config (JSON).
func runConfigWithApp(t *testing.T, listen, app string, handlers ...string) {
	t.Helper()
	if app != "" {
		app = `"llm_proxy":` + app + `,`
	}
	cfg := `{"admin":{"disabled":true,"config":{"persist":false}},"apps":{` + app + `"http":{"servers":{"s":{"listen":["` + listen +
		`"],"automatic_https":{"disable":true},"routes":[{"handle":[` + strings.Join(handlers, ",") + `]}]}}}}}`
	if err := caddy.Load([]byte(cfg), true); err != nil {
		t.Fatalf("loading config: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
}

// waitFor polls cond (the scrape loop runs on real time) for up to 5s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func chat(t *testing.T, gateway, capture string) {
	t.Helper()
	if status, body := post(gateway, capture, ""); status != 200 {
		t.Fatalf("status %d: %s", status, body)
	}
}

// post sends a chat completion with an optional API key.
func post(gateway, capture, key string) (int, string) {
	req, _ := http.NewRequest("POST", "http://"+gateway+"/v1/chat/completions", strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Capture", capture)
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestStartedConfigScrapesAndShowsSaturation: a running config with
// saturation scrapes its upstream through the handler's transport; the
// snapshot reaches the metrics, the admin API (with its age) and the
// {http.llm_proxy.saturation} placeholder; a handler without saturation
// leaves the placeholder unset.
func TestStartedConfigScrapesAndShowsSaturation(t *testing.T) {
	initMetrics()
	m := newMockVLLM(t)
	addr := strings.TrimPrefix(m.URL, "http://")
	gateway := freePort(t)
	runConfig(t, gateway, `{"handler":"llm_proxy_test_capture"}`,
		`{"handler":"llm_proxy","upstreams":[{"dial":"`+addr+`"}],"saturation":{"interval":"200ms"}}`)

	waitFor(t, "a scrape", func() bool {
		for _, v := range shared.upstreams.Saturation(time.Now()) {
			if v.Upstream == addr && v.ScrapedAt != nil {
				return true
			}
		}
		return false
	})
	if ua, _ := m.agent.Load().(string); ua != "caddy-llm-proxy-scraper" {
		t.Errorf("scrape User-Agent %q", ua)
	}

	// Admin API: every upstream, then the one.
	rec := httptest.NewRecorder()
	if err := (adminAPI{}).saturation(rec, httptest.NewRequest("GET", "/llm_proxy/saturation", nil)); err != nil {
		t.Fatal(err)
	}
	var views []satJSON
	if err := json.Unmarshal(rec.Body.Bytes(), &views); err != nil {
		t.Fatalf("%v: %s", err, rec.Body)
	}
	var v *satJSON
	for i := range views {
		if views[i].Upstream == addr {
			v = &views[i]
		}
	}
	if v == nil {
		t.Fatalf("no snapshot for %s in %s", addr, rec.Body)
	}
	if v.ScrapedAt == nil || v.AgeSeconds < 0 || v.AgeSeconds > 5 || v.LastError != "" || !v.ScoreKnown || v.Score != 0.625 || len(v.Signals) != 5 {
		t.Fatalf("snapshot %s", rec.Body)
	}
	if s := v.Signals[0]; s.Signal != "queue_depth" || s.Value == nil || *s.Value != 2 || s.State != "fresh" {
		t.Errorf("queue_depth %+v", s)
	}
	rec = httptest.NewRecorder()
	if err := (adminAPI{}).saturation(rec, httptest.NewRequest("GET", "/llm_proxy/saturation/"+addr, nil)); err != nil {
		t.Fatal(err)
	}
	var one satJSON
	if err := json.Unmarshal(rec.Body.Bytes(), &one); err != nil || one.Upstream != addr {
		t.Fatalf("one upstream: %v %s", err, rec.Body)
	}
	err := (adminAPI{}).saturation(httptest.NewRecorder(), httptest.NewRequest("GET", "/llm_proxy/saturation/10.255.0.1:1", nil))
	if ae, ok := err.(caddy.APIError); !ok || ae.HTTPStatus != http.StatusNotFound {
		t.Errorf("unknown upstream: %v, want 404", err)
	}

	// Metrics.
	if got := testutil.ToFloat64(metrics.saturation.WithLabelValues(addr, "kv_usage")); got != 0.5 {
		t.Errorf("upstream_saturation{kv_usage} = %v", got)
	}
	if got := testutil.ToFloat64(metrics.signalState.WithLabelValues(addr, "queue_depth")); got != 0 {
		t.Errorf("saturation_signal_state{queue_depth} = %v, want 0", got)
	}
	if got := testutil.ToFloat64(metrics.signalState.WithLabelValues(addr, "queue_time")); got != 2 {
		t.Errorf("saturation_signal_state{queue_time} = %v, want 2 (the mock has no histogram)", got)
	}
	if got := testutil.ToFloat64(metrics.scrapeErrors.WithLabelValues(addr)); got != 0 {
		t.Errorf("scrape_errors_total = %v", got)
	}

	// Placeholder: max(2 waiting / 5, 0.5 KV / 0.8) = 0.625.
	chat(t, gateway, "sat")
	if got, _ := captured.Load("sat"); got != "0.625" {
		t.Errorf("{http.llm_proxy.saturation} = %v, want 0.625", got)
	}
}

// TestPlaceholderUnsetWithoutSaturation: a handler without saturation
// leaves {http.llm_proxy.saturation} unset.
func TestPlaceholderUnsetWithoutSaturation(t *testing.T) {
	m := newMockVLLM(t)
	gateway := freePort(t)
	runConfig(t, gateway, `{"handler":"llm_proxy_test_capture"}`,
		`{"handler":"llm_proxy","upstreams":[{"dial":"`+strings.TrimPrefix(m.URL, "http://")+`"}]}`)
	chat(t, gateway, "nosat")
	if got, _ := captured.Load("nosat"); got != "<unset>" {
		t.Errorf("{http.llm_proxy.saturation} = %v, want unset", got)
	}
	if n := m.scrapes.Load(); n != 0 {
		t.Errorf("%d scrapes without saturation", n)
	}
}

// TestSaturatedPoolShedsAndQueuesThroughTheGate: while the pool signal is
// on (the only upstream's queue is past queue_threshold), a sheddable
// tier is refused with 429 saturated and another tier waits in the queue;
// the scrape that shows the queue drained admits it.
func TestSaturatedPoolShedsAndQueuesThroughTheGate(t *testing.T) {
	initMetrics()
	m := newMockVLLM(t)
	m.waiting.Store(10) // score 2: saturated
	addr := strings.TrimPrefix(m.URL, "http://")
	gateway := freePort(t)
	hash := func(k string) string { sum := sha256.Sum256([]byte(k)); return hex.EncodeToString(sum[:]) }
	app := `{"tenants":{"keys":[{"sha256":"` + hash("sk-batch") + `","tenant":"nightly","tier":"batch"},{"sha256":"` + hash("sk-gold") + `","tenant":"acme"}]},` +
		`"tiers":[{"name":"default","priority":0},{"name":"batch","priority":-1}]}`
	runConfigWithApp(t, gateway, app, `{"handler":"llm_proxy","upstreams":[{"dial":"`+addr+`"}],"saturation":{"interval":"100ms"}}`)
	waitFor(t, "the pool signal", func() bool {
		for _, v := range shared.upstreams.Saturation(time.Now()) {
			if v.Upstream == addr && v.ScoreKnown && v.Score >= 1 {
				return true
			}
		}
		return false
	})

	status, body := post(gateway, "", "sk-batch")
	if status != 429 || !strings.Contains(body, `"code":"saturated"`) {
		t.Fatalf("sheddable tier: %d %s, want 429 saturated", status, body)
	}
	depth := metrics.queueDepth.WithLabelValues("default")
	before := testutil.ToFloat64(depth)
	done := make(chan int, 1)
	go func() {
		status, _ := post(gateway, "", "sk-gold")
		done <- status
	}()
	waitFor(t, "the request to queue", func() bool { return testutil.ToFloat64(depth) == before+1 })
	select {
	case s := <-done:
		t.Fatalf("priority 0 answered %d while the pool is saturated; want it queued", s)
	default:
	}
	m.waiting.Store(0)
	select {
	case s := <-done:
		if s != 200 {
			t.Fatalf("queued request: %d after the signal cleared", s)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the queued request was not admitted after the signal cleared")
	}
}

// TestPoolSignalKeepsTheGateAllocationFree: the gate consults the pool
// signal of a scraped, saturated pool on every admission without
// allocating.
func TestPoolSignalKeepsTheGateAllocationFree(t *testing.T) {
	m := newMockVLLM(t)
	m.waiting.Store(10)
	addr := strings.TrimPrefix(m.URL, "http://")
	sat := &saturation.Saturation{Interval: 100 * time.Millisecond, Transport: httpScheme{}}
	pool, err := shared.upstreams.NewPool(upstream.Config{Key: t.Name(), Static: []upstream.Target{{Addr: addr}}, Saturation: sat, Selector: upstream.LeastQueue{}})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Release()
	startedApp(t, caddy.Context{Context: context.Background()}, nil, pool)
	waitFor(t, "the pool signal", pool.Saturated)

	g := admission.NewPoolGate(admission.GateSettings{Pool: pool}, nil, clock.Real, nil)
	if !g.Saturated() {
		t.Fatal("the gate does not see the pool signal")
	}
	if n := testing.AllocsPerRun(1000, func() { g.Saturated() }); n != 0 {
		t.Fatalf("the gate reading a saturated pool's signal allocates %v times, want 0", n)
	}
	m.waiting.Store(0)
	waitFor(t, "the signal to clear", func() bool { return !g.Saturated() })
	var slot admission.Slot
	tier := admission.Tier{Name: "std"}
	if n := testing.AllocsPerRun(1000, func() {
		if _, err := g.AcquireSlot(context.Background(), "acme", tier, &slot); err != nil {
			t.Fatal(err)
		}
		slot.Release()
	}); n != 0 {
		t.Fatalf("AcquireSlot + Release with the pool signal allocate %v times, want 0", n)
	}
}

// httpScheme is http.DefaultTransport for requests without a scheme, as
// Caddy's transport receives them.
type httpScheme struct{}

func (httpScheme) RoundTrip(r *http.Request) (*http.Response, error) {
	r.URL.Scheme = "http"
	return http.DefaultTransport.RoundTrip(r)
}
