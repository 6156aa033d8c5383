package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/api"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

func TestFallbackClamp(t *testing.T) {
	for _, tc := range []struct {
		name              string
		info              RequestInfo
		f                 Fallback
		wantMax           int
		wantSet, wantFits bool
	}{
		{"no bounds keep the client's", RequestInfo{MaxTokens: 64000, MaxTokensSet: true, PromptTokens: 10},
			Fallback{}, 64000, false, true},
		{"max_output_tokens clamps", RequestInfo{MaxTokens: 64000, MaxTokensSet: true, PromptTokens: 10},
			Fallback{MaxOutputTokens: 4096}, 4096, true, true},
		{"within the bound stays", RequestInfo{MaxTokens: 100, MaxTokensSet: true, PromptTokens: 10},
			Fallback{MaxOutputTokens: 4096, ContextWindow: 8192}, 100, false, true},
		{"context window minus prompt is tighter", RequestInfo{MaxTokens: 64000, MaxTokensSet: true, PromptTokens: 6000},
			Fallback{MaxOutputTokens: 4096, ContextWindow: 8192}, 2192, true, true},
		{"absent max_tokens is set to the bound", RequestInfo{PromptTokens: 10},
			Fallback{MaxOutputTokens: 4096}, 4096, true, true},
		{"absent max_tokens without bounds stays absent", RequestInfo{PromptTokens: 10},
			Fallback{Model: "small"}, 0, false, true},
		{"prompt larger than the window is skipped", RequestInfo{MaxTokens: 10, MaxTokensSet: true, PromptTokens: 9000},
			Fallback{ContextWindow: 8192}, 0, false, false},
		{"prompt filling the window exactly is skipped", RequestInfo{PromptTokens: 8192},
			Fallback{ContextWindow: 8192}, 0, false, false},
		{"one token of room", RequestInfo{PromptTokens: 8191, MaxTokens: 50, MaxTokensSet: true},
			Fallback{ContextWindow: 8192}, 1, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, set, fits := tc.f.Clamp(tc.info)
			if m != tc.wantMax || set != tc.wantSet || fits != tc.wantFits {
				t.Fatalf("Clamp = %d, %v, %v; want %d, %v, %v", m, set, fits, tc.wantMax, tc.wantSet, tc.wantFits)
			}
		})
	}
}

func TestRewriteBodyTouchesOnlyModelAndMaxTokens(t *testing.T) {
	for _, tc := range []struct {
		name, in, model string
		max             int
		set             bool
		want            string
	}{
		{"model and max_tokens", `{"model":"big", "stream":true,"max_tokens":64000,"messages":[{"role":"user","content":"hi"}]}` + "\n",
			"small", 4096, true, `{"model":"small", "stream":true,"max_tokens":4096,"messages":[{"role":"user","content":"hi"}]}` + "\n"},
		{"max_completion_tokens keeps its name", `{"model":"big","max_completion_tokens":9000}`,
			"", 100, true, `{"model":"big","max_completion_tokens":100}`},
		{"both are clamped", `{"max_tokens":9000,"max_completion_tokens":9000,"model":"big"}`,
			"s", 7, true, `{"max_tokens":7,"max_completion_tokens":7,"model":"s"}`},
		{"absent is added as max_tokens", `{"model":"big","stream":false}`,
			"", 4096, true, `{"model":"big","stream":false,"max_tokens":4096}`},
		{"null is replaced as absent", `{"model":"big","max_tokens":null}`,
			"", 5, true, `{"model":"big","max_tokens":5}`},
		{"model only", `{"model":"big","max_tokens":3}`, "small", 0, false, `{"model":"small","max_tokens":3}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, _, err := rewriteParsed([]byte(tc.in), api.Chat, tc.model, tc.max, tc.set)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != tc.want {
				t.Fatalf("got\n%s\nwant\n%s", got, tc.want)
			}
		})
	}
}

// TestRewriteBodySetsTheAPIsOutputLimit: the ladder clamps the field the
// request's API reads: Responses' max_output_tokens, Messages' max_tokens
// (a Responses request's max_tokens is not its limit and stays as sent);
// a path without stream semantics is not clamped.
func TestRewriteBodySetsTheAPIsOutputLimit(t *testing.T) {
	for _, tc := range []struct {
		name string
		a    api.API
		in   string
		want string
	}{
		{"responses", api.Responses, `{"model":"big","max_output_tokens":9000,"input":"hi"}`,
			`{"model":"small","max_output_tokens":100,"input":"hi"}`},
		{"responses absent is added", api.Responses, `{"model":"big","max_tokens":9000,"input":"hi"}`,
			`{"model":"small","max_tokens":9000,"input":"hi","max_output_tokens":100}`},
		{"messages", api.Messages, `{"model":"big","max_tokens":9000,"messages":[]}`,
			`{"model":"small","max_tokens":100,"messages":[]}`},
		{"completions", api.Completions, `{"model":"big","max_completion_tokens":9000,"prompt":"x"}`,
			`{"model":"small","max_completion_tokens":9000,"prompt":"x","max_tokens":100}`},
		{"none", api.None, `{"model":"big","input":"x"}`, `{"model":"small","input":"x"}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, _, err := rewriteParsed([]byte(tc.in), tc.a, "small", 100, true)
			if err != nil || string(got) != tc.want {
				t.Fatalf("got %s (%v), want %s", got, err, tc.want)
			}
		})
	}
}

