package admission

import (
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

// TestLocalLimitsDecidesAsTheController drives a Controller with its own
// state and one on LocalLimits through the same random requests,
// settlements, cancellations and clock steps: every decision, refusal
// message, Retry-After, reservation and x-ratelimit figure is the same.
func TestLocalLimitsDecidesAsTheController(t *testing.T) {
	cfg := Config{Tiers: []Tier{
		{Name: "t", MaxConcurrent: 6, RPM: 25, TPM: 4000, DefaultMaxTokens: 300},
		{Name: "u", TPM: 900},
	}, DefaultTier: "t", Tenants: []TenantConfig{{ID: "c", Tier: "u"}}}
	own, clkA, _ := newCtl(t, cfg)
	onStore, clkB, _ := newCtl(t, cfg)
	onStore.SetLimitStore(NewLocalLimits(clkB))

	rng := rand.New(rand.NewPCG(1, 2))
	type pair struct{ a, b *Ticket }
	var live []pair
	tenants := []string{"a", "b", "c"}
	for i := 0; i < 5000; i++ {
		switch op := rng.IntN(10); {
		case op < 5:
			req := Request{Tenant: tenants[rng.IntN(3)], PromptTokens: rng.IntN(400)}
			if rng.IntN(2) == 0 {
				req.MaxTokens = rng.IntN(600)
			}
			if rng.IntN(4) == 0 {
				req.N = 1 + rng.IntN(3)
			}
			ta, ra := own.Reserve(req)
			tb, rb := onStore.Reserve(req)
			switch {
			case (ra == nil) != (rb == nil):
				t.Fatalf("step %d %+v: own %v, store %v", i, req, ra, rb)
			case ra != nil:
				if ra.Code != rb.Code || ra.Message != rb.Message || ra.RetryAfter != rb.RetryAfter ||
					limStr(ra.Limits.Requests) != limStr(rb.Limits.Requests) || limStr(ra.Limits.Tokens) != limStr(rb.Limits.Tokens) {
					t.Fatalf("step %d %+v:\nown   %s %q %s %s %s\nstore %s %q %s %s %s", i, req,
						ra.Code, ra.Message, ra.RetryAfter, limStr(ra.Limits.Requests), limStr(ra.Limits.Tokens),
						rb.Code, rb.Message, rb.RetryAfter, limStr(rb.Limits.Requests), limStr(rb.Limits.Tokens))
				}
			default:
				la, lb := ta.Limits(), tb.Limits()
				if ta.Reserved() != tb.Reserved() || limStr(la.Requests) != limStr(lb.Requests) || limStr(la.Tokens) != limStr(lb.Tokens) {
					t.Fatalf("step %d %+v: own reserved %d %s %s, store %d %s %s", i, req,
						ta.Reserved(), limStr(la.Requests), limStr(la.Tokens), tb.Reserved(), limStr(lb.Requests), limStr(lb.Tokens))
				}
				live = append(live, pair{ta, tb})
			}
		case op < 8 && len(live) > 0:
			j := rng.IntN(len(live))
			p := live[j]
			live = append(live[:j], live[j+1:]...)
			if rng.IntN(4) == 0 {
				p.a.Cancel()
				p.b.Cancel()
				continue
			}
			u := Usage{PromptTokens: rng.IntN(400), CompletionTokens: rng.IntN(700), Verdict: VerdictSuccess}
			p.a.Settle(u, 0)
			p.b.Settle(u, 0)
		default:
			d := time.Duration(rng.IntN(4000)) * time.Millisecond
			clkA.Advance(d)
			clkB.Advance(d)
		}
	}
}

// fakeStore is a LimitStore that admits or refuses as told and counts its
// calls.
type fakeStore struct {
	mu                        sync.Mutex
	decision                  Decision
	reserves, settles, cancel int
	used                      []int64
	quotas                    []Quota
}

func (s *fakeStore) Reserve(q *Quota, h *Hold) Decision {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reserves++
	s.quotas = append(s.quotas, *q)
	d := s.decision
	if d.Code == "" {
		h.Reserved, h.ID = d.Reserved, "lease"
	}
	return d
}

func (s *fakeStore) Settle(h *Hold, used int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if h.ID != "lease" {
		panic("settled a hold the store did not fill")
	}
	s.settles++
	s.used = append(s.used, used)
}

func (s *fakeStore) Cancel(*Hold) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cancel++
}

