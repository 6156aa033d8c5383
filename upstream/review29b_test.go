package upstream

import (
	"fmt"
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
