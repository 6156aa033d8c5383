package caddymodule

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// Two sites of one config in front of one failing server with different
// breaker settings (A: consecutive_failures 2, B: 10). A's breaker opens;
// a reload of the unchanged config (caddy reload, POST /load) must keep it
// open: A's requests keep getting 503 without reaching the server. Before
// the fix the config's first started pool briefly made A's policy the
// primary one, which dropped A's own breaker, so A's requests reached the
// failing server again after every reload.
func TestReloadKeepsSiteBreakerOpenWithTwoPolicies(t *testing.T) {
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		http.Error(w, `{"error":"down"}`, http.StatusInternalServerError)
	}))
	t.Cleanup(srv.Close)
	dial := strings.TrimPrefix(srv.URL, "http://")
	listen := freePort(t)
	route := func(path, breaker string) string {
		return `{"match":[{"path":["` + path + `"]}],"handle":[` +
			`{"handler":"llm_proxy","max_attempts":1,"upstreams":[{"dial":"` + dial + `"}],"breaker":` + breaker + `}]}`
	}
	cfg := `{"admin":{"disabled":true,"config":{"persist":false}},"apps":{"http":{"servers":{"s":{"listen":["` + listen +
		`"],"automatic_https":{"disable":true},"routes":[` +
		route("/a/*", `{"consecutive_failures":2,"open_for":60000000000,"min_open":60000000000}`) + `,` +
		route("/b/*", `{"consecutive_failures":10,"open_for":60000000000,"min_open":60000000000}`) + `]}}}}}`
	if err := caddy.Load([]byte(cfg), true); err != nil {
		t.Fatalf("loading config: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	post := func(site string) int {
		t.Helper()
		resp, err := http.Post("http://"+listen+"/"+site+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	post("a")
	post("a")
	if code := post("a"); code != http.StatusServiceUnavailable {
		t.Fatalf("site A after 2 failures: status %d, want 503", code)
	}
	for reload := 1; reload <= 2; reload++ {
		if err := caddy.Load([]byte(cfg), true); err != nil {
			t.Fatalf("reload %d: %v", reload, err)
		}
		before := hits.Load()
		if code := post("a"); code != http.StatusServiceUnavailable {
			t.Fatalf("site A after reload %d of the unchanged config: status %d, want 503 (its breaker was open)", reload, code)
		}
		if n := hits.Load() - before; n != 0 {
			t.Fatalf("site A's request after reload %d reached the failing server", reload)
		}
	}
	if code := post("b"); code == http.StatusServiceUnavailable {
		t.Fatalf("site B (consecutive_failures 10, no failures) refused with 503")
	}
}