func TestFallbackEligibility(t *testing.T) {
	f := Fallback{Tiers: []string{"free", "batch"}}
	if !f.allows("free") || !f.allows("batch") || f.allows("gold") || f.allows("") {
		t.Fatal("tiers list not applied")
	}
	if !(&Fallback{}).allows("gold") {
		t.Fatal("an empty tiers list must allow every tier")
	}
	if (&Fallback{}).when() != WhenUnavailable {
		t.Fatal("default when must be unavailable")
	}
	x := &exchange{r: httptest.NewRequest("POST", "/", nil), ctx: context.Background()}
	for _, tc := range []struct {
		name string
		f    *failure
		want bool
	}{
		{"no upstream", &failure{pickErr: &UnavailableError{CircuitOpen: true}}, true},
		{"5xx spent", &failure{last: &attempt{outcome: AttemptHTTP5xx}}, true},
		{"upstream 429", &failure{last: &attempt{outcome: AttemptHTTP429}}, true},
		{"connect error", &failure{last: &attempt{outcome: AttemptConnectError}}, true},
		{"first byte timeout", &failure{last: &attempt{outcome: AttemptFirstByteTimeout}}, true},
		{"upstream 4xx is the request's", &failure{last: &attempt{outcome: AttemptHTTP4xx}}, false},
		{"in-band 4xx is the request's", &failure{last: &attempt{outcome: AttemptInbandError4xx}}, false},
		{"client gone", &failure{ctxErr: context.Canceled}, false},
		{"gateway panic", &failure{last: &attempt{outcome: AttemptInternalError}}, false},
	} {
		if got := x.degradable(tc.f); got != tc.want {
			t.Errorf("%s: degradable = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// fallbackProxy is a proxy whose primary pool is primary and whose one
// fallback, "small", is fb's upstreams with f's settings.
func fallbackProxy(t *testing.T, cfg Config, f Fallback, primary []*upstream, fb ...*upstream) (*Proxy, *recordingObserver) {
	t.Helper()
	b := &listBalancer{}
	for _, u := range fb {
		b.addrs = append(b.addrs, u.addr())
	}
	if f.Name == "" {
		f.Name = "small"
	}
	f.Balancer = b
	cfg.Fallbacks = append(cfg.Fallbacks, f)
	p, _, obs := newTestProxy(t, cfg, primary...)
	return p, obs
}

func failing(status int) func(http.ResponseWriter, *http.Request) {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = w.Write([]byte(`{"error":{"message":"down"}}`))
	}
}

func errorBodyOf(t *testing.T, w *httptest.ResponseRecorder) errorDetail {
	t.Helper()
	var e errorBody
	if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil {
		t.Fatalf("error body %q: %v", w.Body, err)
	}
	return e.Error
}

func TestFallbackServesWhenPrimaryFails(t *testing.T) {
	primary := newUpstream(t, failing(503))
	small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	p, obs := fallbackProxy(t, Config{MaxAttempts: 2},
		Fallback{Model: "llama-8b", MaxOutputTokens: 4096, ContextWindow: 8192}, []*upstream{primary}, small)
	w := httptest.NewRecorder()
	body := `{"model":"llama-70b","stream":true,"max_tokens":64000,"messages":[{"role":"user","content":"hello"}]}`
	res := p.ServeHTTP(w, post(body))
	if w.Code != 200 || res.Outcome != OutcomeSuccess || w.Body.String() != chunkA+chunkEnd+done {
		t.Fatalf("status %d outcome %s body %q", w.Code, res.Outcome, w.Body)
	}
	if got := w.Header().Get(HeaderDegraded); got != "fallback=small; model=llama-8b; max_tokens=4096" {
		t.Fatalf("degraded header %q", got)
	}
	if primary.calls.Load() != 2 || small.calls.Load() != 1 {
		t.Fatalf("calls: primary %d (want 2: its attempts), fallback %d", primary.calls.Load(), small.calls.Load())
	}
	want := `{"model":"llama-8b","stream":true,"max_tokens":4096,"messages":[{"role":"user","content":"hello"}]}`
	if got := string(small.bodies[0]); got != want {
		t.Fatalf("fallback got\n%s\nwant\n%s", got, want)
	}
	if string(primary.bodies[0]) != body {
		t.Fatalf("primary got a changed body %s", primary.bodies[0])
	}
	if res.Fallback != "small" || res.DegradeReason != DegradeUnavailable || res.Info.Model != "llama-8b" ||
		res.Info.MaxTokens != 4096 || res.Attempts != 3 || res.Upstream != small.addr() {
		t.Fatalf("result %+v", res)
	}
	obs.waitFor(t, func() bool { return len(obs.results) == 1 })
}

func TestFallbackWhenNoPrimaryUpstream(t *testing.T) {
	small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	p, _ := fallbackProxy(t, Config{}, Fallback{}, nil, small)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, post(`{"model":"m","stream":true}`))
	if w.Code != 200 || res.Fallback != "small" || w.Header().Get(HeaderDegraded) != "fallback=small" {
		t.Fatalf("status %d result %+v header %q", w.Code, res, w.Header().Get(HeaderDegraded))
	}
}

func TestFallbackRefusedKeepsThePrimarysStatus(t *testing.T) {
	t.Run("tier not allowed", func(t *testing.T) {
		primary := newUpstream(t, failing(503))
		small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
		p, _ := fallbackProxy(t, Config{Identifier: tierIdentifier{}},
			Fallback{Tiers: []string{"free"}}, []*upstream{primary}, small)
		w := httptest.NewRecorder()
		r := post(`{"model":"m","stream":true}`)
		r.Header.Set("X-Test-Tier", "gold")
		res := p.ServeHTTP(w, r)
		if w.Code != 503 || small.calls.Load() != 0 || res.Fallback != "" {
			t.Fatalf("status %d, fallback calls %d, result %+v", w.Code, small.calls.Load(), res)
		}
		e := errorBodyOf(t, w)
		if !strings.Contains(e.Message, `fallback small refused: tier "gold" may not degrade to it`) || e.Code != "upstream_error" {
			t.Fatalf("error %+v", e)
		}
		if w.Header().Get(HeaderDegraded) != "" {
			t.Fatal("a refused degradation must not say degraded")
		}
	})
	t.Run("prompt too large", func(t *testing.T) {
		primary := newUpstream(t, failing(502))
		small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
		p, _ := fallbackProxy(t, Config{}, Fallback{ContextWindow: 100}, []*upstream{primary}, small)
		w := httptest.NewRecorder()
		p.ServeHTTP(w, post(`{"model":"m","stream":true,"messages":[{"role":"user","content":"`+strings.Repeat("x", 800)+`"}]}`))
		if w.Code != 502 || small.calls.Load() != 0 {
			t.Fatalf("status %d, fallback calls %d", w.Code, small.calls.Load())
		}
		if e := errorBodyOf(t, w); !strings.Contains(e.Message, "fallback small refused: the prompt estimate of 200 tokens does not fit its context_window of 100") {
			t.Fatalf("error %+v", e)
		}
	})
	t.Run("open breakers keep their 503 headers", func(t *testing.T) {
		small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
		p, _ := fallbackProxy(t, Config{}, Fallback{ContextWindow: 1}, nil, small)
		w := httptest.NewRecorder()
		p.ServeHTTP(w, post(`{"model":"m","messages":[{"role":"user","content":"hello"}]}`))
		if w.Code != 503 || small.calls.Load() != 0 || w.Header().Get("Retry-After") == "" {
			t.Fatalf("status %d calls %d headers %v", w.Code, small.calls.Load(), w.Header())
		}
	})
}

func TestNoFallbackAfterCommitOrForTheRequestsOwnFault(t *testing.T) {
	t.Run("failure after commit", func(t *testing.T) {
		primary := newUpstream(t, sseUpstream(chunkA)) // cut after one event
		small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
		p, _ := fallbackProxy(t, Config{}, Fallback{}, []*upstream{primary}, small)
		w := httptest.NewRecorder()
		res := p.ServeHTTP(w, post(`{"model":"m","stream":true}`))
		if res.Outcome != OutcomeTruncated || small.calls.Load() != 0 || !strings.Contains(w.Body.String(), `"upstream_stream_truncated"`) {
			t.Fatalf("outcome %s, fallback calls %d, body %q", res.Outcome, small.calls.Load(), w.Body)
		}
	})
	t.Run("upstream 400", func(t *testing.T) {
		primary := newUpstream(t, failing(400))
		small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
		p, _ := fallbackProxy(t, Config{}, Fallback{}, []*upstream{primary}, small)
		w := httptest.NewRecorder()
		p.ServeHTTP(w, post(`{"model":"m","stream":true}`))
		if w.Code != 400 || small.calls.Load() != 0 || w.Body.String() != `{"error":{"message":"down"}}` {
			t.Fatalf("status %d, fallback calls %d, body %q", w.Code, small.calls.Load(), w.Body)
		}
	})
}

func TestFallbacksTriedInOrder(t *testing.T) {
	primary := newUpstream(t, failing(503))
	second := newUpstream(t, failing(503))
	third := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	b2, b3 := &listBalancer{addrs: []string{second.addr()}}, &listBalancer{addrs: []string{third.addr()}}
	p, _, _ := newTestProxy(t, Config{MaxAttempts: 1, Fallbacks: []Fallback{
		{Name: "saturated-only", Pool: Pool{Balancer: b3}, When: WhenSaturated},
		{Name: "mid", Pool: Pool{Balancer: b2}},
		{Name: "last", Pool: Pool{Balancer: b3}, Model: "tiny"},
	}}, primary)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, post(`{"model":"m","stream":true}`))
	if w.Code != 200 || res.Fallback != "last" || second.calls.Load() != 1 || third.calls.Load() != 1 || res.Attempts != 3 {
		t.Fatalf("status %d result %+v calls %d/%d", w.Code, res, second.calls.Load(), third.calls.Load())
	}
}

func TestFallbackNewConfigValidation(t *testing.T) {
	b := &listBalancer{}
	for _, fbs := range [][]Fallback{
		{{Pool: Pool{Balancer: b}}},
		{{Name: "a", Pool: Pool{Balancer: b}}, {Name: "a", Pool: Pool{Balancer: b}}},
		{{Name: "a"}},
		{{Name: "a", Pool: Pool{Balancer: b}, ContextWindow: -1}},
	} {
		if _, err := New(Config{Transport: http.DefaultTransport, Balancer: b, Fallbacks: fbs}); err == nil {
			t.Errorf("New accepted %+v", fbs)
		}
	}
}

// ladderTenancy is a tenancy whose gold tier has a small tpm, whose free
// tier may degrade, and whose primary pool holds one request.
func ladderTenancy(t *testing.T) *tenancy {
	t.Helper()
	return tenancyOf(t, admission.Config{
		Tiers: []admission.Tier{
			{Name: "gold", Priority: 1, TPM: 2000},
			{Name: "free", Priority: -1, TPM: 100000},
		},
		Tenants: []admission.TenantConfig{{ID: "a", Tier: "gold"}, {ID: "c", Tier: "free"}},
	}, 1)
}

// tenancyOf is a tenancy over cfg on one fake clock, with a gate of the
// given capacity (0: none) and the key "sk-<id>" for each configured tenant.
func tenancyOf(t *testing.T, cfg admission.Config, capacity int) *tenancy {
	t.Helper()
	tn := &tenancy{clk: clocktest.New(time.Time{}), obs: newAdmObserver()}
	var err error
	if tn.c, err = admission.NewController(cfg, tn.clk, tn.obs); err != nil {
		t.Fatal(err)
	}
	if capacity > 0 {
		tn.g = admission.NewGate(admission.GateConfig{Capacity: func() int { return capacity }, Controller: tn.c}, tn.clk, tn.obs)
	}
	var keys []admission.Key
	for _, tc := range cfg.Tenants {
		keys = append(keys, admission.Key{Hash: admission.HashKey("sk-" + tc.ID), Tenant: tc.ID})
	}
	dir, err := admission.NewDirectory(keys)
	if err != nil {
		t.Fatal(err)
	}
	tn.ident = &KeyIdentifier{Keys: dir, Resolve: func(tenant, tier string) (string, bool) {
		ti, ok := tn.c.Tier(tenant, tier)
		return ti.Name, ok
	}}
	tn.adm = NewTenantAdmitter(tn.c, tn.g)
	return tn
}

func keyed(body, key string) *http.Request {
	r := post(body)
	r.Header.Set("Authorization", "Bearer "+key)
	return r
}

func TestTenantsOwnLimitNeverFallsBack(t *testing.T) {
	tn := ladderTenancy(t)
	primary := newUpstream(t, failing(503))
	small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	cfg := Config{Fallbacks: []Fallback{{Name: "small", Pool: Pool{Balancer: &listBalancer{addrs: []string{small.addr()}}},
		When: WhenUnavailable | WhenSaturated}}}
	p, _ := tn.proxy(t, cfg, primary)
	w := httptest.NewRecorder()
	// 5000 tokens can never fit gold's tpm of 2000.
	p.ServeHTTP(w, keyed(`{"model":"m","stream":true,"max_tokens":5000}`, "sk-a"))
	if w.Code != 429 || primary.calls.Load() != 0 || small.calls.Load() != 0 || w.Header().Get(HeaderDegraded) != "" {
		t.Fatalf("status %d, calls %d/%d", w.Code, primary.calls.Load(), small.calls.Load())
	}
	if e := errorBodyOf(t, w); e.Code != admission.CodeRequestExceedsLimit && e.Code != admission.CodeTenantTPM {
		t.Fatalf("error %+v", e)
	}
}

func TestReservationMovesToTheFallback(t *testing.T) {
	tn := ladderTenancy(t)
	primary := newUpstream(t, failing(503))
	release := make(chan struct{})
	small := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = w.Write([]byte(chunkA))
		w.(http.Flusher).Flush()
		<-release
		_, _ = w.Write([]byte(chunkEnd + done))
	})
	cfg := Config{MaxAttempts: 1, Fallbacks: []Fallback{{Name: "small", MaxOutputTokens: 300,
		Pool: Pool{Balancer: &listBalancer{addrs: []string{small.addr()}}}}}}
	p, _ := tn.proxy(t, cfg, primary)
	w := newStreamRecorder()
	done := make(chan *Result)
	// 1500 of gold's 2000 tokens at admission; 300 + the prompt on the fallback.
	go func() { done <- p.ServeHTTP(w, keyed(`{"model":"m","stream":true,"max_tokens":1500}`, "sk-a")) }()
	w.waitBody(t, chunkA)
	if v := tn.view(t, "a"); v.TokensInWindow != 300 {
		t.Fatalf("tokens in window while the fallback streams: %d, want 300 (the clamped reservation)", v.TokensInWindow)
	}
	close(release)
	res := <-done
	if res.Fallback != "small" || res.Info.MaxTokens != 300 {
		t.Fatalf("result %+v", res)
	}
}

