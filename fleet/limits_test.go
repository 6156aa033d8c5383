package fleet

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
	"github.com/llmproxy/caddy-llm-proxy/internal/redistest"
)

// Fast lease settings for tests: a lease lives 600ms, renewed every 150ms.
const (
	testLeaseTTL = 600 * time.Millisecond
	testRenew    = 150 * time.Millisecond
)

// gateway is one instance of a test fleet: its connection, limit store and
// admission controller.
type limitsGateway struct {
	*harness
	l   *Limits
	ctl *admission.Controller
}

// fleetOf starts n gateways on the Redis at addr, all with cfg's tenants
// and tiers; fc and lc override the fleet and limit settings.
func limitsFleet(t *testing.T, addr string, n int, cfg admission.Config, fc Config, lc LimitsConfig) []*limitsGateway {
	t.Helper()
	if lc.LeaseTTL == 0 {
		lc.LeaseTTL, lc.RenewEvery = testLeaseTTL, testRenew
	}
	if fc.OpTimeout == 0 && fc.Refresh == 0 {
		// These tests count admissions against Redis's windows: an op that
		// times out fails open (a local share), and 40 ms (testOpTimeout)
		// was crossed under a loaded make test (CI: "65 admitted, limit
		// 60", "admitted 15, want 3", an i/o timeout). Tests of what a
		// timeout does set their own.
		fc.OpTimeout, fc.Refresh = 200*time.Millisecond, 500*time.Millisecond
	}
	gws := make([]*limitsGateway, n)
	for i := range gws {
		c := fc
		c.URL = "redis://" + addr
		c.InstanceID = "gw-" + strconv.Itoa(i)
		h := openTicking(t, c)
		l, err := NewLimits(h.Client, lc)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(l.Close)
		ctl, err := admission.NewController(cfg, clock.Real, nil)
		if err != nil {
			t.Fatal(err)
		}
		ctl.SetLimitStore(l)
		gws[i] = &limitsGateway{harness: h, l: l, ctl: ctl}
	}
	return gws
}

func limTier(t admission.Tier) admission.Config {
	t.Name = "t"
	return admission.Config{Tiers: []admission.Tier{t}, DefaultTier: "t"}
}

// direct is a plain client on the test's Redis, for its own checks.
func limDirect(t *testing.T, addr string) *redis.Client {
	t.Helper()
	r := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { _ = r.Close() })
	return r
}

// window returns a tenant's request and token totals in Redis.
func limWindow(t *testing.T, r *redis.Client, tenant string) (reqs, toks int64) {
	t.Helper()
	v, err := r.HMGet(context.Background(), buildKey(DefaultKeyPrefix, "tenant:"+tenant, "win"), "R", "T").Result()
	if err != nil {
		t.Fatal(err)
	}
	n := func(x any) int64 {
		s, _ := x.(string)
		i, _ := strconv.ParseInt(s, 10, 64)
		return i
	}
	return n(v[0]), n(v[1])
}