func TestTenantWithoutLimitsNeverReachesTheStore(t *testing.T) {
	c, _, _ := newCtl(t, Config{Tiers: []Tier{{Name: "free"}, {Name: "paid", RPM: 10}}, DefaultTier: "free"})
	s := &fakeStore{}
	c.SetLimitStore(s)
	tk := mustReserve(t, c, Request{Tenant: "a"})
	tk.Settle(Usage{PromptTokens: 5}, 0)
	if s.reserves != 0 || s.settles != 0 {
		t.Fatalf("store called %d/%d times for a tenant with no limits", s.reserves, s.settles)
	}
	tk = mustReserve(t, c, Request{Tenant: "a", Tier: "paid"})
	tk.Settle(Usage{PromptTokens: 5}, 0)
	if s.reserves != 1 || s.settles != 1 {
		t.Fatalf("store called %d/%d times for a limited tier, want 1/1", s.reserves, s.settles)
	}
}

func TestStoreQuotaCarriesTheRequest(t *testing.T) {
	c, _, _ := newCtl(t, Config{Tiers: []Tier{{Name: "t", MaxConcurrent: 3, RPM: 10, TPM: 5000, DefaultMaxTokens: 200, FailClosed: true}},
		DefaultTier: "t", Tenants: []TenantConfig{{ID: "a", RPM: 7}}})
	s := &fakeStore{decision: Decision{Reserved: 700, Requests: 1, Tokens: 700}}
	c.SetLimitStore(s)
	mustReserve(t, c, Request{Tenant: "a", PromptTokens: 100, MaxTokens: 300, N: 2}).Settle(Usage{}, 0)
	mustReserve(t, c, Request{Tenant: "a", PromptTokens: 100}).Settle(Usage{}, 0)
	want := []Quota{
		{Tenant: "a", Tier: "t", MaxConcurrent: 3, RPM: 7, TPM: 5000, Prompt: 100, Need: 700, Explicit: true, FailClosed: true},
		{Tenant: "a", Tier: "t", MaxConcurrent: 3, RPM: 7, TPM: 5000, Prompt: 100, Need: 300, FailClosed: true},
	}
	for i, q := range s.quotas {
		if q != want[i] {
			t.Fatalf("quota %d: %+v\nwant %+v", i, q, want[i])
		}
	}
}

func TestStoreRefusalTakesNothingAndSettlementRunsOnce(t *testing.T) {
	c, _, _ := newCtl(t, oneTier(Tier{RPM: 10, TPM: 1000}))
	s := &fakeStore{decision: Decision{Code: CodeTenantRPM, RetryAfter: 3 * time.Second, Requests: 10, Tokens: 400, ResetRequests: time.Minute}}
	c.SetLimitStore(s)
	_, r := c.Reserve(Request{Tenant: "a"})
	if r == nil || r.Code != CodeTenantRPM || r.RetryAfter != 3*time.Second ||
		limStr(r.Limits.Requests) != "0/10 reset 1m0s" || limStr(r.Limits.Tokens) != "600/1000 reset 0s" {
		t.Fatalf("refusal %+v %s %s", r, limStr(r.Limits.Requests), limStr(r.Limits.Tokens))
	}
	if v := view(c, "a"); v.Inflight != 0 || s.settles+s.cancel != 0 {
		t.Fatalf("a refusal holds something: inflight %d, store settles %d cancels %d", v.Inflight, s.settles, s.cancel)
	}

	s.decision = Decision{Reserved: 300, Requests: 1, Tokens: 300}
	tk := mustReserve(t, c, Request{Tenant: "a", PromptTokens: 100, MaxTokens: 200})
	if v := view(c, "a"); v.Inflight != 1 || tk.Reserved() != 300 || limStr(tk.Limits().Tokens) != "700/1000 reset 0s" {
		t.Fatalf("inflight %d reserved %d tokens %s", v.Inflight, tk.Reserved(), limStr(tk.Limits().Tokens))
	}
	tk.Settle(Usage{PromptTokens: 100, CompletionTokens: 20}, 0)
	tk.Settle(Usage{PromptTokens: 100, CompletionTokens: 20}, 0)
	tk.Cancel()
	if s.settles != 1 || s.cancel != 0 || s.used[0] != 120 || view(c, "a").Inflight != 0 {
		t.Fatalf("settles %d cancels %d used %v inflight %d", s.settles, s.cancel, s.used, view(c, "a").Inflight)
	}
	tk = mustReserve(t, c, Request{Tenant: "a"})
	tk.Cancel()
	tk.Settle(Usage{}, 0)
	if s.settles != 1 || s.cancel != 1 {
		t.Fatalf("settles %d cancels %d after a cancel", s.settles, s.cancel)
	}
}

