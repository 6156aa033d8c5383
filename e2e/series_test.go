package e2e

import (
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// TestRemovedUpstreamSeriesGoAfterReload: a reload drops one of two
// upstreams; at the next scrape none of its per-upstream series is left
// (requests, attempts, TTFT, stream duration, inter-event gaps, breaker
// state and transitions), and the kept upstream's series are all there.
func TestRemovedUpstreamSeriesGoAfterReload(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2})
	kept, dropped := fleet.Replica(0).Addr(), fleet.Replica(1).Addr()
	gw := startGateway(t, "\tllm_proxy "+kept+" "+dropped+" {\n\t\tlb_policy round_robin\n\t}")
	c := newClient(t)
	for range 4 {
		ctx := testContext(t, 30*time.Second)
		s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("Count me.", true), "X-Mock-Tokens: 3", "X-Mock-Token-Interval: 5ms")
		checkCleanStream(t, s)
	}
	families := []string{"caddy_llm_proxy_requests_total", "caddy_llm_proxy_upstream_attempts_total",
		"caddy_llm_proxy_ttft_seconds_count", "caddy_llm_proxy_stream_duration_seconds_count",
		"caddy_llm_proxy_inter_event_gap_seconds_count", "caddy_llm_proxy_breaker_state"}
	has := func(samples []metricSample, upstream string) (found []string) {
		for _, f := range families {
			if _, ok := metricValue(samples, f, map[string]string{"upstream": upstream}); ok {
				found = append(found, f)
			}
		}
		return found
	}
	before := gw.scrapeMetrics()
	for _, addr := range []string{kept, dropped} {
		if got := has(before, addr); len(got) != len(families) {
			t.Fatalf("before the reload, %s has series in %v, want every one of %v", addr, got, families)
		}
	}

	gw.reload("\tllm_proxy " + kept + " {\n\t\tlb_policy round_robin\n\t}")
	after := gw.scrapeMetrics()
	if got := has(after, dropped); len(got) != 0 {
		t.Errorf("after the reload that dropped %s, it still has series in %v", dropped, got)
	}
	if got := has(after, kept); len(got) != len(families) {
		t.Errorf("after the reload, the kept upstream %s has series in %v, want every one of %v", kept, got, families)
	}
}
