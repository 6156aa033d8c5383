package upstream

import (
	"errors"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
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
// breaker is open. A reload that keeps both policies unchanged but changes
// which handler is provisioned last (the sites swapped, or a third site
// added after them) must keep A's breaker open and B's closed: each
// handler's state follows its own unchanged policy.
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
