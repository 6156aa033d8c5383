package upstream

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

func TestOpenBreakerRemovesUpstreamBeforeSelection(t *testing.T) {
	obs := newFakeObserver()
	reg := NewRegistry(obs)
	p := startPool(t, reg, Config{Static: targets("10.1.0.1:8000", "10.1.0.2:8000"), Selector: firstSelector{}, Breaker: &breaker.Settings{}})
	for range breaker.DefaultConsecutiveFailures {
		up := mustPick(t, p, "")
		if up.Addr != "10.1.0.1:8000" {
			t.Fatalf("pick %s, want the first", up.Addr)
		}
		fail(up)
	}
	if st := p.BreakerState("10.1.0.1:8000", ""); st != "open" {
		t.Fatalf("state %q after %d failures", st, breaker.DefaultConsecutiveFailures)
	}
	up := mustPick(t, p, "")
	if up.Addr != "10.1.0.2:8000" {
		t.Fatalf("with the first open, the policy 'first' must get the second: %s", up.Addr)
	}
	finish(up, proxy.AttemptSuccess)
	if n := obs.shortCircuited("10.1.0.1:8000"); n != 1 {
		t.Fatalf("short-circuited %d times, want 1", n)
	}
	if st, ok := obs.gauge("10.1.0.1:8000", ""); !ok || st != breaker.Open {
		t.Fatalf("breaker gauge %v (present %t), want open", st, ok)
	}
	if st, ok := obs.gauge("10.1.0.2:8000", ""); !ok || st != breaker.Closed {
		t.Fatalf("second upstream's gauge %v (present %t), want closed", st, ok)
	}
}

func TestAllBreakersOpenGivesRetryAfterWithoutUpstream(t *testing.T) {
	reg := NewRegistry(nil)
	p := startPool(t, reg, Config{Static: targets("10.1.1.1:8000"),
		Breaker: &breaker.Settings{ConsecutiveFailures: 1, OpenFor: 30 * time.Second, MinOpen: 30 * time.Second}})
	fail(mustPick(t, p, ""))
	_, err := pickModel(p, "")
	var ue *proxy.UnavailableError
	if !errors.As(err, &ue) || !ue.CircuitOpen || ue.Busy || !errors.Is(err, proxy.ErrNoUpstream) {
		t.Fatalf("err %v (%+v)", err, ue)
	}
	// 30s cooldown jittered upward by up to 40% above MinOpen's 30s.
	if ue.RetryAfter < 29*time.Second || ue.RetryAfter > 42*time.Second {
		t.Fatalf("RetryAfter %v", ue.RetryAfter)
	}
}

// DESIGN §4: the client's faults, its own deadline and cancellations are
// neutral for the upstream's breaker.
func TestNeutralOutcomesLeaveBreakerClosed(t *testing.T) {
	for _, o := range []proxy.AttemptOutcome{
		proxy.AttemptCanceled, proxy.AttemptHTTP4xx, proxy.AttemptInbandError4xx, proxy.AttemptStreamTimeout,
	} {
		t.Run(o.String(), func(t *testing.T) {
			reg := NewRegistry(nil)
			p := startPool(t, reg, Config{Static: targets("10.1.2.1:8000"), Breaker: &breaker.Settings{ConsecutiveFailures: 1, FailureRatio: 0.5, MinRequests: 1}})
			for range 5 {
				finish(mustPick(t, p, ""), o)
			}
			mustPick(t, p, "").Done(nil) // a pick given back unused
			snap := breakerOf(t, reg, "10.1.2.1:8000", "").Snapshot()
			if snap.State != breaker.Closed || snap.ConsecutiveFailures != 0 || snap.FailuresInWindow != 0 || snap.RequestsInWindow != 0 {
				t.Fatalf("snapshot %+v", snap)
			}
		})
	}
}

// A client's 4xx between upstream failures neither resets the run of
// failures nor counts as a success.
func Test4xxDoesNotResetARunOfFailures(t *testing.T) {
	for _, o := range []proxy.AttemptOutcome{proxy.AttemptHTTP4xx, proxy.AttemptInbandError4xx} {
		t.Run(o.String(), func(t *testing.T) {
			reg := NewRegistry(nil)
			p := startPool(t, reg, Config{Static: targets("10.1.6.1:8000"), Breaker: &breaker.Settings{}})
			for _, o := range []proxy.AttemptOutcome{proxy.AttemptHTTP5xx, proxy.AttemptHTTP5xx, o, proxy.AttemptHTTP5xx} {
				finish(mustPick(t, p, ""), o)
			}
			if st := p.BreakerState("10.1.6.1:8000", ""); st != "open" {
				t.Fatalf("5xx, 5xx, %v, 5xx left the breaker %s; the client's error must not reset the run", o, st)
			}
		})
	}
}