// leases returns the number of a tenant's leases in Redis, expired or not.
func limLeases(t *testing.T, r *redis.Client, tenant string) int64 {
	t.Helper()
	n, err := r.ZCard(context.Background(), buildKey(DefaultKeyPrefix, "tenant:"+tenant, "leases")).Result()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func TestLimitsKeysOfATenantShareAHashTag(t *testing.T) {
	l := &Limits{c: &Client{cfg: Config{KeyPrefix: "p:"}}}
	got := l.keys("acme", "gw/1.a")
	want := []string{"p:{tenant:acme}:win", "p:{tenant:acme}:leases", "p:{tenant:acme}:hold:gw/1.a", "p:{tenant:acme}:done:gw/1.a"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("keys %v\nwant %v", got, want)
	}
}

func TestLimitsRPMHoldsAcrossTheFleet(t *testing.T) {
	// Three gateways send a tenant with rpm 60 about 350 requests over 2.5
	// windows of 1.2s: in any window at most 60 are admitted, summed over the
	// gateways, and the window keeps moving.
	s := redistest.Start(t, redistest.Options{})
	const win = 1200 * time.Millisecond
	gws := limitsFleet(t, s.Addr(), 3, limTier(admission.Tier{RPM: 60}), Config{}, LimitsConfig{window: win})
	var mu sync.Mutex
	type span struct{ start, end time.Time }
	var admitted []span // around the Redis time of each admission
	var wg sync.WaitGroup
	end := time.Now().Add(5 * win / 2)
	for _, g := range gws {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(end) {
				start := time.Now()
				tk, r := g.ctl.Reserve(admission.Request{Tenant: "acme"})
				if r == nil {
					mu.Lock()
					admitted = append(admitted, span{start, time.Now()})
					mu.Unlock()
					tk.Settle(admission.Usage{}, 0)
				} else if r.Code != admission.CodeTenantRPM {
					t.Errorf("refused with %s: %s", r.Code, r.Message)
					return
				}
				time.Sleep(8 * time.Millisecond)
			}
		}()
	}
	wg.Wait()
	// A slot's requests leave the window between 59 and 60 slots after
	// they came: within any window less one slot at most 60. Counted are
	// only the admissions certainly within one (Redis's time of each lies
	// between its start and end here), so a miss is a real one.
	within := gws[0].l.window() - gws[0].l.window()/60
	most := 0
	for _, a := range admitted {
		n := 0
		for _, b := range admitted {
			if b == a || !b.start.Before(a.end) && b.end.Before(a.start.Add(within)) {
				n++
			}
		}
		most = max(most, n)
	}
	if most > 60 {
		t.Fatalf("%d requests admitted within %v across the fleet, limit 60", most, within)
	}
	if len(admitted) < 120 {
		t.Fatalf("only %d admitted in 2.5 windows (want at least 120: the window moves)", len(admitted))
	}
	t.Logf("%d admitted over 2.5 windows; at most %d within %v", len(admitted), most, within)
}

func TestLimitsTPMReservationsHoldAcrossTheFleet(t *testing.T) {
	// 20 concurrent requests of 300 tokens (100 prompt + max_tokens 200)
	// on tpm 1000, spread over three gateways: the fleet's reservations fit
	// three, every other request is refused at once.
	s := redistest.Start(t, redistest.Options{})
	gws := limitsFleet(t, s.Addr(), 3, limTier(admission.Tier{TPM: 1000}), Config{}, LimitsConfig{})
	var ok, tpm atomic.Int32
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			_, r := gws[i%3].ctl.Reserve(admission.Request{Tenant: "acme", PromptTokens: 100, MaxTokens: 200})
			switch {
			case r == nil:
				ok.Add(1)
			case r.Code == admission.CodeTenantTPM && r.RetryAfter > 0:
				tpm.Add(1)
			default:
				t.Errorf("refusal %s %s", r.Code, r.Message)
			}
		}()
	}
	close(start)
	wg.Wait()
	if ok.Load() != 3 || tpm.Load() != 17 {
		t.Fatalf("admitted %d, refused tenant_tpm %d; want 3 and 17", ok.Load(), tpm.Load())
	}
	if _, toks := limWindow(t, limDirect(t, s.Addr()), "acme"); toks != 900 {
		t.Fatalf("tokens reserved in redis %d, want 900", toks)
	}
}

func TestLimitsEachTenantHasItsOwnCounters(t *testing.T) {
	s := redistest.Start(t, redistest.Options{})
	gws := limitsFleet(t, s.Addr(), 2, limTier(admission.Tier{RPM: 2}), Config{}, LimitsConfig{})
	for _, tenant := range []string{"a", "b"} {
		for i := range 3 {
			_, r := gws[i%2].ctl.Reserve(admission.Request{Tenant: tenant})
			if (r == nil) != (i < 2) {
				t.Fatalf("tenant %s request %d: refusal %v", tenant, i, r)
			}
		}
	}
}

