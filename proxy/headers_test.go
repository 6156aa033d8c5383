package proxy

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// headerLog records the request headers (and Host) that an upstream saw.
type headerLog struct {
	mu    sync.Mutex
	seen  []http.Header
	hosts []string
}

func (l *headerLog) wrap(h func(http.ResponseWriter, *http.Request)) func(http.ResponseWriter, *http.Request) {
	return func(w http.ResponseWriter, r *http.Request) {
		l.mu.Lock()
		l.seen = append(l.seen, r.Header.Clone())
		l.hosts = append(l.hosts, r.Host)
		l.mu.Unlock()
		h(w, r)
	}
}

func (l *headerLog) last(t *testing.T) (http.Header, string) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.seen) == 0 {
		t.Fatal("the upstream saw no request")
	}
	return l.seen[len(l.seen)-1], l.hosts[len(l.hosts)-1]
}

// setHeader is a Headers.Request that sets each name to its value.
func setHeader(kv ...string) func(*http.Request, http.Header) {
	return func(_ *http.Request, h http.Header) {
		for i := 0; i < len(kv); i += 2 {
			h.Set(kv[i], kv[i+1])
		}
	}
}

func tenantKeys() *KeyIdentifier {
	return &KeyIdentifier{Keys: keyOnly{}, Resolve: func(_, tier string) (string, bool) { return tier, true }}
}

// credentialForms are the three ways a client presents its key.
var credentialForms = []struct{ name, value string }{
	{"Authorization", "Bearer sk-secret"},
	{"Api-Key", "sk-secret"},
	{"X-Api-Key", "sk-secret"},
}

// TestUpstreamGetsOperatorKeyNeverTenantKey: with tenants, whichever
// header carried the tenant's key, the upstream sees the operator's
// header_up Authorization and none of the client's key headers.
func TestUpstreamGetsOperatorKeyNeverTenantKey(t *testing.T) {
	for _, form := range credentialForms {
		t.Run(form.name, func(t *testing.T) {
			var log headerLog
			up := newUpstream(t, log.wrap(sseUpstream(chunkA, chunkEnd, done)))
			p, _, _ := newTestProxy(t, Config{Identifier: tenantKeys(),
				Headers: Headers{Request: setHeader("Authorization", "Bearer sk-operator")}}, up)
			r := post(`{"model":"m","stream":true}`)
			r.Header.Set(form.name, form.value)
			w := httptest.NewRecorder()
			res := p.ServeHTTP(w, r)
			if w.Code != 200 || res.Identity.Tenant != "acme" {
				t.Fatalf("status %d, tenant %q; want 200 for acme", w.Code, res.Identity.Tenant)
			}
			h, _ := log.last(t)
			if got := h.Values("Authorization"); len(got) != 1 || got[0] != "Bearer sk-operator" {
				t.Errorf("upstream Authorization %q, want only the operator's", got)
			}
			for _, k := range []string{"Api-Key", "X-Api-Key"} {
				if v, ok := h[k]; ok {
					t.Errorf("upstream got %s %q", k, v)
				}
			}
			if h.Get(HeaderTenant) != "acme" {
				t.Errorf("upstream %s %q, want acme", HeaderTenant, h.Get(HeaderTenant))
			}
		})
	}
}

// TestTenantKeysStayAtGatewayWithoutHeaderUp: no header_up, tenants on:
// the upstream gets no credential at all, also for an unknown key
// admitted under the unknown tier.
func TestTenantKeysStayAtGatewayWithoutHeaderUp(t *testing.T) {
	for _, key := range []string{"sk-secret", "sk-unknown"} {
		var log headerLog
		up := newUpstream(t, log.wrap(sseUpstream(chunkA, chunkEnd, done)))
		id := tenantKeys()
		id.UnknownTier = "free"
		p, _, _ := newTestProxy(t, Config{Identifier: id}, up)
		r := post(`{"model":"m","stream":true}`)
		r.Header.Set("Authorization", "Bearer "+key)
		r.Header.Set("X-Api-Key", key)
		if w := httptest.NewRecorder(); p.ServeHTTP(w, r) != nil && w.Code != 200 {
			t.Fatalf("%s: status %d", key, w.Code)
		}
		h, _ := log.last(t)
		for _, k := range credentialHeaders {
			if v, ok := h[k]; ok {
				t.Errorf("%s: upstream got %s %q", key, k, v)
			}
		}
	}
}

