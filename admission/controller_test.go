package admission

import (
	"strings"
	"sync"
	"testing"
	"time"
)

// reserve is Reserve failing the test on a refusal.
func mustReserve(t *testing.T, c *Controller, req Request) *Ticket {
	t.Helper()
	tk, r := c.Reserve(req)
	if r != nil {
		t.Fatalf("Reserve(%+v) refused: %s (%s)", req, r.Code, r.Message)
	}
	return tk
}

func TestEveryLimitRefusesWithItsCode(t *testing.T) {
	for _, tc := range []struct {
		name     string
		tier     Tier
		admitted []Request // admitted first, in order, never settled
		req      Request
		code     string
		retry    time.Duration
		msg      string
	}{
		{"max_concurrent", Tier{MaxConcurrent: 2},
			[]Request{{}, {}}, Request{}, CodeTenantConcurrency, time.Second,
			"tenant a: 2 concurrent requests (max_concurrent) in flight; retry in 1s"},
		{"rpm", Tier{RPM: 3},
			[]Request{{}, {}, {}}, Request{}, CodeTenantRPM, windowLen,
			"tenant a: 3 requests per minute (rpm) exceeded; retry in 1m0s"},
		{"tpm, explicit max_tokens does not fit what is left", Tier{TPM: 1000},
			[]Request{{PromptTokens: 100, MaxTokens: 500}}, Request{PromptTokens: 100, MaxTokens: 401}, CodeTenantTPM, windowLen,
			"tenant a: 1000 tokens per minute (tpm) exceeded: reservation of 501 tokens, 400 left; retry in 1m0s"},
		{"tpm, capped default when what is left is below the prompt", Tier{TPM: 1000},
			[]Request{{PromptTokens: 100, MaxTokens: 850}}, Request{PromptTokens: 60}, CodeTenantTPM, windowLen,
			"tenant a: 1000 tokens per minute (tpm) exceeded: prompt of 60 tokens, 50 left; retry in 1m0s"},
		{"tpm, nothing left and an empty prompt", Tier{TPM: 100},
			[]Request{{MaxTokens: 100}}, Request{}, CodeTenantTPM, windowLen,
			"tenant a: 100 tokens per minute (tpm) exceeded: prompt of 1 tokens, 0 left; retry in 1m0s"},
		{"request larger than the whole limit", Tier{TPM: 1000},
			nil, Request{PromptTokens: 100, MaxTokens: 301, N: 3}, CodeRequestExceedsLimit, 0,
			"tenant a: request needs 1003 tokens (prompt 100 + 3 × max_tokens 301), more than the whole limit of 1000 tokens per minute (tpm)"},
		{"prompt alone larger than the whole limit", Tier{TPM: 1000},
			nil, Request{PromptTokens: 1001}, CodeRequestExceedsLimit, 0,
			"tenant a: prompt of 1001 tokens exceeds the whole limit of 1000 tokens per minute (tpm)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, _, obs := newCtl(t, oneTier(tc.tier))
			for _, r := range tc.admitted {
				r.Tenant = "a"
				mustReserve(t, c, r)
			}
			tc.req.Tenant = "a"
			tk, r := c.Reserve(tc.req)
			if r == nil {
				t.Fatalf("admitted (reserved %d), want %s", tk.Reserved(), tc.code)
			}
			if r.Status != 429 || r.Code != tc.code || r.RetryAfter != tc.retry || r.Message != tc.msg {
				t.Fatalf("refusal %d %s retry %s %q\nwant 429 %s retry %s %q", r.Status, r.Code, r.RetryAfter, r.Message, tc.code, tc.retry, tc.msg)
			}
			if r.CircuitOpen {
				t.Fatal("CircuitOpen on a limit refusal")
			}
			if got := obs.lastDecision(); got != "a/t/"+tc.code {
				t.Fatalf("decision %q", got)
			}
		})
	}
}