func TestGrownReservationThatDoesNotFitIsNotSent(t *testing.T) {
	tn := ladderTenancy(t)
	primary := newUpstream(t, failing(503))
	small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	// No max_tokens: gold reserves the default 1024 (capped at what is
	// left of 2000); the fallback sets 4096, which does not fit.
	cfg := Config{MaxAttempts: 1, Fallbacks: []Fallback{{Name: "small", MaxOutputTokens: 4096,
		Pool: Pool{Balancer: &listBalancer{addrs: []string{small.addr()}}}}}}
	p, _ := tn.proxy(t, cfg, primary)
	w := httptest.NewRecorder()
	p.ServeHTTP(w, keyed(`{"model":"m","stream":true}`, "sk-a"))
	if w.Code != 503 || small.calls.Load() != 0 {
		t.Fatalf("status %d, fallback calls %d", w.Code, small.calls.Load())
	}
	if e := errorBodyOf(t, w); !strings.Contains(e.Message, "fallback small refused: tenant a: 4096 tokens do not fit") {
		t.Fatalf("error %+v", e)
	}
}

func TestSaturatedPrimarySendsAllowedTiersToTheFallbackAtOnce(t *testing.T) {
	tn := ladderTenancy(t)
	hold := make(chan struct{})
	primary := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = w.Write([]byte(chunkA))
		w.(http.Flusher).Flush()
		<-hold
		_, _ = w.Write([]byte(chunkEnd + done))
	})
	small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	cfg := Config{Fallbacks: []Fallback{{Name: "small", Tiers: []string{"free"}, When: WhenSaturated,
		Pool: Pool{Balancer: &listBalancer{addrs: []string{small.addr()}}}}}}
	p, _ := tn.proxy(t, cfg, primary)

	// Gold takes the primary's only slot.
	w1 := newStreamRecorder()
	first := make(chan *Result)
	go func() { first <- p.ServeHTTP(w1, keyed(`{"model":"m","stream":true,"max_tokens":10}`, "sk-a")) }()
	w1.waitBody(t, chunkA)

	// Free is served by the fallback at once.
	w2 := httptest.NewRecorder()
	res := p.ServeHTTP(w2, keyed(`{"model":"m","stream":true,"max_tokens":10}`, "sk-c"))
	if w2.Code != 200 || res.Fallback != "small" || res.DegradeReason != DegradeSaturated || small.calls.Load() != 1 {
		t.Fatalf("free: status %d result %+v", w2.Code, res)
	}
	if w2.Header().Get(HeaderDegraded) != "fallback=small" {
		t.Fatalf("degraded header %q", w2.Header().Get(HeaderDegraded))
	}

	// A second gold request queues for the primary, never the fallback.
	w3 := httptest.NewRecorder()
	third := make(chan *Result)
	go func() { third <- p.ServeHTTP(w3, keyed(`{"model":"m","stream":true,"max_tokens":10}`, "sk-a")) }()
	tn.obs.waitQueued(t)
	close(hold)
	<-first
	res3 := <-third
	if w3.Code != 200 || res3.Fallback != "" || primary.calls.Load() != 2 || small.calls.Load() != 1 {
		t.Fatalf("gold: status %d result %+v calls %d/%d", w3.Code, res3, primary.calls.Load(), small.calls.Load())
	}
}

