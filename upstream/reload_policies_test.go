package upstream

import (
	"errors"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/saturation"
)

// reloadAll replaces the running pools with new ones for cfgs (one config
// generation, provisioned in order) the way a config reload does.
func reloadAll(t *testing.T, reg *Registry, old []*Pool, cfgs ...Config) []*Pool {
	t.Helper()
	gen := reg.NextGeneration()
	var next []*Pool
	for _, c := range cfgs {
		c.Generation = gen
		next = append(next, buildPool(t, reg, c))
	}
	for _, p := range next {
		p.Activate()
	}
	for _, p := range old {
		p.Deactivate()
	}
	for _, p := range old {
		p.Release()
	}
	return next
}

// Two sites with different breaker policies over one upstream; site A's
// breaker is open. A reload that keeps both policies (unchanged, or with a
// third site added after them) keeps A's breaker open and B's closed. A
// config starts its pools one by one; before the fix its first started
// pool (A's) made A's policy the primary one for a moment, which dropped
// A's own breaker, and its open state, on every reload.
func TestReloadKeepsEachPolicysStateWhenTheNewestHandlerChanges(t *testing.T) {
	sa := func() *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: 2, OpenFor: time.Hour, MinOpen: time.Hour}
	}
	sb := func() *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: 10, OpenFor: time.Hour, MinOpen: time.Hour}
	}
	sc := func() *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: 7, OpenFor: time.Hour, MinOpen: time.Hour}
	}
	const addr = "10.7.9.1:8000"
	for _, tc := range []struct {
		name  string
		after func() []Config
	}{
		{"unchanged", func() []Config {
			return []Config{{Key: "a", Static: targets(addr), Breaker: sa()}, {Key: "b", Static: targets(addr), Breaker: sb()}}
		}},
		{"swapped", func() []Config {
			return []Config{{Key: "b", Static: targets(addr), Breaker: sb()}, {Key: "a", Static: targets(addr), Breaker: sa()}}
		}},
		{"site added last", func() []Config {
			return []Config{{Key: "a", Static: targets(addr), Breaker: sa()}, {Key: "b", Static: targets(addr), Breaker: sb()},
				{Key: "c", Static: targets(addr), Breaker: sc()}}
		}},
		{"site added last, breaker off", func() []Config {
			return []Config{{Key: "a", Static: targets(addr), Breaker: sa()}, {Key: "b", Static: targets(addr), Breaker: sb()},
				{Key: "c", Static: targets(addr)}}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := NewRegistry(nil)
			pools := reloadAll(t, reg, nil,
				Config{Key: "a", Static: targets(addr), Breaker: sa()},
				Config{Key: "b", Static: targets(addr), Breaker: sb()})
			a, b := pools[0], pools[1]
			fail(mustPick(t, a, ""))
			fail(mustPick(t, a, ""))
			var ue *proxy.UnavailableError
			if _, err := pickModel(a, ""); !errors.As(err, &ue) || !ue.CircuitOpen {
				t.Fatalf("site A after 2 failures: pick error %v, want circuit open", err)
			}
			// B saw 5 failures of its 10.
			for range 5 {
				fail(mustPick(t, b, ""))
			}
			next := reloadAll(t, reg, pools, tc.after()...)
			byKey := map[string]*Pool{}
			for _, p := range next {
				byKey[p.cfg.Key] = p
			}
			if _, err := pickModel(byKey["a"], ""); !errors.As(err, &ue) || !ue.CircuitOpen {
				t.Errorf("site A after the reload: pick error %v, want circuit open (its policy did not change)", err)
			}
			if st := byKey["a"].BreakerState(addr, ""); st != "open" {
				t.Errorf("site A's breaker after the reload %q, want open", st)
			}
			if st := byKey["b"].BreakerState(addr, ""); st != "closed" {
				t.Errorf("site B's breaker after the reload %q, want closed", st)
			}
			if _, err := pickModel(byKey["b"], ""); err != nil {
				t.Errorf("site B after the reload: %v, want its request to reach the upstream", err)
			}
			if c := byKey["c"]; c != nil {
				if _, err := pickModel(c, ""); err != nil {
					t.Errorf("new site C refused by another site's open breaker: %v", err)
				}
			}
		})
	}
}