func TestRefusalConsumesNothing(t *testing.T) {
	// A tenant at max_concurrent, with rpm and tpm room: refusals of every
	// kind leave rpm, tpm and slots as they were.
	c, _, _ := newCtl(t, oneTier(Tier{MaxConcurrent: 1, RPM: 5, TPM: 1000}))
	held := mustReserve(t, c, Request{Tenant: "a", PromptTokens: 10, MaxTokens: 90})
	before := view(c, "a")
	for _, req := range []Request{
		{Tenant: "a"}, // concurrency
		{Tenant: "a", PromptTokens: 2000, MaxTokens: 1}, // checked after concurrency: still concurrency
	} {
		for range 10 {
			if _, r := c.Reserve(req); r == nil || r.Code != CodeTenantConcurrency {
				t.Fatalf("want tenant_concurrency, got %+v", r)
			}
		}
	}
	held.Settle(Usage{PromptTokens: 10, CompletionTokens: 90}, 0)
	// Now exceed tpm repeatedly: nothing is counted.
	for range 10 {
		if _, r := c.Reserve(Request{Tenant: "a", PromptTokens: 100, MaxTokens: 2000}); r == nil || r.Code != CodeRequestExceedsLimit {
			t.Fatalf("want request_exceeds_limit, got %+v", r)
		}
		if _, r := c.Reserve(Request{Tenant: "a", PromptTokens: 100, MaxTokens: 850}); r == nil || r.Code != CodeTenantTPM {
			t.Fatalf("want tenant_tpm, got %+v", r)
		}
	}
	after := view(c, "a")
	if after.RequestsInWindow != before.RequestsInWindow || after.TokensInWindow != 100 || after.Inflight != 0 {
		t.Fatalf("before %+v after %+v: refusals consumed something", before, after)
	}
	// Everything that is left is still there: 4 requests, 900 tokens.
	tk := mustReserve(t, c, Request{Tenant: "a", PromptTokens: 100, MaxTokens: 800})
	if l := tk.Limits(); l.Requests.Remaining != 3 || l.Tokens.Remaining != 0 {
		t.Fatalf("limits %s %s", limStr(l.Requests), limStr(l.Tokens))
	}
}

func TestReservationArithmetic(t *testing.T) {
	for _, tc := range []struct {
		name     string
		tier     Tier
		used     int // tokens settled before
		req      Request
		reserved int
	}{
		{"explicit max_tokens reserved in full", Tier{TPM: 10000}, 0, Request{PromptTokens: 100, MaxTokens: 500}, 600},
		{"n multiplies max_tokens", Tier{TPM: 10000}, 0, Request{PromptTokens: 100, MaxTokens: 500, N: 3}, 1600},
		{"n 0 means 1", Tier{TPM: 10000}, 0, Request{PromptTokens: 100, MaxTokens: 500, N: 0}, 600},
		{"default max tokens", Tier{TPM: 10000}, 0, Request{PromptTokens: 100}, 100 + DefaultMaxTokens},
		{"tier's default max tokens with n", Tier{TPM: 10000, DefaultMaxTokens: 200}, 0, Request{PromptTokens: 100, N: 2}, 500},
		{"default capped at what is left", Tier{TPM: 1000}, 700, Request{PromptTokens: 100}, 300},
		{"default capped to exactly the prompt", Tier{TPM: 1000}, 900, Request{PromptTokens: 100}, 100},
		{"explicit fits exactly what is left", Tier{TPM: 1000}, 700, Request{PromptTokens: 100, MaxTokens: 200}, 300},
		{"explicit with n fits exactly the whole limit", Tier{TPM: 1000}, 0, Request{PromptTokens: 100, MaxTokens: 300, N: 3}, 1000},
		{"no tpm: nothing reserved", Tier{RPM: 10}, 0, Request{PromptTokens: 100, MaxTokens: 500}, 0},
		{"rpm-only tier needs no max_tokens", Tier{RPM: 10}, 0, Request{PromptTokens: 1 << 40}, 0},
		{"negative client values count as nothing", Tier{TPM: 1000}, 0, Request{PromptTokens: -5, MaxTokens: -3, N: -2}, 1000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, _, _ := newCtl(t, oneTier(tc.tier))
			if tc.used > 0 {
				mustReserve(t, c, Request{Tenant: "a", MaxTokens: 1}).Settle(Usage{PromptTokens: tc.used}, 0)
			}
			tc.req.Tenant = "a"
			tk := mustReserve(t, c, tc.req)
			if tk.Reserved() != tc.reserved {
				t.Fatalf("reserved %d, want %d", tk.Reserved(), tc.reserved)
			}
			if v := view(c, "a"); v.TokensInWindow != tc.used+tc.reserved {
				t.Fatalf("window %d, want %d", v.TokensInWindow, tc.used+tc.reserved)
			}
		})
	}
}

