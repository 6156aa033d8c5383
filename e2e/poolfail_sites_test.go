package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// TestPoolFailureOfOneSiteLeavesTheOtherServing: two handlers of one site
// in front of the same two replicas (so the same upstream list); every
// request of site A fails with a 500 on both (its requests carry a fault,
// as a model that crashes the engine would), site B's succeed. A's pool
// fails as a whole and answers 503 at once; B, whose requests all
// succeed, must keep serving them (200), not answer 503 "the pool failed
// as a whole" from A's failures, and /llm_proxy/pools must show only A's
// pool failed.
func TestPoolFailureOfOneSiteLeavesTheOtherServing(t *testing.T) {
	t.Parallel()
	fl := startFleet(t, mockllm.FleetConfig{Replicas: 2, Behavior: mockllm.Behavior{
		TTFT: mockllm.Fixed(time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	site := fmt.Sprintf(`	handle_path /a/* {
		request_header X-Mock-Fault "status=500"
		llm_proxy %[1]s {
			lb_policy round_robin
			max_attempts 2
		}
	}
	handle_path /b/* {
		llm_proxy %[1]s {
			lb_policy round_robin
			max_attempts 2
			breaker {
				consecutive_failures 7
			}
		}
	}
`, upstreams(fl))
	gw := startGateway(t, site)
	c := newClient(t)
	send := func(path string) int {
		t.Helper()
		ctx := testContext(t, 10*time.Second)
		resp := post(ctx, t, c, gw.URL+path+"/v1/chat/completions", chatBody("hi", false))
		resp.Body.Close()
		return resp.StatusCode
	}
	for i := range 3 {
		if code := send("/b"); code != http.StatusOK {
			t.Fatalf("site B request %d: status %d, want 200", i, code)
		}
	}
	shed := false
	for i := 0; i < 60 && !shed; i++ {
		shed = send("/a") == http.StatusServiceUnavailable
	}
	if !shed {
		t.Fatal("site A, every attempt failing on both replicas, never answered 503 (its pool did not fail as a whole)")
	}
	for i := range 3 {
		if code := send("/b"); code != http.StatusOK {
			t.Errorf("site B request %d after site A's pool failed: status %d, want 200 (its own requests succeed)", i, code)
		}
	}
	status, body := gw.admin(http.MethodGet, "/llm_proxy/pools")
	if status != http.StatusOK {
		t.Fatalf("GET /llm_proxy/pools: %d %s", status, body)
	}
	var pools []struct {
		Handler string `json:"handler"`
		Failed  bool   `json:"failed"`
	}
	if err := json.Unmarshal(body, &pools); err != nil {
		t.Fatalf("GET /llm_proxy/pools: %v: %s", err, body)
	}
	failed := 0
	for _, p := range pools {
		if p.Failed {
			failed++
		}
	}
	if len(pools) != 2 || failed != 1 {
		t.Errorf("GET /llm_proxy/pools: %s; want two pools, only site A's failed", body)
	}
}
