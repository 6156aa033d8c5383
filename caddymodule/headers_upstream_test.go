package caddymodule

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/headers"
)

// TestHeaderUpHostUpstreamHostportSendsDialAddress: `header_up Host
// {upstream_hostport}`, reverse_proxy's idiom for an HTTPS upstream that
// wants its own name, sends the upstream's dial address as Host (and
// the stream succeeds), as reverse_proxy does; the placeholder is not sent
// as it is written.
func TestHeaderUpHostUpstreamHostportSendsDialAddress(t *testing.T) {
	var mu sync.Mutex
	var hosts []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		hosts = append(hosts, r.Host)
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}`)
	}))
	t.Cleanup(srv.Close)
	dial := strings.TrimPrefix(srv.URL, "http://")
	listen := freePort(t)
	out, err := adapt(t, "{\n\tadmin off\n\tpersist_config off\n}\nhttp://"+listen+" {\n\tllm_proxy "+dial+
		" {\n\t\tmax_attempts 1\n\t\theader_up Host {upstream_hostport}\n\t}\n}")
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(out, true); err != nil {
		t.Fatalf("loading config: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	resp, err := http.Post("http://"+listen+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("status %d, want 200", resp.StatusCode)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(hosts) != 1 || hosts[0] != dial {
		t.Errorf("upstream saw Host %q, want its dial address %q once", hosts, dial)
	}
}

// TestUpstreamPlaceholdersOtherThanHostRefusedAtProvision: a header_up or
// header_down that names another {http.reverse_proxy.upstream.*}
// placeholder fails to load, naming it, instead of sending it as written.
func TestUpstreamPlaceholdersOtherThanHostRefusedAtProvision(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	for _, hh := range []*headers.Handler{
		{Request: &headers.HeaderOps{Set: http.Header{"X-Upstream": {"{http.reverse_proxy.upstream.host}"}}}},
		{Request: &headers.HeaderOps{Add: http.Header{"Host": {"{http.reverse_proxy.upstream.hostport}"}}}},
		{Response: &headers.RespHeaderOps{HeaderOps: &headers.HeaderOps{Set: http.Header{"X-Served-By": {"{http.reverse_proxy.upstream.hostport}"}}}}},
	} {
		if _, err := poolHeaders(ctx, "llm_proxy: fallback hosted", hh, false); err == nil ||
			!strings.Contains(err.Error(), "fallback hosted") || !strings.Contains(err.Error(), "{http.reverse_proxy.upstream.") {
			t.Errorf("error %v, want one naming the pool and the placeholder", err)
		}
	}
}

// TestHeaderUpWildcardDeleteDropsTenantHeaders: the docs' `header_up
// -X-Llm-Proxy-*` on a hosted fallback removes the tenant and tier headers
// that the gateway set, so tenants' names do not reach the third party.
func TestHeaderUpWildcardDeleteDropsTenantHeaders(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	ph, err := poolHeaders(ctx, "llm_proxy: fallback hosted",
		&headers.Handler{Request: &headers.HeaderOps{Delete: []string{"X-Llm-Proxy-*"}}}, false)
	if err != nil {
		t.Fatal(err)
	}
	h := http.Header{"X-Llm-Proxy-Tenant": {"acme"}, "X-Llm-Proxy-Tier": {"gold"}, "Content-Type": {"application/json"}}
	ph.Request(httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil), h)
	if len(h) != 1 || h.Get("Content-Type") == "" {
		t.Errorf("after header_up -X-Llm-Proxy-*: %v, want Content-Type alone", h)
	}
}
