package caddymodule

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// Two sites on two ports (so two Caddy servers, which Caddy provisions in
// map order, at random) in front of one upstream with different breaker
// settings. Which site's breaker has the plain key "<upstream>" must be a
// function of the config: loading the same config again, or on another
// gateway of a fleet, names the breakers alike (else a fleet's gateways
// share one Redis key between two sites' breakers, and an operator's
// POST to "<upstream>~<policy>" hits the other site after a restart).
// Before, the primary policy was the last provisioned handler's: over ten
// loads of this config it went to either site.
func TestPlainBreakerKeyDoesNotDependOnProvisionOrder(t *testing.T) {
	m := newMockVLLM(t)
	dial := strings.TrimPrefix(m.URL, "http://")
	site := func(listen, name string, failures int) string {
		return fmt.Sprintf("http://%s {\n\tllm_proxy %s {\n\t\tname %s\n\t\tbreaker {\n\t\t\tconsecutive_failures %d\n\t\t}\n\t}\n}\n",
			listen, dial, name, failures)
	}
	src := "{\n\tadmin off\n\tpersist_config off\n}\n" + site(freePort(t), "site-a", 2) + site(freePort(t), "site-b", 10)
	cfg, err := adapt(t, src)
	if err != nil {
		t.Fatalf("adapt: %v\n%s", err, src)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	seen := map[string]int{}
	for range 10 {
		if err := caddy.Load(cfg, true); err != nil {
			t.Fatalf("load: %v", err)
		}
		plain := getBreaker(t, dial)
		seen[strings.Join(plain.Handlers, ",")]++
	}
	if len(seen) != 1 {
		t.Fatalf("the plain key %q served, over ten loads of one config: %v; want one site every time", dial, seen)
	}
}

// An operator drains a server two sites use, site A with breaker off and
// site B with breakers on: POST /llm_proxy/breakers/<addr>/open must stop
// both from sending there (README: "a drain keeps every site from sending
// there"), and close brings both back. Before, site A has no breaker, so
// its requests kept reaching the drained server.
func TestDrainStopsASiteWithBreakerOff(t *testing.T) {
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}`)
	}))
	t.Cleanup(srv.Close)
	dial := strings.TrimPrefix(srv.URL, "http://")
	listen := freePort(t)
	cfg := sitesConfig(listen, dial, siteRoute{"a", `{"disabled":true}`}, siteRoute{"b", `{}`})
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatalf("loading config: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	post := func(site string) int { t.Helper(); return postSite(t, http.DefaultClient, listen, site) }
	if code, _ := postBreaker(t, dial, "open"); code != http.StatusOK {
		t.Fatalf("POST %s/open: %d", dial, code)
	}
	before := hits.Load()
	for _, site := range []string{"a", "b"} {
		if code := post(site); code != http.StatusServiceUnavailable {
			t.Errorf("site %s during the drain: status %d, want 503", site, code)
		}
	}
	if n := hits.Load() - before; n != 0 {
		t.Errorf("the drained server got %d requests, want 0", n)
	}
	if code, _ := postBreaker(t, dial, "close"); code != http.StatusOK {
		t.Fatalf("POST %s/close: %d", dial, code)
	}
	for _, site := range []string{"a", "b"} {
		if code := post(site); code != http.StatusOK {
			t.Errorf("site %s after close: status %d, want 200", site, code)
		}
	}
}

// An operator drains a server for two minutes; a reload then adds a site
// whose breaker policy takes the plain key, so the breakers of the two
// earlier sites are built again under new keys. Every breaker must still
// show forced (README: "forced: true is an operator's drain (silence
// it)"; caddy llm-proxy status prints "forced"). Before, the rebuilt
// breakers adopted the open state as if the fleet had opened them: open
// until the same time, but forced no more.
func TestDrainStaysForcedWhenAReloadRekeysTheBreakers(t *testing.T) {
	m := newMockVLLM(t)
	dial := strings.TrimPrefix(m.URL, "http://")
	listen := freePort(t)
	site := func(path, name string, failures int) string {
		return fmt.Sprintf("\thandle_path %s {\n\t\tllm_proxy %s {\n\t\t\tname %s\n\t\t\tbreaker {\n\t\t\t\tconsecutive_failures %d\n\t\t\t}\n\t\t}\n\t}\n",
			path, dial, name, failures)
	}
	head := "{\n\tadmin off\n\tpersist_config off\n}\nhttp://" + listen + " {\n"
	load := func(src string) {
		t.Helper()
		cfg, err := adapt(t, src)
		if err != nil {
			t.Fatalf("adapt: %v\n%s", err, src)
		}
		if err := caddy.Load(cfg, true); err != nil {
			t.Fatalf("load: %v", err)
		}
	}
	two := site("/a/*", "site-a", 2) + site("/b/*", "site-b", 5)
	load(head + two + "}\n")
	t.Cleanup(func() { _ = caddy.Stop() })
	rec := httptest.NewRecorder()
	if err := (adminAPI{}).control(rec, httptest.NewRequest("POST", "/llm_proxy/breakers/"+dial+"/open?for=2m", nil)); err != nil {
		t.Fatal(err)
	}
	// consecutive_failures 8 sorts after both (the policy fingerprints are
	// hashes of the settings): site C takes the plain key.
	load(head + two + site("/c/*", "site-c", 8) + "}\n")
	if plain := getBreaker(t, dial); !slices.Equal(plain.Handlers, []string{"site-c"}) {
		t.Fatalf("the plain key serves %q; the test needs site-c's policy to take it", plain.Handlers)
	}
	rec = httptest.NewRecorder()
	if err := (adminAPI{}).list(rec, httptest.NewRequest("GET", "/llm_proxy/breakers", nil)); err != nil {
		t.Fatal(err)
	}
	var views []upstream.BreakerView
	if err := json.Unmarshal(rec.Body.Bytes(), &views); err != nil {
		t.Fatalf("%v: %s", err, rec.Body)
	}
	if len(views) != 3 {
		t.Fatalf("%d breakers, want 3 (one per site): %s", len(views), rec.Body)
	}
	for _, v := range views {
		if v.State != breaker.Open || !v.Forced {
			t.Errorf("breaker %s of %q: state %s, forced %v; want open and forced (the drain)", v.Key, v.Handlers, v.State, v.Forced)
		}
	}
}
