package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// TestTwoSitesBreakerPoliciesSurviveReload: two handlers of one site in
// front of one dead server (connection refused), A with
// consecutive_failures 2 and B with 10. After A's breaker opens, a reload
// that changes neither handler (POST /load) keeps it open: A's requests get
// 503 circuit_open at once, B's still reach the server (502). The admin
// API lists a breaker per policy, each with its pools.
func TestTwoSitesBreakerPoliciesSurviveReload(t *testing.T) {
	t.Parallel()
	dead := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	handler := func(path string, n int) string {
		return fmt.Sprintf("\thandle_path %s {\n\t\tllm_proxy %s {\n\t\t\tmax_attempts 1\n\t\t\tbreaker {\n\t\t\t\tconsecutive_failures %d\n"+
			"\t\t\t\topen_for 1m\n\t\t\t\tmin_open 1m\n\t\t\t}\n\t\t}\n\t}\n", path, dead, n)
	}
	site := handler("/a/*", 2) + handler("/b/*", 10)
	gw := startGateway(t, site)
	c := newClient(t)
	send := func(path string) int {
		t.Helper()
		ctx := testContext(t, 10*time.Second)
		resp := post(ctx, t, c, gw.URL+path+"/v1/chat/completions", chatBody("hi", false))
		resp.Body.Close()
		return resp.StatusCode
	}
	send("/a")
	send("/a")
	if code := send("/a"); code != http.StatusServiceUnavailable {
		t.Fatalf("site A after 2 refused connections: status %d, want 503", code)
	}
	for i := 1; i <= 2; i++ {
		// Caddy skips a reload whose config is unchanged: change an
		// unrelated header, as an operator's edit of another directive does.
		gw.reload(fmt.Sprintf("\theader X-Config %d\n", i) + site)
		if code := send("/a"); code != http.StatusServiceUnavailable {
			t.Fatalf("site A after reload %d that changed neither handler: status %d, want 503 (its breaker was open)", i, code)
		}
		if code := send("/b"); code != http.StatusBadGateway {
			t.Fatalf("site B after reload %d: status %d, want 502 (its own breaker is closed)", i, code)
		}
	}
	status, body := gw.admin(http.MethodGet, "/llm_proxy/breakers")
	if status != http.StatusOK {
		t.Fatalf("GET /llm_proxy/breakers: %d %s", status, body)
	}
	var views []struct {
		Key   string   `json:"key"`
		State string   `json:"state"`
		Pools []string `json:"pools"`
	}
	if err := json.Unmarshal(body, &views); err != nil {
		t.Fatalf("%v: %s", err, body)
	}
	states := map[string]int{}
	for _, v := range views {
		states[v.State]++
		if len(v.Pools) == 0 {
			t.Errorf("breaker %s lists no pools", v.Key)
		}
	}
	if len(views) != 2 || states["open"] != 1 || states["closed"] != 1 {
		t.Fatalf("breakers %s, want one open (A's) and one closed (B's)", body)
	}
}

// TestDrainReachesEverySite: two handlers in front of one server with
// different breaker settings (A consecutive_failures 2, B 10). POST
// /llm_proxy/breakers/<addr>/open drains the server for both: the answer
// lists both breakers, open and forced, and neither site's requests reach
// the server (503); close brings both back. Before, the plain address
// named the newest handler's breaker alone, and site A kept sending to the
// drained server.
func TestDrainReachesEverySite(t *testing.T) {
	t.Parallel()
	fl := startFleet(t, mockllm.FleetConfig{Replicas: 1})
	addr := fl.Replica(0).Addr()
	handler := func(path string, n int) string {
		return fmt.Sprintf("\thandle_path %s {\n\t\tllm_proxy %s {\n\t\t\tmax_attempts 1\n\t\t\tbreaker {\n\t\t\t\tconsecutive_failures %d\n"+
			"\t\t\t}\n\t\t}\n\t}\n", path, addr, n)
	}
	gw := startGateway(t, handler("/a/*", 2)+handler("/b/*", 10))
	c := newClient(t)
	send := func(path string) int {
		t.Helper()
		ctx := testContext(t, 10*time.Second)
		resp := post(ctx, t, c, gw.URL+path+"/v1/chat/completions", chatBody("hi", false))
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, p := range []string{"/a", "/b"} {
		if code := send(p); code != http.StatusOK {
			t.Fatalf("site %s before the drain: status %d, want 200", p, code)
		}
	}
	status, vs := gw.breakerActions(addr, "open")
	if status != http.StatusOK || len(vs) != 2 {
		t.Fatalf("POST %s/open: status %d, %+v; want 200 and both sites' breakers", addr, status, vs)
	}
	for _, v := range vs {
		if v.State != "open" || !v.Forced {
			t.Errorf("POST %s/open lists %+v, want open and forced", addr, v)
		}
	}
	before := fl.Replica(0).Stats().Requests
	for _, p := range []string{"/a", "/b"} {
		if code := send(p); code != http.StatusServiceUnavailable {
			t.Errorf("site %s with the server drained: status %d, want 503", p, code)
		}
	}
	if n := fl.Replica(0).Stats().Requests - before; n != 0 {
		t.Errorf("the drained server got %d requests", n)
	}
	if status, vs := gw.breakerActions(addr, "close"); status != http.StatusOK || len(vs) != 2 || vs[0].State != "closed" || vs[1].State != "closed" {
		t.Fatalf("POST %s/close: status %d, %+v; want both breakers closed", addr, status, vs)
	}
	for _, p := range []string{"/a", "/b"} {
		if code := send(p); code != http.StatusOK {
			t.Errorf("site %s after close: status %d, want 200", p, code)
		}
	}
}
