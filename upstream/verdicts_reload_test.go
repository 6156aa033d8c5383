package upstream

import (
	"errors"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/breaker/breakertest"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// Two unnamed sites over one upstream (the Caddyfile names them by line,
// and both pools have the upstream list's key): A at line 5 trips after 2
// failures, B at line 20 after 10. A's breaker is open, B's closed. A
// reload that inserts 15 lines above both moves A to line 20 and B to line
// 35: A must still hold the upstream out, and B must still send to it.
// The new A's name is the old B's, so predecessorLocked's "same handler
// name in the newest older config" rule hands A the old B's closed
// verdict and A's open one is lost.
func TestReloadThatMovesUnnamedSitesKeepsEachSitesVerdict(t *testing.T) {
	const addr = "10.29.0.1:8000"
	sa := func() *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: 2, OpenFor: time.Hour, MinOpen: time.Hour}
	}
	sb := func() *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: 10, OpenFor: time.Hour, MinOpen: time.Hour}
	}
	reg := NewRegistry(nil)
	pools := reloadAll(t, reg, nil,
		Config{Key: addr, Handler: "Caddyfile:5", Static: targets(addr), Breaker: sa()},
		Config{Key: addr, Handler: "Caddyfile:20", Static: targets(addr), Breaker: sb()})
	a := pools[0]
	fail(mustPick(t, a, ""))
	fail(mustPick(t, a, ""))
	if st := a.BreakerState(addr, ""); st != "open" {
		t.Fatalf("site A after 2 failures: %q, want open", st)
	}
	next := reloadAll(t, reg, pools,
		Config{Key: addr, Handler: "Caddyfile:20", Static: targets(addr), Breaker: sa()},
		Config{Key: addr, Handler: "Caddyfile:35", Static: targets(addr), Breaker: sb()})
	if st := next[0].BreakerState(addr, ""); st != "open" {
		t.Errorf("site A (now Caddyfile:20) after the reload: %q, want open (its own verdict)", st)
	}
	var ue *proxy.UnavailableError
	if _, err := pickModel(next[0], ""); !errors.As(err, &ue) || !ue.CircuitOpen {
		t.Errorf("site A after the reload: pick error %v, want circuit open", err)
	}
	if st := next[1].BreakerState(addr, ""); st != "closed" {
		t.Errorf("site B (now Caddyfile:35) after the reload: %q, want closed", st)
	}
}

// Two sites over one upstream, one with scope model and one without. The
// upstream refuses every connection: three refused attempts made by the
// scope-model site (for model "m") are hard evidence of a dead server, and
// every handler's breaker hears every attempt on the upstream, so the
// other site's breaker opens too. Entry.hear matches breakers by model
// key, "m" against "", so the per-upstream breaker never hears them (nor
// a first token, nor a Retry-After) and keeps sending its clients to the
// dead server; the reverse holds as well.
func TestEveryAttemptReachesBreakersOfTheOtherScope(t *testing.T) {
	const addr = "10.29.0.2:8000"
	s := func() *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: 3, OpenFor: time.Hour, MinOpen: time.Hour}
	}
	for _, tc := range []struct {
		name            string
		failing, victim int // which pool makes the attempts, which should hear them
	}{
		{"scope model heard by scope upstream", 0, 1},
		{"scope upstream heard by scope model", 1, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := NewRegistry(nil)
			pools := reloadAll(t, reg, nil,
				Config{Key: "per-model", Handler: "Caddyfile:3", Static: targets(addr), Breaker: s(), ScopeModel: true},
				Config{Key: "per-upstream", Handler: "Caddyfile:9", Static: targets(addr), Breaker: s()})
			// The victim has a breaker for the model before the outage.
			finish(mustPick(t, pools[tc.victim], "m"), proxy.AttemptSuccess)
			for range 3 {
				finish(mustPick(t, pools[tc.failing], "m"), proxy.AttemptConnectError)
			}
			if st := pools[tc.failing].BreakerState(addr, "m"); st != "open" {
				t.Fatalf("the failing site's breaker: %q, want open", st)
			}
			if st := pools[tc.victim].BreakerState(addr, "m"); st != "open" {
				t.Errorf("the other site's breaker after 3 refused connections to the upstream: %q, want open", st)
			}
		})
	}
}