// Two sites over one server, both reading saturation signals with the same
// breaker settings: site A trips on KV-cache usage above 0.9, site B has
// `trip off`. With the server's KV usage at 0.97, A's breaker opens by
// observation and B's stays closed, whichever site is declared last: each
// handler's saturation trip rules govern its own breakers. (The scraper,
// one per server, judges with one config's rules: the newest's.)
func TestEachSiteObeysItsOwnSaturationTripRules(t *testing.T) {
	const full = `# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 8
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.97
`
	for _, order := range []string{"A then B", "B then A"} {
		t.Run(order, func(t *testing.T) {
			reg := NewRegistry(nil)
			clk := newLoopClock()
			reg.UseClock(clk)
			m := newMetricsServer(t, full)
			const interval = 20 * time.Millisecond
			sat := func(trip *saturation.TripRules) *saturation.Saturation {
				return &saturation.Saturation{Transport: httpTransport{}, Interval: interval, Timeout: interval, Trip: trip}
			}
			a := Config{Key: "a", Static: targets(m.addr), Breaker: &breaker.Settings{},
				Saturation: sat(&saturation.TripRules{KVUsage: 0.9, KVFor: 2 * interval})}
			b := Config{Key: "b", Static: targets(m.addr), Breaker: &breaker.Settings{}, Saturation: sat(nil)}
			cfgs := []Config{a, b}
			if order == "B then A" {
				cfgs = []Config{b, a}
			}
			pools := reloadAll(t, reg, nil, cfgs...)
			pa, pb := pools[0], pools[1]
			if order == "B then A" {
				pa, pb = pb, pa
			}
			for range 10 {
				awaitTickers(t, clk, 1) // scraped, waiting for the next tick
				clk.Advance(interval)
			}
			awaitTickers(t, clk, 1)
			if st := pa.BreakerState(m.addr, ""); st != "open" {
				t.Errorf("site A (trip kv_usage 0.9) breaker %q with KV usage 0.97 for 10 intervals, want open", st)
			}
			if st := pb.BreakerState(m.addr, ""); st != "closed" {
				t.Errorf("site B (trip off) breaker %q, want closed: another site's trip rules opened it", st)
			}
		})
	}
}

// Two sites over one upstream with the same breaker settings (the
// defaults, say), site B with scope model: A's per-upstream breaker opens.
// B's requests are governed by B's model breakers, so B still counts the
// upstream healthy (its per_upstream capacity and pool signal read
// ClosedUpstreams) and lists none of A's breakers as its own.
func TestScopeModelSiteIgnoresAnotherSitesPerUpstreamBreaker(t *testing.T) {
	reg := NewRegistry(nil)
	const addr = "10.7.9.9:8000"
	s := func() *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: 1, OpenFor: time.Hour, MinOpen: time.Hour}
	}
	pools := reloadAll(t, reg, nil,
		Config{Key: "a", Static: targets(addr), Breaker: s()},
		Config{Key: "b", Static: targets(addr), Breaker: s(), ScopeModel: true})
	a, b := pools[0], pools[1]
	fail(mustPick(t, a, ""))
	if st := a.BreakerState(addr, ""); st != "open" {
		t.Fatalf("site A's breaker %q, want open", st)
	}
	if n := b.ClosedUpstreams(); n != 1 {
		t.Errorf("site B (scope model, no model breaker open) counts %d healthy upstreams, want 1: site A's breaker counted", n)
	}
	e, _ := reg.Entry(addr)
	if bs := b.Breakers(e); len(bs) != 0 {
		t.Errorf("site B (scope model, no traffic yet) lists breakers %v as its own, want none", bs)
	}
	if _, err := pickModel(b, "m"); err != nil {
		t.Errorf("site B's request refused: %v", err)
	}
}

