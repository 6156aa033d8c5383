package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// admObserver records what admission reports: settled tokens, and queue
// depth changes (queued is signalled when a request starts to wait).
type admObserver struct {
	mu     sync.Mutex
	tokens []string // "tenant kind source n"
	queued chan string
}

func newAdmObserver() *admObserver { return &admObserver{queued: make(chan string, 16)} }

func (o *admObserver) Decision(string, string, string)                  {}
func (o *admObserver) QueueWait(string, string, time.Duration)          {}
func (o *admObserver) Inflight(string, int)                             {}
func (o *admObserver) TenantBreaker(string, string, breaker.Transition) {}
func (o *admObserver) QueueDepth(tier string, n int) {
	if n > 0 {
		select {
		case o.queued <- tier:
		default:
		}
	}
}
func (o *admObserver) Tokens(tenant, _, _, kind, source string, n int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.tokens = append(o.tokens, tenant+" "+kind+" "+source+" "+itoa(n))
}
func (o *admObserver) settled() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return strings.Join(o.tokens, ", ")
}

// waitQueued waits until a request of some tier waits in the gate.
func (o *admObserver) waitQueued(t *testing.T) {
	t.Helper()
	select {
	case <-o.queued:
	case <-time.After(5 * time.Second):
		t.Fatal("no request was queued")
	}
}

var tenantConfig = admission.Config{
	Tiers: []admission.Tier{
		{Name: "gold", Priority: 1, RPM: 3, TPM: 10000, QueueTimeout: 5 * time.Second},
		{Name: "batch", Priority: -1, RPM: 1},
		{Name: "free"},
	},
	Tenants: []admission.TenantConfig{{ID: "a", Tier: "gold"}, {ID: "b", Tier: "batch"}, {ID: "c", Tier: "free"}},
}

// tenancy is a controller, an optional gate and the identifier and
// admitter over them, on one fake clock.
type tenancy struct {
	clk   *clocktest.Fake
	obs   *admObserver
	c     *admission.Controller
	g     *admission.Gate
	ident *KeyIdentifier
	adm   *TenantAdmitter
}

func newTenancy(t *testing.T, capacity int) *tenancy {
	t.Helper()
	return tenancyOf(t, tenantConfig, capacity)
}

// proxy returns a lifecycle over the tenancy, its admitter wrapped by wrap.
func (tn *tenancy) proxy(t *testing.T, cfg Config, ups ...*upstream) (*Proxy, *recordingObserver) {
	cfg.Identifier, cfg.Admitter, cfg.RequestUsage = tn.ident, tn.adm, true
	if cfg.Clock == nil {
		cfg.Clock = tn.clk
	}
	p, _, obs := newTestProxy(t, cfg, ups...)
	return p, obs
}

func (tn *tenancy) view(t *testing.T, tenant string) admission.TenantView {
	t.Helper()
	for _, v := range tn.c.Tenants() {
		if v.Tenant == tenant {
			return v
		}
	}
	return admission.TenantView{Tenant: tenant}
}

func tenantPost(key, body string) *http.Request {
	r := post(body)
	r.Header.Set("Authorization", "Bearer "+key)
	return r
}

