package caddymodule

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// postBreaker POSTs an operator's action to the admin API and returns the
// status and the breakers the answer lists as changed.
func postBreaker(t *testing.T, key, action string) (int, []upstream.BreakerView) {
	t.Helper()
	rec := httptest.NewRecorder()
	err := (adminAPI{}).control(rec, httptest.NewRequest("POST", "/llm_proxy/breakers/"+key+"/"+action, nil))
	if err != nil {
		var ae caddy.APIError
		if !errors.As(err, &ae) {
			t.Fatalf("POST %s/%s: %v", key, action, err)
		}
		return ae.HTTPStatus, nil
	}
	var vs []upstream.BreakerView
	if err := json.Unmarshal(rec.Body.Bytes(), &vs); err != nil {
		t.Fatalf("POST %s/%s: %v: %s", key, action, err, rec.Body)
	}
	return http.StatusOK, vs
}

// An operator drains a server three sites use with breaker settings of
// their own (A: consecutive_failures 2, B: 10, C: scope model):
// POST /llm_proxy/breakers/<addr>/open must stop every site from sending
// there — A's and B's per-upstream breakers and C's model breaker open,
// and a model C had not requested before is refused too — and the answer
// lists the three breakers it opened. close brings every site back. A
// fleet_key ("<addr>~<policy>") acts on that policy's breaker alone.
func TestDrainReachesEverySite(t *testing.T) {
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}`)
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
		route("/a/*", `{"consecutive_failures":2}`) + `,` +
		route("/b/*", `{"consecutive_failures":10}`) + `,` +
		route("/c/*", `{"scope":"model"}`) + `]}}}}}`
	if err := caddy.Load([]byte(cfg), true); err != nil {
		t.Fatalf("loading config: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	post := func(site, model string) int {
		t.Helper()
		resp, err := http.Post("http://"+listen+"/"+site+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"`+model+`","messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, s := range []string{"a", "b", "c"} {
		if code := post(s, "m"); code != http.StatusOK {
			t.Fatalf("site %s before the drain: status %d, want 200", s, code)
		}
	}

	status, opened := postBreaker(t, dial, "open")
	if status != http.StatusOK {
		t.Fatalf("POST %s/open: status %d, want 200", dial, status)
	}
	var keys []string
	for _, v := range opened {
		keys = append(keys, v.Key)
		if v.State != breaker.Open || !v.Forced || v.Upstream != dial {
			t.Errorf("POST %s/open lists %+v, want it open and forced", dial, v)
		}
	}
	if len(opened) != 3 {
		t.Fatalf("POST %s/open changed %q, want the three sites' breakers (A's, B's, C's for model m)", dial, keys)
	}
	before := hits.Load()
	for _, req := range [][2]string{{"a", "m"}, {"b", "m"}, {"c", "m"}, {"c", "other"}} {
		if code := post(req[0], req[1]); code != http.StatusServiceUnavailable {
			t.Errorf("site %s, model %s, with the server drained: status %d, want 503", req[0], req[1], code)
		}
	}
	if n := hits.Load() - before; n != 0 {
		t.Fatalf("the drained server got %d requests", n)
	}

	status, closed := postBreaker(t, dial, "close")
	if status != http.StatusOK || len(closed) != 4 {
		t.Fatalf("POST %s/close: status %d, %d breakers, want 200 and 4 (C's breaker of model other too)", dial, status, len(closed))
	}
	for _, req := range [][2]string{{"a", "m"}, {"b", "m"}, {"c", "m"}, {"c", "other"}} {
		if code := post(req[0], req[1]); code != http.StatusOK {
			t.Errorf("site %s, model %s, after close: status %d, want 200", req[0], req[1], code)
		}
	}

	// One policy's breaker, by its fleet key: A's or B's, not both.
	var policyKey string
	for _, v := range closed {
		if v.Model == "" {
			policyKey = v.FleetKey
			break
		}
	}
	if policyKey == "" {
		t.Fatalf("no per-upstream breaker of a policy among %+v", closed)
	}
	status, one := postBreaker(t, policyKey, "open")
	if status != http.StatusOK || len(one) != 1 || one[0].FleetKey != policyKey || one[0].State != breaker.Open {
		t.Fatalf("POST %s/open: status %d, %+v; want one breaker, open", policyKey, status, one)
	}
	if a, b := post("a", "m"), post("b", "m"); (a == http.StatusOK) == (b == http.StatusOK) {
		t.Errorf("with %s open: site A %d, site B %d; want one site refused and the other served", policyKey, a, b)
	}
	if code := post("c", "m"); code != http.StatusOK {
		t.Errorf("with %s open: site C %d, want 200", policyKey, code)
	}
}

// Two sites on two ports (so two Caddy servers, which Caddy provisions in
// map order, at random) in front of one upstream with different breaker
// settings. Each site's breaker, and its fleet key, must be a function of
// the config: loading the same config again, or on another gateway of a
// fleet, names the breakers alike (else a fleet's gateways share one Redis
// key between two sites' breakers, and an operator's POST to a fleet_key
// hits the other site after a restart), and a GET of the upstream shows
// the same site's breaker every time.
func TestBreakerNamesDoNotDependOnProvisionOrder(t *testing.T) {
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
	first := map[string]int{}
	keys := map[string]map[string]bool{} // handler → fleet keys seen
	for range 10 {
		if err := caddy.Load(cfg, true); err != nil {
			t.Fatalf("load: %v", err)
		}
		first[strings.Join(getBreaker(t, dial).Handlers, ",")]++
		for _, v := range shared.upstreams.Breakers() {
			if keys[v.Handler] == nil {
				keys[v.Handler] = map[string]bool{}
			}
			keys[v.Handler][v.FleetKey] = true
		}
	}
	if len(first) != 1 {
		t.Fatalf("GET %s showed, over ten loads of one config: %v; want one site every time", dial, first)
	}
	if len(keys) != 2 || len(keys["site-a"]) != 1 || len(keys["site-b"]) != 1 {
		t.Fatalf("fleet keys by handler over ten loads: %v; want one per site, the same every time", keys)
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

// An operator drains a server for two minutes; a reload then adds a
// site. The new config's breakers — A's and B's, carried over, and C's,
// new — must all show forced (README: "forced: true is an operator's
// drain (silence it)"; caddy llm-proxy status prints "forced"), not open
// as if the fleet had opened them.
func TestDrainStaysForcedAcrossAReloadThatAddsASite(t *testing.T) {
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
	// A reload adds site C: the new config's breakers for A and B carry
	// the drain over, and C's new one starts forced.
	load(head + two + site("/c/*", "site-c", 8) + "}\n")
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
