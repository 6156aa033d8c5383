package caddymodule

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// Two sites of a Caddyfile, neither named (so each is "Caddyfile:<line>"
// of its llm_proxy directive), in front of one upstream with their own
// settings. An operator drains site A's breakers by their fleet_key. A
// routine edit above both sites (seven comment lines, the size of one site
// block) moves A's directive to the line B's was on, and the reload hands
// A the old B's verdict: A's drain ends and its clients reach the drained
// server. The docs say an open breaker carries over to "the handler that
// replaces it — the same name (by default the directive's
// Caddyfile:<line>), else the same upstreams with the same settings".
func TestReloadThatMovesUnnamedSitesKeepsAPolicyDrain(t *testing.T) {
	m := newMockVLLM(t)
	dial := strings.TrimPrefix(m.URL, "http://")
	listen := freePort(t)
	site := func(path string, failures int) string { // 7 lines
		return fmt.Sprintf("\thandle_path %s {\n\t\tllm_proxy %s {\n\t\t\tbreaker {\n\t\t\t\tconsecutive_failures %d\n\t\t\t}\n\t\t}\n\t}\n",
			path, dial, failures)
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
	sites := site("/a/*", 2) + site("/b/*", 5)
	load(head + sites + "}\n")
	t.Cleanup(func() { _ = caddy.Stop() })
	list := func() []upstream.BreakerView {
		t.Helper()
		rec := httptest.NewRecorder()
		if err := (adminAPI{}).list(rec, httptest.NewRequest("GET", "/llm_proxy/breakers", nil)); err != nil {
			t.Fatal(err)
		}
		var views []upstream.BreakerView
		if err := json.Unmarshal(rec.Body.Bytes(), &views); err != nil {
			t.Fatalf("%v: %s", err, rec.Body)
		}
		return views
	}
	views := list()
	if len(views) != 2 {
		t.Fatalf("%d breakers, want 2", len(views))
	}
	// Site A's directive comes first: the lower line.
	a := views[0]
	for _, v := range views[1:] {
		if line(v.Handler) < line(a.Handler) {
			a = v
		}
	}
	if status, opened := postBreaker(t, a.FleetKey, "open"); status != http.StatusOK || len(opened) != 1 {
		t.Fatalf("POST %s/open: status %d, %d breakers; want 200 and site A's one", a.FleetKey, status, len(opened))
	}
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
	if code := post("a"); code != http.StatusServiceUnavailable {
		t.Fatalf("site A drained: status %d, want 503", code)
	}
	load(head + strings.Repeat("\t# routing notes\n", 7) + sites + "}\n")
	for _, v := range list() {
		if v.FleetKey == a.FleetKey && (v.State.String() != "open" || !v.Forced) {
			t.Errorf("site A's breaker (%s, now %s) after the reload: %s, forced %v; want open and forced (drained)", v.FleetKey, v.Handler, v.State, v.Forced)
		}
	}
	if code := post("a"); code != http.StatusServiceUnavailable {
		t.Errorf("site A after a reload that moved its lines: status %d, want 503 (drained)", code)
	}
	if code := post("b"); code != http.StatusOK {
		t.Errorf("site B after the reload: status %d, want 200", code)
	}
}

// line is the line of a handler named "Caddyfile:<line>".
func line(handler string) int {
	var n int
	_, _ = fmt.Sscanf(handler[strings.LastIndex(handler, ":")+1:], "%d", &n)
	return n
}
