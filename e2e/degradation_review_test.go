package e2e

// Review probes of the degradation ladder (issue 11) against the real
// binary: a fallback with a capacity of its own in a site without tenants,
// an upstream 429 with a non-streamed max_completion_tokens request, a
// reload while a request is on the fallback, a fallback whose upstreams
// are dynamic, and the Caddyfile grammar as the issue writes it.

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// A fallback's own capacity needs no tenants: a site without an admission
// block whose primary answers 503 is served by a fallback that has
// `capacity 4`.
func TestReviewDegradationFallbackCapacityWithoutTenants(t *testing.T) {
	primary := startFleet(t, mockllm.FleetConfig{Replicas: 1, Behavior: mockllm.Behavior{Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503}}})
	small := startFleet(t, mockllm.FleetConfig{Replicas: 1, Behavior: mockllm.Behavior{Model: "llama-8b", Tokens: 4}})
	g := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		max_attempts 1
		fallback small {
			to %s
			capacity 4
		}
	}`, upstreams(primary), upstreams(small)))
	c := newClient(t)
	ctx := testContext(t, 20*time.Second)
	r := mustSend(ctx, t, c, g.URL+"/v1/chat/completions", chatOf(content40, false, nil))
	if r.Status != 200 || r.Header.Get("X-LLM-Proxy-Degraded") != "fallback=small" || fleetRequests(small) != 1 {
		t.Fatalf("status %d degraded %q fallback calls %d; body %s", r.Status, r.Header.Get("X-LLM-Proxy-Degraded"), fleetRequests(small), r.Body)
	}
}

// An upstream 429 on the primary is "unavailable": a non-streamed request
// with max_completion_tokens and n = 2 is served by the fallback at once,
// max_completion_tokens clamped (no max_tokens added); the tenant's
// reservation comes back; GET /v1/models without a key is refused.
func TestReviewDegradationUpstream429NonStreamed(t *testing.T) {
	l := startLadder(t, mockllm.Behavior{Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: 429}}, "tiers free", "")
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	url := l.URL + "/v1/chat/completions"
	body := chatOf(content40, false, map[string]any{"max_completion_tokens": 30000, "n": 2, "model": "llama-70b"})
	start := time.Now()
	r := mustSend(ctx, t, c, url, body, bearer(l.free))
	if r.Status != 200 || time.Since(start) > 5*time.Second {
		t.Fatalf("status %d after %v; body %s", r.Status, time.Since(start), r.Body)
	}
	if got := r.Header.Get("X-LLM-Proxy-Degraded"); got != "fallback=small; model=llama-8b; max_completion_tokens=4096" {
		t.Fatalf("X-LLM-Proxy-Degraded %q", got)
	}
	var resp struct {
		Model   string `json:"model"`
		Choices []any  `json:"choices"`
	}
	if err := json.Unmarshal(r.Body, &resp); err != nil || resp.Model != "llama-8b" {
		t.Fatalf("response %s (%v): want the fallback upstream's model", r.Body, err)
	}
	st := l.small.Replica(0).Stats()
	var sent map[string]any
	if err := json.Unmarshal(st.LastBody, &sent); err != nil {
		t.Fatal(err)
	}
	if sent["max_completion_tokens"] != float64(4096) || sent["max_tokens"] != nil || sent["model"] != "llama-8b" || sent["n"] != float64(2) {
		t.Fatalf("the fallback received %s", st.LastBody)
	}
	v := l.waitTenantIdle("f", 5*time.Second)
	if v.TokensInWindow <= 0 || v.TokensInWindow >= 2*4096 {
		t.Fatalf("tokens in window %d after the request settled: want its usage, not a reservation", v.TokensInWindow)
	}

	// /v1/models is the gateway's own answer: no key, no list.
	resp2, err := c.Get(l.URL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	resp2.Body.Close()
	if resp2.StatusCode != 401 {
		t.Fatalf("GET /v1/models without a key: status %d", resp2.StatusCode)
	}
}

// A reload while a request streams from a fallback with `capacity 1`: the
// stream completes, its slot and the tenant's reservation come back, and
// the next request is served by the fallback at once.
func TestReviewDegradationReloadWhileOnFallback(t *testing.T) {
	free := newKey("free")
	primary := startFleet(t, mockllm.FleetConfig{Replicas: 1, Behavior: mockllm.Behavior{Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503}}})
	small := startFleet(t, mockllm.FleetConfig{Replicas: 1, Behavior: mockllm.Behavior{Model: "llama-8b",
		TTFT: mockllm.Fixed(5 * time.Millisecond), TokenInterval: 2 * time.Millisecond, Tokens: 4}})
	globals := fmt.Sprintf(`	llm_proxy {
		tenants {
			key %s f tier free
		}
		tier free {
			tpm 100000
		}
	}`, free)
	site := func(fbt string) string {
		return fmt.Sprintf(`	llm_proxy %s {
		max_attempts 1
		first_byte_timeout %s
		fallback small {
			to %s
			model llama-8b
			capacity 1
		}
	}`, upstreams(primary), fbt, upstreams(small))
	}
	g := startTenantGateway(t, gatewayOptions{Globals: globals, Site: site("5s")}, free)
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	url := g.URL + "/v1/chat/completions"
	hold := streamStart(ctx, t, c, url, chatOf("hold", true, nil), bearer(free), "X-Mock-Tokens: 30", "X-Mock-Token-Interval: 50ms")
	g.reload(site("6s"))
	hold.drain(t)
	g.waitTenantIdle("f", 5*time.Second)
	start := time.Now()
	s := streamRequest(ctx, t, c, url, chatOf("after", true, nil), bearer(free))
	if s.Status != 200 || s.Header.Get("X-LLM-Proxy-Degraded") != "fallback=small; model=llama-8b" || time.Since(start) > 2*time.Second {
		t.Fatalf("after the reload: status %d degraded %q in %v (a fallback slot kept by the old config?)",
			s.Status, s.Header.Get("X-LLM-Proxy-Degraded"), time.Since(start))
	}
	if n := fleetRequests(small); n != 2 {
		t.Fatalf("fallback calls %d, want 2", n)
	}
	g.waitTenantIdle("f", 5*time.Second)
}

// A fallback whose upstreams come from a dynamic source (`dynamic a`).
func TestReviewDegradationDynamicFallback(t *testing.T) {
	primary := startFleet(t, mockllm.FleetConfig{Replicas: 1, Behavior: mockllm.Behavior{Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503}}})
	small := startFleet(t, mockllm.FleetConfig{Replicas: 1, Behavior: mockllm.Behavior{Model: "llama-8b", Tokens: 4}})
	addr := small.Addrs()[0]
	port := addr[strings.LastIndex(addr, ":")+1:]
	g := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		max_attempts 1
		fallback small {
			dynamic a localhost %s {
				versions ipv4
			}
			model llama-8b
		}
	}`, upstreams(primary), port))
	c := newClient(t)
	ctx := testContext(t, 20*time.Second)
	s := streamRequest(ctx, t, c, g.URL+"/v1/chat/completions", chatOf(content40, true, nil))
	if s.Status != 200 || s.Header.Get("X-LLM-Proxy-Degraded") != "fallback=small; model=llama-8b" || fleetRequests(small) != 1 {
		t.Fatalf("status %d degraded %q fallback calls %d; %s", s.Status, s.Header.Get("X-LLM-Proxy-Degraded"), fleetRequests(small), s.Tail)
	}
	if v, found := metricValue(g.scrapeMetrics(), "caddy_llm_proxy_degraded_total",
		map[string]string{"fallback": "small", "reason": "unavailable"}); !found || v != 1 {
		t.Fatalf("caddy_llm_proxy_degraded_total{fallback=small,reason=unavailable} = %v (found %v), want 1", v, found)
	}
}