func TestOverflowingRequestNeverFits(t *testing.T) {
	c, _, _ := newCtl(t, oneTier(Tier{TPM: 1000}))
	_, r := c.Reserve(Request{Tenant: "a", PromptTokens: 1, MaxTokens: 1 << 62, N: 1 << 30})
	if r == nil || r.Code != CodeRequestExceedsLimit {
		t.Fatalf("want request_exceeds_limit, got %+v", r)
	}
}

func TestSettlementReplacesTheReservation(t *testing.T) {
	for _, tc := range []struct {
		name   string
		req    Request
		usage  Usage
		window int
		tokens map[string]int
	}{
		{"usage replaces a larger reservation", Request{PromptTokens: 100, MaxTokens: 900},
			Usage{PromptTokens: 120, CompletionTokens: 30}, 150,
			map[string]int{"a/prompt/usage": 120, "a/completion/usage": 30}},
		{"usage above the reservation is charged", Request{PromptTokens: 10, MaxTokens: 10},
			Usage{PromptTokens: 50, CompletionTokens: 500}, 550,
			map[string]int{"a/prompt/usage": 50, "a/completion/usage": 500}},
		{"estimated usage", Request{PromptTokens: 100},
			Usage{PromptTokens: 100, CompletionTokens: 42, Estimated: true}, 142,
			map[string]int{"a/prompt/estimate": 100, "a/completion/estimate": 42}},
		{"failed before any token settles 0", Request{PromptTokens: 100, MaxTokens: 900},
			Usage{}, 0, map[string]int{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, _, obs := newCtl(t, oneTier(Tier{TPM: 5000}))
			tc.req.Tenant = "a"
			tk := mustReserve(t, c, tc.req)
			tk.Settle(tc.usage, 0)
			v := view(c, "a")
			if v.TokensInWindow != tc.window || v.Inflight != 0 || v.RequestsInWindow != 1 {
				t.Fatalf("view %+v, want %d tokens, nothing in flight, 1 request", v, tc.window)
			}
			for k, n := range tc.tokens {
				if obs.tokens[k] != n {
					t.Errorf("tokens %s = %d, want %d (all %v)", k, obs.tokens[k], n, obs.tokens)
				}
			}
			if len(obs.tokens) != len(tc.tokens) {
				t.Errorf("tokens reported %v, want %v", obs.tokens, tc.tokens)
			}
		})
	}
}

func TestSettleRunsExactlyOnce(t *testing.T) {
	c, _, obs := newCtl(t, oneTier(Tier{MaxConcurrent: 2, TPM: 5000}))
	a := mustReserve(t, c, Request{Tenant: "a", PromptTokens: 100, MaxTokens: 100})
	b := mustReserve(t, c, Request{Tenant: "a", PromptTokens: 100, MaxTokens: 100})
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() { a.Settle(Usage{PromptTokens: 10, CompletionTokens: 10}, 0) })
	}
	wg.Wait()
	a.Settle(Usage{PromptTokens: 1000}, 0)
	a.Cancel()
	v := view(c, "a")
	if v.Inflight != 1 || v.TokensInWindow != 20+200 {
		t.Fatalf("after 10 settles of one ticket: %+v", v)
	}
	if obs.tokens["a/prompt/usage"] != 10 {
		t.Fatalf("tokens reported %v", obs.tokens)
	}
	// The other ticket's slot is still held: one more fits, two do not.
	mustReserve(t, c, Request{Tenant: "a", MaxTokens: 1})
	if _, r := c.Reserve(Request{Tenant: "a", MaxTokens: 1}); r == nil {
		t.Fatal("a double settle gave back a slot it did not hold")
	}
	b.Settle(Usage{}, 0)
}

