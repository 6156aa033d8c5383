package admission

import (
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// run admits one request of tenant and settles it with u and queueWait.
func run(t *testing.T, c *Controller, tenant string, prompt int, u Usage, queueWait time.Duration) {
	t.Helper()
	tk := mustReserve(t, c, Request{Tenant: tenant, PromptTokens: prompt})
	tk.Settle(u, queueWait)
}

func TestTenantBreakerOpens(t *testing.T) {
	ok := Usage{Verdict: VerdictSuccess, TTFT: 100 * time.Millisecond}
	for _, tc := range []struct {
		name   string
		tier   Tier
		prompt int
		u      Usage
		wait   time.Duration
		opens  bool
		reason string
	}{
		{"slow ttft", Tier{TTFTSLO: time.Second}, 10,
			Usage{Verdict: VerdictSuccess, TTFT: 1100 * time.Millisecond}, 0, true, "slow call: ttft 1.1s > objective 1s"},
		{"ttft within the prompt's budget", Tier{TTFTSLO: time.Second, TTFTPer1kPrompt: time.Second}, 2000,
			Usage{Verdict: VerdictSuccess, TTFT: 2900 * time.Millisecond, PromptTokens: 2000}, 0, false, ""},
		{"ttft above the prompt's budget", Tier{TTFTSLO: time.Second, TTFTPer1kPrompt: time.Second}, 2000,
			Usage{Verdict: VerdictSuccess, TTFT: 3100 * time.Millisecond, PromptTokens: 2000}, 0, true, "objective 3s"},
		{"prompt estimate when usage has no prompt", Tier{TTFTSLO: time.Second, TTFTPer1kPrompt: time.Second}, 2000,
			Usage{Verdict: VerdictSuccess, TTFT: 2900 * time.Millisecond}, 0, false, ""},
		{"slow queue wait", Tier{QueueWaitSLO: 5 * time.Second}, 10,
			ok, 6 * time.Second, true, "queue wait 6s > queue_wait_slo 5s"},
		{"queue wait within objective", Tier{QueueWaitSLO: 5 * time.Second}, 10,
			ok, 5 * time.Second, false, ""},
		{"tenant failures", Tier{Breaker: &breaker.Settings{}}, 10,
			Usage{Verdict: VerdictFailure}, 0, true, "tenant's own failure"},
		{"neutral outcomes never", Tier{Breaker: &breaker.Settings{}, TTFTSLO: time.Second}, 10,
			Usage{Verdict: VerdictNeutral, TTFT: time.Hour}, time.Hour, false, ""},
		{"no breaker without settings or objectives", Tier{}, 10,
			Usage{Verdict: VerdictFailure}, 0, false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, _, obs := newCtl(t, oneTier(tc.tier))
			for range breaker.DefaultConsecutiveFailures {
				run(t, c, "a", tc.prompt, tc.u, tc.wait)
			}
			_, r := c.Reserve(Request{Tenant: "a"})
			if !tc.opens {
				if r != nil {
					t.Fatalf("refused: %+v", r)
				}
				return
			}
			if r == nil || r.Code != CodeTenantCircuitOpen || !r.CircuitOpen || r.Status != 429 {
				t.Fatalf("want tenant_circuit_open, got %+v", r)
			}
			if r.RetryAfter != breaker.DefaultOpenFor || !strings.Contains(r.Message, "retry in 10s") {
				t.Fatalf("retry after %s: %q", r.RetryAfter, r.Message)
			}
			if len(obs.transitions) != 1 || obs.transitions[0].To != breaker.Open || !strings.Contains(obs.transitions[0].Reason, tc.reason) {
				t.Fatalf("transitions %+v, want one to open with %q", obs.transitions, tc.reason)
			}
			// Other tenants of the same tier are unaffected.
			run(t, c, "b", 10, Usage{Verdict: VerdictSuccess}, 0)
			if v := view(c, "a"); v.Breaker == nil || v.Breaker.State != breaker.Open {
				t.Fatalf("view %+v", v)
			}
		})
	}
}