// Two sites over one upstream with different breaker policies, site A's
// breaker open and B with failures of its own: a reload that removes site
// B keeps A's own open state, not B's closed one; a later reload that adds
// a site C keeps A open and lets C's requests through.
func TestReloadThatRemovesTheNewestSiteKeepsTheOthersState(t *testing.T) {
	sa := &breaker.Settings{ConsecutiveFailures: 2, OpenFor: time.Hour, MinOpen: time.Hour}
	sb := &breaker.Settings{ConsecutiveFailures: 10, OpenFor: time.Hour, MinOpen: time.Hour}
	sc := &breaker.Settings{ConsecutiveFailures: 7, OpenFor: time.Hour, MinOpen: time.Hour}
	const addr = "10.7.9.2:8000"
	reg := NewRegistry(nil)
	pools := reloadAll(t, reg, nil,
		Config{Key: "a", Static: targets(addr), Breaker: sa},
		Config{Key: "b", Static: targets(addr), Breaker: sb})
	fail(mustPick(t, pools[0], ""))
	fail(mustPick(t, pools[0], ""))
	fail(mustPick(t, pools[1], ""))
	var ue *proxy.UnavailableError
	pools = reloadAll(t, reg, pools, Config{Key: "a", Static: targets(addr), Breaker: sa})
	if _, err := pickModel(pools[0], ""); !errors.As(err, &ue) || !ue.CircuitOpen {
		t.Fatalf("site A after site B left: pick error %v, want circuit open", err)
	}
	if b := breakerOf(t, reg, addr, ""); b.State() != breaker.Open || b.Key() != addr {
		t.Fatalf("site A's breaker after site B left: %s %v, want %s, open", b.Key(), b.State(), addr)
	}
	pools = reloadAll(t, reg, pools, Config{Key: "a", Static: targets(addr), Breaker: sa}, Config{Key: "c", Static: targets(addr), Breaker: sc})
	if st := pools[0].BreakerState(addr, ""); st != "open" {
		t.Errorf("site A's breaker after site C came last: %q, want open", st)
	}
	if _, err := pickModel(pools[1], ""); err != nil {
		t.Errorf("site C refused: %v", err)
	}
}

// The scrape settings and the prober of an upstream that several handlers
// of one config share are chosen by the config, not by the order Caddy
// started the handlers' pools in (it starts its HTTP servers in no fixed
// order): two sites, each with its own scrape interval and prober, started
// in either order, give the same choice.
func TestSharedLoopSettingsDoNotDependOnStartOrder(t *testing.T) {
	addr := "10.9.77.1:8000"
	mk := func(handler string, interval time.Duration) Config {
		s := breaker.Settings{ConsecutiveFailures: 3}
		if handler == "site-b" {
			s.ConsecutiveFailures = 5
		}
		return Config{Key: handler + "|" + addr, Handler: handler, Generation: 7, Static: targets(addr), Breaker: &s,
			Prober:     &Prober{Transport: refusingTransport{}, URI: "/" + handler},
			Saturation: &saturation.Saturation{Transport: refusingTransport{}, Interval: interval, StaleAfter: 5 * time.Hour, Window: 5 * time.Hour}}
	}
	choose := func(order ...string) (scrapeBy, probeBy string) {
		reg := NewRegistry(nil)
		for _, h := range order {
			iv := time.Hour
			if h == "site-b" {
				iv = 2 * time.Hour
			}
			startPool(t, reg, mk(h, iv))
		}
		e, ok := reg.Entry(addr)
		if !ok {
			t.Fatal("no entry")
		}
		e.mu.Lock()
		defer e.mu.Unlock()
		c := e.satClaimLocked()
		pr := e.proberLocked()
		return c.handler, pr.URI
	}
	s1, p1 := choose("site-a", "site-b")
	s2, p2 := choose("site-b", "site-a")
	if s1 != s2 || p1 != p2 {
		t.Errorf("started a then b: scrape settings of %s, prober %s; b then a: %s, %s — want the same choice", s1, p1, s2, p2)
	}
}

