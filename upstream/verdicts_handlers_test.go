package upstream

import (
	"github.com/llmproxy/caddy-llm-proxy/breaker/breakertest"
	"time"

	"fmt"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// Two unnamed sites with the same (default) breaker settings share
// upstream a0: site X balances a0, a1 and a2, site Y has a0 alone. X's
// outlier detector ejects a0 (it fails half X's requests, its peers none);
// Y has no peer to judge a0 against and keeps it. A reload that inserts 15
// lines above both moves X from line 5 to line 20 and Y from line 20 to
// line 35. X must still hold a0 out, Y must still send to it: their pools
// (upstream lists) are what identifies them, the line is not.
func TestReloadThatMovesUnnamedSitesWithEqualSettingsKeepsEachPoolsEjection(t *testing.T) {
	clk := clocktest.New(simT0)
	reg := NewRegistry(nil)
	reg.UseClock(clk)
	addrs := make([]string, 3)
	for i := range addrs {
		addrs[i] = fmt.Sprintf("10.29.8.%d:8000", i+1)
	}
	cfgX := func(line int) Config {
		return Config{Key: "X", Handler: fmt.Sprintf("Caddyfile:%d", line), Static: targets(addrs...), Breaker: &breaker.Settings{}}
	}
	cfgY := func(line int) Config {
		return Config{Key: "Y", Handler: fmt.Sprintf("Caddyfile:%d", line), Static: targets(addrs[0]), Breaker: &breaker.Settings{}}
	}
	pools := reloadAll(t, reg, nil, cfgX(5), cfgY(20))
	x := pools[0]
	serveOn(t, x, addrs, addrs[1], 40, never)
	serveOn(t, x, addrs, addrs[2], 40, never)
	serveOn(t, x, addrs, addrs[0], 40, every(2))
	nextRun(clk)
	if st := x.BreakerState(addrs[0], ""); st != "open" {
		t.Fatalf("site X's breaker on the outlier before the reload: %q, want open", st)
	}
	if st := pools[1].BreakerState(addrs[0], ""); st != "closed" {
		t.Fatalf("site Y's breaker on its only upstream before the reload: %q, want closed", st)
	}
	next := reloadAll(t, reg, pools, cfgX(20), cfgY(35))
	if st := next[0].BreakerState(addrs[0], ""); st != "open" {
		t.Errorf("site X (now Caddyfile:20) after the reload: %q, want open (its pool's ejection)", st)
	}
	if st := next[1].BreakerState(addrs[0], ""); st != "closed" {
		t.Errorf("site Y (now Caddyfile:35) after the reload: %q, want closed (its own verdict)", st)
	}
}

// A hundred reloads of two sites over one upstream, alternating the
// scope of one of them while the upstream is held open, leave the entry
// with the running config's claims and breakers only: the old configs'
// verdicts, the breakers a scope change inherits, and the claims go when
// their config is released.
func TestHundredReloadsLeaveOnlyTheRunningConfigsBreakers(t *testing.T) {
	const addr = "10.29.8.10:8000"
	clk := clocktest.New(simT0)
	reg := NewRegistry(nil)
	reg.UseClock(clk)
	s := func() *breaker.Settings { return &breaker.Settings{ConsecutiveFailures: 2} }
	cfgs := func(i int) []Config {
		return []Config{
			{Key: addr, Handler: "a", Named: true, Static: targets(addr), Breaker: s(), ScopeModel: i%2 == 1},
			{Key: addr, Handler: "b", Named: true, Static: targets(addr), Breaker: s()},
		}
	}
	pools := reloadAll(t, reg, nil, cfgs(0)...)
	fail(mustPick(t, pools[1], ""))
	fail(mustPick(t, pools[1], ""))
	for i := 1; i <= 100; i++ {
		pools = reloadAll(t, reg, pools, cfgs(i)...)
		pickModel(pools[0], "m")
	}
	e, ok := reg.Entry(addr)
	if !ok {
		t.Fatal("no entry")
	}
	e.mu.Lock()
	claims, inherit, succ := len(e.claims), len(e.inherit), len(e.succ)
	e.mu.Unlock()
	if claims != 2 || inherit > 1 || len(e.verdictList()) > 3 || succ > 2 {
		t.Errorf("after 100 reloads: %d claims, %d inherited breakers, %d verdicts, %d successors; want 2, at most 1, at most 3, at most 2", claims, inherit, len(e.verdictList()), succ)
	}
}

// A site keys its breakers by model; the upstream refuses every
// connection, and the breaker of the only model the site serves opens on
// that hard evidence for an hour. A reload that turns scope model off
// (the other direction of TestReloadThatChangesScopeKeepsTheOpenVerdict)
// must keep the site from sending to the dead server: the open model
// verdict covered everything the site sent there.
func TestReloadThatTurnsScopeModelOffKeepsAHardOpenVerdict(t *testing.T) {
	const addr = "10.29.8.20:8000"
	clk := clocktest.New(simT0)
	reg := NewRegistry(nil)
	reg.UseClock(clk)
	s := func() *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: 3, OpenFor: time.Hour, MinOpen: time.Hour}
	}
	pools := reloadAll(t, reg, nil, Config{Key: addr, Handler: "chat", Named: true, Static: targets(addr), Breaker: s(), ScopeModel: true})
	for range 3 {
		finish(mustPick(t, pools[0], "m"), proxy.AttemptConnectError)
	}
	if st := pools[0].BreakerState(addr, "m"); st != "open" {
		t.Fatalf("model breaker after 3 refused connections: %q, want open", st)
	}
	next := reloadAll(t, reg, pools, Config{Key: addr, Handler: "chat", Named: true, Static: targets(addr), Breaker: s()})
	if up, err := pickModel(next[0], "m"); err == nil {
		up.Done(nil)
		t.Errorf("after the reload turned scope model off: picked %s (breaker %q), want the dead upstream held out", up.Addr, next[0].BreakerState(addr, ""))
	}
}

