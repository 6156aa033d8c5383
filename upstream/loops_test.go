package upstream

import (
	"testing"
	"time"
)

// TestProbeLoopRunsOnlyForAStartedConfig: background loops start and stop
// with the llm_proxy app. A config that is only provisioned runs none; its
// start starts the loop, and its stop (no other config running) ends it.
func TestProbeLoopRunsOnlyForAStartedConfig(t *testing.T) {
	addr, probes := probeServer(t, 503) // keeps the breaker open
	reg := NewRegistry(nil)
	p := buildPool(t, reg, Config{Static: targets(addr), Breaker: activeProbing(), Prober: testProber("/health")})
	b := breakerOf(t, reg, addr, "")
	b.ForceOpen(time.Millisecond, "test") // due for a probe at once
	time.Sleep(30 * time.Millisecond)     // six probe intervals
	if n, loops := probes(), reg.ProbeLoops(); n != 0 || loops != 0 {
		t.Fatalf("before the config started: %d probes, %d loops; want none", n, loops)
	}
	p.Activate()
	eventually(t, 5*time.Second, "no probe after the config started", func() bool { return probes() > 0 })
	p.Deactivate()
	eventually(t, 5*time.Second, "the probe loop outlived its config's stop", func() bool { return reg.ProbeLoops() == 0 })
}