// TestForwardKeysKeepsTenantKeys: a pool that forwards keys gets the
// client's credential headers as sent.
func TestForwardKeysKeepsTenantKeys(t *testing.T) {
	for _, form := range credentialForms {
		var log headerLog
		up := newUpstream(t, log.wrap(sseUpstream(chunkA, chunkEnd, done)))
		p, _, _ := newTestProxy(t, Config{Identifier: tenantKeys(), Headers: Headers{ForwardKeys: true}}, up)
		r := post(`{"model":"m","stream":true}`)
		r.Header.Set(form.name, form.value)
		p.ServeHTTP(httptest.NewRecorder(), r)
		if h, _ := log.last(t); h.Get(form.name) != form.value {
			t.Errorf("%s: upstream got %q, want %q", form.name, h.Get(form.name), form.value)
		}
	}
}

// TestWithoutTenantsKeysAreForwarded: without an Identifier the gateway
// checks no key, and the client's credentials pass as before.
func TestWithoutTenantsKeysAreForwarded(t *testing.T) {
	var log headerLog
	up := newUpstream(t, log.wrap(sseUpstream(chunkA, chunkEnd, done)))
	p, _, _ := newTestProxy(t, Config{}, up)
	r := post(`{"model":"m","stream":true}`)
	for _, form := range credentialForms {
		r.Header.Set(form.name, form.value)
	}
	p.ServeHTTP(httptest.NewRecorder(), r)
	h, _ := log.last(t)
	for _, form := range credentialForms {
		if h.Get(form.name) != form.value {
			t.Errorf("upstream %s %q, want %q", form.name, h.Get(form.name), form.value)
		}
	}
}

// TestHeaderUpRunsAfterGatewayHeaders: header_up sees, and may replace,
// what the gateway set (X-Forwarded-For, the tenant header), and edits the
// outbound Host as Caddy's ApplyToRequest does.
func TestHeaderUpRunsAfterGatewayHeaders(t *testing.T) {
	var log headerLog
	up := newUpstream(t, log.wrap(sseUpstream(chunkA, chunkEnd, done)))
	var sawXFF, sawHost string
	edit := func(_ *http.Request, h http.Header) {
		sawXFF, sawHost = h.Get("X-Forwarded-For"), h.Get("Host")
		h.Set(HeaderTenant, "renamed")
		h.Set("Host", "api.example.com")
	}
	p, _, _ := newTestProxy(t, Config{Identifier: tenantKeys(), Headers: Headers{Request: edit}}, up)
	r := post(`{"model":"m","stream":true}`)
	r.Host = "gateway.local"
	r.Header.Set("Authorization", "Bearer sk-secret")
	p.ServeHTTP(httptest.NewRecorder(), r)
	h, host := log.last(t)
	if sawXFF != "192.0.2.1" || sawHost != "gateway.local" {
		t.Errorf("header_up saw X-Forwarded-For %q, Host %q; want the gateway's 192.0.2.1 and the client's host", sawXFF, sawHost)
	}
	if h.Get(HeaderTenant) != "renamed" || host != "api.example.com" {
		t.Errorf("upstream tenant %q, Host %q; want header_up's renamed, api.example.com", h.Get(HeaderTenant), host)
	}
}

// TestHeaderUpDeletingHostSendsDialAddress: header_up -Host leaves the
// Host empty, and the request then names the upstream's dial address.
func TestHeaderUpDeletingHostSendsDialAddress(t *testing.T) {
	var log headerLog
	up := newUpstream(t, log.wrap(sseUpstream(chunkA, chunkEnd, done)))
	p, _, _ := newTestProxy(t, Config{Headers: Headers{Request: func(_ *http.Request, h http.Header) { h.Del("Host") }}}, up)
	r := post(`{"model":"m","stream":true}`)
	r.Host = "gateway.local"
	p.ServeHTTP(httptest.NewRecorder(), r)
	if _, host := log.last(t); host != up.addr() {
		t.Errorf("upstream Host %q, want the dial address %s", host, up.addr())
	}
}