func TestCancelGivesBackEverything(t *testing.T) {
	c, _, obs := newCtl(t, oneTier(Tier{MaxConcurrent: 1, RPM: 1, TPM: 1000}))
	tk := mustReserve(t, c, Request{Tenant: "a", PromptTokens: 100, MaxTokens: 900})
	tk.Cancel()
	tk.Settle(Usage{PromptTokens: 100}, 0) // Cancel came first: nothing
	if v := view(c, "a"); v.Inflight != 0 || v.RequestsInWindow != 0 || v.TokensInWindow != 0 {
		t.Fatalf("after Cancel %+v", v)
	}
	if len(obs.tokens) != 0 {
		t.Fatalf("Cancel reported tokens %v", obs.tokens)
	}
	mustReserve(t, c, Request{Tenant: "a", PromptTokens: 100, MaxTokens: 900})
}

func TestRPMWindowRollsAndRetryAfterIsWhenTheOldestLeaves(t *testing.T) {
	c, clk, _ := newCtl(t, oneTier(Tier{RPM: 3}))
	mustReserve(t, c, Request{Tenant: "a"}).Settle(Usage{}, 0) // t=0
	clk.Advance(20 * time.Second)
	mustReserve(t, c, Request{Tenant: "a"}).Settle(Usage{}, 0) // t=20s
	mustReserve(t, c, Request{Tenant: "a"}).Settle(Usage{}, 0)
	clk.Advance(12*time.Second + 500*time.Millisecond) // t=32.5s
	_, r := c.Reserve(Request{Tenant: "a"})
	if r == nil || r.Code != CodeTenantRPM {
		t.Fatalf("want tenant_rpm, got %+v", r)
	}
	// The request of t=0 leaves the window at t=60s.
	if want := 27*time.Second + 500*time.Millisecond; r.RetryAfter != want {
		t.Fatalf("retry after %s, want %s", r.RetryAfter, want)
	}
	if !strings.HasSuffix(r.Message, "retry in 28s") {
		t.Fatalf("message %q", r.Message)
	}
	if l := r.Limits.Requests; l == nil || l.Remaining != 0 || l.Limit != 3 || l.Reset != 47*time.Second+500*time.Millisecond {
		t.Fatalf("limits %s", limStr(l))
	}
	clk.Advance(r.RetryAfter - time.Millisecond)
	if _, r := c.Reserve(Request{Tenant: "a"}); r == nil {
		t.Fatal("admitted before the oldest request left")
	}
	clk.Advance(time.Millisecond)
	tk := mustReserve(t, c, Request{Tenant: "a"})
	if l := tk.Limits(); l.Requests.Remaining != 0 || l.Tokens != nil {
		t.Fatalf("limits %s %s", limStr(l.Requests), limStr(l.Tokens))
	}
}

func TestTPMRetryAfterIsWhenEnoughTokensLeave(t *testing.T) {
	c, clk, _ := newCtl(t, oneTier(Tier{TPM: 1000}))
	mustReserve(t, c, Request{Tenant: "a", MaxTokens: 1}).Settle(Usage{PromptTokens: 300}, 0) // t=0
	clk.Advance(10 * time.Second)
	mustReserve(t, c, Request{Tenant: "a", MaxTokens: 1}).Settle(Usage{PromptTokens: 600}, 0) // t=10s
	// 100 left: 400 needs the 300 of t=0 to leave (t=60s); 800 needs both (t=70s).
	for _, tc := range []struct {
		max   int
		retry time.Duration
	}{{399, 50 * time.Second}, {799, 60 * time.Second}} {
		_, r := c.Reserve(Request{Tenant: "a", PromptTokens: 1, MaxTokens: tc.max})
		if r == nil || r.Code != CodeTenantTPM || r.RetryAfter != tc.retry {
			t.Fatalf("max_tokens %d: %+v, want tenant_tpm retry %s", tc.max, r, tc.retry)
		}
		if l := r.Limits.Tokens; l.Remaining != 100 || l.Reset != 60*time.Second {
			t.Fatalf("limits %s", limStr(l))
		}
	}
}

