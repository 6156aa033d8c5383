package e2e

// End-to-end tests of upstream credentials (issue 32): header_up and
// header_down in the handler and in fallback blocks, and tenants' keys
// kept at the gateway. The upstreams here check their own key as vLLM
// started with --api-key does (keyedUpstream) and record every header
// they were sent.

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// keyedUpstream is an inference server that checks its own credentials:
// it answers 401 unless each header of want carries its value (as vLLM
// with --api-key wants "Authorization: Bearer <key>", an Anthropic-style
// endpoint x-api-key and anthropic-version), records the headers of every
// request, and passes accepted ones to a mock replica, each event flushed
// as it comes. With status set it answers that status instead of passing.
type keyedUpstream struct {
	*httptest.Server
	mu     sync.Mutex
	want   map[string]string
	status int
	seen   []http.Header
}

func newKeyedUpstream(t *testing.T, replica string, want map[string]string) *keyedUpstream {
	t.Helper()
	target, err := url.Parse("http://" + replica)
	if err != nil {
		t.Fatal(err)
	}
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.FlushInterval = -1
	// A fresh connection to the replica each time: a kept one that the
	// replica closed would fail a POST here (502), and the gateway's
	// retry would be counted as a second request.
	rp.Transport = &http.Transport{DisableKeepAlives: true}
	u := &keyedUpstream{want: want}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.mu.Lock()
		u.seen = append(u.seen, r.Header.Clone())
		want, status := u.want, u.status
		u.mu.Unlock()
		for k, v := range want {
			if r.Header.Get(k) != v {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusUnauthorized)
				fmt.Fprintf(w, `{"error":{"message":"bad %s","type":"invalid_request_error"}}`, k)
				return
			}
		}
		if status != 0 {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			_, _ = w.Write([]byte(`{"error":{"message":"down","type":"server_error"}}`))
			return
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(u.Close)
	return u
}

func (u *keyedUpstream) addr() string { return strings.TrimPrefix(u.URL, "http://") }

// setWant replaces the credentials the upstream accepts (a key rotation).
func (u *keyedUpstream) setWant(want map[string]string) {
	u.mu.Lock()
	u.want = want
	u.mu.Unlock()
}

// requests returns the headers of every request received so far.
func (u *keyedUpstream) requests() []http.Header {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]http.Header(nil), u.seen...)
}

// checkNeverSaw fails t if any header of any request held secret.
func (u *keyedUpstream) checkNeverSaw(t *testing.T, who, secret string) {
	t.Helper()
	for i, h := range u.requests() {
		for k, vs := range h {
			for _, v := range vs {
				if strings.Contains(v, secret) {
					t.Errorf("%s: request %d carried the tenant's key in %s", who, i+1, k)
				}
			}
		}
	}
}

// operatorKey returns a fresh operator (upstream) key.
func operatorKey(name string) string {
	var b [12]byte
	rand.Read(b[:])
	return "sk-op-" + name + "-" + hex.EncodeToString(b[:])
}

// tenantsGlobal is a global option with one tenant key.
func tenantsGlobal(key string) string {
	return fmt.Sprintf(`	llm_proxy {
		tenants {
			key %s acme tier one
		}
		tier one {
			rpm 10000
		}
	}`, key)
}

// credentialAPIs are the four APIs: path and a streamed request body.
var credentialAPIs = []struct {
	name, path string
	body       string
}{
	{"chat", "/v1/chat/completions", chatBody("hello", true)},
	{"completions", "/v1/completions", completionBody("hello", true)},
	{"responses", "/v1/responses", streamingAPIs[0].body("hello", 16, true)},
	{"messages", "/v1/messages", streamingAPIs[1].body("hello", 16, true)},
}

