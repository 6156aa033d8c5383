package caddymodule

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// Defect 1 of issue 20, through the real provisioning path: two sites of
// one config in front of one failing server, site A with
// consecutive_failures 2 and site B with breakers off, declared after A.
// A stops reaching the server after two failures; B keeps reaching it.
// Before per-handler policy, B's "off" switched A's breaker off too.
func TestTwoSitesOneUpstreamEachObeyTheirBreaker(t *testing.T) {
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		http.Error(w, `{"error":"down"}`, http.StatusInternalServerError)
	}))
	t.Cleanup(srv.Close)
	dial := strings.TrimPrefix(srv.URL, "http://")
	listen := freePort(t)
	// Two routes of one server, so that B is provisioned after A.
	cfg := sitesConfig(listen, dial, siteRoute{"a", `{"consecutive_failures":2,"open_for":60000000000,"min_open":60000000000}`},
		siteRoute{"b", `{"disabled":true}`})
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatalf("loading config: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	post := func(site string) int { t.Helper(); return postSite(t, http.DefaultClient, listen, site) }
	for range 2 {
		post("a")
	}
	if n := hits.Load(); n != 2 {
		t.Fatalf("site A's 2 requests reached the server %d times, want 2", n)
	}
	for i := range 3 {
		if code := post("a"); code != http.StatusServiceUnavailable {
			t.Fatalf("site A's request %d after 2 failures: status %d, want 503 (breaker open)", i+3, code)
		}
	}
	if n := hits.Load(); n != 2 {
		t.Fatalf("site A kept reaching the failing server: %d hits, want 2", n)
	}
	for i := range 3 {
		if code := post("b"); code == http.StatusServiceUnavailable {
			t.Fatalf("site B (breaker off) request %d refused with 503", i+1)
		}
	}
	if n := hits.Load(); n != 5 {
		t.Fatalf("site B's 3 requests: server hit %d times in all, want 5", n)
	}
}

// Defect 2 of issue 20: a saturation trip decided for site A (which has a
// saturation block) must not refuse site B (none) with 503 circuit_open.
func TestSaturationTripSteersOnlyThePoolsThatAskedForIt(t *testing.T) {
	m := newMockVLLM(t) // KV cache 50%
	dial := strings.TrimPrefix(m.URL, "http://")
	listen := freePort(t)
	route := func(path, extra string) string {
		return `{"match":[{"path":["` + path + `"]}],"handle":[` +
			`{"handler":"llm_proxy","max_attempts":1,"upstreams":[{"dial":"` + dial + `"}]` + extra + `}]}`
	}
	cfg := `{"admin":{"disabled":true,"config":{"persist":false}},"apps":{"http":{"servers":{"s":{"listen":["` + listen +
		`"],"automatic_https":{"disable":true},"routes":[` +
		route("/a/*", `,"saturation":{"interval":100000000,"trip":{"kv_usage":0.4,"kv_for":100000000}}`) + `,` +
		route("/b/*", ``) + `]}}}}}`
	if err := caddy.Load([]byte(cfg), true); err != nil {
		t.Fatalf("loading config: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	waitFor(t, "site A's saturation trip", func() bool {
		for _, v := range shared.upstreams.Breakers() {
			if v.Upstream == dial && v.Observed {
				return true
			}
		}
		return false
	})
	for i := range 3 {
		resp, err := http.Post("http://"+listen+"/b/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("site B (no saturation) request %d: status %d, want 200", i+1, resp.StatusCode)
		}
	}
}