func TestSettleGoesToTheStoreThatAdmitted(t *testing.T) {
	c, _, _ := newCtl(t, oneTier(Tier{RPM: 10}))
	s := &fakeStore{decision: Decision{Requests: 1}}
	c.SetLimitStore(s)
	onStore := mustReserve(t, c, Request{Tenant: "a"})
	c.SetLimitStore(nil)
	own := mustReserve(t, c, Request{Tenant: "a"})
	if v := view(c, "a"); v.RequestsInWindow != 1 || v.Inflight != 2 {
		t.Fatalf("own window %d inflight %d", v.RequestsInWindow, v.Inflight)
	}
	onStore.Settle(Usage{}, 0)
	if s.settles != 1 {
		t.Fatalf("the admitting store got %d settlements", s.settles)
	}
	c.SetLimitStore(s)
	own.Cancel()
	if s.cancel != 0 || view(c, "a").RequestsInWindow != 0 || view(c, "a").Inflight != 0 {
		t.Fatalf("a request of the own state was cancelled in the store (%d) or not at home: %+v", s.cancel, view(c, "a"))
	}
}

func TestStoreDecisionsShapeTheRefusal(t *testing.T) {
	c, _, obs := newCtl(t, oneTier(Tier{RPM: 60, TPM: 3000, FailClosed: true}))
	s := &fakeStore{decision: Decision{Code: CodeFleetUnavailable, RetryAfter: time.Second}}
	c.SetLimitStore(s)
	_, r := c.Reserve(Request{Tenant: "a"})
	if r == nil || r.Status != 503 || r.Code != CodeFleetUnavailable || r.RetryAfter != time.Second ||
		r.Message != "tenant a: tier t is fail_closed and the fleet's limits cannot be checked (redis unavailable); retry in 1s" {
		t.Fatalf("fail_closed refusal %+v", r)
	}
	if obs.lastDecision() != "a/t/"+CodeFleetUnavailable {
		t.Fatalf("decision %q", obs.lastDecision())
	}

	// A local fallback's decision shows this gateway's share of the limits.
	s.decision = Decision{Code: CodeTenantRPM, RetryAfter: 2 * time.Second, Local: true, RPM: 20, TPM: 1000, Requests: 20}
	_, r = c.Reserve(Request{Tenant: "a"})
	if r == nil || r.Message != "tenant a: 20 requests per minute (rpm) exceeded (this gateway's share: the fleet's store is unreachable); retry in 2s" ||
		limStr(r.Limits.Requests) != "0/20 reset 0s" || limStr(r.Limits.Tokens) != "1000/1000 reset 0s" {
		t.Fatalf("local refusal %q %s %s", r.Message, limStr(r.Limits.Requests), limStr(r.Limits.Tokens))
	}
}

func TestLocalLimitsCounts(t *testing.T) {
	clk := newFakeClock()
	l := NewLocalLimits(clk)
	q := Quota{Tenant: "a", MaxConcurrent: 2, TPM: 1000, Prompt: 10, Need: 110, Explicit: true}
	var h1, h2, h3 Hold
	if d := l.Reserve(&q, &h1); d.Code != "" || d.Reserved != 110 {
		t.Fatalf("first: %+v", d)
	}
	if d := l.Reserve(&q, &h2); d.Code != "" {
		t.Fatalf("second: %+v", d)
	}
	if d := l.Reserve(&q, &h3); d.Code != CodeTenantConcurrency {
		t.Fatalf("third: %+v", d)
	}
	l.Settle(&h1, 50)
	l.Settle(&h1, 50) // a second settlement of one hold does nothing
	l.Cancel(&h2)
	if in, reqs, toks := l.Counts("a"); in != 0 || reqs != 1 || toks != 50 {
		t.Fatalf("counts %d %d %d, want 0 1 50", in, reqs, toks)
	}
	clk.Advance(windowLen)
	if in, reqs, toks := l.Counts("a"); in != 0 || reqs != 0 || toks != 0 {
		t.Fatalf("counts after a window %d %d %d", in, reqs, toks)
	}
}