// TestUpstreamSeesOperatorKeyNeverTenantKey: with tenants and header_up
// Authorization "Bearer {env.…}", every API's stream succeeds against an
// upstream that wants the operator's key, whichever of the three headers
// carried the tenant's key, and the upstream never sees the tenant's key.
func TestUpstreamSeesOperatorKeyNeverTenantKey(t *testing.T) {
	t.Parallel()
	tenant, op := newKey("acme"), operatorKey("vllm")
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(time.Millisecond), Tokens: 3, TokenInterval: mockllm.NoDelay}})
	up := newKeyedUpstream(t, fleet.Addrs()[0], map[string]string{"Authorization": "Bearer " + op})
	gw := startTenantGateway(t, gatewayOptions{
		Globals: tenantsGlobal(tenant),
		Site: fmt.Sprintf(`	llm_proxy %s {
		header_up Authorization "Bearer {env.E2E_VLLM_API_KEY}"
	}`, up.addr()),
		Env: []string{"E2E_VLLM_API_KEY=" + op},
	}, tenant)
	c := newClient(t)
	ctx := testContext(t, 60*time.Second)
	for _, a := range credentialAPIs {
		for _, form := range []string{bearer(tenant), "api-key: " + tenant, "x-api-key: " + tenant} {
			name := strings.SplitN(form, ":", 2)[0]
			s := streamRequest(ctx, t, c, gw.URL+a.path, a.body, form)
			if s.Status != http.StatusOK || s.Err != nil || len(s.dataEvents()) < 2 {
				t.Errorf("%s with the key in %s: status %d, %d data events, err %v", a.name, name, s.Status, len(s.dataEvents()), s.Err)
			}
		}
	}
	reqs := up.requests()
	if len(reqs) != 12 {
		t.Errorf("the upstream got %d requests, want 12 (4 APIs × 3 key headers)", len(reqs))
	}
	for i, h := range reqs {
		if got := h.Values("Authorization"); len(got) != 1 || got[0] != "Bearer "+op {
			t.Errorf("request %d: upstream Authorization %d values, want the operator's key alone", i+1, len(got))
		}
		if h.Get("X-LLM-Proxy-Tenant") != "acme" {
			t.Errorf("request %d: X-LLM-Proxy-Tenant %q, want acme", i+1, h.Get("X-LLM-Proxy-Tenant"))
		}
	}
	up.checkNeverSaw(t, "the upstream", tenant)
}

// TestFallbackPoolSeesItsOwnKey: a fallback with its own header_up (an
// Anthropic-compatible endpoint's x-api-key and anthropic-version) gets
// its own credentials, neither the primary's nor the tenant's, and its
// header_down shapes the answer it serves.
func TestFallbackPoolSeesItsOwnKey(t *testing.T) {
	t.Parallel()
	tenant, vllmKey, hostedKey := newKey("acme"), operatorKey("vllm"), operatorKey("hosted")
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(time.Millisecond), Tokens: 3, TokenInterval: mockllm.NoDelay}})
	primary := newKeyedUpstream(t, fleet.Addrs()[0], map[string]string{"Authorization": "Bearer " + vllmKey})
	primary.status = http.StatusServiceUnavailable
	hosted := newKeyedUpstream(t, fleet.Addrs()[1], map[string]string{"X-Api-Key": hostedKey, "Anthropic-Version": "2023-06-01"})
	gw := startTenantGateway(t, gatewayOptions{
		Globals: tenantsGlobal(tenant),
		Site: fmt.Sprintf(`	llm_proxy %s {
		max_attempts 1
		header_up Authorization "Bearer {env.E2E_VLLM_API_KEY}"
		header_down X-Served-By primary
		fallback hosted {
			to %s
			header_up x-api-key {env.E2E_HOSTED_API_KEY}
			header_up anthropic-version 2023-06-01
			header_down X-Served-By hosted
		}
	}`, primary.addr(), hosted.addr()),
		Env: []string{"E2E_VLLM_API_KEY=" + vllmKey, "E2E_HOSTED_API_KEY=" + hostedKey},
	}, tenant)
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	s := streamRequest(ctx, t, c, gw.URL+"/v1/messages", streamingAPIs[1].body("hello", 16, true), "x-api-key: "+tenant)
	if s.Status != http.StatusOK || s.count("message_stop") != 1 {
		t.Fatalf("status %d, events %v; want a whole stream from the fallback", s.Status, s.names())
	}
	if got := s.Header.Get("X-LLM-Proxy-Degraded"); !strings.HasPrefix(got, "fallback=hosted") {
		t.Errorf("X-LLM-Proxy-Degraded %q, want fallback=hosted", got)
	}
	if got := s.Header.Values("X-Served-By"); len(got) != 1 || got[0] != "hosted" {
		t.Errorf("X-Served-By %q, want the fallback's header_down alone", got)
	}
	pr, hr := primary.requests(), hosted.requests()
	if len(pr) != 1 || len(hr) != 1 {
		t.Fatalf("primary got %d requests, fallback %d; want 1 and 1", len(pr), len(hr))
	}
	if pr[0].Get("Authorization") != "Bearer "+vllmKey || pr[0].Get("X-Api-Key") != "" {
		t.Errorf("primary: want the vLLM key in Authorization and no x-api-key")
	}
	if _, ok := hr[0]["Authorization"]; ok {
		t.Errorf("fallback: got an Authorization header (the primary's header_up, or the client's)")
	}
	if hr[0].Get("X-Api-Key") != hostedKey || hr[0].Get("Anthropic-Version") != "2023-06-01" {
		t.Errorf("fallback: want its own x-api-key and anthropic-version")
	}
	for who, u := range map[string]*keyedUpstream{"the primary": primary, "the fallback": hosted} {
		u.checkNeverSaw(t, who, tenant)
		u.checkNeverSaw(t, who+" (other pool's key)", map[string]string{"the primary": hostedKey, "the fallback": vllmKey}[who])
	}
}