// tierIdentifier names the tier from X-Test-Tier.
type tierIdentifier struct{}

func (tierIdentifier) Identify(r *http.Request, _ RequestInfo) (Identity, error) {
	return Identity{Tenant: "t", Tier: r.Header.Get("X-Test-Tier")}, nil
}

// streamRecorder is a ResponseRecorder that a test can watch while the
// proxy streams into it.
type streamRecorder struct {
	mu   sync.Mutex
	h    http.Header
	code int
	body bytes.Buffer
	ch   chan struct{}
}

func newStreamRecorder() *streamRecorder {
	return &streamRecorder{h: http.Header{}, ch: make(chan struct{}, 1)}
}

func (w *streamRecorder) Header() http.Header { return w.h }
func (w *streamRecorder) WriteHeader(c int) {
	w.mu.Lock()
	w.code = c
	w.mu.Unlock()
}
func (w *streamRecorder) Write(b []byte) (int, error) {
	w.mu.Lock()
	n, err := w.body.Write(b)
	w.mu.Unlock()
	select {
	case w.ch <- struct{}{}:
	default:
	}
	return n, err
}
func (w *streamRecorder) Flush() {}

// waitBody waits until the body holds want.
func (w *streamRecorder) waitBody(t *testing.T, want string) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		w.mu.Lock()
		ok := strings.Contains(w.body.String(), want)
		w.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-w.ch:
		case <-deadline:
			t.Fatalf("body never held %q", want)
		}
	}
}

func TestFallbackRewriteIsChargedToTheBodyBudget(t *testing.T) {
	primary := newUpstream(t, failing(503))
	small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	body := `{"model":"big","stream":true,"messages":[{"role":"user","content":"` + strings.Repeat("x", 1000) + `"}]}`
	// Room for the client's body, not for a second copy of it.
	budget, err := NewBodyBudget(int64(len(body))*3/2, 0)
	if err != nil {
		t.Fatal(err)
	}
	p, _ := fallbackProxy(t, Config{BodyBudget: budget}, Fallback{Model: "small"}, []*upstream{primary}, small)
	w := httptest.NewRecorder()
	p.ServeHTTP(w, post(body))
	if w.Code != 503 || small.calls.Load() != 0 {
		t.Fatalf("status %d, fallback calls %d", w.Code, small.calls.Load())
	}
	if e := errorBodyOf(t, w); !strings.Contains(e.Message, "fallback small refused: no body memory") {
		t.Fatalf("error %+v", e)
	}
	// Every charge is back when ServeHTTP returns (finish gives them back).
	if n := budget.InUse(); n != 0 {
		t.Fatalf("%d bytes still charged after the request", n)
	}
	// Without a model rewrite or a clamp, no copy is made: the fallback serves.
	p, _ = fallbackProxy(t, Config{BodyBudget: budget}, Fallback{}, []*upstream{primary}, small)
	w = httptest.NewRecorder()
	p.ServeHTTP(w, post(body))
	if w.Code != 200 || small.calls.Load() != 1 {
		t.Fatalf("status %d, fallback calls %d", w.Code, small.calls.Load())
	}
}

// A fallback's rewritten body goes back to the body budget at commit, as
// the client's body does: a stream served by a fallback for minutes holds
// neither.
func TestFallbackRewriteIsReleasedAtCommit(t *testing.T) {
	primary := newUpstream(t, failing(503))
	release := make(chan struct{})
	small := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, chunkA)
		w.(http.Flusher).Flush()
		<-release
		_, _ = io.WriteString(w, chunkEnd+done)
	})
	body := `{"model":"big","stream":true,"messages":[{"role":"user","content":"` + strings.Repeat("x", 1000) + `"}]}`
	budget, err := NewBodyBudget(int64(len(body))*8, 0)
	if err != nil {
		t.Fatal(err)
	}
	p, _ := fallbackProxy(t, Config{BodyBudget: budget}, Fallback{Model: "small"}, []*upstream{primary}, small)
	w := &firstWriteWriter{discardWriter: discardWriter{h: http.Header{}}, wrote: make(chan struct{})}
	duringStream := make(chan int64, 1)
	go func() {
		<-w.wrote // committed: the first event reached the client
		duringStream <- budget.InUse()
		close(release)
	}()
	res := p.ServeHTTP(w, post(body))
	if res.Outcome != OutcomeSuccess || res.Fallback != "small" || small.calls.Load() != 1 {
		t.Fatalf("outcome %v, fallback %q, fallback calls %d", res.Outcome, res.Fallback, small.calls.Load())
	}
	if n := <-duringStream; n != 0 {
		t.Errorf("budget in use while the fallback's stream runs: %d bytes, want 0", n)
	}
	if n := budget.InUse(); n != 0 {
		t.Errorf("budget in use after the request: %d bytes", n)
	}
}