// An upstream is held open (an operator's drain; another gateway's open
// in the fleet's store); reloads while it lasts keep it open. Nothing
// changed state: the handler's verdict was open before each reload and is
// after it, so no breaker transition may be reported (each one counts in
// caddy_llm_proxy_breaker_transitions_total{to="open"}, writes a warn log
// and emits llm_proxy_breaker_open). The new config's breaker is created
// closed in Provision (holdBreakers → breakerFor) and then opened, by
// breakerFor's ForceOpen for the drain or by breaker.New adopting the
// store's open key: one closed→open transition per handler per reload.
// Before breakers were per handler the policy's breaker outlived the
// reload and reported nothing.
func TestReloadOfAnOpenUpstreamReportsNoTransition(t *testing.T) {
	s := func() *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: 3, OpenFor: time.Hour, MinOpen: time.Hour}
	}
	for _, tc := range []struct {
		name string
		hold func(t *testing.T, e *Entry, p *Pool, sm *breakertest.SharedMemory)
	}{
		{"drained", func(t *testing.T, e *Entry, p *Pool, sm *breakertest.SharedMemory) {
			if _, ok := e.Drain(0, "maintenance"); !ok {
				t.Fatal("drain refused")
			}
		}},
		{"open in the fleet", func(t *testing.T, e *Entry, p *Pool, sm *breakertest.SharedMemory) {
			key := p.Breakers(e)[""].StoreKey()
			other := breaker.New(e.Addr(), *s(), breaker.WithStore(sm.Instance("gw1")), breaker.WithStoreKey(key))
			other.ForceOpen(time.Hour, "drained by another gateway")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const addr = "10.29.0.3:8000"
			obs := newFakeObserver()
			reg := NewRegistry(obs)
			sm := breakertest.NewSharedMemory(nil, 1)
			reg.SetBreakerStore(sm.Instance("gw0"))
			cfg := Config{Key: addr, Handler: "Caddyfile:3", Static: targets(addr)}
			cfg.Breaker = s()
			pools := reloadAll(t, reg, nil, cfg)
			e, _ := reg.Entry(addr)
			tc.hold(t, e, pools[0], sm)
			opened := "transition " + gaugeKey(addr, "") + " closed→open"
			for i := range 3 {
				n := obs.countPrefix(opened)
				cfg.Breaker = s()
				pools = reloadAll(t, reg, pools, cfg)
				if st := pools[0].BreakerState(addr, ""); st != "open" {
					t.Fatalf("reload %d: breaker %q, want open", i+1, st)
				}
				if got := obs.countPrefix(opened) - n; got != 0 {
					t.Errorf("reload %d reported %d closed→open transition(s) of a breaker open before and after it, want 0", i+1, got)
				}
			}
		})
	}
}

// A request still running on a config that a reload released picks again
// (a retry after its first attempt failed). Its handler's upstream U1 is
// open on hard evidence (the new config's breaker for the same handler
// carries that verdict), so the retry must not go to U1. After Release the
// old claim holds no breaker (breakerFor returns nil), and Pick treats a
// nil breaker as "breakers off": every open upstream is a candidate again.
func TestRequestOfAReleasedConfigStillAvoidsAnOpenUpstream(t *testing.T) {
	const u1, u2 = "10.29.0.4:8000", "10.29.0.5:8000"
	s := func() *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: 3, OpenFor: time.Hour, MinOpen: time.Hour}
	}
	cfg := func() Config {
		return Config{Key: "site", Handler: "Caddyfile:3", Static: targets(u1, u2), Breaker: s(), Selector: firstSelector{}}
	}
	reg := NewRegistry(nil)
	pools := reloadAll(t, reg, nil, cfg())
	old := pools[0]
	for range 3 {
		finish(mustPick(t, old, ""), proxy.AttemptConnectError)
	}
	if st := old.BreakerState(u1, ""); st != "open" {
		t.Fatalf("%s after 3 refused connections: %q, want open", u1, st)
	}
	next := reloadAll(t, reg, pools, cfg())
	if st := next[0].BreakerState(u1, ""); st != "open" {
		t.Fatalf("%s for the new config: %q, want open", u1, st)
	}
	// The old config's request retries after the reload.
	up, err := pickModel(old, "", u2)
	if err != nil {
		t.Fatalf("retry on the released config: %v", err)
	}
	defer finish(up, proxy.AttemptSuccess)
	if up.Addr == u1 {
		t.Errorf("retry on the released config went to %s, whose breaker is open", u1)
	}
}

