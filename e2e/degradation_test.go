package e2e

// The degradation ladder (issue 11) against the real binary: a 70B-like
// primary fleet, an 8B-like fallback fleet, tenants of a free tier that may
// degrade and a gold tier that may not.

import (
	"context"
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

// ladder is a gateway with a primary fleet, a fallback fleet and two
// tenants.
type ladder struct {
	*tenantGateway
	primary, small *mockllm.Fleet
	free, gold     string // keys
}

// startLadder starts the fleets and a gateway whose handler has one
// fallback, "small", with the given extra lines in its block and in the
// handler's.
func startLadder(t *testing.T, primaryBehavior mockllm.Behavior, fallbackLines, handlerLines string) *ladder {
	t.Helper()
	l := &ladder{free: newKey("free"), gold: newKey("gold")}
	l.primary = startFleet(t, mockllm.FleetConfig{Replicas: 2, Behavior: primaryBehavior})
	l.small = startFleet(t, mockllm.FleetConfig{Replicas: 1, Behavior: mockllm.Behavior{Model: "llama-8b",
		TTFT: mockllm.Fixed(5 * time.Millisecond), TokenInterval: 2 * time.Millisecond, Tokens: 8}})
	globals := fmt.Sprintf(`	llm_proxy {
		tenants {
			key %s f tier free
			key %s g tier gold
		}
		tier free {
			priority -1
			tpm 100000
		}
		tier gold {
			priority 10
			tpm 100000
		}
	}`, l.free, l.gold)
	site := fmt.Sprintf(`	llm_proxy %s {
		max_attempts 2
		first_byte_timeout 2s
		%s
		fallback small {
			to %s
			model llama-8b
			context_window 8192
			max_output_tokens 4096
			%s
		}
	}`, upstreams(l.primary), handlerLines, upstreams(l.small), fallbackLines)
	l.tenantGateway = startTenantGateway(t, gatewayOptions{Globals: globals, Site: site}, l.free, l.gold)
	return l
}

func (l *ladder) smallCalls() int64   { return fleetRequests(l.small) }
func (l *ladder) primaryCalls() int64 { return fleetRequests(l.primary) }

// degradedCount is caddy_llm_proxy_degraded_total for the labels; found is
// false when the series is missing.
func (l *ladder) degradedCount(reason, tier string) (float64, bool) {
	return metricValue(l.scrapeMetrics(), "caddy_llm_proxy_degraded_total",
		map[string]string{"fallback": "small", "reason": reason, "tier": tier})
}

func TestDegradationFallbackServesAllowedTiersOnly(t *testing.T) {
	l := startLadder(t, mockllm.Behavior{Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503}},
		"tiers free", "")
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	url := l.URL + "/v1/chat/completions"
	body := chatOf(content40, true, map[string]any{"max_tokens": 64000, "model": "llama-70b", "temperature": 0.25})

	// Free degrades: served by the fallback, model rewritten, max_tokens clamped.
	s := streamRequest(ctx, t, c, url, body, bearer(l.free))
	if s.Status != 200 {
		t.Fatalf("free: status %d, body %s", s.Status, s.Tail)
	}
	if got := s.Header.Get("X-LLM-Proxy-Degraded"); got != "fallback=small; model=llama-8b; max_tokens=4096" {
		t.Fatalf("free: X-LLM-Proxy-Degraded %q", got)
	}
	if n := len(s.dataEvents()); n < 8 || !s.Events[len(s.Events)-1].IsDone() {
		t.Fatalf("free: %d data events, last %q: want a whole stream from the fallback", n, s.Events[len(s.Events)-1].Data())
	}
	// The response's own model field is the upstream's, passed through.
	var chunk struct {
		Model string `json:"model"`
	}
	if err := json.Unmarshal([]byte(s.dataEvents()[0].Data()), &chunk); err != nil || chunk.Model != "llama-8b" {
		t.Fatalf("free: first chunk's model %q (%v)", chunk.Model, err)
	}
	st := l.small.Replica(0).Stats()
	if st.Requests != 1 {
		t.Fatalf("fallback requests %d, want 1", st.Requests)
	}
	// With tenants the gateway asks for usage (stream_options), as on
	// the primary; nothing else changes but the model and max_tokens.
	want := strings.Replace(strings.Replace(body, `"max_tokens":64000`, `"max_tokens":4096`, 1), `"model":"llama-70b"`, `"model":"llama-8b"`, 1)
	want = strings.TrimSuffix(want, "}") + `,"stream_options":{"include_usage":true}}`
	if string(st.LastBody) != want {
		t.Fatalf("fallback received\n%s\nwant (only model and max_tokens changed)\n%s", st.LastBody, want)
	}
	if p := l.primaryCalls(); p != 2 {
		t.Fatalf("primary calls %d, want 2 (max_attempts) before the fallback", p)
	}

	// Gold may not degrade: the primary's 503, our error body naming the
	// fallback, and not one call to the fallback.
	r := mustSend(ctx, t, c, url, body, bearer(l.gold))
	msg := checkRefusal(t, "gold", r, 503, "upstream_error", false, 0)
	if !strings.Contains(msg, `fallback small refused: tier "gold" may not degrade to it`) {
		t.Fatalf("gold: message %q does not name the refused fallback", msg)
	}
	if r.Header.Get("X-LLM-Proxy-Degraded") != "" || l.smallCalls() != 1 {
		t.Fatalf("gold: degraded %q, fallback calls %d (want still 1)", r.Header.Get("X-LLM-Proxy-Degraded"), l.smallCalls())
	}

	// A prompt larger than the fallback's context window is never sent.
	big := chatOf(strings.Repeat("x", 4*9000), true, map[string]any{"max_tokens": 10})
	r = mustSend(ctx, t, c, url, big, bearer(l.free))
	msg = checkRefusal(t, "large prompt", r, 503, "upstream_error", false, 0)
	if !strings.Contains(msg, "fallback small refused: the prompt estimate of 9000 tokens does not fit its context_window of 8192") {
		t.Fatalf("large prompt: message %q", msg)
	}
	if l.smallCalls() != 1 {
		t.Fatalf("large prompt reached the fallback: %d calls", l.smallCalls())
	}

	if v, found := l.degradedCount("unavailable", "free"); !found || v != 1 {
		t.Fatalf("caddy_llm_proxy_degraded_total{reason=unavailable,tier=free} = %v (found %v), want 1", v, found)
	}
	if v, found := l.degradedCount("unavailable", "gold"); found && v != 0 {
		t.Fatalf("gold counted as degraded: %v", v)
	}
	// One admission decision per request, wherever it was served.
	if v, found := metricValue(l.scrapeMetrics(), "caddy_llm_proxy_admission_total",
		map[string]string{"tier": "free", "decision": "admitted"}); !found || v != 2 {
		t.Fatalf("admission_total{tier=free,decision=admitted} = %v (found %v), want 2 (two free requests, one degraded)", v, found)
	}
}