// Two sites in front of the same two replicas (equal upstream lists, so
// equal pool keys) with different breaker settings: site A's requests (a
// model that crashes the engine, say) fail on both replicas, site B's
// succeed. A's pool failing as a whole is A's: B, whose last attempts all
// succeeded, must still send its requests, not answer 503 "the pool failed
// as a whole" from A's record.
func TestAPoolThatFailsAsAWholeFailsOnlyItsOwnSite(t *testing.T) {
	clk := clocktest.New(simT0)
	reg := NewRegistry(nil)
	reg.UseClock(clk)
	addrs := []string{"10.29.8.31:8000", "10.29.8.32:8000"}
	const key = "10.29.8.31:8000,10.29.8.32:8000"
	pools := reloadAll(t, reg, nil,
		Config{Key: key, Handler: "a", Named: true, Static: targets(addrs...), Breaker: &breaker.Settings{ConsecutiveFailures: 100}},
		Config{Key: key, Handler: "b", Named: true, Static: targets(addrs...), Breaker: &breaker.Settings{ConsecutiveFailures: 50}})
	a, b := pools[0], pools[1]
	for range 4 {
		finish(mustPick(t, b, "small"), proxy.AttemptSuccess)
	}
	for i := 0; i < 2*PoolFailWindow && !a.fail.failed.Load(); i++ {
		up, err := pickModel(a, "big")
		if err != nil {
			t.Fatalf("site A's attempt %d: %v", i, err)
		}
		fail(up)
	}
	if !a.fail.failed.Load() {
		t.Fatal("site A's pool did not fail as a whole after its attempts all failed on both replicas")
	}
	if up, err := pickModel(b, "small"); err != nil {
		t.Errorf("site B, whose attempts all succeeded: %v; want its request sent", err)
	} else {
		up.Done(nil)
	}
	if st := b.Status(); st.Failed {
		t.Errorf("site B's pool status: failed (%s), want not failed", st.FailedReason)
	}
}