// A half-open probe answered with a 4xx proves the server is back.
func Test4xxAnsweringAProbeClosesBreaker(t *testing.T) {
	reg := NewRegistry(nil)
	clk := newLoopClock()
	reg.UseClock(clk)
	p := startPool(t, reg, Config{Static: targets("10.1.8.1:8000"),
		Breaker: &breaker.Settings{ConsecutiveFailures: 1, OpenFor: 10 * time.Millisecond, MinOpen: -1, RecoverySuccesses: 1}})
	fail(mustPick(t, p, ""))
	if _, err := pickModel(p, ""); err == nil {
		t.Fatal("picked the upstream whose breaker just opened")
	}
	clk.Advance(100 * time.Millisecond) // past the 10ms cooldown, however jittered
	probe, err := pickModel(p, "")
	if err != nil {
		t.Fatalf("the breaker let no probe in after its cooldown: %v", err)
	}
	if st := p.BreakerState("10.1.8.1:8000", ""); st != "half_open" {
		t.Fatalf("the probe was picked with the breaker %s", st)
	}
	finish(probe, proxy.AttemptHTTP4xx)
	if st := p.BreakerState("10.1.8.1:8000", ""); st != "closed" {
		t.Fatalf("a probe answered 400 left the breaker %s", st)
	}
}

func TestUpstreamFaultsAreFailures(t *testing.T) {
	for _, o := range []proxy.AttemptOutcome{
		proxy.AttemptConnectError, proxy.AttemptFirstByteTimeout, proxy.AttemptHTTP5xx, proxy.AttemptHTTP429,
		proxy.AttemptInbandError5xx, proxy.AttemptInbandError429, proxy.AttemptTruncated, proxy.AttemptIdleTimeout,
	} {
		t.Run(o.String(), func(t *testing.T) {
			reg := NewRegistry(nil)
			p := startPool(t, reg, Config{Static: targets("10.1.9.1:8000"), Breaker: &breaker.Settings{ConsecutiveFailures: 1}})
			finish(mustPick(t, p, ""), o)
			if st := p.BreakerState("10.1.9.1:8000", ""); st != "open" {
				t.Fatalf("%v left the breaker %s", o, st)
			}
		})
	}
}

func TestRetryAfterOpensBreakerForThatLong(t *testing.T) {
	reg := NewRegistry(nil)
	p := startPool(t, reg, Config{Static: targets("10.1.3.1:8000", "10.1.3.2:8000"), Selector: firstSelector{}, Breaker: &breaker.Settings{}})
	up := mustPick(t, p, "")
	up.Done(&proxy.AttemptReport{Upstream: up.Addr, Outcome: proxy.AttemptHTTP429, Status: 429, RetryAfter: 2 * time.Second})
	br := breakerOf(t, reg, "10.1.3.1:8000", "")
	if br.State() != breaker.Open {
		t.Fatalf("a 429 with Retry-After should exclude the upstream; state %v", br.State())
	}
	if left := time.Until(br.Snapshot().OpenUntil); left > 2*time.Second || left < time.Second {
		t.Fatalf("open until %v from now, want ~2s", left)
	}
	if up := mustPick(t, p, ""); up.Addr != "10.1.3.2:8000" {
		t.Fatalf("picked %s", up.Addr)
	}
}

func TestScopeModelKeepsBreakersApart(t *testing.T) {
	reg := NewRegistry(nil)
	reg.Models.Learn("llama")
	reg.Models.Learn("qwen")
	p := startPool(t, reg, Config{Static: targets("10.1.4.1:8000"), ScopeModel: true, Breaker: &breaker.Settings{ConsecutiveFailures: 1}})
	fail(mustPick(t, p, "llama"))
	if _, err := pickModel(p, "llama"); err == nil {
		t.Fatal("llama's breaker should be open")
	}
	if _, err := pickModel(p, "qwen"); err != nil {
		t.Fatalf("qwen on the same upstream should pass: %v", err)
	}
	if st := p.BreakerState("10.1.4.1:8000", "llama"); st != "open" {
		t.Fatalf("llama %s", st)
	}
	if st := p.BreakerState("10.1.4.1:8000", "qwen"); st != "closed" {
		t.Fatalf("qwen %s", st)
	}
}