// A reload that turns scope model on or off while the site's upstream is
// open on hard evidence (it refuses every connection). The docs promise
// that an open breaker stays open across any reload in which the new
// config still uses the upstream with breakers on; and a handler's
// breakers are keyed as its scope says ("" per upstream, the model's under
// scope model). activate carries the old verdict to a breaker of the old
// model key: under the new scope nobody picks with that key, so the
// verdict is lost for the new keys (the dead upstream gets traffic again)
// and a stray breaker of the other scope is listed beside them (in the
// admin API, and its open state in the breaker_state gauge).
func TestReloadThatChangesScopeKeepsTheOpenVerdict(t *testing.T) {
	const addr = "10.29.0.6:8000"
	s := func() *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: 3, OpenFor: time.Hour, MinOpen: time.Hour}
	}
	for _, tc := range []struct {
		name          string
		before, after bool // scope model
		// wantOpen: the per-upstream verdict covers every model; one
		// model's verdict need not cover the upstream.
		wantOpen bool
	}{
		{"scope upstream to scope model", false, true, true},
		{"scope model to scope upstream", true, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := NewRegistry(nil)
			reg.Models.Learn("m")
			pools := reloadAll(t, reg, nil, Config{Key: addr, Handler: "Caddyfile:3", Static: targets(addr), Breaker: s(), ScopeModel: tc.before})
			for range 3 {
				finish(mustPick(t, pools[0], "m"), proxy.AttemptConnectError)
			}
			if st := pools[0].BreakerState(addr, "m"); st != "open" {
				t.Fatalf("before the reload: %q, want open", st)
			}
			next := reloadAll(t, reg, pools, Config{Key: addr, Handler: "Caddyfile:3", Static: targets(addr), Breaker: s(), ScopeModel: tc.after})
			var ue *proxy.UnavailableError
			if up, err := pickModel(next[0], "m"); tc.wantOpen && (!errors.As(err, &ue) || !ue.CircuitOpen) {
				if err == nil {
					finish(up, proxy.AttemptSuccess)
				}
				t.Errorf("after the reload: pick error %v, want circuit open (the upstream is dead)", err)
			}
			e, _ := reg.Entry(addr)
			for k := range next[0].Breakers(e) {
				if want := next[0].breakerKey("m"); k != want {
					t.Errorf("after the reload the site has a breaker of model key %q, which its scope never uses (its key is %q)", k, want)
				}
			}
		})
	}
}

// A pool of two upstreams fails as a whole (every attempt answered 503):
// it answers 503 at once. A reload of the same config (an operator's
// routine change elsewhere in the Caddyfile, or during the incident) does
// not make the upstreams any better: the handler that replaces it must
// still fail fast, as an open verdict carries over. poolFailure lives in
// the Pool (p.fail) and is not handed over, so the new pool sends every
// request to the failed upstreams again until PoolFailWindow (40) new
// failures fill its window.
func TestReloadKeepsAPoolThatFailedAsAWholeFailed(t *testing.T) {
	const a, b = "10.29.0.7:8000", "10.29.0.8:8000"
	reg := NewRegistry(nil)
	clk := newLoopClock()
	reg.UseClock(clk)
	cfg := func() Config {
		return Config{Key: a + "," + b, Handler: "Caddyfile:3", Static: targets(a, b), Breaker: &breaker.Settings{}}
	}
	pools := reloadAll(t, reg, nil, cfg())
	// A healthy start at 20 requests/s, then every answer is a 503.
	for range 20 {
		finish(mustPick(t, pools[0], ""), proxy.AttemptSuccess)
		clk.Advance(50 * time.Millisecond)
	}
	for i := 0; i < 4*PoolFailWindow && !pools[0].fail.failed.Load(); i++ {
		up, err := pickModel(pools[0], "")
		if err != nil {
			t.Fatalf("pick %d before the pool failed: %v", i, err)
		}
		fail(up)
		clk.Advance(50 * time.Millisecond)
	}
	var ue *proxy.UnavailableError
	if _, err := pickModel(pools[0], ""); !errors.As(err, &ue) || !ue.CircuitOpen {
		t.Fatalf("the pool did not fail as a whole: pick error %v", err)
	}
	next := reloadAll(t, reg, pools, cfg())
	if up, err := pickModel(next[0], ""); !errors.As(err, &ue) || !ue.CircuitOpen {
		if err == nil {
			fail(up)
		}
		t.Errorf("after the reload: pick error %v, want 503 circuit open (the pool failed as a whole and no probe succeeded)", err)
	}
}