func TestRefusalMapping(t *testing.T) {
	lim := admission.Limits{
		Requests: &admission.Limit{Limit: 60, Remaining: -2, Reset: 1500 * time.Millisecond},
		Tokens:   &admission.Limit{Limit: 1000, Remaining: 10, Reset: 5*time.Minute + 59*time.Second + time.Millisecond},
	}
	cases := []struct {
		name       string
		r          admission.Refusal
		status     int
		typ        string
		retryAfter string
		breaker    string
	}{
		{"rpm", admission.Refusal{Status: 429, Code: "tenant_rpm", Message: "rpm 60 per minute", RetryAfter: 1200 * time.Millisecond, Limits: lim},
			429, TypeRateLimit, "2", ""},
		{"never fits", admission.Refusal{Status: 429, Code: "request_exceeds_limit", Message: "larger than tpm", Limits: lim},
			429, TypeRateLimit, "", ""},
		{"open tenant breaker", admission.Refusal{Status: 429, Code: "tenant_circuit_open", Message: "open", RetryAfter: 30 * time.Second, CircuitOpen: true, Limits: lim},
			429, TypeRateLimit, "30", "open"},
		{"no capacity can serve", admission.Refusal{Status: 503, Code: "saturated", Message: "none", RetryAfter: time.Second},
			503, TypeServer, "1", ""},
		{"no tier", admission.Refusal{Status: 401, Code: "invalid_api_key", Message: "tenant x: no tier"},
			401, TypeInvalidRequest, "", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ge, ok := refusalError(&tc.r, tc.r.Limits, 0).(*GatewayError)
			if !ok {
				t.Fatal("not a *GatewayError")
			}
			w := httptest.NewRecorder()
			ge.Write(w)
			h := w.Header()
			if w.Code != tc.status || h.Get("Retry-After") != tc.retryAfter || h.Get("X-Circuit-Breaker") != tc.breaker {
				t.Fatalf("code %d headers %v", w.Code, h)
			}
			if !strings.Contains(w.Body.String(), `"type":"`+tc.typ+`"`) || !strings.Contains(w.Body.String(), `"code":"`+tc.r.Code+`"`) ||
				!strings.Contains(w.Body.String(), `"message":"`+tc.r.Message+`"`) {
				t.Fatalf("body %s", w.Body)
			}
			if tc.r.Limits.Requests == nil {
				for k := range h {
					if strings.HasPrefix(strings.ToLower(k), "x-ratelimit") {
						t.Fatalf("%s set for a tenant without limits", k)
					}
				}
				return
			}
			want := map[string]string{
				"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "2s",
				"x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "10", "x-ratelimit-reset-tokens": "6m0s",
			}
			for k, v := range want {
				if got := h.Get(k); got != v {
					t.Errorf("%s = %q, want %q", k, got, v)
				}
			}
		})
	}
}

// Every response to a tenant with limits carries its x-ratelimit-* headers,
// this request counted: the committed response, an upstream error passed
// through, the gateway's own errors and its 429s. A tenant without limits
// gets none.
func TestRateLimitHeadersOnEveryResponse(t *testing.T) {
	tn := newTenancy(t, 0)
	var status atomic.Int64
	status.Store(200)
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		// The shared account's own figures, which no tenant may see.
		w.Header().Set("X-Ratelimit-Limit-Requests", "999999")
		w.Header().Set("X-Ratelimit-Remaining-Tokens", "123456")
		if code := int(status.Load()); code != 200 {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(code)
			_, _ = io.WriteString(w, `{"error":{"message":"no"}}`)
			return
		}
		sseUpstream(chunkA, chunkEnd, done)(w, r)
	})
	p, _ := tn.proxy(t, Config{MaxAttempts: 1}, up)
	const body = `{"stream":true,"max_tokens":100,"messages":[{"role":"user","content":"abcd"}]}` // reserves 1 + 100
	steps := []struct {
		name                 string
		upstream, code       int
		remReq, remTok, rate string
	}{
		// 10000 - 101 reserved
		{"committed stream", 200, 200, "2", "9899", ""},
		// - 3 settled (estimate: 1 prompt + 2 content events) - 101 reserved
		{"upstream 400 passed through", 400, 400, "1", "9896", ""},
		// the 400 settled 0
		{"gateway 502", 500, 500, "0", "9896", ""},
		// nothing reserved: what is left, untouched
		{"tenant rpm 429", 200, 429, "0", "9997", "tenant_rpm"},
	}
	for _, s := range steps {
		status.Store(int64(s.upstream))
		w := httptest.NewRecorder()
		res := p.ServeHTTP(w, tenantPost("sk-a", body))
		h := w.Header()
		if w.Code != s.code {
			t.Fatalf("%s: code %d, body %s", s.name, w.Code, w.Body)
		}
		if h.Get("X-Ratelimit-Limit-Requests") != "3" || h.Get("X-Ratelimit-Remaining-Requests") != s.remReq ||
			h.Get("X-Ratelimit-Limit-Tokens") != "10000" || h.Get("X-Ratelimit-Remaining-Tokens") != s.remTok {
			t.Fatalf("%s: headers %v", s.name, h)
		}
		for _, k := range []string{"X-Ratelimit-Reset-Requests", "X-Ratelimit-Reset-Tokens"} {
			d, err := time.ParseDuration(h.Get(k))
			if err != nil || d%time.Second != 0 || d < 0 || d > time.Minute {
				t.Fatalf("%s: %s = %q, want whole seconds within the minute", s.name, k, h.Get(k))
			}
		}
		if s.rate != "" && (!strings.Contains(w.Body.String(), `"code":"`+s.rate+`"`) || h.Get("Retry-After") == "" || res.Outcome != OutcomeRefused) {
			t.Fatalf("%s: headers %v body %s", s.name, h, w.Body)
		}
	}
	if up.calls.Load() != 3 {
		t.Fatalf("upstream called %d times, want 3 (the 429 never reaches it)", up.calls.Load())
	}
	status.Store(200)
	w := httptest.NewRecorder()
	p.ServeHTTP(w, tenantPost("sk-c", body))
	for k := range w.Header() {
		if strings.HasPrefix(k, "X-Ratelimit") {
			t.Fatalf("tenant without limits got %s: %v", k, w.Header())
		}
	}
}