func TestLimitsSettlementAdjustsOnceAndAReplayIsANoop(t *testing.T) {
	s := redistest.Start(t, redistest.Options{})
	g := limitsFleet(t, s.Addr(), 1, limTier(admission.Tier{RPM: 100, TPM: 10000}), Config{}, LimitsConfig{})[0]
	r := limDirect(t, s.Addr())

	q := admission.Quota{Tenant: "acme", RPM: 100, TPM: 10000, Prompt: 100, Need: 300, Explicit: true}
	var h admission.Hold
	d := g.l.Reserve(&q, &h)
	if d.Code != "" || d.Local || d.Reserved != 300 || d.Requests != 1 || d.Tokens != 300 || d.Left != 10000 {
		t.Fatalf("reserve: %+v", d)
	}
	if d.ResetRequests <= 0 || d.ResetRequests > time.Minute || d.ResetTokens <= 0 {
		t.Fatalf("resets %v %v", d.ResetRequests, d.ResetTokens)
	}
	id := h.ID
	g.l.Settle(&h, 120)
	if reqs, toks := limWindow(t, r, "acme"); reqs != 1 || toks != 120 {
		t.Fatalf("after settling 120 of 300: %d requests, %d tokens", reqs, toks)
	}
	// The same settlement again (a retry whose first reply was lost).
	p := pendingSettle{tenant: "acme", id: id, used: 120}
	if err := g.l.send(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	g.l.Settle(&h, 120) // the hold is spent: nothing
	if reqs, toks := limWindow(t, r, "acme"); reqs != 1 || toks != 120 {
		t.Fatalf("after a replay: %d requests, %d tokens", reqs, toks)
	}
	if n, _ := r.Exists(context.Background(), buildKey(DefaultKeyPrefix, "tenant:acme", "hold", id)).Result(); n != 0 {
		t.Fatal("the hold outlived its settlement")
	}

	// A cancellation gives everything back; a second one does nothing.
	d = g.l.Reserve(&q, &h)
	if d.Code != "" || d.Requests != 2 || d.Tokens != 420 {
		t.Fatalf("second reserve: %+v", d)
	}
	id = h.ID
	g.l.Cancel(&h)
	if err := g.l.send(context.Background(), pendingSettle{tenant: "acme", id: id, cancel: true}); err != nil {
		t.Fatal(err)
	}
	if reqs, toks := limWindow(t, r, "acme"); reqs != 1 || toks != 120 {
		t.Fatalf("after a cancellation: %d requests, %d tokens", reqs, toks)
	}
	// A default reservation is capped at what is left.
	q2 := admission.Quota{Tenant: "acme", TPM: 10000, Prompt: 10, Need: 50000}
	if d := g.l.Reserve(&q2, &h); d.Code != "" || d.Reserved != 10000-120 {
		t.Fatalf("capped reserve: %+v", d)
	}
	g.l.Settle(&h, 0)
	if g.l.Pending() != 0 {
		t.Fatalf("%d settlements pending with redis up", g.l.Pending())
	}
}

func TestLimitsRefusalsMatchTheLocalOnes(t *testing.T) {
	// The same requests on a Redis-backed controller and on one with its
	// own state: the same codes, messages, Retry-After (within the second
	// their windows' slots may be apart) and remaining counts.
	s := redistest.Start(t, redistest.Options{})
	cfg := limTier(admission.Tier{MaxConcurrent: 4, RPM: 5, TPM: 1000})
	g := limitsFleet(t, s.Addr(), 1, cfg, Config{}, LimitsConfig{})[0]
	own, _ := admission.NewController(cfg, clock.Real, nil)
	reqs := []admission.Request{
		{PromptTokens: 100, MaxTokens: 200},
		{PromptTokens: 100, MaxTokens: 700},  // tpm: 601 left... reserves 800? no: 700 left
		{PromptTokens: 2000},                 // larger than the whole tpm
		{PromptTokens: 100, MaxTokens: 2000}, // explicit, larger than the whole tpm
		{PromptTokens: 10},                   // capped at what is left
		{PromptTokens: 10},                   // nothing left: tpm
		{}, {}, {},                           // max_concurrent, then rpm
	}
	for i, rq := range reqs {
		rq.Tenant = "acme"
		_, ra := own.Reserve(rq)
		_, rb := g.ctl.Reserve(rq)
		if (ra == nil) != (rb == nil) {
			t.Fatalf("request %d: own %v, fleet %v", i, ra, rb)
		}
		if ra == nil {
			continue
		}
		// The messages end with "; retry in <RetryAfter>", which may be a
		// second apart like RetryAfter itself (1m0s against 59s).
		msg := func(m string) string {
			if i := strings.LastIndex(m, "; retry in "); i >= 0 {
				return m[:i]
			}
			return m
		}
		if d := ra.RetryAfter - rb.RetryAfter; ra.Code != rb.Code || msg(ra.Message) != msg(rb.Message) || d > time.Second || d < -time.Second ||
			fmt.Sprint(ra.Limits.Tokens.Remaining) != fmt.Sprint(rb.Limits.Tokens.Remaining) {
			t.Fatalf("request %d:\nown   %s %q %v\nfleet %s %q %v", i, ra.Code, ra.Message, ra.RetryAfter, rb.Code, rb.Message, rb.RetryAfter)
		}
	}
}

func TestLimitsConcurrencyLeasesAcrossTheFleet(t *testing.T) {
	// max_concurrent 2: two long requests on two gateways hold exactly two
	// leases while they live (renewed past several lease ttls); a third,
	// on the third gateway, is refused throughout; after they end the
	// count is 0, and stays 0 (never negative) whatever is replayed.
	s := redistest.Start(t, redistest.Options{})
	gws := limitsFleet(t, s.Addr(), 3, limTier(admission.Tier{MaxConcurrent: 2}), Config{}, LimitsConfig{})
	r := limDirect(t, s.Addr())
	a := limAdmit(t, gws[0].ctl, "acme")
	b := limAdmit(t, gws[1].ctl, "acme")
	for end := time.Now().Add(3 * testLeaseTTL); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if n := limLeases(t, r, "acme"); n != 2 {
			t.Fatalf("%d leases while two requests live", n)
		}
		if _, rf := gws[2].ctl.Reserve(admission.Request{Tenant: "acme"}); rf == nil || rf.Code != admission.CodeTenantConcurrency {
			t.Fatalf("a third request: %v", rf)
		}
	}
	a.Settle(admission.Usage{}, 0)
	b.Cancel()
	a.Settle(admission.Usage{}, 0)
	if n := limLeases(t, r, "acme"); n != 0 {
		t.Fatalf("%d leases after both ended", n)
	}
	for _, g := range gws[:2] {
		if g.l.Leases() != 0 {
			t.Fatalf("%s still renews %d leases", g.InstanceID(), g.l.Leases())
		}
	}
	// Two new ones are admitted at once: nothing was left behind.
	limAdmit(t, gws[2].ctl, "acme").Settle(admission.Usage{}, 0)
	limAdmit(t, gws[2].ctl, "acme")
	limAdmit(t, gws[0].ctl, "acme")
}