// TestFallbackPoolSendsItsOwnCredentials: the primary's header_up goes to
// the primary only; the fallback's upstream gets the fallback's key, and
// the fallback's header_down shapes the answer it commits.
func TestFallbackPoolSendsItsOwnCredentials(t *testing.T) {
	var pl, fl headerLog
	primary := newUpstream(t, pl.wrap(failing(503)))
	small := newUpstream(t, fl.wrap(sseUpstream(chunkA, chunkEnd, done)))
	down := func(tag string) func(*http.Request, int, http.Header) {
		return func(_ *http.Request, _ int, h http.Header) { h.Set("X-Pool", tag) }
	}
	p, _ := fallbackProxy(t, Config{MaxAttempts: 1, Identifier: tenantKeys(), Headers: Headers{
		Request: setHeader("Authorization", "Bearer sk-vllm", "X-Primary", "1"), Response: down("primary")}},
		Fallback{Pool: Pool{Headers: Headers{Request: setHeader("X-Api-Key", "sk-hosted", "Anthropic-Version", "2023-06-01"),
			Response: down("small")}}},
		[]*upstream{primary}, small)
	r := post(`{"model":"m","stream":true}`)
	r.Header.Set("Authorization", "Bearer sk-secret")
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, r)
	if w.Code != 200 || res.Fallback != "small" {
		t.Fatalf("status %d, fallback %q", w.Code, res.Fallback)
	}
	ph, _ := pl.last(t)
	if ph.Get("Authorization") != "Bearer sk-vllm" || ph.Get("X-Api-Key") != "" {
		t.Errorf("primary got Authorization %q, X-Api-Key %q", ph.Get("Authorization"), ph.Get("X-Api-Key"))
	}
	fh, _ := fl.last(t)
	if _, ok := fh["Authorization"]; ok || fh.Get("X-Primary") != "" {
		t.Errorf("fallback got the primary's or the tenant's headers: %v", fh)
	}
	if fh.Get("X-Api-Key") != "sk-hosted" || fh.Get("Anthropic-Version") != "2023-06-01" {
		t.Errorf("fallback got X-Api-Key %q, Anthropic-Version %q", fh.Get("X-Api-Key"), fh.Get("Anthropic-Version"))
	}
	if got := w.Header().Get("X-Pool"); got != "small" {
		t.Errorf("X-Pool %q: want the committing fallback's header_down", got)
	}
}

// headerWriter records the header as it was when the status was written,
// and signals each body write.
type headerWriter struct {
	*httptest.ResponseRecorder
	mu     sync.Mutex
	atHead http.Header
	writes chan string
}

func (w *headerWriter) WriteHeader(c int) {
	w.mu.Lock()
	w.atHead = w.ResponseRecorder.Header().Clone()
	w.mu.Unlock()
	w.ResponseRecorder.WriteHeader(c)
}

func (w *headerWriter) Write(b []byte) (int, error) {
	n, err := w.ResponseRecorder.Write(b)
	w.writes <- string(b)
	return n, err
}

// TestHeaderDownEditsStreamWithoutHoldingEvents: header_down sets and
// removes response headers of a stream (its own edits after the
// gateway's), and the first event still reaches the client while the
// upstream holds the second.
func TestHeaderDownEditsStreamWithoutHoldingEvents(t *testing.T) {
	release := make(chan struct{})
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("X-Upstream-Secret", "internal")
		_, _ = w.Write([]byte(chunkA))
		w.(http.Flusher).Flush()
		<-release
		_, _ = w.Write([]byte(chunkEnd + done))
	})
	var calls int
	down := func(_ *http.Request, status int, h http.Header) {
		calls++
		if status == 200 && h.Get("X-Accel-Buffering") == "no" {
			h.Set("X-Served-By", "gateway")
		}
		h.Del("X-Upstream-Secret")
	}
	p, _, _ := newTestProxy(t, Config{Headers: Headers{Response: down}}, up)
	w := &headerWriter{ResponseRecorder: httptest.NewRecorder(), writes: make(chan string, 16)}
	served := make(chan *Result, 1)
	go func() { served <- p.ServeHTTP(w, post(`{"model":"m","stream":true}`)) }()
	select {
	case got := <-w.writes:
		if got != chunkA {
			t.Fatalf("first write %q, want the first event", got)
		}
	case <-time.After(5 * time.Second):
		close(release)
		t.Fatal("the first event did not reach the client while the upstream held the second")
	}
	w.mu.Lock()
	h := w.atHead
	w.mu.Unlock()
	if h.Get("X-Served-By") != "gateway" || h.Get("X-Upstream-Secret") != "" {
		t.Errorf("headers at commit %v: want X-Served-By set and X-Upstream-Secret removed", h)
	}
	close(release)
	if res := result(t, served); res.Outcome != OutcomeSuccess || calls != 1 {
		t.Fatalf("outcome %v, header_down ran %d times", res.Outcome, calls)
	}
}

// TestHeaderDownOnJSONResponse: a non-streamed answer passes header_down
// too, with the upstream's status.
func TestHeaderDownOnJSONResponse(t *testing.T) {
	up := newUpstream(t, failing(400))
	var got int
	p, _, _ := newTestProxy(t, Config{Headers: Headers{Response: func(_ *http.Request, status int, h http.Header) {
		got = status
		h.Set("X-Down", "1")
	}}}, up)
	w := httptest.NewRecorder()
	p.ServeHTTP(w, post(`{"model":"m"}`))
	if w.Code != 400 || got != 400 || w.Header().Get("X-Down") != "1" {
		t.Fatalf("status %d, header_down saw %d, X-Down %q", w.Code, got, w.Header().Get("X-Down"))
	}
}