// panickyMove is an admission whose move to a fallback's pool panics.
type panickyMove struct{}

func (panickyMove) Release(*Result)                          {}
func (panickyMove) Queue(context.Context, RequestInfo) error { return nil }
func (panickyMove) MoveTo(context.Context, *admission.Gate, RequestInfo, bool) error {
	panic("admission bug")
}

type panickyAdmitter struct{}

func (panickyAdmitter) Admit(context.Context, Identity, RequestInfo) (Admission, error) {
	return panickyMove{}, nil
}

// A fallback's rewritten body charged to the body budget goes back even
// when moving the admission to the fallback's pool panics: a charge left
// behind would shrink the process-wide budget for good.
func TestFallbackRewriteChargeSurvivesAPanic(t *testing.T) {
	primary := newUpstream(t, failing(503))
	small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	body := `{"model":"big","stream":true,"messages":[{"role":"user","content":"` + strings.Repeat("x", 1000) + `"}]}`
	budget, err := NewBodyBudget(int64(len(body))*8, 0)
	if err != nil {
		t.Fatal(err)
	}
	p, _ := fallbackProxy(t, Config{BodyBudget: budget, Admitter: panickyAdmitter{}}, Fallback{Model: "small"}, []*upstream{primary}, small)
	func() {
		defer func() {
			if v := recover(); v != "admission bug" {
				t.Fatalf("recovered %v", v)
			}
		}()
		p.ServeHTTP(httptest.NewRecorder(), post(body))
	}()
	if n := budget.InUse(); n != 0 {
		t.Fatalf("%d bytes still charged after the request", n)
	}
}

// Every rung's breakers open: the 503 at the ladder's foot says when the
// first pool opens again (the primary's 30 s, not the fallback's 120 s),
// and its message names both pools. Before, it carried the fallback's
// Retry-After and message alone, and clients waited four times too long.
func TestLadderOf503sSaysTheEarliestRetry(t *testing.T) {
	p, _, _ := newTestProxy(t, Config{Fallbacks: []Fallback{{Name: "small",
		Pool: Pool{Balancer: balancerFunc(func(PickRequest) (Upstream, error) {
			return Upstream{}, &UnavailableError{CircuitOpen: true, RetryAfter: 120 * time.Second, Reason: "all 1 upstream(s) have open breakers"}
		})}}}})
	p.cfg.Balancer = balancerFunc(func(PickRequest) (Upstream, error) {
		return Upstream{}, &UnavailableError{CircuitOpen: true, RetryAfter: 30 * time.Second, Reason: "all 2 upstream(s) have open breakers"}
	})
	p.primary.Balancer = p.cfg.Balancer
	w := httptest.NewRecorder()
	p.ServeHTTP(w, post(`{"model":"m","messages":[{"role":"user","content":"hello"}]}`))
	if w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") != "30" || w.Header().Get("X-Circuit-Breaker") != "open" {
		t.Fatalf("status %d, headers %v; want 503 with Retry-After 30 (the primary's) and X-Circuit-Breaker open", w.Code, w.Header())
	}
	e := errorBodyOf(t, w)
	if e.Code != "circuit_open" || !strings.Contains(e.Message, "all 1 upstream(s)") ||
		!strings.Contains(e.Message, "the primary pool: no upstream available: all 2 upstream(s) have open breakers") {
		t.Fatalf("error %+v, want circuit_open naming both pools", e)
	}
}

// rewriteParsed parses body as a's request and rewrites it (rewriteBody).
func rewriteParsed(body []byte, a api.API, model string, maxTokens int, setMax bool) ([]byte, string, error) {
	info, err := a.ParseRequest(body)
	if err != nil {
		return nil, "", err
	}
	out, _, note, err := rewriteBody(body, info, a, model, maxTokens, setMax)
	return out, note, err
}

// fallbackTenancy has three tiers that all fit big requests: gold (queues),
// silver (queues, may degrade), free (sheddable); tenants a, b, c; the
// primary pool holds one request.
func fallbackTenancy(t *testing.T) *tenancy {
	t.Helper()
	return tenancyOf(t, admission.Config{
		Tiers: []admission.Tier{
			{Name: "gold", Priority: 10, TPM: 100000, QueueTimeout: 5 * time.Second},
			{Name: "silver", Priority: 0, TPM: 100000, QueueTimeout: 5 * time.Second},
			{Name: "free", Priority: -1, TPM: 100000},
		},
		Tenants: []admission.TenantConfig{{ID: "a", Tier: "gold"}, {ID: "b", Tier: "silver"}, {ID: "c", Tier: "free"}},
	}, 1)
}

// releaser is a channel that the test closes with release (once); call
// its cleanup after the upstream that waits on it is made (cleanups run
// last first), so a failing test does not hang in the server's Close.
func releaser() (ch chan struct{}, release func()) {
	ch = make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(ch) }) }
	return ch, release
}

// holdingUpstream streams chunkA, then waits for release before ending.
func holdingUpstream(t *testing.T) (*upstream, func()) {
	release, rel := releaser()
	u := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = w.Write([]byte(chunkA))
		w.(http.Flusher).Flush()
		<-release
		_, _ = w.Write([]byte(chunkEnd + done))
	})
	t.Cleanup(rel)
	return u, rel
}

// A second fallback is a rung of its own: it gets the client's request
// adapted to its own settings, not the first fallback's rewrite. A
// fallback without `model` serves the client's model; one whose
// max_output_tokens is 8192 is sent 8192, not the 4096 of the rung above,
// and its header says so.
func TestSecondFallbackGetsTheClientsOwnRequest(t *testing.T) {
	for _, tc := range []struct {
		name       string
		second     Fallback
		wantBody   string
		wantHeader string
	}{
		{"no model, no bounds", Fallback{Name: "same"},
			`{"model":"llama-70b","stream":true,"max_tokens":64000,"messages":[{"role":"user","content":"hello"}]}`,
			"fallback=same"},
		{"its own bound", Fallback{Name: "same", MaxOutputTokens: 8192},
			`{"model":"llama-70b","stream":true,"max_tokens":8192,"messages":[{"role":"user","content":"hello"}]}`,
			"fallback=same; max_tokens=8192"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			primary := newUpstream(t, failing(503))
			small := newUpstream(t, failing(503))
			same := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
			second := tc.second
			second.Balancer = &listBalancer{addrs: []string{same.addr()}}
			cfg := Config{MaxAttempts: 1, Fallbacks: []Fallback{
				{Name: "small", Model: "llama-8b", MaxOutputTokens: 4096, Pool: Pool{Balancer: &listBalancer{addrs: []string{small.addr()}}}},
				second,
			}}
			p, _, _ := newTestProxy(t, cfg, primary)
			w := httptest.NewRecorder()
			body := `{"model":"llama-70b","stream":true,"max_tokens":64000,"messages":[{"role":"user","content":"hello"}]}`
			res := p.ServeHTTP(w, post(body))
			if w.Code != 200 || res.Fallback != "same" || small.calls.Load() != 1 || same.calls.Load() != 1 {
				t.Fatalf("status %d fallback %q calls small %d same %d", w.Code, res.Fallback, small.calls.Load(), same.calls.Load())
			}
			if got := string(same.bodies[0]); got != tc.wantBody {
				t.Fatalf("second fallback got\n%s\nwant\n%s", got, tc.wantBody)
			}
			if got := w.Header().Get(HeaderDegraded); got != tc.wantHeader {
				t.Fatalf("degraded header %q, want %q", got, tc.wantHeader)
			}
		})
	}
}