// A reload that adds a fleet (SetBreakerStore) rebuilds every breaker with
// the new store. A verdict must travel as it is: an upstream ejected as a
// statistical outlier stays a statistical hold (it counts against
// max_ejection and the panic rule routes over it), and an operator's
// timed drain stays forced (the admin API and status say so). useStore
// hands the new breaker only the end of the cooldown (Breaker.Adopt, a
// fleet verdict), so the outlier becomes hard evidence (never routed over,
// outside the cap: the detector may eject another) and the drain an
// unforced open; breaker.CarryOver keeps both.
func TestBreakerStoreChangeKeepsEachVerdictsKind(t *testing.T) {
	const a, b, c = "10.29.0.9:8000", "10.29.0.10:8000", "10.29.0.11:8000"
	reg := NewRegistry(nil)
	reg.UseClock(newLoopClock())
	p := startPool(t, reg, Config{Key: "k", Handler: "Caddyfile:3", Static: targets(a, b, c), Breaker: &breaker.Settings{}})
	ea, _ := reg.Entry(a)
	eb, _ := reg.Entry(b)
	if !p.Breakers(ea)[""].Eject("outlier: failure ratio 12/20 against 0.05 for the rest of the pool", 0.05) {
		t.Fatal("eject refused")
	}
	p.Breakers(eb)[""].ForceOpen(10*time.Minute, "maintenance")
	reg.SetBreakerStore(breakertest.NewSharedMemory(nil, 1).Instance("gw0"))
	if br := p.Breakers(ea)[""]; br.State() != breaker.Open || br.Evidence() != breaker.Statistical {
		t.Errorf("the outlier after the store changed: %v on %v evidence, want open on statistical evidence", br.State(), br.Evidence())
	}
	if s := p.Breakers(eb)[""].Snapshot(); s.State != breaker.Open || !s.Forced {
		t.Errorf("the drained upstream after the store changed: %v, forced %v; want open and forced", s.State, s.Forced)
	}
}

// In a fleet every attempt's failure reaches the fleet's counts once per
// breaker key (DESIGN §9: discovery constant in fleet size). Sites A and B
// have equal settings, so one key; A's pool has ejected the upstream as an
// outlier against its peers (B's pool has none), and site C, breaker off,
// sends a request that the upstream refuses. Entry.hear lets only the
// first breaker of a key report, and that first one is A's, which is not
// closed and so only tallies (Breaker.Hear): B's, which could report,
// stays quiet, and the fleet never hears of the refused connection.
func TestFleetHearsAFailureWhenTheFirstBreakerOfItsKeyIsOpen(t *testing.T) {
	const u, v, w = "10.29.0.12:8000", "10.29.0.13:8000", "10.29.0.14:8000"
	sm := breakertest.NewSharedMemory(nil, 1)
	reg := NewRegistry(nil)
	reg.UseClock(newLoopClock())
	reg.SetBreakerStore(sm.Instance("gw0"))
	s := func() *breaker.Settings { return &breaker.Settings{ConsecutiveFailures: 5} }
	pools := reloadAll(t, reg, nil,
		Config{Key: u + "," + v + "," + w, Handler: "A", Static: targets(u, v, w), Breaker: s()},
		Config{Key: u, Handler: "B", Static: targets(u), Breaker: s()},
		Config{Key: u + " off", Handler: "C", Static: targets(u)})
	e, _ := reg.Entry(u)
	a, b := pools[0].Breakers(e)[""], pools[1].Breakers(e)[""]
	if a.StoreKey() != b.StoreKey() {
		t.Fatalf("equal settings, keys %s and %s", a.StoreKey(), b.StoreKey())
	}
	if !a.Eject("outlier: failure ratio 12/20 against 0.05 for the rest of the pool", 0.05) {
		t.Fatal("eject refused")
	}
	finish(mustPick(t, pools[2], ""), proxy.AttemptConnectError)
	if n := sm.Counts(b.StoreKey()).Consecutive; n != 1 {
		t.Errorf("the fleet's count of %s after one refused connection: %d, want 1", b.StoreKey(), n)
	}
}