// The fallback block's grammar exactly as the issue writes it: `to` or
// `dynamic`, `when` with one or both triggers in any order, `capacity` or
// `per_upstream`, `tiers` with several names.
func TestReviewDegradationCaddyfileGrammar(t *testing.T) {
	g := startGateway(t, `	respond "ok"`)
	cfg := g.adapt(`	llm_proxy {
		to 10.0.0.1:8000 10.0.0.2:8000
		fallback small {
			to 10.0.1.1:8000 10.0.1.2:8000
			model llama-8b
			context_window 8192
			max_output_tokens 4096
			when saturated unavailable
			tiers free batch
			capacity 16
		}
		fallback dyn {
			dynamic a small.internal 8000
			when unavailable
			per_upstream 4
		}
	}`)
	hs := llmProxyHandlers(cfg)
	if len(hs) != 1 {
		t.Fatalf("%d llm_proxy handlers", len(hs))
	}
	b, _ := json.Marshal(hs[0]["fallbacks"])
	var fbs []map[string]any
	if err := json.Unmarshal(b, &fbs); err != nil || len(fbs) != 2 {
		t.Fatalf("fallbacks %s (%v)", b, err)
	}
	f0, f1 := fbs[0], fbs[1]
	j := func(v any) string { b, _ := json.Marshal(v); return string(b) }
	if f0["name"] != "small" || f0["model"] != "llama-8b" || f0["context_window"] != float64(8192) ||
		f0["max_output_tokens"] != float64(4096) || j(f0["when"]) != `["saturated","unavailable"]` ||
		j(f0["tiers"]) != `["free","batch"]` || f0["capacity"] != float64(16) || !strings.Contains(j(f0["upstreams"]), "10.0.1.2:8000") {
		t.Fatalf("fallback small adapted to %s", j(f0))
	}
	if f1["name"] != "dyn" || f1["per_upstream"] != float64(4) || !strings.Contains(j(f1["dynamic_upstreams"]), `"source":"a"`) {
		t.Fatalf("fallback dyn adapted to %s", j(f1))
	}
	// Typos and the exclusive pair are refused, naming what is wrong.
	for bad, want := range map[string]string{
		"when sometimes":                   "sometimes",
		"capacity 2\n\t\t\tper_upstream 2": "capacity or per_upstream",
	} {
		req, _ := http.NewRequest(http.MethodPost, g.AdminURL+"/adapt", strings.NewReader(g.caddyfile(fmt.Sprintf(`	llm_proxy 10.0.0.1:8000 {
		fallback small {
			to 10.0.1.1:8000
			%s
		}
	}`, bad))))
		req.Header.Set("Content-Type", "text/caddyfile")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == 200 || !strings.Contains(string(body), want) {
			t.Fatalf("%q: adapt status %d body %s; want a refusal naming %q", bad, resp.StatusCode, body, want)
		}
	}
}