// A request offered to a saturated-overflow fallback whose capacity is full
// goes back to queue for the primary with its original body: its
// reservation must be the original max_tokens, not the fallback's clamp
// (else the tenant's tpm admits more than it should while it runs).
func TestRefusedMoveKeepsThePrimarysReservation(t *testing.T) {
	tn := fallbackTenancy(t)
	primary, releaseP := holdingUpstream(t)
	small, releaseF := holdingUpstream(t)
	fg := admission.NewGate(admission.GateConfig{Capacity: func() int { return 1 }, Controller: tn.c}, tn.clk, tn.obs)
	cfg := Config{MaxAttempts: 1, Fallbacks: []Fallback{{Name: "small", MaxOutputTokens: 300, When: WhenSaturated,
		Tiers: []string{"silver"}, Pool: Pool{Balancer: &listBalancer{addrs: []string{small.addr()}}, Gate: fg}}}}
	p, _ := tn.proxy(t, cfg, primary)

	// Gold holds the primary, silver the fallback.
	wa, wb := newStreamRecorder(), newStreamRecorder()
	ra, rb := make(chan *Result, 1), make(chan *Result, 1)
	go func() { ra <- p.ServeHTTP(wa, keyed(`{"model":"m","stream":true,"max_tokens":10}`, "sk-a")) }()
	wa.waitBody(t, chunkA)
	go func() { rb <- p.ServeHTTP(wb, keyed(`{"model":"m","stream":true,"max_tokens":10}`, "sk-b")) }()
	wb.waitBody(t, chunkA)
	if v := tn.view(t, "b"); v.TokensInWindow != 10 {
		t.Fatalf("b's tokens in window %d, want 10", v.TokensInWindow)
	}

	// A second silver request finds both full: it queues for the primary,
	// with its own max_tokens of 50000 reserved.
	wc := newStreamRecorder()
	rc := make(chan *Result, 1)
	go func() { rc <- p.ServeHTTP(wc, keyed(`{"model":"m","stream":true,"max_tokens":50000}`, "sk-b")) }()
	tn.obs.waitQueued(t)
	if v := tn.view(t, "b"); v.TokensInWindow != 10+50000 {
		t.Fatalf("b's tokens in window while its 50000-token request queues for the primary: %d, want %d", v.TokensInWindow, 10+50000)
	}
	releaseF()
	<-rb
	releaseP()
	<-ra
	res := <-rc
	if res.Fallback != "" || small.calls.Load() != 1 || primary.calls.Load() != 2 {
		t.Fatalf("result %+v calls %d/%d", res, primary.calls.Load(), small.calls.Load())
	}
}