// Two unnamed sites over u1 and u2: A at line 5 (consecutive_failures
// 10), B at line 20 (2). u1 refuses connections: B's breaker on it is
// open, A's still closed. A reload inserts 15 lines above both, so A is
// now Caddyfile:20, B's old name. A request of B still running on the
// released config retries (u2 tried): its handler is B, whose breaker
// (the new config's B) holds u1 out, so the retry must not go to u1.
// successorFor ranks "the same handler name" first, and takes the new A's
// closed breaker.
func TestRetryOfAReleasedConfigUsesItsOwnSitesSuccessorAfterLinesMoved(t *testing.T) {
	const u1, u2 = "10.29.8.41:8000", "10.29.8.42:8000"
	s := func(n int) *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: n, OpenFor: time.Hour, MinOpen: time.Hour}
	}
	cfgA := func(line int) Config {
		return Config{Key: "site", Handler: fmt.Sprintf("Caddyfile:%d", line), Static: targets(u1, u2), Breaker: s(10), Selector: firstSelector{}}
	}
	cfgB := func(line int) Config {
		return Config{Key: "site", Handler: fmt.Sprintf("Caddyfile:%d", line), Static: targets(u1, u2), Breaker: s(2), Selector: firstSelector{}}
	}
	reg := NewRegistry(nil)
	pools := reloadAll(t, reg, nil, cfgA(5), cfgB(20))
	oldB := pools[1]
	for range 2 {
		finish(mustPick(t, oldB, ""), proxy.AttemptConnectError)
	}
	if st := oldB.BreakerState(u1, ""); st != "open" {
		t.Fatalf("site B's breaker on %s after 2 refused connections: %q, want open", u1, st)
	}
	if st := pools[0].BreakerState(u1, ""); st != "closed" {
		t.Fatalf("site A's breaker on %s: %q, want closed", u1, st)
	}
	next := reloadAll(t, reg, pools, cfgA(20), cfgB(35))
	if st := next[1].BreakerState(u1, ""); st != "open" {
		t.Fatalf("site B (now Caddyfile:35) on %s after the reload: %q, want open", u1, st)
	}
	up, err := pickModel(oldB, "", u2)
	if err == nil {
		defer finish(up, proxy.AttemptSuccess)
		if up.Addr == u1 {
			t.Errorf("site B's retry on the released config went to %s, which site B holds open (it used site A's breaker: A took B's old line)", u1)
		}
	}
}

// An attempt of a request that was running when a reload released its
// config ends in a refused connection: the fleet hears it once, whether
// the old config's breaker (its permit's) or the new config's breakers of
// the same key report it.
func TestFleetCountsAnAttemptOfAReleasedConfigOnce(t *testing.T) {
	const u = "10.29.8.51:8000"
	for _, withPermit := range []bool{true, false} {
		t.Run(fmt.Sprintf("permit %v", withPermit), func(t *testing.T) {
			sm := breakertest.NewSharedMemory(nil, 3)
			reg := NewRegistry(nil)
			reg.UseClock(newLoopClock())
			reg.SetBreakerStore(sm.Instance("gw0"))
			cfg := func() []Config {
				c := []Config{{Key: u, Handler: "A", Named: true, Static: targets(u), Breaker: &breaker.Settings{ConsecutiveFailures: 5}}}
				if !withPermit {
					// The request's site has breakers off: its attempt
					// is heard by the other site's breakers only.
					c[0].Breaker = nil
				}
				return append(c, Config{Key: u + " b", Handler: "B", Named: true, Static: targets(u), Breaker: &breaker.Settings{ConsecutiveFailures: 5}})
			}
			pools := reloadAll(t, reg, nil, cfg()...)
			up := mustPick(t, pools[0], "")
			next := reloadAll(t, reg, pools, cfg()...)
			e, _ := reg.Entry(u)
			key := next[1].Breakers(e)[""].StoreKey()
			finish(up, proxy.AttemptConnectError)
			if n := sm.Counts(key).Consecutive; n != 1 {
				t.Errorf("the fleet's count of %s after one refused connection of a released config: %d, want 1", key, n)
			}
		})
	}
}