// scope model: a model no upstream has served yet still gets a breaker of
// its own, so one broken model does not black out another.
func TestScopeModelUnservedModelsHaveTheirOwnBreakers(t *testing.T) {
	reg := NewRegistry(nil)
	p := startPool(t, reg, Config{Static: targets("10.9.4.1:8000"), ScopeModel: true, Breaker: &breaker.Settings{ConsecutiveFailures: 1}})
	fail(mustPick(t, p, "fresh-model-b"))
	if _, err := pickModel(p, "fresh-model-a"); err != nil {
		t.Fatalf("model a refused after model b's failure: %v", err)
	}
}

// scope model: client-chosen model names get breakers only up to a bound.
func TestScopeModelBreakersAreBounded(t *testing.T) {
	obs := newFakeObserver()
	reg := NewRegistry(obs)
	const maxUnserved = 16
	reg.Models = NewModelNames(DefaultMaxModels, maxUnserved)
	p := startPool(t, reg, Config{Static: targets("10.9.3.1:8000"), ScopeModel: true, Breaker: &breaker.Settings{}})
	for i := range 500 {
		up, err := pickModel(p, fmt.Sprintf("junk-%d", i))
		if err != nil {
			t.Fatal(err)
		}
		finish(up, proxy.AttemptHTTP4xx)
	}
	e, _ := reg.Entry("10.9.3.1:8000")
	if n := len(e.Verdicts()); n > maxUnserved+1 {
		t.Fatalf("%d breakers from client-chosen model names, want at most %d", n, maxUnserved+1)
	}
	if n := obs.countPrefix("created 10.9.3.1:8000|"); n > maxUnserved+1 {
		t.Fatalf("%d breaker gauges from client-chosen model names", n)
	}
}

func TestTransitionReachesObserver(t *testing.T) {
	obs := newFakeObserver()
	reg := NewRegistry(obs)
	p := startPool(t, reg, Config{Static: targets("10.1.7.1:8000"), Breaker: &breaker.Settings{ConsecutiveFailures: 1}})
	n := obs.count()
	fail(mustPick(t, p, ""))
	got := obs.eventsSince(n)
	if len(got) != 1 || got[0] != "transition 10.1.7.1:8000| closed→open" {
		t.Fatalf("events %q, want one closed→open transition", got)
	}
}

// A breaker no config uses any more takes its gauge with it.
func TestDestroyedBreakerLeavesNoGauge(t *testing.T) {
	obs := newFakeObserver()
	reg := NewRegistry(obs)
	reg.Models.Learn("llama")
	p := startPool(t, reg, Config{Static: targets("10.9.6.1:8000"), ScopeModel: true, Breaker: &breaker.Settings{}})
	finish(mustPick(t, p, "llama"), proxy.AttemptSuccess)
	finish(mustPick(t, p, "qwen"), proxy.AttemptSuccess)
	if _, ok := obs.gauge("10.9.6.1:8000", "llama"); !ok {
		t.Fatal("no gauge for a live breaker")
	}
	p.Deactivate()
	p.Release()
	for _, k := range []string{"llama", "qwen"} {
		if st, ok := obs.gauge("10.9.6.1:8000", k); ok {
			t.Fatalf("gauge of the destroyed breaker %q still reports %v", k, st)
		}
	}
	if _, ok := reg.Entry("10.9.6.1:8000"); ok {
		t.Fatal("entry outlived its only pool")
	}
}

// A newer config turning breakers off forgets the upstream's breakers and
// their gauges; picks no longer consult them.
func TestReloadTurningBreakersOffForgetsThem(t *testing.T) {
	obs := newFakeObserver()
	reg := NewRegistry(obs)
	old := startPool(t, reg, Config{Static: targets("10.1.10.1:8000"), Breaker: &breaker.Settings{ConsecutiveFailures: 1, OpenFor: time.Minute, MinOpen: time.Minute}})
	fail(mustPick(t, old, ""))
	next := reload(t, old, Config{Static: targets("10.1.10.1:8000")})
	if _, ok := obs.gauge("10.1.10.1:8000", ""); ok {
		t.Fatal("breaker gauge kept with breakers off")
	}
	e, _ := reg.Entry("10.1.10.1:8000")
	if n := len(e.Verdicts()); n != 0 {
		t.Fatalf("%d breakers kept with breakers off", n)
	}
	if _, err := pickModel(next, ""); err != nil {
		t.Fatalf("breakers off, yet refused: %v", err)
	}
	if st := next.BreakerState("10.1.10.1:8000", ""); st != "" {
		t.Fatalf("BreakerState %q with breakers off", st)
	}
}
