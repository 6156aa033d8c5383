package e2e

import (
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/bodyburst"
	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// A burst of large bodies over a small max_buffered_bodies: the bodies
// that fit are served, the others wait their second and get 503 with
// Retry-After and code body_memory_exhausted, none is lost, every body that
// reached the mock is the one sent, and the gateway's RSS grows by no more
// than 1.2× the bodies it admitted (issue 12 item 4: 20 bodies of 15 MiB
// grew it by 2.5× before).
func TestBodyBudgetBoundsABurstOfLargeBodies(t *testing.T) {
	const bodies, size = 12, 8 << 20
	// The mock holds every request longer than the budget's 1s wait, so
	// the bodies admitted first are still held when the others give up;
	// its KV cache holds their 2M-token prompts all at once.
	fleet := startFleet(t, mockllm.FleetConfig{KVBlocks: 1 << 24, Behavior: mockllm.Behavior{
		TTFT: mockllm.Fixed(1500 * time.Millisecond), Tokens: 1, TokenInterval: mockllm.NoDelay}})
	gw := startGatewayWith(t, gatewayOptions{
		Globals: "\tllm_proxy {\n\t\tmax_buffered_bodies 40MiB\n\t}",
		Site:    "\tllm_proxy " + upstreams(fleet) + " {\n\t\tmax_attempts 1\n\t}",
	})
	res, err := bodyburst.Run(testContext(t, 30*time.Second), bodyburst.Config{
		URL: gw.URL + "/v1/chat/completions", Bodies: bodies, Size: size, PID: gw.cmd.Process.Pid})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("\n%s", res.Markdown())
	if res.Other != 0 || res.Admitted+res.Refused != bodies {
		t.Fatalf("%d admitted, %d refused, %d lost (%v): want every request served or refused with 503", res.Admitted, res.Refused, res.Other, res.Errors)
	}
	// 40 MiB holds four 8 MiB bodies at once.
	if res.Admitted < 1 || res.Admitted > 8 || res.Refused < 4 {
		t.Fatalf("%d admitted, %d refused: want at most four at once admitted and the rest refused", res.Admitted, res.Refused)
	}
	if got := fleetRequests(fleet); got != int64(res.Admitted) {
		t.Fatalf("the mock got %d requests, want the %d admitted", got, res.Admitted)
	}
	want := sha256Hex(bodyburst.Body("mock-llama", size))
	for _, r := range fleet.Stats().Replicas {
		for _, h := range r.BodySHA256 {
			if h != want {
				t.Fatalf("the mock got a body with SHA-256 %s, want the one sent, %s", h, want)
			}
		}
	}
	if limit := 1.2; res.Ratio() > limit {
		t.Fatalf("RSS grew by %d bytes for %d bytes of bodies admitted: %.2f×, want at most %.1f×", res.Growth(), res.AdmittedBytes(), res.Ratio(), limit)
	}
	// The budget is visible, and every charge is back once the burst is over.
	if v, found := metricValue(gw.scrapeMetrics(), "caddy_llm_proxy_buffered_body_limit_bytes", nil); !found || v != 40<<20 {
		t.Fatalf("caddy_llm_proxy_buffered_body_limit_bytes = %v (found %v), want %d", v, found, 40<<20)
	}
	if !waitFor(5*time.Second, func() bool {
		v, found := metricValue(gw.scrapeMetrics(), "caddy_llm_proxy_buffered_body_bytes", nil)
		return found && v == 0
	}) {
		v, found := metricValue(gw.scrapeMetrics(), "caddy_llm_proxy_buffered_body_bytes", nil)
		t.Fatalf("caddy_llm_proxy_buffered_body_bytes = %v (found %v) after the burst, want 0", v, found)
	}
}