// TestHeaderDownKeepsStreamTiming: header_down edits a stream's response
// headers (sets one, deletes the upstream's X-Mock-Replica) while the
// first event still reaches the client at once: the upstream holds the
// second event for 2 s, and the first must arrive well before it, as it
// does on a handler without header_down on the same gateway.
func TestHeaderDownKeepsStreamTiming(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	gw := startGateway(t, fmt.Sprintf(`	@plain header X-Plain 1
	llm_proxy @plain %[1]s
	llm_proxy %[1]s {
		header_down -%[2]s
		header_down +X-Gateway llm_proxy
	}`, upstreams(fleet), mockllm.HeaderReplica))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	const hold = 2 * time.Second
	first := func(extra ...string) (time.Duration, *stream) {
		h := append([]string{"X-Mock-Token-Interval: " + hold.String()}, extra...)
		s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("hold the second event", true), h...)
		ev := s.dataEvents()
		if s.Status != http.StatusOK || len(ev) < 3 {
			t.Fatalf("status %d, %d data events", s.Status, len(ev))
		}
		// The upstream sends the first token at once and the rest 2 s
		// later: the first must arrive before the rest, not with it.
		rest := ev[len(ev)-1].At.Sub(ev[0].At)
		if ev[0].At.Sub(s.Sent) >= hold/2 || rest < hold/2 {
			t.Errorf("first event after %v, the last %v after it: the first was not relayed while the upstream held the next",
				ev[0].At.Sub(s.Sent), rest)
		}
		return ev[0].At.Sub(s.Sent), s
	}
	plain, ps := first("X-Plain: 1")
	down, ds := first()
	t.Logf("first event after %v with header_down, %v without (upstream holds the next for %v)", down, plain, hold)
	if ds.Header.Get(mockllm.HeaderReplica) != "" || ds.Header.Get("X-Gateway") != "llm_proxy" {
		t.Errorf("with header_down: %s %q, X-Gateway %q; want it removed and X-Gateway set",
			mockllm.HeaderReplica, ds.Header.Get(mockllm.HeaderReplica), ds.Header.Get("X-Gateway"))
	}
	if ps.Header.Get(mockllm.HeaderReplica) == "" || ps.Header.Get("X-Gateway") != "" {
		t.Errorf("without header_down the upstream's headers pass unchanged: %v", ps.Header)
	}
	if ds.Header.Get("Cache-Control") != "no-cache" {
		t.Errorf("Cache-Control %q: the gateway's stream headers are kept", ds.Header.Get("Cache-Control"))
	}
}

// TestReloadChangesUpstreamKey: a key rotated on the upstream and in the
// Caddyfile by a reload is sent from the next request on.
func TestReloadChangesUpstreamKey(t *testing.T) {
	t.Parallel()
	tenant, oldKey, newKey_ := newKey("acme"), operatorKey("old"), operatorKey("new")
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	up := newKeyedUpstream(t, fleet.Addrs()[0], map[string]string{"Authorization": "Bearer " + oldKey})
	site := func(key string) string {
		return fmt.Sprintf(`	llm_proxy %s {
		header_up Authorization "Bearer %s"
	}`, up.addr(), key)
	}
	gw := startTenantGateway(t, gatewayOptions{Globals: tenantsGlobal(tenant), Site: site(oldKey)}, tenant)
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	ask := func(what string) {
		t.Helper()
		s, err := doStream(ctx, c, gw.URL+"/v1/chat/completions", chatBody("hello", true), bearer(tenant))
		// A request lost in the reload's listener hand-off never reached
		// the gateway: sent again, as the SDKs do.
		for try := 1; err != nil && handOffLost(err) && try <= 3; try++ {
			s, err = doStream(ctx, c, gw.URL+"/v1/chat/completions", chatBody("hello", true), bearer(tenant))
		}
		if err != nil || s.Status != http.StatusOK {
			t.Fatalf("%s: %v, want 200", what, err)
		}
	}
	ask("before the rotation")
	up.setWant(map[string]string{"Authorization": "Bearer " + newKey_})
	gw.reload(site(newKey_))
	ask("the first request after the reload")
	reqs := up.requests()
	if last := reqs[len(reqs)-1].Get("Authorization"); last != "Bearer "+newKey_ {
		t.Errorf("after the reload the upstream got the old key")
	}
	if reqs[0].Get("Authorization") != "Bearer "+oldKey {
		t.Errorf("before the reload the upstream did not get the old key")
	}
	up.checkNeverSaw(t, "the upstream", tenant)
}