// max_completion_tokens with n = 2: the fallback's body gets
// max_completion_tokens clamped (no max_tokens added), and the tenant's
// reservation is n × the clamped value, on a non-streamed request.
func TestMaxCompletionTokensWithNIsClampedAndReserved(t *testing.T) {
	tn := fallbackTenancy(t)
	primary := newUpstream(t, failing(503))
	release, releaseAll := releaser()
	small := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		<-release
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"id":"x","object":"chat.completion","model":"llama-8b-real","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"},{"index":1,"message":{"role":"assistant","content":"yo"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}`))
	})
	t.Cleanup(releaseAll)
	cfg := Config{MaxAttempts: 1, Fallbacks: []Fallback{{Name: "small", Model: "llama-8b", MaxOutputTokens: 300,
		Pool: Pool{Balancer: &listBalancer{addrs: []string{small.addr()}}}}}}
	p, _ := tn.proxy(t, cfg, primary)
	w := httptest.NewRecorder()
	got := make(chan *Result, 1)
	body := `{"model":"llama-70b","n":2,"max_completion_tokens":1500,"messages":[]}`
	go func() { got <- p.ServeHTTP(w, keyed(body, "sk-a")) }()
	deadline := time.Now().Add(5 * time.Second)
	for small.calls.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if v := tn.view(t, "a"); v.TokensInWindow != 2*300 {
		t.Fatalf("tokens in window on the fallback: %d, want 600 (n=2 × 300)", v.TokensInWindow)
	}
	releaseAll()
	res := <-got
	if w.Code != 200 || res.Fallback != "small" {
		t.Fatalf("status %d result %+v body %s", w.Code, res, w.Body)
	}
	if want := `{"model":"llama-8b","n":2,"max_completion_tokens":300,"messages":[]}`; string(small.bodies[0]) != want {
		t.Fatalf("fallback got %s, want %s", small.bodies[0], want)
	}
	if h := w.Header().Get(HeaderDegraded); h != "fallback=small; model=llama-8b; max_completion_tokens=300" {
		t.Fatalf("degraded header %q", h)
	}
	if !strings.Contains(w.Body.String(), `"model":"llama-8b-real"`) {
		t.Fatalf("the upstream's model field was not passed through: %s", w.Body)
	}
	if v := tn.view(t, "a"); v.Inflight != 0 || v.TokensInWindow != 7 {
		t.Fatalf("after: in flight %d, tokens in window %d (want 0 and the usage of 7)", v.Inflight, v.TokensInWindow)
	}
}

// The saturated path: a sheddable tier that finds the primary and the
// fallback full is refused at once with 429 naming the fallback, and
// consumes nothing; every slot of both gates comes back.
func TestSaturatedEverywhereShedsWithTheNoteAndLeaksNothing(t *testing.T) {
	tn := fallbackTenancy(t)
	primary, releaseP := holdingUpstream(t)
	small, releaseF := holdingUpstream(t)
	fg := admission.NewGate(admission.GateConfig{Capacity: func() int { return 1 }, Controller: tn.c}, tn.clk, tn.obs)
	cfg := Config{MaxAttempts: 1, Fallbacks: []Fallback{{Name: "small", When: WhenSaturated | WhenUnavailable,
		Tiers: []string{"free"}, Pool: Pool{Balancer: &listBalancer{addrs: []string{small.addr()}}, Gate: fg}}}}
	p, _ := tn.proxy(t, cfg, primary)

	wa, wc := newStreamRecorder(), newStreamRecorder()
	ra, rc := make(chan *Result, 1), make(chan *Result, 1)
	go func() { ra <- p.ServeHTTP(wa, keyed(`{"model":"m","stream":true,"max_tokens":10}`, "sk-a")) }()
	wa.waitBody(t, chunkA)
	go func() { rc <- p.ServeHTTP(wc, keyed(`{"model":"m","stream":true,"max_tokens":10}`, "sk-c")) }()
	wc.waitBody(t, chunkA)

	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, keyed(`{"model":"m","stream":true,"max_tokens":20}`, "sk-c"))
	if w.Code != 429 || small.calls.Load() != 1 || primary.calls.Load() != 1 || res.Fallback != "" {
		t.Fatalf("status %d calls %d/%d result %+v", w.Code, primary.calls.Load(), small.calls.Load(), res)
	}
	e := errorBodyOf(t, w)
	if e.Code != admission.CodeSaturated || !strings.HasSuffix(e.Message, "fallback small refused: its capacity is full") {
		t.Fatalf("error %+v", e)
	}
	if w.Header().Get(HeaderDegraded) != "" {
		t.Fatalf("a refused request says it was degraded: %q", w.Header().Get(HeaderDegraded))
	}
	if v := tn.view(t, "c"); v.TokensInWindow != 10 || v.Inflight != 1 {
		t.Fatalf("c: tokens %d in flight %d after the refusal, want 10 and 1 (the refusal consumed nothing)", v.TokensInWindow, v.Inflight)
	}
	releaseF()
	releaseP()
	<-ra
	<-rc
	// Both gates have their one slot free again.
	for name, g := range map[string]*admission.Gate{"primary": tn.g, "fallback": fg} {
		var s admission.Slot
		if !g.TryAcquireSlot("x", admission.Tier{Name: "gold"}, &s) {
			t.Fatalf("%s gate: no free slot after every request ended (a slot leaked)", name)
		}
		s.Release()
	}
	for _, id := range []string{"a", "c"} {
		if v := tn.view(t, id); v.Inflight != 0 {
			t.Fatalf("tenant %s: %d in flight after every request ended", id, v.Inflight)
		}
	}
}

// A failure of the fallback itself (after the primary's) is the fallback's
// answer, and it is not sent to the primary again; a 4xx of the request's
// own on the primary never reaches a fallback (pins DESIGN §4 with a 422).
func TestOwnFault422NeverFallsBack(t *testing.T) {
	primary := newUpstream(t, failing(422))
	small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	p, _ := fallbackProxy(t, Config{MaxAttempts: 2}, Fallback{Model: "llama-8b"}, []*upstream{primary}, small)
	w := httptest.NewRecorder()
	p.ServeHTTP(w, post(`{"model":"m","stream":true}`))
	if w.Code != 422 || small.calls.Load() != 0 || primary.calls.Load() != 1 || w.Header().Get(HeaderDegraded) != "" {
		t.Fatalf("status %d calls primary %d fallback %d", w.Code, primary.calls.Load(), small.calls.Load())
	}
	if w.Body.String() != `{"error":{"message":"down"}}` {
		t.Fatalf("the upstream's 422 was not passed through unchanged: %s", w.Body)
	}
}

// An upstream 429 on the primary is "unavailable": the fallback serves it.
func TestUpstream429FallsBack(t *testing.T) {
	primary := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", "30")
		failing(429)(w, r)
	})
	small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	p, _ := fallbackProxy(t, Config{MaxAttempts: 2}, Fallback{}, []*upstream{primary}, small)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, post(`{"model":"m","stream":true}`))
	if w.Code != 200 || res.Fallback != "small" || small.calls.Load() != 1 || w.Header().Get(HeaderDegraded) != "fallback=small" {
		t.Fatalf("status %d result %+v header %q", w.Code, res, w.Header().Get(HeaderDegraded))
	}
}

// The primary failed (unavailable) and the fallback's capacity is full: the
// fallback is passed over ("its capacity full" in README's list of a
// fallback's own reasons) and the client gets the primary's status with
// the note at once, rather than waiting in the fallback's queue after the
// primary's attempts are already spent.
func TestFullFallbackIsPassedOverAtOnce(t *testing.T) {
	tn := fallbackTenancy(t)
	primary := newUpstream(t, failing(503))
	small, releaseF := holdingUpstream(t)
	fg := admission.NewGate(admission.GateConfig{Capacity: func() int { return 1 }, Controller: tn.c}, tn.clk, tn.obs)
	cfg := Config{MaxAttempts: 1, Fallbacks: []Fallback{{Name: "small",
		Pool: Pool{Balancer: &listBalancer{addrs: []string{small.addr()}}, Gate: fg}}}}
	p, _ := tn.proxy(t, cfg, primary)
	wa := newStreamRecorder()
	ra := make(chan *Result, 1)
	go func() { ra <- p.ServeHTTP(wa, keyed(`{"model":"m","stream":true,"max_tokens":10}`, "sk-a")) }()
	wa.waitBody(t, chunkA) // on the fallback, its one slot taken

	w := httptest.NewRecorder()
	rb := make(chan *Result, 1)
	go func() { rb <- p.ServeHTTP(w, keyed(`{"model":"m","stream":true,"max_tokens":10}`, "sk-b")) }()
	select {
	case <-rb:
	case <-time.After(3 * time.Second):
		releaseF()
		<-rb
		<-ra
		t.Fatal("the request waited in the full fallback's queue after the primary failed")
	}
	if w.Code != 503 || small.calls.Load() != 1 {
		t.Fatalf("status %d fallback calls %d", w.Code, small.calls.Load())
	}
	if e := errorBodyOf(t, w); !strings.Contains(e.Message, "fallback small refused: its capacity is full") {
		t.Fatalf("error %+v", e)
	}
	releaseF()
	<-ra
}

// A request that falls back is one request of its tenant's rpm, not one
// per pool tried: a tenant with rpm 2 gets both of its requests served by
// the fallback.
func TestFallbackChargesRPMOnce(t *testing.T) {
	tn := &tenancy{clk: clocktest.New(time.Time{}), obs: newAdmObserver()}
	var err error
	if tn.c, err = admission.NewController(admission.Config{
		Tiers:   []admission.Tier{{Name: "free", RPM: 2}},
		Tenants: []admission.TenantConfig{{ID: "c", Tier: "free"}},
	}, tn.clk, tn.obs); err != nil {
		t.Fatal(err)
	}
	dir, err := admission.NewDirectory([]admission.Key{{Hash: admission.HashKey("sk-c"), Tenant: "c"}})
	if err != nil {
		t.Fatal(err)
	}
	tn.ident = &KeyIdentifier{Keys: dir, Resolve: func(tenant, tier string) (string, bool) {
		ti, ok := tn.c.Tier(tenant, tier)
		return ti.Name, ok
	}}
	tn.adm = NewTenantAdmitter(tn.c, nil)
	primary := newUpstream(t, failing(503))
	small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	fg := admission.NewGate(admission.GateConfig{Capacity: func() int { return 4 }, Controller: tn.c}, tn.clk, tn.obs)
	cfg := Config{MaxAttempts: 1, Fallbacks: []Fallback{{Name: "small", MaxOutputTokens: 50,
		Pool: Pool{Balancer: &listBalancer{addrs: []string{small.addr()}}, Gate: fg}}}}
	p, _ := tn.proxy(t, cfg, primary)
	for i := range 2 {
		w := httptest.NewRecorder()
		res := p.ServeHTTP(w, keyed(`{"model":"m","stream":true,"max_tokens":100}`, "sk-c"))
		if w.Code != 200 || res.Fallback != "small" {
			t.Fatalf("request %d: status %d result %+v body %s", i, w.Code, res, w.Body)
		}
	}
	if v := tn.view(t, "c"); v.RequestsInWindow != 2 || v.Inflight != 0 {
		t.Fatalf("requests in window %d, in flight %d; want 2 and 0", v.RequestsInWindow, v.Inflight)
	}
	w := httptest.NewRecorder()
	p.ServeHTTP(w, keyed(`{"model":"m","stream":true,"max_tokens":100}`, "sk-c"))
	if w.Code != 429 || small.calls.Load() != 2 || primary.calls.Load() != 2 {
		t.Fatalf("third request: status %d calls %d/%d (the rpm 429 must reach no pool)", w.Code, primary.calls.Load(), small.calls.Load())
	}
}

// A refused degradation answers with the primary's failure status and the
// gateway's OpenAI-shaped body naming the fallback: an upstream 429 stays
// a 429 (rate_limit_error, its Retry-After kept), no upstream at all a 503.
func TestRefusedDegradationKeepsThePrimarysStatus(t *testing.T) {
	for _, tc := range []struct {
		name       string
		primary    func(http.ResponseWriter, *http.Request)
		status     int
		typ, retry string
	}{
		{"upstream 429", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Retry-After", "7")
			failing(429)(w, r)
		}, 429, TypeRateLimit, "7"},
		{"upstream 502", failing(502), 502, TypeServer, ""},
		{"no primary upstream", nil, 503, TypeServer, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ups []*upstream
			if tc.primary != nil {
				ups = append(ups, newUpstream(t, tc.primary))
			}
			small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
			p, _ := fallbackProxy(t, Config{MaxAttempts: 1, Identifier: tierIdentifier{}},
				Fallback{Tiers: []string{"free"}}, ups, small)
			w := httptest.NewRecorder()
			r := post(`{"model":"m","stream":true}`)
			r.Header.Set("X-Test-Tier", "gold")
			p.ServeHTTP(w, r)
			if w.Code != tc.status || small.calls.Load() != 0 || w.Header().Get(HeaderDegraded) != "" {
				t.Fatalf("status %d (want %d), fallback calls %d", w.Code, tc.status, small.calls.Load())
			}
			if ct := w.Header().Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
				t.Fatalf("Content-Type %q", ct)
			}
			e := errorBodyOf(t, w)
			if e.Type != tc.typ || e.Code == "" || !strings.HasSuffix(e.Message, `fallback small refused: tier "gold" may not degrade to it`) {
				t.Fatalf("error %+v", e)
			}
			if got := w.Header().Get("Retry-After"); tc.retry != "" && got != tc.retry {
				t.Fatalf("Retry-After %q, want %q", got, tc.retry)
			}
		})
	}
}

// An in-band error event before commit (vLLM's "overloaded" as the first
// event of a 200 stream) is the primary being unavailable, not a commit:
// the fallback serves, and the client sees nothing of the primary's event.
// A 4xx-like in-band error is the request's own fault and never falls back.
func TestInbandErrorBeforeCommitFallsBack(t *testing.T) {
	for _, tc := range []struct {
		name     string
		code     int
		fallback bool
	}{
		{"5xx-like", 503, true},
		{"4xx-like", 400, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ev := "data: {\"error\":{\"message\":\"nope\",\"type\":\"x\",\"code\":" + strconv.Itoa(tc.code) + "}}\n\n"
			primary := newUpstream(t, sseUpstream(ev))
			small := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
			p, _ := fallbackProxy(t, Config{MaxAttempts: 1}, Fallback{}, []*upstream{primary}, small)
			w := httptest.NewRecorder()
			res := p.ServeHTTP(w, post(`{"model":"m","stream":true}`))
			if tc.fallback {
				if w.Code != 200 || res.Fallback != "small" || w.Body.String() != chunkA+chunkEnd+done {
					t.Fatalf("status %d result %+v body %q", w.Code, res, w.Body)
				}
				return
			}
			if w.Code != tc.code || small.calls.Load() != 0 || res.Fallback != "" {
				t.Fatalf("status %d fallback calls %d result %+v", w.Code, small.calls.Load(), res)
			}
		})
	}
}

// The ladder's last rungs (shed, then queue): a request sent
// to a saturated-overflow fallback that then fails there is not lost — a
// tier that may queue waits for the primary, as it would have without the
// fallback, and is served once the primary's slot frees.
func TestFailedOverflowFallbackQueuesForThePrimary(t *testing.T) {
	tn := fallbackTenancy(t)
	primary, releaseP := holdingUpstream(t)
	small := newUpstream(t, failing(503))
	cfg := Config{MaxAttempts: 1, Fallbacks: []Fallback{{Name: "small", When: WhenSaturated, Tiers: []string{"silver"},
		Pool: Pool{Balancer: &listBalancer{addrs: []string{small.addr()}}}}}}
	p, _ := tn.proxy(t, cfg, primary)
	wa := newStreamRecorder()
	ra := make(chan *Result, 1)
	go func() { ra <- p.ServeHTTP(wa, keyed(`{"model":"m","stream":true,"max_tokens":10}`, "sk-a")) }()
	wa.waitBody(t, chunkA)

	wb := newStreamRecorder()
	rb := make(chan *Result, 1)
	go func() { rb <- p.ServeHTTP(wb, keyed(`{"model":"m","stream":true,"max_tokens":10}`, "sk-b")) }()
	select {
	case res := <-rb:
		releaseP()
		<-ra
		t.Fatalf("silver ended at once with %d (outcome %s, fallback %q) after the fallback failed: want it queued for the primary",
			res.Status, res.Outcome, res.Fallback)
	case <-tn.obs.queued:
	case <-time.After(5 * time.Second):
		t.Fatal("silver neither ended nor queued")
	}
	releaseP()
	<-ra
	res := <-rb
	if res.Status != 200 || small.calls.Load() != 1 || primary.calls.Load() != 2 {
		t.Fatalf("silver: status %d calls primary %d fallback %d", res.Status, primary.calls.Load(), small.calls.Load())
	}
}

// Without fallbacks, a 503 whose breakers are all open says why once, and
// names no primary pool: there is no ladder to report on.
func TestAllOpenWithoutFallbacksSaysWhyOnce(t *testing.T) {
	p, _, _ := newTestProxy(t, Config{})
	p.cfg.Balancer = balancerFunc(func(PickRequest) (Upstream, error) {
		return Upstream{}, &UnavailableError{CircuitOpen: true, RetryAfter: 30 * time.Second, Reason: "the circuit breakers of all 3 upstream(s) are open"}
	})
	p.primary.Balancer = p.cfg.Balancer
	w := httptest.NewRecorder()
	p.ServeHTTP(w, post(`{"model":"m","messages":[{"role":"user","content":"hello"}]}`))
	e := errorBodyOf(t, w)
	if w.Code != http.StatusServiceUnavailable || e.Code != "circuit_open" ||
		strings.Count(e.Message, "are open") != 1 || strings.Contains(e.Message, "primary") {
		t.Fatalf("status %d, error %+v; want 503 circuit_open saying once why, naming no primary pool", w.Code, e)
	}
}
