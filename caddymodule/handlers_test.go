package caddymodule

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// Two sites in front of one upstream, from a Caddyfile: site A named by
// `name site-a`, site B unnamed (so named by where its directive is,
// "Caddyfile:<line>"). With different breaker settings each breaker lists
// exactly its own site in "handlers" (the listing, one breaker by key, and
// the pools); with equal settings the one breaker lists both.
func TestBreakersNameTheHandlersTheyServe(t *testing.T) {
	m := newMockVLLM(t)
	dial := strings.TrimPrefix(m.URL, "http://")
	listen := freePort(t)
	// A new connection per request: the second load closes the first's
	// listener.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	for _, tc := range []struct {
		name   string
		fa, fb int
	}{{"different policies", 2, 10}, {"equal policies", 3, 3}} {
		t.Run(tc.name, func(t *testing.T) {
			head := "{\n\tadmin off\n\tpersist_config off\n}\nhttp://" + listen + " {\n"
			siteA := fmt.Sprintf("\thandle_path /a/* {\n\t\tllm_proxy %s {\n\t\t\tname site-a\n\t\t\tbreaker {\n\t\t\t\tconsecutive_failures %d\n\t\t\t}\n\t\t}\n\t}\n", dial, tc.fa)
			siteB := fmt.Sprintf("\thandle_path /b/* {\n\t\tllm_proxy %s {\n\t\t\tbreaker {\n\t\t\t\tconsecutive_failures %d\n\t\t\t}\n\t\t}\n\t}\n", dial, tc.fb)
			src := head + siteA + siteB + "}\n"
			// Site B's directive is on the second line of its block.
			nameB := fmt.Sprintf("Caddyfile:%d", strings.Count(head+siteA, "\n")+2)
			cfg, err := adapt(t, src)
			if err != nil {
				t.Fatalf("adapt: %v\n%s", err, src)
			}
			if err := caddy.Load(cfg, true); err != nil {
				t.Fatalf("load: %v", err)
			}
			t.Cleanup(func() { _ = caddy.Stop() })
			for _, site := range []string{"a", "b"} {
				resp, err := client.Post("http://"+listen+"/"+site+"/v1/chat/completions", "application/json",
					strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("site %s: status %d", site, resp.StatusCode)
				}
			}
			rec := httptest.NewRecorder()
			if err := (adminAPI{}).list(rec, httptest.NewRequest("GET", "/llm_proxy/breakers", nil)); err != nil {
				t.Fatal(err)
			}
			var views []upstream.BreakerView
			if err := json.Unmarshal(rec.Body.Bytes(), &views); err != nil {
				t.Fatalf("%v: %s", err, rec.Body)
			}
			// One breaker per handler, whatever their settings; GET of
			// the upstream's key shows the first one listed.
			var got [][]string
			for i, v := range views {
				got = append(got, v.Handlers)
				if one := getBreaker(t, v.Key); i == 0 && !slices.Equal(one.Handlers, v.Handlers) {
					t.Errorf("GET /llm_proxy/breakers/%s lists handlers %q, the listing %q", v.Key, one.Handlers, v.Handlers)
				}
				if one := getBreaker(t, v.FleetKey); tc.fa != tc.fb && !slices.Equal(one.Handlers, v.Handlers) {
					t.Errorf("GET /llm_proxy/breakers/%s lists handlers %q, the listing %q", v.FleetKey, one.Handlers, v.Handlers)
				}
			}
			want := [][]string{{"site-a"}, {nameB}}
			slices.SortFunc(got, func(a, b []string) int { return strings.Compare(strings.Join(a, ","), strings.Join(b, ",")) })
			slices.SortFunc(want, func(a, b []string) int { return strings.Compare(strings.Join(a, ","), strings.Join(b, ",")) })
			if !slices.EqualFunc(got, want, slices.Equal) {
				t.Fatalf("breakers' handlers %q, want %q", got, want)
			}
			rec = httptest.NewRecorder()
			if err := (adminAPI{}).pools(rec, httptest.NewRequest("GET", "/llm_proxy/pools", nil)); err != nil {
				t.Fatal(err)
			}
			var pools []upstream.PoolStatus
			if err := json.Unmarshal(rec.Body.Bytes(), &pools); err != nil {
				t.Fatalf("%v: %s", err, rec.Body)
			}
			var handlers []string
			for _, p := range pools {
				handlers = append(handlers, p.Handler)
			}
			slices.Sort(handlers)
			if !slices.Equal(handlers, []string{nameB, "site-a"}) {
				t.Errorf("pools' handlers %q, want %q", handlers, []string{nameB, "site-a"})
			}
		})
	}
}