// A request larger than the whole token limit is refused without
// Retry-After (waiting cannot help), and its headers show the untouched
// remaining value.
func TestRequestThatCanNeverFit(t *testing.T) {
	tn := newTenancy(t, 0)
	up := newUpstream(t, sseUpstream(chunkA, done))
	p, _ := tn.proxy(t, Config{}, up)
	w := httptest.NewRecorder()
	p.ServeHTTP(w, tenantPost("sk-a", `{"max_completion_tokens":20000}`))
	h := w.Header()
	if w.Code != 429 || h.Get("Retry-After") != "" || !strings.Contains(w.Body.String(), `"code":"request_exceeds_limit"`) ||
		h.Get("X-Ratelimit-Remaining-Tokens") != "10000" || up.calls.Load() != 0 {
		t.Fatalf("code %d headers %v body %s", w.Code, h, w.Body)
	}
}

// A request the gate refuses gives back its reservation at once: it
// consumes nothing, and the tenant's next request is admitted.
func TestGateRefusalConsumesNothing(t *testing.T) {
	tn := newTenancy(t, 1)
	held, err := tn.adm.Admit(context.Background(), Identity{Tenant: "a", Tier: "gold"}, RequestInfo{N: 1})
	if err != nil {
		t.Fatal(err)
	}
	// b's tier is sheddable: refused at once while the pool is full.
	_, err = tn.adm.Admit(context.Background(), Identity{Tenant: "b", Tier: "batch"}, RequestInfo{N: 1, PromptTokens: 10})
	ge, ok := errors.AsType[*GatewayError](err)
	if !ok || ge.Status != 429 || ge.Code != admission.CodeSaturated || ge.RetryAfter != 1 {
		t.Fatalf("error %v, want 429 saturated", err)
	}
	// The headers show b's rpm untouched by the refused request.
	if ge.Header.Get("X-Ratelimit-Remaining-Requests") != "1" || ge.Header.Get("X-Ratelimit-Limit-Requests") != "1" {
		t.Fatalf("refusal headers %v", ge.Header)
	}
	if v := tn.view(t, "b"); v.Inflight != 0 || v.RequestsInWindow != 0 || v.TokensInWindow != 0 {
		t.Fatalf("the refused request holds %+v", v)
	}
	held.Release(&Result{})
	adm, err := tn.adm.Admit(context.Background(), Identity{Tenant: "b", Tier: "batch"}, RequestInfo{N: 1})
	if err != nil {
		t.Fatalf("b's only request of the minute refused after the pool freed: %v", err)
	}
	adm.Release(&Result{})
	if v := tn.view(t, "a"); v.Inflight != 0 {
		t.Fatalf("a still holds %+v", v)
	}
}

