package upstream

import (
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// TestProbeLoopRunsOnlyForAStartedConfig: background loops start and stop
// with the llm_proxy app. A config that is only provisioned runs none; its
// start starts the loop, and its stop (no other config running) ends it.
func TestProbeLoopRunsOnlyForAStartedConfig(t *testing.T) {
	addr, probes := probeServer(t, 503) // keeps the breaker open
	reg := NewRegistry(nil)
	clk := newLoopClock()
	reg.UseClock(clk)
	p := buildPool(t, reg, Config{Static: targets(addr), Breaker: activeProbing(), Prober: testProber("/health")})
	b := breakerOf(t, reg, addr, "")
	b.ForceOpen(time.Millisecond, "test") // due for a probe at once
	// The transition starts a loop synchronously, if it starts one.
	if n, loops := probes(), reg.ProbeLoops(); n != 0 || loops != 0 {
		t.Fatalf("before the config started: %d probes, %d loops; want none", n, loops)
	}
	clk.Advance(time.Minute)
	if n, loops := probes(), reg.ProbeLoops(); n != 0 || loops != 0 {
		t.Fatalf("a minute later, before the config started: %d probes, %d loops; want none", n, loops)
	}
	p.Activate()
	step(t, clk, reg, 5*time.Millisecond)
	if n := probes(); n != 1 {
		t.Fatalf("%d probes in the first interval after the config started, want 1", n)
	}
	p.Deactivate()
	step(t, clk, reg, 5*time.Millisecond) // the loop wakes and sees no started config
	clocktest.Settle(t, "the probe loop outlived its config's stop", func() bool { return reg.ProbeLoops() == 0 })
	n := probes()
	clk.Advance(time.Minute)
	if m := probes(); m != n {
		t.Fatalf("%d probes after the config stopped and its loop ended", m-n)
	}
}

// TestClosedUpstreamsCountsModelBreakers: under scope model an upstream
// counts as healthy while one of its model breakers is closed, and not when
// all are open (it used to count every upstream as closed: the
// per-upstream breaker it looked for does not exist under scope model).
func TestClosedUpstreamsCountsModelBreakers(t *testing.T) {
	reg := NewRegistry(nil)
	s := breaker.Settings{ConsecutiveFailures: 1}
	p := startPool(t, reg, Config{Static: targets("10.88.0.1:8000", "10.88.0.2:8000"), Breaker: &s, ScopeModel: true, Selector: firstSelector{}})
	reg.Models.Learn("m")
	if n := p.ClosedUpstreams(); n != 2 {
		t.Fatalf("before any traffic: %d healthy, want 2", n)
	}
	fail(mustPick(t, p, "m")) // opens 10.88.0.1|m, its only breaker
	if n := p.ClosedUpstreams(); n != 1 {
		t.Fatalf("after the only model breaker of one upstream opened: %d healthy, want 1", n)
	}
}