func TestDegradationTenantsOwnLimitNeverFallsBack(t *testing.T) {
	l := startLadder(t, mockllm.Behavior{Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503}}, "", "")
	c := newClient(t)
	ctx := testContext(t, 20*time.Second)
	url := l.URL + "/v1/chat/completions"
	// 200000 tokens never fit the free tier's tpm of 100000.
	start := time.Now()
	r := mustSend(ctx, t, c, url, chatOf(content40, true, map[string]any{"max_tokens": 200000}), bearer(l.free))
	if r.Status != 429 || time.Since(start) > 2*time.Second {
		t.Fatalf("status %d after %v, want 429 at once; body %s", r.Status, time.Since(start), r.Body)
	}
	if l.smallCalls() != 0 || l.primaryCalls() != 0 || r.Header.Get("X-LLM-Proxy-Degraded") != "" {
		t.Fatalf("a tenant's own limit reached upstreams: primary %d, fallback %d", l.primaryCalls(), l.smallCalls())
	}
}

func TestDegradationNoFallbackAfterCommit(t *testing.T) {
	l := startLadder(t, mockllm.Behavior{Tokens: 10, Fault: mockllm.Fault{Kind: mockllm.FaultCut, After: 3}}, "", "")
	c := newClient(t)
	ctx := testContext(t, 20*time.Second)
	s := streamRequest(ctx, t, c, l.URL+"/v1/chat/completions", chatOf(content40, true, nil), bearer(l.free))
	if s.Status != 200 || s.Header.Get("X-LLM-Proxy-Degraded") != "" {
		t.Fatalf("status %d degraded %q", s.Status, s.Header.Get("X-LLM-Proxy-Degraded"))
	}
	last := s.Events[len(s.Events)-1]
	obj, ok := last.ErrorObject()
	if !ok || obj["code"] != "upstream_stream_truncated" {
		t.Fatalf("last event %q: want the terminal error event", last.Data())
	}
	for _, e := range s.Events {
		if e.IsDone() {
			t.Fatal("a truncated stream ended with [DONE]")
		}
	}
	if l.smallCalls() != 0 {
		t.Fatalf("a failure after commit went to the fallback: %d calls", l.smallCalls())
	}
}