// Two sites with different thresholds over one upstream, one of them open:
// a reload that changes the other site's thresholds keeps the open site's
// verdict and its open_until exactly, whichever of the two is open (the
// policies sort either way), and the changed site stays closed.
func TestReloadChangingOneSitesThresholdsKeepsTheOthersOpenUntil(t *testing.T) {
	const addr = "10.7.9.2:8000"
	settings := func(n int) *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: n, OpenFor: time.Hour, MinOpen: time.Hour}
	}
	for _, tc := range []struct {
		name              string
		open, other       int // thresholds before
		otherAfter        int // the other site's threshold after the reload
		openKey, otherKey string
	}{
		{"open site sorts first", 2, 10, 12, "a", "b"},
		{"open site sorts last", 2, 10, 12, "b", "a"},
		{"changed site becomes the open site's twin", 2, 10, 2, "a", "b"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := clocktest.New(simT0)
			reg := NewRegistry(nil)
			reg.UseClock(clk)
			pools := reloadAll(t, reg, nil,
				Config{Key: tc.openKey, Static: targets(addr), Breaker: settings(tc.open)},
				Config{Key: tc.otherKey, Static: targets(addr), Breaker: settings(tc.other)})
			for range tc.open {
				fail(mustPick(t, pools[0], ""))
			}
			before := pools[0].Breakers(pools[0].Entries()[0])[""].Snapshot()
			if before.State != breaker.Open || pools[1].BreakerState(addr, "") != "closed" {
				t.Fatalf("before the reload: open site %s, other %s", before.State, pools[1].BreakerState(addr, ""))
			}
			clk.Advance(time.Minute)
			next := reloadAll(t, reg, pools,
				Config{Key: tc.openKey, Static: targets(addr), Breaker: settings(tc.open)},
				Config{Key: tc.otherKey, Static: targets(addr), Breaker: settings(tc.otherAfter)})
			after := next[0].Breakers(next[0].Entries()[0])[""].Snapshot()
			if after.State != breaker.Open || !after.OpenUntil.Equal(before.OpenUntil) {
				t.Errorf("open site after the reload: %s until %v, want open until %v", after.State, after.OpenUntil, before.OpenUntil)
			}
			var ue *proxy.UnavailableError
			if _, err := pickModel(next[0], ""); !errors.As(err, &ue) || !ue.CircuitOpen {
				t.Errorf("open site after the reload: pick error %v, want circuit open", err)
			}
			if tc.otherAfter != tc.open {
				if st := next[1].BreakerState(addr, ""); st != "closed" {
					t.Errorf("changed site after the reload: %s, want closed", st)
				}
				if _, err := pickModel(next[1], ""); err != nil {
					t.Errorf("changed site after the reload: %v, want its request to reach the upstream", err)
				}
			}
		})
	}
}

// Two named sites over one upstream swap their breaker settings in a
// reload: each site keeps its own state (A open until the same time, B
// closed), because a verdict belongs to a handler, not to its settings.
// With verdicts shared by settings, B would have taken A's open breaker.
func TestReloadThatSwapsTwoSitesPoliciesKeepsEachSitesState(t *testing.T) {
	const addr = "10.7.9.4:8000"
	settings := func(n int) *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: n, OpenFor: time.Hour, MinOpen: time.Hour}
	}
	clk := clocktest.New(simT0)
	reg := NewRegistry(nil)
	reg.UseClock(clk)
	pools := reloadAll(t, reg, nil,
		Config{Key: addr, Handler: "site-a", Named: true, Static: targets(addr), Breaker: settings(2)},
		Config{Key: addr, Handler: "site-b", Named: true, Static: targets(addr), Breaker: settings(10)})
	fail(mustPick(t, pools[0], ""))
	fail(mustPick(t, pools[0], ""))
	before := pools[0].Breakers(pools[0].Entries()[0])[""].Snapshot()
	if before.State != breaker.Open || pools[1].BreakerState(addr, "") != "closed" {
		t.Fatalf("before the reload: A %s, B %s; want A open, B closed", before.State, pools[1].BreakerState(addr, ""))
	}
	clk.Advance(time.Minute)
	next := reloadAll(t, reg, pools,
		Config{Key: addr, Handler: "site-a", Named: true, Static: targets(addr), Breaker: settings(10)},
		Config{Key: addr, Handler: "site-b", Named: true, Static: targets(addr), Breaker: settings(2)})
	after := next[0].Breakers(next[0].Entries()[0])[""].Snapshot()
	if after.State != breaker.Open || !after.OpenUntil.Equal(before.OpenUntil) {
		t.Errorf("site A after the swap: %s until %v, want open until %v", after.State, after.OpenUntil, before.OpenUntil)
	}
	if st := next[1].BreakerState(addr, ""); st != "closed" {
		t.Errorf("site B after the swap: %s, want closed (it never failed)", st)
	}
	if _, err := pickModel(next[1], ""); err != nil {
		t.Errorf("site B after the swap: %v, want its request through", err)
	}
	var ue *proxy.UnavailableError
	if _, err := pickModel(next[0], ""); !errors.As(err, &ue) || !ue.CircuitOpen {
		t.Errorf("site A after the swap: pick error %v, want circuit open", err)
	}
}
