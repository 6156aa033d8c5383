package e2e

import (
	"fmt"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// TestOpenBreakerShortCircuitsWith503: after consecutive_failures 503s in
// a row, the upstream's breaker opens: the next request is not sent to it,
// and with no other upstream the client gets the gateway's own 503 in
// OpenAI's error shape, with Retry-After and X-Circuit-Breaker: open.
func TestOpenBreakerShortCircuitsWith503(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{
		Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503},
	}})
	gw := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		max_attempts 1
		breaker {
			consecutive_failures 3
			open_for 30s
			min_open 30s
		}
	}`, upstreams(fleet)))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	url := gw.URL + "/v1/chat/completions"

	for i := range 3 {
		r, err := doPlain(ctx, c, url, chatBody("Fail me.", true))
		if err != nil {
			t.Fatal(err)
		}
		if r.Status != http.StatusServiceUnavailable || r.Header.Get("X-Circuit-Breaker") != "" {
			t.Fatalf("request %d: status %d, X-Circuit-Breaker %q; want the upstream's 503 passed through",
				i+1, r.Status, r.Header.Get("X-Circuit-Breaker"))
		}
	}
	if n := fleetRequests(fleet); n != 3 {
		t.Fatalf("the upstream got %d requests, want 3", n)
	}

	r, err := doPlain(ctx, c, url, chatBody("Fail me.", true))
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != http.StatusServiceUnavailable {
		t.Fatalf("status %d, want 503: %s", r.Status, r.Body)
	}
	if n := fleetRequests(fleet); n != 3 {
		t.Errorf("the upstream got %d requests, want still 3: an open breaker must keep requests away", n)
	}
	if got := r.Header.Get("X-Circuit-Breaker"); got != "open" {
		t.Errorf("X-Circuit-Breaker %q, want open", got)
	}
	if ra, err := strconv.Atoi(r.Header.Get("Retry-After")); err != nil || ra < 1 || ra > 60 {
		t.Errorf("Retry-After %q, want whole seconds until the breaker may half-open (about 30)", r.Header.Get("Retry-After"))
	}
	if ct := r.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q, want application/json", ct)
	}
	_, typ, code := openAIError(t, r.Body)
	t.Logf("breaker 503: type %q, code %q, Retry-After %s", typ, code, r.Header.Get("Retry-After"))

	samples := gw.scrapeMetrics()
	addr := fleet.Replica(0).Addr()
	if v, _ := metricValue(samples, "caddy_llm_proxy_breaker_state", map[string]string{"upstream": addr}); v != 2 {
		t.Errorf("caddy_llm_proxy_breaker_state{upstream=%s} = %v, want 2 (open)", addr, v)
	}
	if v, _ := metricValue(samples, "caddy_llm_proxy_short_circuited_total", map[string]string{"upstream": addr}); v != 1 {
		t.Errorf("caddy_llm_proxy_short_circuited_total{upstream=%s} = %v, want 1", addr, v)
	}
	if v, _ := metricValue(samples, "caddy_llm_proxy_requests_total", map[string]string{"outcome": "no_upstream"}); v != 1 {
		t.Errorf("caddy_llm_proxy_requests_total{outcome=no_upstream} = %v, want 1", v)
	}
}