func TestDegradationSaturatedPrimary(t *testing.T) {
	// The primary holds one request at a time; free requests that find it
	// full go to the fallback at once; gold requests queue for it.
	l := startLadder(t, mockllm.Behavior{TTFT: mockllm.Fixed(5 * time.Millisecond), TokenInterval: 5 * time.Millisecond, Tokens: 4},
		"when saturated\n\t\t\ttiers free", "admission {\n\t\t\tcapacity 1\n\t\t}")
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	url := l.URL + "/v1/chat/completions"

	// Gold holds the primary's only slot with a slow stream.
	hold := streamStart(ctx, t, c, url, chatOf("hold the slot", true, nil), bearer(l.gold), "X-Mock-Tokens: 40", "X-Mock-Token-Interval: 50ms")

	// Free is served by the fallback at once (its stream takes ~20 ms).
	for i := range 3 {
		start := time.Now()
		s := streamRequest(ctx, t, c, url, chatOf(fmt.Sprintf("free %d", i), true, nil), bearer(l.free))
		took := time.Since(start)
		if s.Status != 200 || s.Header.Get("X-LLM-Proxy-Degraded") != "fallback=small; model=llama-8b; max_tokens=4096" {
			t.Fatalf("free %d: status %d degraded %q", i, s.Status, s.Header.Get("X-LLM-Proxy-Degraded"))
		}
		if took > time.Second {
			t.Fatalf("free %d took %v: it waited instead of degrading at once", i, took)
		}
	}
	// Gold queues for the primary: it is served after the hold ends.
	start := time.Now()
	got := make(chan reply, 1)
	go func() { got <- send(ctx, c, url, chatOf("gold waits", true, nil), bearer(l.gold)) }()
	waitFor(5*time.Second, func() bool { return l.tenant("g").Queued == 1 })
	hold.drain(t)
	r := <-got
	if r.Status != 200 || r.Header.Get("X-LLM-Proxy-Degraded") != "" {
		t.Fatalf("gold: status %d degraded %q body %s", r.Status, r.Header.Get("X-LLM-Proxy-Degraded"), r.Body)
	}
	if time.Since(start) < 500*time.Millisecond {
		t.Fatalf("gold was served in %v: it did not wait for the primary's slot", time.Since(start))
	}
	if l.smallCalls() != 3 || l.primaryCalls() != 2 {
		t.Fatalf("calls: fallback %d (want 3, every free one), primary %d (want 2, both gold)", l.smallCalls(), l.primaryCalls())
	}
	if v, found := l.degradedCount("saturated", "free"); !found || v != 3 {
		t.Fatalf("caddy_llm_proxy_degraded_total{reason=saturated,tier=free} = %v (found %v), want 3", v, found)
	}
}

func TestDegradationModelsListIsTheUnion(t *testing.T) {
	l := startLadder(t, mockllm.Behavior{Model: "llama-70b"}, "", "")
	c := newClient(t)
	req, _ := http.NewRequestWithContext(testContext(t, 10*time.Second), "GET", l.URL+"/v1/models", nil)
	req.Header.Set("Authorization", "Bearer "+l.free)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var list struct {
		Object string `json:"object"`
		Data   []struct {
			ID    string   `json:"id"`
			Pools []string `json:"pools"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil || resp.StatusCode != 200 {
		t.Fatalf("status %d: %v", resp.StatusCode, err)
	}
	got := map[string]string{}
	for _, m := range list.Data {
		got[m.ID] = strings.Join(m.Pools, ",")
	}
	if list.Object != "list" || len(got) != 2 || got["llama-70b"] != "primary" || got["llama-8b"] != "small" {
		t.Fatalf("models %+v, want llama-70b from primary and llama-8b from small", list)
	}
}

// heldStream is a stream being read in the background.
type heldStream struct {
	done chan error
}

// streamStart starts a streamed request and returns once its first event
// arrived (its upstream slot is taken); drain waits for its end.
func streamStart(ctx context.Context, t *testing.T, c *http.Client, url, body string, headers ...string) *heldStream {
	t.Helper()
	req, err := newRequest(ctx, url, body, headers...)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 {
		resp.Body.Close()
		t.Fatalf("held stream: status %d", resp.StatusCode)
	}
	first := make(chan struct{})
	h := &heldStream{done: make(chan error, 1)}
	go func() {
		defer resp.Body.Close()
		once := false
		_, _, err := readEvents(resp.Body, func(event, int) bool {
			if !once {
				once = true
				close(first)
			}
			return true
		})
		if !once {
			close(first)
		}
		h.done <- err
	}()
	select {
	case <-first:
	case <-ctx.Done():
		t.Fatal("held stream: no first event")
	}
	return h
}

func (h *heldStream) drain(t *testing.T) {
	t.Helper()
	if err := <-h.done; err != nil {
		t.Fatalf("held stream: %v", err)
	}
}

// A fallback's own capacity needs no tenants: a site without an admission
// block whose primary answers 503 is served by a fallback that has
// `capacity 4`.
func TestFallbackCapacityWithoutTenants(t *testing.T) {
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
func TestUpstream429NonStreamedIsServedByTheFallback(t *testing.T) {
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
func TestReloadWhileOnFallbackKeepsTheStreamAndFreesItsSlot(t *testing.T) {
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
func TestDynamicFallbackServes(t *testing.T) {
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
func TestFallbackGrammarAdaptsEveryForm(t *testing.T) {
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
func TestModelMatcherRoutesToAHandlerWithAFallback(t *testing.T) {
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
