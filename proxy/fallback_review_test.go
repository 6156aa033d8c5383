package proxy

// Review probes of the degradation ladder (issue 11): the ladder's rungs
// each derived from the client's own request, the reservation when a move
// is refused, max_completion_tokens with n > 1, and slots given back.

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// reviewTenancy has three tiers that all fit big requests: gold (queues),
// silver (queues, may degrade), free (sheddable); tenants a, b, c; the
// primary pool holds one request.
func reviewTenancy(t *testing.T) *tenancy {
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
func TestReviewSecondFallbackGetsTheClientsOwnRequest(t *testing.T) {
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
func TestReviewRefusedMoveKeepsThePrimarysReservation(t *testing.T) {
	tn := reviewTenancy(t)
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
func TestReviewMaxCompletionTokensWithNIsClampedAndReserved(t *testing.T) {
	tn := reviewTenancy(t)
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
func TestReviewSaturatedEverywhereShedsWithTheNoteAndLeaksNothing(t *testing.T) {
	tn := reviewTenancy(t)
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
func TestReviewOwnFault422NeverFallsBack(t *testing.T) {
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
func TestReviewUpstream429FallsBack(t *testing.T) {
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
func TestReviewUnavailableFallbackFullIsPassedOverAtOnce(t *testing.T) {
	tn := reviewTenancy(t)
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
func TestReviewFallbackChargesRPMOnce(t *testing.T) {
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
func TestReviewRefusedDegradationBody(t *testing.T) {
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
func TestReviewInbandErrorBeforeCommitFallsBack(t *testing.T) {
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

// The ladder's last rungs (issue 11 §4, README steps 3-4): a request sent
// to a saturated-overflow fallback that then fails there is not lost — a
// tier that may queue waits for the primary, as it would have without the
// fallback, and is served once the primary's slot frees.
func TestReviewFailedOverflowFallbackQueuesForThePrimary(t *testing.T) {
	tn := reviewTenancy(t)
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
