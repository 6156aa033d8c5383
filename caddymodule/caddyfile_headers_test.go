package caddymodule

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/headers"
)

// headerLines are header_up/header_down lines in every form of
// reverse_proxy's grammar: set, add, delete, regexp replace, placeholders.
const headerLines = `
		header_up Authorization "Bearer {env.VLLM_API_KEY}"
		header_up +X-Added one
		header_up -X-Removed
		header_up X-Rewritten ^sk-(.*)$ key-$1
		header_up Host api.example.com
		header_down -Server
		header_down +X-Via gateway
		header_down X-Request-Id ^(.*)$ llm-$1
`

// reverseProxyHeaders adapts headerLines under reverse_proxy and returns
// its "headers" object.
func reverseProxyHeaders(t *testing.T) string {
	t.Helper()
	out, err := adapt(t, ":8080 {\n\treverse_proxy 10.0.0.1:8000 {"+headerLines+"\t}\n}")
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		Apps struct {
			HTTP struct {
				Servers map[string]struct {
					Routes []struct {
						Handle []map[string]json.RawMessage `json:"handle"`
					} `json:"routes"`
				} `json:"servers"`
			} `json:"http"`
		} `json:"apps"`
	}
	if err := json.Unmarshal(out, &cfg); err != nil {
		t.Fatal(err)
	}
	for _, s := range cfg.Apps.HTTP.Servers {
		for _, r := range s.Routes {
			for _, h := range r.Handle {
				if string(h["handler"]) == `"reverse_proxy"` {
					var v any
					_ = json.Unmarshal(h["headers"], &v)
					return compact(t, v)
				}
			}
		}
	}
	t.Fatalf("no reverse_proxy in %s", out)
	return ""
}

// TestHeaderOpsAdaptAsReverseProxys: header_up and header_down lines adapt
// to exactly the JSON that the same lines give reverse_proxy, in the
// handler and in a fallback block, and forward_tenant_keys sets its field
// where it is written.
func TestHeaderOpsAdaptAsReverseProxys(t *testing.T) {
	want := reverseProxyHeaders(t)
	if !strings.Contains(want, `"Authorization":["Bearer {env.VLLM_API_KEY}"]`) || !strings.Contains(want, `"delete":["X-Removed"]`) {
		t.Fatalf("reverse_proxy's headers %s: the lines did not adapt as expected", want)
	}
	out, err := adapt(t, ":8080 {\n\tllm_proxy 10.0.0.1:8000 {"+headerLines+
		"\t\tfallback hosted {\n\t\t\tto 10.0.1.1:8000"+strings.ReplaceAll(headerLines, "\t\t", "\t\t\t")+
		"\t\t\tforward_tenant_keys\n\t\t}\n\t}\n}")
	if err != nil {
		t.Fatal(err)
	}
	h := llmHandler(t, out)
	if got := compact(t, h["headers"]); got != want {
		t.Errorf("handler headers\n%s\nwant reverse_proxy's\n%s", got, want)
	}
	if _, ok := h["forward_tenant_keys"]; ok {
		t.Errorf("forward_tenant_keys set on the handler; it was written in the fallback only")
	}
	fb := h["fallbacks"].([]any)[0].(map[string]any)
	if got := compact(t, fb["headers"]); got != want {
		t.Errorf("fallback headers\n%s\nwant reverse_proxy's\n%s", got, want)
	}
	if fb["forward_tenant_keys"] != true {
		t.Errorf("fallback forward_tenant_keys %v, want true", fb["forward_tenant_keys"])
	}
	if err := caddy.Validate(mustConfig(t, out)); err != nil {
		t.Errorf("provisioning: %v", err)
	}
}

func TestHeaderOpsCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ block, want string }{
		{"header_up", "wrong argument count or unexpected line ending after 'header_up', at Caddyfile:3"},
		{"header_up A b c d", "after 'd', at Caddyfile:3"},
		{"header_down", "after 'header_down', at Caddyfile:3"},
		{"forward_tenant_keys yes", "after 'yes', at Caddyfile:3"},
		{"forward_tenant_keys\nforward_tenant_keys", "forward_tenant_keys already specified"},
		{"fallback a {\n to 10.0.1.1:8000\n header_up\n}", "after 'header_up', at Caddyfile:5"},
		{"fallback a {\n to 10.0.1.1:8000\n forward_tenant_keys on\n}", "after 'on', at Caddyfile:5"},
		{"fallback a {\n to 10.0.1.1:8000\n forward_tenant_keys\n forward_tenant_keys\n}", "forward_tenant_keys already specified"},
	} {
		_, err := adapt(t, ":8080 {\n llm_proxy 10.0.0.1:8000 {\n"+tc.block+"\n }\n}")
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want one containing %q", tc.block, err, tc.want)
		}
	}
}