// The same key's count stays one per attempt when the failure trips the
// first breaker of the key on this gateway (its own rules; the fleet,
// wanting two gateways, does not open the key): the next breaker of the
// key, still closed, must not report the failure again.
func TestFleetCountsAFailureOnceWhenItTripsTheFirstBreakerOfItsKey(t *testing.T) {
	const u = "10.29.0.15:8000"
	sm := breakertest.NewSharedMemory(nil, 2)
	reg := NewRegistry(nil)
	reg.UseClock(newLoopClock())
	reg.SetBreakerStore(sm.Instance("gw0"))
	s := func() *breaker.Settings { return &breaker.Settings{ConsecutiveFailures: 1} }
	pools := reloadAll(t, reg, nil,
		Config{Key: u, Handler: "A", Static: targets(u), Breaker: s()},
		Config{Key: u, Handler: "B", Static: targets(u), Breaker: s()},
		Config{Key: u + " off", Handler: "C", Static: targets(u)})
	e, _ := reg.Entry(u)
	key := pools[0].Breakers(e)[""].StoreKey()
	finish(mustPick(t, pools[2], ""), proxy.AttemptConnectError)
	if n := sm.Counts(key).Consecutive; n != 1 {
		t.Errorf("the fleet's count of %s after one refused connection: %d, want 1", key, n)
	}
	for _, p := range pools[:2] {
		if st := p.BreakerState(u, ""); st != "open" {
			t.Errorf("site %s's breaker: %q, want open (consecutive_failures 1)", p.Handler(), st)
		}
	}
}

// While a reload's new config is provisioned and not started, its breaker
// for a handler hears the same outcomes as the running one's and trips
// with it: the upstream opened once, and one closed→open transition is
// reported, the running config's.
func TestAProvisionedConfigsBreakerReportsNoTransitionOfItsOwn(t *testing.T) {
	const addr = "10.29.0.9:8000"
	obs := newFakeObserver()
	reg := NewRegistry(obs)
	cfg := Config{Key: addr, Handler: "site", Named: true, Static: targets(addr),
		Breaker: &breaker.Settings{ConsecutiveFailures: 1, OpenFor: time.Hour, MinOpen: time.Hour}}
	running := startPool(t, reg, cfg)
	loading := buildPool(t, reg, cfg)
	fail(mustPick(t, running, ""))
	if st := loading.BreakerState(addr, ""); st != "open" {
		t.Fatalf("the provisioned config's breaker: %q, want open (it heard the failure)", st)
	}
	if n := obs.countPrefix("transition " + gaugeKey(addr, "") + " closed→open"); n != 1 {
		t.Fatalf("%d closed→open transitions reported, want 1 (the running config's)", n)
	}
}

// An operator's open of one site's breaker (by its fleet_key) stays that
// site's: a reload that adds another site with the settings the first one
// had does not start the new site's breaker forced open, and the first
// site, matched by its name, keeps it.
func TestAnOperatorsOpenOfOneSiteIsNotANewSitesVerdict(t *testing.T) {
	const addr = "10.29.0.11:8000"
	s := func(n int) *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: n, OpenFor: time.Hour, MinOpen: time.Hour}
	}
	reg := NewRegistry(nil)
	pools := reloadAll(t, reg, nil, Config{Key: addr, Handler: "site-a", Named: true, Static: targets(addr), Breaker: s(10)})
	e, _ := reg.Entry(addr)
	pools[0].Breakers(e)[""].ForceOpen(5*time.Minute, "maintenance of site-a's route")
	next := reloadAll(t, reg, pools,
		Config{Key: addr, Handler: "site-a", Named: true, Static: targets(addr), Breaker: s(2)},
		Config{Key: addr, Handler: "Caddyfile:18", Static: targets(addr), Breaker: s(10)})
	if snap := next[0].Breakers(e)[""].Snapshot(); snap.State != breaker.Open || !snap.Forced {
		t.Errorf("site-a after the reload: %+v, want still forced open", snap)
	}
	if st := next[1].BreakerState(addr, ""); st != "closed" {
		t.Errorf("the added site after the reload: %q, want closed (the operator opened site-a's breaker only)", st)
	}
}
