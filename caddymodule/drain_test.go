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

// An operator drains a server three sites use with breaker policies of
// their own (A: consecutive_failures 2, B: 10, C: scope model, declared
// last, so that the server has no per-upstream breaker of the plain key):
// POST /llm_proxy/breakers/<addr>/open must stop every site from sending
// there — A's and B's per-upstream breakers and C's model breaker open,
// and a model C had not requested before is refused too — and the answer
// lists the three breakers it opened. close brings every site back. A
// "~<policy>" key acts on that policy's breaker alone. Before, the plain
// address named the primary policy's per-upstream breaker only (here
// none: 404), so the other sites kept sending to a drained server.
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

	// One policy's breaker: A's or B's, not both.
	var policyKey string
	for _, v := range closed {
		if v.Policy != "" && v.Model == "" {
			policyKey = v.Key
			break
		}
	}
	if policyKey == "" {
		t.Fatalf("no per-upstream breaker of a policy among %+v", closed)
	}
	status, one := postBreaker(t, policyKey, "open")
	if status != http.StatusOK || len(one) != 1 || one[0].Key != policyKey || one[0].State != breaker.Open {
		t.Fatalf("POST %s/open: status %d, %+v; want one breaker, open", policyKey, status, one)
	}
	if a, b := post("a", "m"), post("b", "m"); (a == http.StatusOK) == (b == http.StatusOK) {
		t.Errorf("with %s open: site A %d, site B %d; want one site refused and the other served", policyKey, a, b)
	}
	if code := post("c", "m"); code != http.StatusOK {
		t.Errorf("with %s open: site C %d, want 200", policyKey, code)
	}
}