// TestHeaderOpsWithBadRegexpRefusedAtProvision: a JSON config whose
// replace has an invalid regexp fails to load, naming the pool.
func TestHeaderOpsWithBadRegexpRefusedAtProvision(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	hh := &headers.Handler{Request: &headers.HeaderOps{Replace: map[string][]headers.Replacement{
		"Authorization": {{SearchRegexp: "(", Replace: "x"}}}}}
	if _, err := poolHeaders(ctx, "llm_proxy: fallback hosted", hh, false); err == nil ||
		!strings.Contains(err.Error(), "fallback hosted") {
		t.Fatalf("error %v, want one naming fallback hosted", err)
	}
}

// TestPoolHeadersExpandPlaceholders: the operations run with the request's
// replacer ({env.*}, request placeholders), and header_down's require
// limits it to the statuses it names.
func TestPoolHeadersExpandPlaceholders(t *testing.T) {
	t.Setenv("LLM_PROXY_TEST_KEY", "sk-operator")
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	hh := &headers.Handler{
		Request: &headers.HeaderOps{Set: http.Header{
			"Authorization": {"Bearer {env.LLM_PROXY_TEST_KEY}"},
			"X-Path":        {"{http.request.uri.path}"},
		}},
		Response: &headers.RespHeaderOps{HeaderOps: &headers.HeaderOps{Set: http.Header{"X-Down": {"{http.request.method}"}}}},
	}
	ph, err := poolHeaders(ctx, "llm_proxy", hh, true)
	if err != nil {
		t.Fatal(err)
	}
	if !ph.ForwardKeys {
		t.Error("ForwardKeys not carried")
	}
	r := caddyhttp.PrepareRequest(httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil),
		caddy.NewReplacer(), httptest.NewRecorder(), nil)
	h := http.Header{}
	ph.Request(r, h)
	if h.Get("Authorization") != "Bearer sk-operator" || h.Get("X-Path") != "/v1/chat/completions" {
		t.Errorf("header_up gave %v", h)
	}
	down := http.Header{}
	ph.Response(r, 200, down)
	if down.Get("X-Down") != "POST" {
		t.Errorf("header_down gave %v", down)
	}
	// A request without Caddy's replacer still gets global placeholders.
	h = http.Header{}
	ph.Request(httptest.NewRequest(http.MethodPost, "/", nil), h)
	if h.Get("Authorization") != "Bearer sk-operator" {
		t.Errorf("without a replacer: %v", h)
	}
}

// TestHeaderUpRefusesUpstreamPlaceholders: {upstream_hostport} and the
// other per-upstream placeholders would reach the upstream unexpanded (a
// pool's headers are made before an upstream is picked): a fallback's is
// refused by the Caddyfile at its line, the handler's when the config
// loads, each with a message that names the way to send the upstream's
// address.
func TestHeaderUpRefusesUpstreamPlaceholders(t *testing.T) {
	for _, line := range []string{"header_up Host {upstream_hostport}", "header_up +X-Up {http.reverse_proxy.upstream.host}",
		"header_up X-Up ^(.*)$ {upstream_hostport}"} {
		_, err := adapt(t, ":8080 {\n\tllm_proxy 10.0.0.1:8000 {\n\t\tfallback f {\n\t\t\tto 10.0.1.1:8000\n\t\t\t"+line+"\n\t\t}\n\t}\n}")
		if err == nil || !strings.Contains(err.Error(), "fallback f: header_up") || !strings.Contains(err.Error(), "header_up -Host") {
			t.Errorf("fallback %s: error %v, want it refused", line, err)
		}
		out, err := adapt(t, ":8080 {\n\tllm_proxy 10.0.0.1:8000 {\n\t\t"+line+"\n\t}\n}")
		if err != nil {
			t.Fatalf("%s: adapt: %v", line, err)
		}
		err = caddy.Validate(mustConfig(t, out))
		if err == nil || !strings.Contains(err.Error(), "llm_proxy: header_up") || !strings.Contains(err.Error(), "header_up -Host") {
			t.Errorf("handler %s: error %v, want it refused at load", line, err)
		}
	}
}