// A client that leaves the queue leaves at once, with its reservation
// given back, and the request ends as client gone.
func TestClientLeavingTheQueueCancelsItsReservation(t *testing.T) {
	tn := newTenancy(t, 1)
	up := newUpstream(t, sseUpstream(chunkA, done))
	p, _ := tn.proxy(t, Config{}, up)
	held, err := tn.adm.Admit(context.Background(), Identity{Tenant: "c", Tier: "free"}, RequestInfo{N: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release(&Result{})
	ctx, cancel := context.WithCancel(context.Background())
	served := serve(p, httptest.NewRecorder(), tenantPost("sk-a", `{"max_tokens":10}`).WithContext(ctx))
	tn.obs.waitQueued(t)
	if v := tn.view(t, "a"); v.Queued != 1 || v.RequestsInWindow != 1 {
		t.Fatalf("queued request: %+v", v)
	}
	cancel()
	res := result(t, served)
	if res.Outcome != OutcomeClientGone || res.Status != 499 || up.calls.Load() != 0 {
		t.Fatalf("outcome %v status %d upstream calls %d", res.Outcome, res.Status, up.calls.Load())
	}
	if v := tn.view(t, "a"); v.Queued != 0 || v.Inflight != 0 || v.RequestsInWindow != 0 || v.TokensInWindow != 0 {
		t.Fatalf("the request that left holds %+v", v)
	}
	if s := tn.obs.settled(); s != "" {
		t.Fatalf("a cancelled request reported tokens: %s", s)
	}
}

// The queue's wait is measured and reported, both for a request that is
// admitted after waiting and for one refused at its queue_timeout.
func TestQueueWaitIsReported(t *testing.T) {
	tn := newTenancy(t, 1)
	up := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	p, _ := tn.proxy(t, Config{}, up)
	held, err := tn.adm.Admit(context.Background(), Identity{Tenant: "c", Tier: "free"}, RequestInfo{N: 1})
	if err != nil {
		t.Fatal(err)
	}

	served := serve(p, httptest.NewRecorder(), tenantPost("sk-a", `{"stream":true}`))
	tn.obs.waitQueued(t)
	tn.clk.Advance(2 * time.Second)
	held.Release(&Result{})
	if res := result(t, served); res.Outcome != OutcomeSuccess || res.QueueWait != 2*time.Second {
		t.Fatalf("outcome %v queue wait %v, want success after 2s", res.Outcome, res.QueueWait)
	}

	held, err = tn.adm.Admit(context.Background(), Identity{Tenant: "c", Tier: "free"}, RequestInfo{N: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release(&Result{})
	w := httptest.NewRecorder()
	served = serve(p, w, tenantPost("sk-a", `{"stream":true}`))
	tn.obs.waitQueued(t)
	tn.clk.Advance(5 * time.Second) // gold's queue_timeout
	res := result(t, served)
	if w.Code != 429 || !strings.Contains(w.Body.String(), `"code":"queue_timeout"`) || res.QueueWait != 5*time.Second ||
		w.Header().Get("Retry-After") != "1" || w.Header().Get("X-Ratelimit-Limit-Requests") != "3" {
		t.Fatalf("code %d queue wait %v headers %v body %s", w.Code, res.QueueWait, w.Header(), w.Body)
	}
	if v := tn.view(t, "a"); v.Inflight != 0 || v.RequestsInWindow != 1 {
		t.Fatalf("after the timeout a holds %+v (only the first request counts)", v)
	}
}

// countingAdmitter counts Release calls of the admissions it hands out.
type countingAdmitter struct {
	inner    Admitter
	released atomic.Int64
}

func (c *countingAdmitter) Admit(ctx context.Context, id Identity, info RequestInfo) (Admission, error) {
	adm, err := c.inner.Admit(ctx, id, info)
	if adm == nil || err != nil {
		return adm, err
	}
	return admissionFunc(func(res *Result) { c.released.Add(1); adm.Release(res) }), nil
}

// The admission is released exactly once on every path, and settles what
// the request used: the upstream's usage, else (once committed) the prompt
// estimate plus the content events relayed, else nothing.
func TestAdmissionSettledOnceOnEveryPath(t *testing.T) {
	const body = `{"stream":true,"messages":[{"role":"user","content":"abcdefgh"}]}` // prompt estimate 2
	cases := []struct {
		name    string
		handler func(w http.ResponseWriter, r *http.Request)
		cfg     func(*Config, *clocktest.Fake)
		drive   func(*testing.T, *clocktest.Fake)
		client  func(*http.Request) (http.ResponseWriter, *http.Request)
		outcome Outcome
		settled string
	}{
		{name: "normal end with usage", handler: sseUpstream(chunkA, chunkEnd, usageOnly, done),
			outcome: OutcomeSuccess, settled: "a prompt usage 11, a completion usage 7"},
		{name: "normal end without usage", handler: sseUpstream(chunkA, chunkB, chunkEnd, done),
			outcome: OutcomeSuccess, settled: "a prompt estimate 2, a completion estimate 3"},
		{name: "client gone after commit", handler: func(w http.ResponseWriter, r *http.Request) {
			sseUpstream(chunkA)(w, r)
			<-r.Context().Done()
		}, client: func(r *http.Request) (http.ResponseWriter, *http.Request) {
			ctx, cancel := context.WithCancel(r.Context())
			return &cancelOnWrite{ResponseRecorder: httptest.NewRecorder(), cancel: cancel}, r.WithContext(ctx)
		}, outcome: OutcomeClientGone, settled: "a prompt estimate 2, a completion estimate 1"},
		{name: "upstream error before commit", handler: func(w http.ResponseWriter, r *http.Request) { http.Error(w, "down", 503) },
			outcome: OutcomeUpstreamError, settled: ""},
		{name: "upstream error after commit", handler: sseUpstream(chunkA, chunkB),
			outcome: OutcomeTruncated, settled: "a prompt estimate 2, a completion estimate 2"},
		{name: "first-byte timeout", handler: func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() },
			cfg: func(c *Config, _ *clocktest.Fake) { c.FirstByteTimeout = time.Second },
			drive: func(t *testing.T, clk *clocktest.Fake) {
				clk.WaitTimer(t, time.Second)
				clk.Advance(time.Second)
			}, outcome: OutcomeTimeout, settled: ""},
		{name: "panic after commit", handler: sseUpstream(chunkA, chunkB, chunkEnd, done),
			cfg: func(c *Config, _ *clocktest.Fake) { c.Observer = panicObserver{} },
			// The observer panics as the first event goes out, before it is counted.
			outcome: OutcomeInternalError, settled: "a prompt estimate 2"},
		{name: "panic before commit", handler: sseUpstream(chunkA, done),
			cfg: func(c *Config, _ *clocktest.Fake) {
				c.Balancer = balancerFunc(func(PickRequest) (Upstream, error) { panic("balancer bug") })
			}, outcome: OutcomeInternalError, settled: ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tn := newTenancy(t, 1)
			up := newUpstream(t, tc.handler)
			counting := &countingAdmitter{inner: tn.adm}
			cfg := Config{Identifier: tn.ident, Admitter: counting, RequestUsage: true, Clock: tn.clk, MaxAttempts: 1,
				Transport: schemeTransport{http.DefaultTransport}, Balancer: &listBalancer{addrs: []string{up.addr()}}}
			var results atomic.Pointer[Result]
			cfg.Observer = resultObserver{&results}
			if tc.cfg != nil {
				tc.cfg(&cfg, tn.clk)
			}
			p, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			var w http.ResponseWriter = httptest.NewRecorder()
			r := tenantPost("sk-a", body)
			if tc.client != nil {
				w, r = tc.client(r)
			}
			done := make(chan *Result, 1)
			go func() {
				defer func() {
					if v := recover(); v != nil {
						done <- nil
					}
				}()
				done <- p.ServeHTTP(w, r)
			}()
			if tc.drive != nil {
				tc.drive(t, tn.clk)
			}
			res := <-done
			if res == nil { // it panicked: the Result went to the observer... unless the observer panicked
				res = results.Load()
			}
			if n := counting.released.Load(); n != 1 {
				t.Fatalf("released %d times, want 1", n)
			}
			if res != nil && res.Outcome != tc.outcome {
				t.Fatalf("outcome %v, want %v", res.Outcome, tc.outcome)
			}
			if got := tn.obs.settled(); got != tc.settled {
				t.Fatalf("settled %q, want %q", got, tc.settled)
			}
			if v := tn.view(t, "a"); v.Inflight != 0 || tn.g.Saturated() {
				t.Fatalf("slots still held: %+v, pool saturated %v", v, tn.g.Saturated())
			}
		})
	}
}

// resultObserver keeps the last Result reported.
type resultObserver struct{ last *atomic.Pointer[Result] }

func (resultObserver) AttemptDone(*AttemptReport)   {}
func (resultObserver) EventRelayed()                {}
func (resultObserver) Retry(string, AttemptOutcome) {}
func (resultObserver) RetryBudgetExhausted()        {}
func (resultObserver) Hedge(string)                 {}
func (resultObserver) StaleConnection(string)       {}
func (o resultObserver) RequestDone(r *Result)      { o.last.Store(r) }

func TestVerdict(t *testing.T) {
	cases := []struct {
		res  Result
		want admission.Verdict
	}{
		{Result{Outcome: OutcomeSuccess}, admission.VerdictSuccess},
		{Result{Outcome: OutcomeClientError, TenantFault: true}, admission.VerdictFailure},
		{Result{Outcome: OutcomeClientError}, admission.VerdictNeutral}, // e.g. an upstream 409
		{Result{Outcome: OutcomeUpstreamError}, admission.VerdictNeutral},
		{Result{Outcome: OutcomeRateLimited}, admission.VerdictNeutral},
		{Result{Outcome: OutcomeTimeout}, admission.VerdictNeutral},
		{Result{Outcome: OutcomeTruncated}, admission.VerdictNeutral},
		{Result{Outcome: OutcomeClientGone}, admission.VerdictNeutral},
		{Result{Outcome: OutcomeStreamTimeout}, admission.VerdictNeutral},
		{Result{Outcome: OutcomeInternalError}, admission.VerdictNeutral},
	}
	for _, tc := range cases {
		if got := verdict(&tc.res); got != tc.want {
			t.Errorf("verdict(%v, fault %v) = %v, want %v", tc.res.Outcome, tc.res.TenantFault, got, tc.want)
		}
	}
}

// TenantFault: the statuses of DESIGN §4's tenant column, and in-band 4xx
// errors before commit; not other 4xx, not 429.
func TestTenantFault(t *testing.T) {
	status := func(code int) func(http.ResponseWriter, *http.Request) {
		return func(w http.ResponseWriter, r *http.Request) { http.Error(w, `{"error":{}}`, code) }
	}
	inband := sseUpstream("data: {\"error\":{\"message\":\"context too long\",\"type\":\"BadRequestError\",\"code\":400}}\n\n")
	cases := []struct {
		name    string
		handler func(http.ResponseWriter, *http.Request)
		fault   bool
	}{
		{"400", status(400), true}, {"401", status(401), true}, {"403", status(403), true}, {"404", status(404), true},
		{"413", status(413), true}, {"422", status(422), true}, {"409", status(409), false}, {"405", status(405), false},
		{"429", status(429), false}, {"500", status(500), false}, {"in-band 400 before commit", inband, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			up := newUpstream(t, tc.handler)
			p, _, _ := newTestProxy(t, Config{MaxAttempts: 1}, up)
			if res := p.ServeHTTP(httptest.NewRecorder(), post(`{"stream":true}`)); res.TenantFault != tc.fault {
				t.Fatalf("TenantFault %v (outcome %v)", res.TenantFault, res.Outcome)
			}
		})
	}
}

// advancingTransport moves the clock by d during each round trip: the
// upstream takes d to answer.
type advancingTransport struct {
	rt  http.RoundTripper
	clk *clocktest.Fake
	d   time.Duration
}

func (a advancingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	a.clk.Advance(a.d)
	return a.rt.RoundTrip(r)
}

// AttemptTTFT is measured from the committed attempt's start, without the
// failed attempt before it.
func TestAttemptTTFTIsFromTheCommittedAttemptsStart(t *testing.T) {
	bad := newUpstream(t, func(w http.ResponseWriter, r *http.Request) { http.Error(w, "down", 503) })
	good := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	clk := clocktest.New(time.Time{})
	p, err := New(Config{Clock: clk, MaxAttempts: 2,
		Transport: advancingTransport{rt: schemeTransport{http.DefaultTransport}, clk: clk, d: 300 * time.Millisecond},
		Balancer:  &listBalancer{addrs: []string{bad.addr(), good.addr()}}})
	if err != nil {
		t.Fatal(err)
	}
	res := p.ServeHTTP(httptest.NewRecorder(), post(`{"stream":true}`))
	if res.Outcome != OutcomeSuccess || !res.Committed || res.AttemptTTFT != 300*time.Millisecond || res.TTFT != 600*time.Millisecond {
		t.Fatalf("outcome %v committed %v attempt TTFT %v TTFT %v", res.Outcome, res.Committed, res.AttemptTTFT, res.TTFT)
	}
}

func TestSettlement(t *testing.T) {
	cases := []struct {
		name      string
		res       Result
		p, c      int
		estimated bool
	}{
		{"usage reported", Result{Committed: true, ContentEvents: 9, Usage: Usage{PromptTokens: 5, CompletionTokens: 3, Reported: true}, Info: RequestInfo{PromptTokens: 50}}, 5, 3, false},
		{"stream without usage", Result{Committed: true, Streamed: true, ContentEvents: 9, Info: RequestInfo{PromptTokens: 50}}, 50, 9, true},
		// A whole body without usage used to settle 0 completion tokens,
		// however long the answer: a tpm hole.
		{"body without usage", Result{Committed: true, ResponseBytes: 16001, Info: RequestInfo{PromptTokens: 50}}, 50, 4001, true},
		{"failed before a token", Result{ContentEvents: 0, Info: RequestInfo{PromptTokens: 50}}, 0, 0, false},
	}
	for _, tc := range cases {
		p, c, est := tc.res.Settlement()
		if p != tc.p || c != tc.c || est != tc.estimated {
			t.Errorf("%s: Settlement = %d, %d, %v; want %d, %d, %v", tc.name, p, c, est, tc.p, tc.c, tc.estimated)
		}
	}
}

// appendSeconds formats a reset as time.Duration.String does.
func TestAppendSecondsFormatsAsDurationString(t *testing.T) {
	for _, d := range []time.Duration{0, time.Second, 59 * time.Second, time.Minute, 61 * time.Second, 6 * time.Minute,
		time.Hour, time.Hour + time.Second, 25*time.Hour + 59*time.Minute + 59*time.Second, 1500 * time.Millisecond, -time.Second} {
		if got, want := string(appendSeconds(nil, d)), d.String(); got != want {
			t.Errorf("appendSeconds(%v) = %q, want %q", d, got, want)
		}
	}
}