func TestLimitsOnlyForConfiguredLimits(t *testing.T) {
	for _, tc := range []struct {
		name     string
		tier     Tier
		req, tok bool
	}{
		{"none", Tier{MaxConcurrent: 5}, false, false},
		{"rpm", Tier{RPM: 5}, true, false},
		{"tpm", Tier{TPM: 5000}, false, true},
		{"both", Tier{RPM: 5, TPM: 5000}, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, _, _ := newCtl(t, oneTier(tc.tier))
			l := mustReserve(t, c, Request{Tenant: "a", PromptTokens: 10, MaxTokens: 90}).Limits()
			if (l.Requests != nil) != tc.req || (l.Tokens != nil) != tc.tok {
				t.Fatalf("limits %s %s", limStr(l.Requests), limStr(l.Tokens))
			}
			if tc.req && (l.Requests.Remaining != 4 || l.Requests.Reset != windowLen) {
				t.Fatalf("requests %s", limStr(l.Requests))
			}
			if tc.tok && (l.Tokens.Remaining != 4900 || l.Tokens.Reset != windowLen) {
				t.Fatalf("tokens %s", limStr(l.Tokens))
			}
		})
	}
}

func TestRemainingNeverBelowZero(t *testing.T) {
	c, _, _ := newCtl(t, oneTier(Tier{TPM: 100}))
	mustReserve(t, c, Request{Tenant: "a", MaxTokens: 1}).Settle(Usage{PromptTokens: 5000}, 0)
	_, r := c.Reserve(Request{Tenant: "a", MaxTokens: 1})
	if r == nil || r.Limits.Tokens.Remaining != 0 {
		t.Fatalf("refusal %+v", r)
	}
}

func TestRequestExceedingTheLimitShowsTheUntouchedRemaining(t *testing.T) {
	c, _, _ := newCtl(t, oneTier(Tier{TPM: 1000, RPM: 10}))
	mustReserve(t, c, Request{Tenant: "a", PromptTokens: 100, MaxTokens: 100})
	_, r := c.Reserve(Request{Tenant: "a", PromptTokens: 100, MaxTokens: 5000})
	if r == nil || r.Code != CodeRequestExceedsLimit || r.RetryAfter != 0 {
		t.Fatalf("refusal %+v", r)
	}
	if r.Limits.Tokens.Remaining != 800 || r.Limits.Requests.Remaining != 9 {
		t.Fatalf("limits %s %s", limStr(r.Limits.Requests), limStr(r.Limits.Tokens))
	}
}

func TestTenantsHaveTheirOwnCountersAndOverrides(t *testing.T) {
	cfg := Config{
		Tiers:       []Tier{{Name: "free", RPM: 1}, {Name: "gold", RPM: 100}},
		Tenants:     []TenantConfig{{ID: "vip", Tier: "free", RPM: 3}, {ID: "g", Tier: "gold"}},
		DefaultTier: "free",
	}
	c, _, _ := newCtl(t, cfg)
	for _, id := range []string{"x", "y", "z"} {
		mustReserve(t, c, Request{Tenant: id}) // each its own rpm 1
		if _, r := c.Reserve(Request{Tenant: id}); r == nil || r.Code != CodeTenantRPM {
			t.Fatalf("%s: second request %+v", id, r)
		}
	}
	for range 3 {
		mustReserve(t, c, Request{Tenant: "vip"})
	}
	if _, r := c.Reserve(Request{Tenant: "vip"}); r == nil || !strings.Contains(r.Message, "3 requests per minute") {
		t.Fatalf("vip override: %+v", r)
	}
	// A key's tier overrides the tenant's; the tenant's counters are shared.
	tk := mustReserve(t, c, Request{Tenant: "x", Tier: "gold"})
	if tk.Tier().Name != "gold" || tk.Tier().RPM != 100 || tk.Tenant() != "x" {
		t.Fatalf("ticket %s %+v", tk.Tenant(), tk.Tier())
	}
	if tr, ok := c.Tier("vip", ""); !ok || tr.Name != "free" || tr.RPM != 3 || tr.DefaultMaxTokens != DefaultMaxTokens ||
		tr.Queue != DefaultQueue || tr.QueueTimeout != DefaultQueueTimeout {
		t.Fatalf("Tier(vip) = %+v", tr)
	}
}