// llm_model routes to a handler with a fallback: the primary gets the
// client's bytes (the matcher's read handed on), the fallback the rewrite;
// the access log carries {http.llm_proxy.degraded}; a model the matcher
// does not route never reaches either pool.
func TestReviewDegradationModelMatcherWithFallback(t *testing.T) {
	primary := startFleet(t, mockllm.FleetConfig{Replicas: 1, Behavior: mockllm.Behavior{Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503}}})
	small := startFleet(t, mockllm.FleetConfig{Replicas: 1, Behavior: mockllm.Behavior{Model: "llama-8b", Tokens: 4}})
	logFile := filepath.Join(t.TempDir(), "access.log")
	g := startGateway(t, fmt.Sprintf(`	log {
		output file %s
		format json
	}
	log_append llm_degraded {http.llm_proxy.degraded}
	@big llm_model llama-70b*
	handle @big {
		llm_proxy %s {
			max_attempts 1
			fallback small {
				to %s
				model llama-8b
				max_output_tokens 100
			}
		}
	}
	handle {
		respond "no route" 404
	}`, logFile, upstreams(primary), upstreams(small)))
	c := newClient(t)
	ctx := testContext(t, 20*time.Second)
	url := g.URL + "/v1/chat/completions"
	body := `{"model":"llama-70b-instruct", "stream":true,"max_tokens":5000,"messages":[{"role":"user","content":"hi"}]}`
	s := streamRequest(ctx, t, c, url, body)
	if s.Status != 200 || s.Header.Get("X-LLM-Proxy-Degraded") != "fallback=small; model=llama-8b; max_tokens=100" {
		t.Fatalf("status %d degraded %q; %s", s.Status, s.Header.Get("X-LLM-Proxy-Degraded"), s.Tail)
	}
	if got := string(primary.Replica(0).Stats().LastBody); got != body {
		t.Fatalf("the primary received\n%s\nwant the client's bytes\n%s", got, body)
	}
	want := `{"model":"llama-8b", "stream":true,"max_tokens":100,"messages":[{"role":"user","content":"hi"}]}`
	if got := string(small.Replica(0).Stats().LastBody); got != want {
		t.Fatalf("the fallback received\n%s\nwant\n%s", got, want)
	}
	r := mustSend(ctx, t, c, url, `{"model":"gpt-4o","stream":true}`)
	if r.Status != 404 || fleetRequests(primary) != 1 || fleetRequests(small) != 1 {
		t.Fatalf("unrouted model: status %d, calls %d/%d", r.Status, fleetRequests(primary), fleetRequests(small))
	}
	var entries []map[string]any
	if !waitFor(5*time.Second, func() bool { entries = readJSONLines(t, logFile); return len(entries) >= 1 }) {
		t.Fatal("no access log entry")
	}
	if entries[0]["llm_degraded"] != "fallback=small; model=llama-8b; max_tokens=100" {
		t.Fatalf("access log llm_degraded = %v", entries[0]["llm_degraded"])
	}
}
