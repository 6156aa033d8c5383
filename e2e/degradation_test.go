package e2e

// The degradation ladder (issue 11) against the real binary: a 70B-like
// primary fleet, an 8B-like fallback fleet, tenants of a free tier that may
// degrade and a gold tier that may not.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
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