// An operator drains an upstream (open until close), a reload turns scope
// model on for the site in front of it, and the operator closes the
// drain. Every model's breaker must then be closed, including that of a
// model first requested after the close: the drain is over. Entry.inherit
// keeps the old config's per-upstream breaker, forced open, and starts
// each new model breaker with it, so a model first asked for after the
// close is refused until an operator closes that breaker too.
func TestCloseAfterAReloadToScopeModelEndsTheDrainForModelsFirstSeenLater(t *testing.T) {
	const addr = "10.29.8.61:8000"
	clk := clocktest.New(simT0)
	reg := NewRegistry(nil)
	reg.UseClock(clk)
	s := func() *breaker.Settings { return &breaker.Settings{} }
	pools := reloadAll(t, reg, nil, Config{Key: addr, Handler: "chat", Named: true, Static: targets(addr), Breaker: s()})
	e, _ := reg.Entry(addr)
	if _, ok := e.Drain(0, "maintenance"); !ok {
		t.Fatal("drain refused")
	}
	next := reloadAll(t, reg, pools, Config{Key: addr, Handler: "chat", Named: true, Static: targets(addr), Breaker: s(), ScopeModel: true})
	if _, err := pickModel(next[0], "m1"); err == nil {
		t.Fatal("model m1 picked the drained upstream")
	}
	if _, ok := e.Undrain(false, "maintenance over"); !ok {
		t.Fatal("close refused")
	}
	for _, m := range []string{"m1", "m2"} {
		up, err := pickModel(next[0], m)
		if err != nil {
			t.Errorf("model %s after the operator closed the drain: %v (breaker %s), want its request sent", m, err, next[0].BreakerState(addr, m))
			continue
		}
		finish(up, proxy.AttemptSuccess)
	}
}

// Two unnamed sites over one upstream (the Caddyfile's default: no name)
// swap their breaker settings in place, neither line moving: A at line 5
// (consecutive_failures 2, open), B at line 20 (10, closed) become A with
// 10 and B with 2. Each site keeps its own state, as named sites do
// (TestReloadThatSwapsTwoSitesPoliciesKeepsEachSitesState): no line
// moved, so the lines still say which site is which. Matching by
// upstreams and settings first gives A's open verdict to B.
func TestReloadThatSwapsUnnamedSitesSettingsInPlaceKeepsEachSitesState(t *testing.T) {
	const addr = "10.29.8.71:8000"
	s := func(n int) *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: n, OpenFor: time.Hour, MinOpen: time.Hour}
	}
	reg := NewRegistry(nil)
	pools := reloadAll(t, reg, nil,
		Config{Key: addr, Handler: "Caddyfile:5", Static: targets(addr), Breaker: s(2)},
		Config{Key: addr, Handler: "Caddyfile:20", Static: targets(addr), Breaker: s(10)})
	fail(mustPick(t, pools[0], ""))
	fail(mustPick(t, pools[0], ""))
	if st := pools[0].BreakerState(addr, ""); st != "open" {
		t.Fatalf("site A after 2 failures: %q, want open", st)
	}
	next := reloadAll(t, reg, pools,
		Config{Key: addr, Handler: "Caddyfile:5", Static: targets(addr), Breaker: s(10)},
		Config{Key: addr, Handler: "Caddyfile:20", Static: targets(addr), Breaker: s(2)})
	if st := next[0].BreakerState(addr, ""); st != "open" {
		t.Errorf("site A (Caddyfile:5) after swapping settings in place: %q, want open", st)
	}
	if st := next[1].BreakerState(addr, ""); st != "closed" {
		t.Errorf("site B (Caddyfile:20) after swapping settings in place: %q, want closed", st)
	}
}
