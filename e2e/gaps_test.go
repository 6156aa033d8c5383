package e2e

import (
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// TestInterEventGapHistogram: streams whose tokens come 40 ms apart fill
// caddy_llm_proxy_inter_event_gap_seconds for their upstream and model
// with gaps of about 40 ms — one per read after the first event (the role chunk and the last token, its finish and [DONE] may come together).
func TestInterEventGapHistogram(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{
		TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 8, TokenInterval: 40 * time.Millisecond}})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet))
	c := newClient(t)
	ctx := testContext(t, 20*time.Second)
	const streams = 3
	for range streams {
		s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("Count me.", true))
		checkCleanStream(t, s)
	}
	samples := gw.scrapeMetrics()
	labels := map[string]string{"upstream": fleet.Replica(0).Addr(), "model": "mock-llama"}
	n, found := metricValue(samples, "caddy_llm_proxy_inter_event_gap_seconds_count", labels)
	sum, _ := metricValue(samples, "caddy_llm_proxy_inter_event_gap_seconds_sum", labels)
	if !found || n < streams*4 || n > streams*10 {
		t.Fatalf("gap count %v (found %v) for %d streams of 8 tokens, want 4-10 per stream (one per read; the last events come together)", n, found, streams)
	}
	if mean := sum / n; mean < 0.025 || mean > 0.2 {
		t.Fatalf("mean gap %.3fs over %v gaps, want about the 40 ms token interval", mean, n)
	}
	// Most gaps are the token interval: under 75 ms.
	fast, _ := metricValue(samples, "caddy_llm_proxy_inter_event_gap_seconds_bucket", map[string]string{
		"upstream": fleet.Replica(0).Addr(), "model": "mock-llama", "le": "0.075"})
	if fast < n*0.6 {
		t.Fatalf("%v of %v gaps at most 75 ms, want most", fast, n)
	}
}