func TestTenantBreakerSlowRatio(t *testing.T) {
	tier := Tier{TTFTSLO: time.Second, Breaker: &breaker.Settings{SlowRatio: 0.5, MinRequests: 4, ConsecutiveFailures: -1}}
	c, _, obs := newCtl(t, oneTier(tier))
	fast := Usage{Verdict: VerdictSuccess, TTFT: 500 * time.Millisecond}
	slow := Usage{Verdict: VerdictSuccess, TTFT: 2 * time.Second}
	for _, u := range []Usage{fast, slow, fast} {
		run(t, c, "a", 1, u, 0)
	}
	if tk, r := c.Reserve(Request{Tenant: "a"}); r != nil {
		t.Fatalf("open below MinRequests: %+v", r)
	} else {
		tk.Cancel() // no verdict: not counted
	}
	run(t, c, "a", 1, slow, 0) // 2 slow of 4
	if _, r := c.Reserve(Request{Tenant: "a"}); r == nil || r.Code != CodeTenantCircuitOpen {
		t.Fatalf("want open, got %+v", r)
	}
	if got := obs.transitions[0].Reason; !strings.Contains(got, "slow call ratio 2/4") || !strings.Contains(got, "objective 1s") {
		t.Fatalf("reason %q", got)
	}
}

func TestTenantBreakerHalfOpenAdmitsProbes(t *testing.T) {
	fail, okU := Usage{Verdict: VerdictFailure}, Usage{Verdict: VerdictSuccess}
	for _, tc := range []struct {
		name   string
		probes []Usage
		want   breaker.State
	}{
		{"probes succeed: closed", []Usage{okU, okU}, breaker.Closed},
		{"a probe fails: open again", []Usage{okU, fail}, breaker.Open},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tier := Tier{Breaker: &breaker.Settings{HalfOpenProbes: 1, RecoverySuccesses: 2}}
			c, clk, obs := newCtl(t, oneTier(tier))
			for range 3 {
				run(t, c, "a", 1, fail, 0)
			}
			clk.Advance(breaker.DefaultOpenFor - time.Millisecond)
			if _, r := c.Reserve(Request{Tenant: "a"}); r == nil || r.RetryAfter != time.Second {
				t.Fatalf("before the cooldown's end: %+v", r)
			}
			clk.Advance(time.Millisecond)
			for i, u := range tc.probes {
				probe := mustReserve(t, c, Request{Tenant: "a"})
				if _, r := c.Reserve(Request{Tenant: "a"}); r == nil || r.Code != CodeTenantCircuitOpen {
					t.Fatalf("probe %d: a second request while it is out: %+v", i, r)
				}
				probe.Settle(u, 0)
			}
			if st := c.TenantBreaker("a").State(); st != tc.want {
				t.Fatalf("state %s, want %s; transitions %+v", st, tc.want, obs.transitions)
			}
			if last := obs.transitions[len(obs.transitions)-1]; last.To != tc.want || last.Key != "a" {
				t.Fatalf("last transition %+v", last)
			}
		})
	}
}

func TestRefusedProbeFreesItsSlot(t *testing.T) {
	tier := Tier{RPM: 3, Breaker: &breaker.Settings{HalfOpenProbes: 1}}
	c, clk, _ := newCtl(t, oneTier(tier))
	for range 3 {
		run(t, c, "a", 1, Usage{Verdict: VerdictFailure}, 0) // rpm full too
	}
	clk.Advance(breaker.DefaultOpenFor)
	for i := range 3 {
		// The breaker gives the probe permit, rpm refuses: the permit
		// must come back, or the next would see tenant_circuit_open.
		if _, r := c.Reserve(Request{Tenant: "a"}); r == nil || r.Code != CodeTenantRPM {
			t.Fatalf("request %d: %+v, want tenant_rpm", i, r)
		}
	}
	clk.Advance(windowLen)
	probe := mustReserve(t, c, Request{Tenant: "a"})
	probe.Cancel() // refused later by a pool: slot back, no verdict
	mustReserve(t, c, Request{Tenant: "a"}).Settle(Usage{Verdict: VerdictSuccess}, 0)
	mustReserve(t, c, Request{Tenant: "a"}).Settle(Usage{Verdict: VerdictSuccess}, 0)
	if st := c.TenantBreaker("a").State(); st != breaker.Closed {
		t.Fatalf("state %s", st)
	}
}

func TestAdminForcesATenantBreakerOpen(t *testing.T) {
	cfg := oneTier(Tier{TTFTSLO: time.Second})
	cfg.Tenants = []TenantConfig{{ID: "quiet"}}
	c, _, _ := newCtl(t, cfg)
	b := c.TenantBreaker("quiet") // no request yet: created for the admin
	if b == nil {
		t.Fatal("no breaker for a configured tenant with objectives")
	}
	b.ForceOpen(time.Minute, "operator")
	_, r := c.Reserve(Request{Tenant: "quiet"})
	if r == nil || r.Code != CodeTenantCircuitOpen || r.RetryAfter != time.Minute {
		t.Fatalf("%+v", r)
	}
	if c.TenantBreaker("nobody") != nil {
		t.Fatal("breaker for an unknown tenant")
	}
}