// TestSDKsWithTenantsAndOperatorKey: the official openai and
// @anthropic-ai/sdk clients, each presenting a tenant's key its own way
// (Authorization: Bearer, x-api-key), stream through tenants and
// header_up to an upstream that wants the operator's key, which never
// sees the tenant's.
func TestSDKsWithTenantsAndOperatorKey(t *testing.T) {
	requireNode(t)
	t.Parallel()
	tenant, op := newKey("acme"), operatorKey("vllm")
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(time.Millisecond), Tokens: 4, TokenInterval: mockllm.NoDelay}})
	up := newKeyedUpstream(t, fleet.Addrs()[0], map[string]string{"Authorization": "Bearer " + op})
	gw := startTenantGateway(t, gatewayOptions{
		Globals: tenantsGlobal(tenant),
		Site: fmt.Sprintf(`	llm_proxy %s {
		header_up Authorization "Bearer {env.E2E_VLLM_API_KEY}"
	}`, up.addr()),
		Env: []string{"E2E_VLLM_API_KEY=" + op},
	}, tenant)
	for _, mode := range []string{"openai-chat", "openai-responses", "anthropic-stream"} {
		r := runSDK(t, mode, gw.URL, nil, map[string]any{"apiKey": tenant})
		if !r.OK || r.Text == "" {
			t.Errorf("%s: ok %v, text %q, error %s", mode, r.OK, r.Text, r.thrown())
		}
	}
	// Each SDK call reached it; a request written on a kept connection
	// the upstream closed (stale_connection) may be sent once more.
	if n := len(up.requests()); n < 3 || n > 4 {
		t.Errorf("the upstream got %d requests, want 3 (4 with one resent after a stale connection)", n)
	}
	up.checkNeverSaw(t, "the upstream", tenant)
}

// TestForwardTenantKeysSendsTheClientsKey: forward_tenant_keys keeps the
// tenant's key on requests to its pool (backends that check the same
// keys), while a fallback without it does not get the key.
func TestForwardTenantKeysSendsTheClientsKey(t *testing.T) {
	t.Parallel()
	tenant := newKey("acme")
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	same := newKeyedUpstream(t, fleet.Addrs()[0], map[string]string{"Authorization": "Bearer " + tenant})
	other := newKeyedUpstream(t, fleet.Addrs()[1], nil)
	gw := startTenantGateway(t, gatewayOptions{
		Globals: tenantsGlobal(tenant),
		Site: fmt.Sprintf(`	llm_proxy %s {
		max_attempts 1
		forward_tenant_keys
		fallback other {
			to %s
		}
	}`, same.addr(), other.addr()),
	}, tenant)
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	if s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("hello", true), bearer(tenant)); s.Status != http.StatusOK {
		t.Fatalf("status %d: the primary did not get the tenant's key", s.Status)
	}
	same.mu.Lock()
	same.status = http.StatusServiceUnavailable // now the fallback serves
	same.mu.Unlock()
	s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("hello", true), bearer(tenant))
	if s.Status != http.StatusOK || !strings.HasPrefix(s.Header.Get("X-LLM-Proxy-Degraded"), "fallback=other") {
		t.Fatalf("status %d, degraded %q: want the fallback's answer", s.Status, s.Header.Get("X-LLM-Proxy-Degraded"))
	}
	if n := len(other.requests()); n != 1 {
		t.Fatalf("the fallback got %d requests, want 1", n)
	}
	other.checkNeverSaw(t, "the fallback without forward_tenant_keys", tenant)
}