func limAdmit(t *testing.T, c *admission.Controller, tenant string) *admission.Ticket {
	t.Helper()
	tk, r := c.Reserve(admission.Request{Tenant: tenant})
	if r != nil {
		t.Fatalf("refused: %s %s", r.Code, r.Message)
	}
	return tk
}

func TestLimitsAKilledInstancesLeaseFreesWithinOneTTL(t *testing.T) {
	s := redistest.Start(t, redistest.Options{})
	gws := limitsFleet(t, s.Addr(), 2, limTier(admission.Tier{MaxConcurrent: 1}), Config{}, LimitsConfig{})
	limAdmit(t, gws[0].ctl, "acme") // never settled: its gateway dies
	time.Sleep(2 * testRenew)       // renewed at least once
	gws[0].l.Close()                // no more heartbeats
	killed := time.Now()
	for {
		_, r := gws[1].ctl.Reserve(admission.Request{Tenant: "acme"})
		if r == nil {
			break
		}
		if r.Code != admission.CodeTenantConcurrency {
			t.Fatalf("refused with %s", r.Code)
		}
		if time.Since(killed) > testLeaseTTL+100*time.Millisecond {
			t.Fatalf("the dead gateway's slot still held %v after it stopped renewing (ttl %v)", time.Since(killed), testLeaseTTL)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("slot free %v after its gateway stopped renewing (lease ttl %v)", time.Since(killed).Round(time.Millisecond), testLeaseTTL)
}

func TestLimitsRenewalNeverRecreatesAnExpiredLease(t *testing.T) {
	s := redistest.Start(t, redistest.Options{})
	g := limitsFleet(t, s.Addr(), 1, limTier(admission.Tier{MaxConcurrent: 5}), Config{}, LimitsConfig{})[0]
	r := limDirect(t, s.Addr())
	tk := limAdmit(t, g.ctl, "acme")
	key := buildKey(DefaultKeyPrefix, "tenant:acme", "leases")
	// The lease expires (as after Redis was away longer than its ttl)
	// while the request still runs here.
	ids, _ := r.ZRange(context.Background(), key, 0, -1).Result()
	if len(ids) != 1 {
		t.Fatalf("leases %v", ids)
	}
	r.ZAdd(context.Background(), key, redis.Z{Score: 1, Member: ids[0]})
	waitFor(t, "the renewal to give up the lease", 5*testRenew, func() bool { return g.l.Leases() == 0 })
	if n := limLeases(t, r, "acme"); n != 0 {
		t.Fatalf("%d leases after the renewal: it brought an expired one back", n)
	}
	tk.Settle(admission.Usage{}, 0)
	if n := limLeases(t, r, "acme"); n != 0 {
		t.Fatalf("%d leases after the settlement", n)
	}
}

func TestLimitsRedisAwayFallsBackToLocalShares(t *testing.T) {
	for _, tc := range []struct {
		name       string
		fail, mend func(p *redistest.Proxy, s *redistest.Server)
		ambiguous  bool
	}{
		{"stopped", func(_ *redistest.Proxy, s *redistest.Server) { s.Stop() }, func(_ *redistest.Proxy, s *redistest.Server) { s.Restart() }, false},
		{"blackholed", func(p *redistest.Proxy, _ *redistest.Server) { p.Blackhole() }, func(p *redistest.Proxy, _ *redistest.Server) { p.Pass() }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := redistest.Start(t, redistest.Options{})
			p := redistest.NewProxy(t, s.Addr())
			cfg := admission.Config{Tiers: []admission.Tier{
				{Name: "open", RPM: 30, MaxConcurrent: 6},
				{Name: "strict", RPM: 30, FailClosed: true},
			}, DefaultTier: "open"}
			g := limitsFleet(t, p.Addr(), 1, cfg, Config{ExpectedInstances: 3, OpTimeout: testOpTimeout, Refresh: testRefresh}, LimitsConfig{})[0]
			limAdmit(t, g.ctl, "warm").Settle(admission.Usage{}, 0) // a pooled connection
			before := g.l.fallback.Load()

			tc.fail(p, s)
			// Until local mode, each request waits at most one op timeout.
			for i := 0; !g.Degraded(); i++ {
				start := time.Now()
				tk, r := g.ctl.Reserve(admission.Request{Tenant: "early"})
				if took := time.Since(start); took > testOpTimeout+30*time.Millisecond {
					t.Fatalf("request %d waited %v on redis (op_timeout %v)", i, took, testOpTimeout)
				}
				if r != nil {
					t.Fatalf("refused while redis fails: %s", r.Message)
				}
				tk.Settle(admission.Usage{}, 0)
				if i > 10 {
					t.Fatal("not degraded after 10 failed requests")
				}
			}
			waitFor(t, "the local limits to start from zero", time.Second, func() bool { return g.l.fallback.Load() != before })

			// Local mode: rpm 30 ÷ 3 instances = 10, decided at once.
			admitted := 0
			var last *admission.Refusal
			for range 20 {
				start := time.Now()
				tk, r := g.ctl.Reserve(admission.Request{Tenant: "acme"})
				if took := time.Since(start); took > 5*time.Millisecond {
					t.Fatalf("a local decision took %v", took)
				}
				if r == nil {
					admitted++
					tk.Settle(admission.Usage{}, 0)
				} else {
					last = r
				}
			}
			if admitted != 10 || last.Code != admission.CodeTenantRPM || last.Limits.Requests.Limit != 10 {
				t.Fatalf("admitted %d of 20 locally (want 10 = 30 ÷ 3); last refusal %v", admitted, last)
			}
			// max_concurrent 6 ÷ 3 = 2.
			limAdmit(t, g.ctl, "conc")
			limAdmit(t, g.ctl, "conc")
			if _, r := g.ctl.Reserve(admission.Request{Tenant: "conc"}); r == nil || r.Code != admission.CodeTenantConcurrency {
				t.Fatalf("third concurrent request in local mode: %v", r)
			}
			// fail_closed: 503 with Retry-After, nothing runs on local limits.
			_, r := g.ctl.Reserve(admission.Request{Tenant: "acme", Tier: "strict"})
			if r == nil || r.Status != 503 || r.Code != admission.CodeFleetUnavailable || r.RetryAfter < time.Second {
				t.Fatalf("fail_closed tier while degraded: %+v", r)
			}

			tc.mend(p, s)
			waitFor(t, "fleet mode again", 3*time.Second, func() bool { return !g.Degraded() })
			if _, r := g.ctl.Reserve(admission.Request{Tenant: "acme", Tier: "strict"}); r != nil {
				t.Fatalf("fail_closed tier after recovery: %s", r.Message)
			}
			if tc.ambiguous {
				// The warm-up's blackholed successors never reached
				// Redis; their cancellations were queued and are gone.
				waitFor(t, "pending cancellations sent", 2*time.Second, func() bool { return g.l.Pending() == 0 })
			}
		})
	}
}

func TestLimitsAnAmbiguousReserveIsTakenBackNotReplayed(t *testing.T) {
	// Mute: Redis runs the reserve, its reply never comes. The request is
	// decided locally; the fleet's count of it is cancelled (by its id)
	// when Redis answers again, so the tenant is charged once.
	s := redistest.Start(t, redistest.Options{})
	p := redistest.NewProxy(t, s.Addr())
	g := limitsFleet(t, p.Addr(), 1, limTier(admission.Tier{RPM: 100, TPM: 100000, MaxConcurrent: 10}), Config{}, LimitsConfig{})[0]
	r := limDirect(t, s.Addr())
	limAdmit(t, g.ctl, "warm").Settle(admission.Usage{}, 0)

	p.Mute()
	tk := limAdmit(t, g.ctl, "acme")
	if reqs, toks := limWindow(t, r, "acme"); reqs != 1 || toks == 0 {
		t.Fatalf("the muted reserve did not reach redis: %d requests %d tokens", reqs, toks)
	}
	if g.l.Pending() != 1 {
		t.Fatalf("%d pending, want the cancellation of the muted reserve", g.l.Pending())
	}
	tk.Settle(admission.Usage{PromptTokens: 10, CompletionTokens: 10}, 0) // settles locally
	p.Pass()
	waitFor(t, "the cancellation to be sent", 3*time.Second, func() bool { return g.l.Pending() == 0 })
	if reqs, toks := limWindow(t, r, "acme"); reqs != 0 || toks != 0 {
		t.Fatalf("after the cancellation: %d requests %d tokens in redis, want 0 0", reqs, toks)
	}
	if n := limLeases(t, r, "acme"); n != 0 {
		t.Fatalf("%d leases left by the muted reserve", n)
	}
}

func TestLimitsASettlementThatFailsIsSentAgain(t *testing.T) {
	s := redistest.Start(t, redistest.Options{})
	p := redistest.NewProxy(t, s.Addr())
	g := limitsFleet(t, p.Addr(), 1, limTier(admission.Tier{TPM: 100000}), Config{OpTimeout: testOpTimeout, Refresh: testRefresh}, LimitsConfig{})[0]
	r := limDirect(t, s.Addr())
	tk, rf := g.ctl.Reserve(admission.Request{Tenant: "acme", PromptTokens: 100, MaxTokens: 900})
	if rf != nil {
		t.Fatal(rf)
	}
	p.Blackhole()
	start := time.Now()
	tk.Settle(admission.Usage{PromptTokens: 100, CompletionTokens: 50}, 0)
	if took := time.Since(start); took > testOpTimeout+30*time.Millisecond {
		t.Fatalf("settling waited %v (op_timeout %v)", took, testOpTimeout)
	}
	if _, toks := limWindow(t, r, "acme"); toks != 1000 || g.l.Pending() != 1 {
		t.Fatalf("tokens %d, pending %d: want the reservation standing and one pending", toks, g.l.Pending())
	}
	p.Pass()
	waitFor(t, "the settlement to be sent", 3*time.Second, func() bool { return g.l.Pending() == 0 })
	if _, toks := limWindow(t, r, "acme"); toks != 150 {
		t.Fatalf("tokens %d after the settlement was sent again, want 150", toks)
	}
}

func TestLimitsAnEmptyScriptCacheFailsNoRequest(t *testing.T) {
	s := redistest.Start(t, redistest.Options{})
	gws := limitsFleet(t, s.Addr(), 2, limTier(admission.Tier{MaxConcurrent: 100, RPM: 100000, TPM: 1 << 30}), Config{}, LimitsConfig{})
	r := limDirect(t, s.Addr())
	var holds [2][]admission.Hold
	for i := range 200 {
		if i%25 == 0 {
			if err := r.ScriptFlush(context.Background()).Err(); err != nil {
				t.Fatal(err)
			}
		}
		g := gws[i%2]
		q := admission.Quota{Tenant: "acme", MaxConcurrent: 100, RPM: 100000, TPM: 1 << 30, Prompt: 10, Need: 20, Explicit: true}
		var h admission.Hold
		if d := g.l.Reserve(&q, &h); d.Code != "" || d.Local {
			t.Fatalf("request %d after a script flush: %+v", i, d)
		}
		holds[i%2] = append(holds[i%2], h)
		if len(holds[i%2]) > 20 {
			g.l.Settle(&holds[i%2][0], 5)
			holds[i%2] = holds[i%2][1:]
		}
		if i%50 == 0 {
			g.l.renew(context.Background()) // renewals through a flushed cache too
		}
	}
	for i, g := range gws {
		if n := g.ops.count("limits_reserve script") + g.ops.count("limits_settle script") + g.ops.count("limits_renew script"); n != 0 {
			t.Fatalf("%s: %d script errors", g.InstanceID(), n)
		}
		if g.l.Pending() != 0 || g.Degraded() {
			t.Fatalf("gateway %d: pending %d degraded %v", i, g.l.Pending(), g.Degraded())
		}
	}
	if n := limLeases(t, r, "acme"); n != 40 {
		t.Fatalf("%d leases, want the 40 still held", n)
	}
}

// BenchmarkLimitsReserveSettle is one admission and its settlement through
// a Controller on the fleet's store (two round trips to a local
// redis-server), for a tenant with max_concurrent, rpm and tpm.
func BenchmarkLimitsReserveSettle(b *testing.B) {
	s := redistest.Start(b, redistest.Options{})
	c, err := Open(Config{URL: "redis://" + s.Addr(), OpTimeout: 200 * time.Millisecond, Refresh: time.Second}, nil, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	l, err := NewLimits(c, LimitsConfig{})
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	ctl, _ := admission.NewController(limTier(admission.Tier{MaxConcurrent: 1 << 20, RPM: 1 << 30, TPM: 1 << 40}), clock.Real, nil)
	ctl.SetLimitStore(l)
	u := admission.Usage{PromptTokens: 100, CompletionTokens: 200}
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		var tk admission.Ticket
		for pb.Next() {
			if r := ctl.ReserveInto(&tk, admission.Request{Tenant: "acme", PromptTokens: 100, MaxTokens: 500}); r != nil {
				b.Fatal(r)
			}
			tk.Settle(u, 0)
		}
	})
}