// TestHeaderUpOncePerPoolWithRetries: the edit runs once per request and
// pool however many attempts share it.
func TestHeaderUpOncePerPoolWithRetries(t *testing.T) {
	var log headerLog
	bad := newUpstream(t, log.wrap(failing(503)))
	good := newUpstream(t, log.wrap(sseUpstream(chunkA, chunkEnd, done)))
	calls := 0
	p, _, _ := newTestProxy(t, Config{Headers: Headers{Request: func(_ *http.Request, h http.Header) {
		calls++
		h.Set("Authorization", "Bearer sk-operator")
	}}}, bad, good)
	w := httptest.NewRecorder()
	if res := p.ServeHTTP(w, post(`{"model":"m","stream":true}`)); res.Attempts != 2 || w.Code != 200 {
		t.Fatalf("attempts %d, status %d", res.Attempts, w.Code)
	}
	for i, h := range log.seen {
		if h.Get("Authorization") != "Bearer sk-operator" {
			t.Errorf("attempt %d: Authorization %q", i, h.Get("Authorization"))
		}
	}
	if calls != 1 {
		t.Errorf("header_up ran %d times, want once", calls)
	}
}

// TestModelsListSendsEachPoolsHeaderUp: the gateway's own GET /v1/models
// to each pool carries that pool's header_up (a key-protected vLLM
// answers it), never the caller's key.
func TestModelsListSendsEachPoolsHeaderUp(t *testing.T) {
	keyed := func(want string) *upstream {
		return newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Authorization") != want {
				http.Error(w, "bad key", http.StatusUnauthorized)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"object":"list","data":[{"id":"m-` + r.Host + `"}]}`))
		})
	}
	primary, hosted := keyed("Bearer sk-vllm"), keyed("Bearer sk-hosted")
	m := &Models{Sources: []ModelSource{
		{Name: "primary", Balancer: &listBalancer{addrs: []string{primary.addr()}}, Header: setHeader("Authorization", "Bearer sk-vllm")},
		{Name: "hosted", Balancer: &listBalancer{addrs: []string{hosted.addr()}},
			Header: setHeader("Authorization", "Bearer sk-hosted", "Host", "api.example.com")},
	}, Transport: schemeTransport{http.DefaultTransport}}
	r := httptest.NewRequest("GET", "/v1/models", nil)
	r.Header.Set("Authorization", "Bearer sk-tenant")
	w := httptest.NewRecorder()
	m.ServeHTTP(w, r, nil)
	body := w.Body.String()
	if w.Code != 200 || !strings.Contains(body, `"m-`+primary.addr()+`"`) || !strings.Contains(body, `"m-api.example.com"`) {
		t.Fatalf("status %d body %s: want both pools listed, the hosted one asked with its Host", w.Code, body)
	}
}

// TestUpstreamRefusingOperatorKeyIsNotTenantsFault: with tenants, the
// upstream never sees the tenant's key, so its 401 or 403 (the operator's
// key wrong or rotated) is not the tenant's fault: its tenant breaker must
// not count it, or every tenant is locked out by the operator's mistake.
// When the pool forwards the tenant's key, the upstream judged that key,
// and the 401 stays the tenant's.
func TestUpstreamRefusingOperatorKeyIsNotTenantsFault(t *testing.T) {
	for _, tc := range []struct {
		status  int
		forward bool
		fault   bool
	}{
		{http.StatusUnauthorized, false, false},
		{http.StatusForbidden, false, false},
		{http.StatusUnauthorized, true, true},
		{http.StatusBadRequest, false, true},
	} {
		up := newUpstream(t, func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(tc.status)
			_, _ = w.Write([]byte(`{"error":"Unauthorized"}`))
		})
		p, _, _ := newTestProxy(t, Config{Identifier: tenantKeys(),
			Headers: Headers{Request: setHeader("Authorization", "Bearer sk-stale"), ForwardKeys: tc.forward}}, up)
		r := post(`{"model":"m","stream":true}`)
		r.Header.Set("Authorization", "Bearer sk-secret")
		w := httptest.NewRecorder()
		res := p.ServeHTTP(w, r)
		if w.Code != tc.status {
			t.Errorf("%d forward %v: status %d, want the upstream's passed through", tc.status, tc.forward, w.Code)
		}
		if res.TenantFault != tc.fault {
			t.Errorf("%d forward %v: tenant fault %v, want %v", tc.status, tc.forward, res.TenantFault, tc.fault)
		}
	}
}