func TestNoTierIsRefusedWith401(t *testing.T) {
	c, _, _ := newCtl(t, Config{Tiers: []Tier{{Name: "gold"}}})
	for _, req := range []Request{{Tenant: "stranger"}, {Tenant: "a", Tier: "platinum"}} {
		if _, r := c.Reserve(req); r == nil || r.Status != 401 || r.Code != CodeUnknownKey {
			t.Fatalf("%+v: %+v", req, r)
		}
		if _, ok := c.Tier(req.Tenant, req.Tier); ok {
			t.Fatalf("Tier(%+v) ok", req)
		}
	}
}

func TestSetConfigKeepsWindows(t *testing.T) {
	c, _, _ := newCtl(t, oneTier(Tier{RPM: 2}))
	mustReserve(t, c, Request{Tenant: "a"})
	mustReserve(t, c, Request{Tenant: "a"})
	if err := c.SetConfig(oneTier(Tier{RPM: 3})); err != nil {
		t.Fatal(err)
	}
	mustReserve(t, c, Request{Tenant: "a"})
	if _, r := c.Reserve(Request{Tenant: "a"}); r == nil {
		t.Fatal("the reload forgot the window")
	}
	if err := c.SetConfig(Config{Tiers: []Tier{{Name: "t", RPM: -1}}}); err == nil {
		t.Fatal("invalid config applied")
	}
}

func TestBoundedTenantStates(t *testing.T) {
	cfg := oneTier(Tier{})
	cfg.Tenants = []TenantConfig{{ID: "listed"}}
	c, clk, _ := newCtl(t, cfg)
	held := make([]*Ticket, 0, MaxTenantStates)
	for i := range MaxTenantStates {
		held = append(held, mustReserve(t, c, Request{Tenant: "h" + itoa(i)}))
	}
	// Busy states are not evicted: a new one is refused, configured and
	// known ones are admitted.
	if _, r := c.Reserve(Request{Tenant: "new"}); r == nil || r.Code != CodeSaturated || r.RetryAfter <= 0 {
		t.Fatalf("state %d: %+v", MaxTenantStates+1, r)
	}
	mustReserve(t, c, Request{Tenant: "listed"})
	mustReserve(t, c, Request{Tenant: UnknownTenant})
	mustReserve(t, c, Request{Tenant: "h1"})
	for _, tk := range held {
		tk.Settle(Usage{}, 0)
	}
	// Idle now (no tokens were used, but their requests are in the window
	// for a minute), then evictable.
	clk.Advance(windowLen + time.Second)
	mustReserve(t, c, Request{Tenant: "new"})
	if n := len(c.Tenants()); n > MaxTenantStates+2 {
		t.Fatalf("%d states", n)
	}
}

func itoa(i int) string {
	b := []byte{}
	for {
		b = append([]byte{byte('0' + i%10)}, b...)
		if i /= 10; i == 0 {
			return string(b)
		}
	}
}

func TestConcurrentReservesNeverOvershoot(t *testing.T) {
	c, _, _ := newCtl(t, oneTier(Tier{MaxConcurrent: 3, RPM: 1000, TPM: 1 << 30}))
	var mu sync.Mutex
	in, peak := 0, 0
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 100 {
				tk, r := c.Reserve(Request{Tenant: "a", MaxTokens: 1})
				if r != nil {
					continue
				}
				mu.Lock()
				in++
				peak = max(peak, in)
				mu.Unlock()
				mu.Lock()
				in--
				mu.Unlock()
				tk.Settle(Usage{}, 0)
			}
		})
	}
	wg.Wait()
	v := view(c, "a")
	if peak > 3 || v.Inflight != 0 || v.RequestsInWindow > 1000 {
		t.Fatalf("peak %d, view %+v", peak, v)
	}
}
