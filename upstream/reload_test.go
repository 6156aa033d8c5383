package upstream

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

func TestBreakerStateSurvivesPoolReplacement(t *testing.T) {
	reg := NewRegistry(nil)
	old := startPool(t, reg, Config{Static: targets("10.1.5.1:8000"),
		Breaker: &breaker.Settings{ConsecutiveFailures: 1, OpenFor: time.Minute, MinOpen: time.Minute}})
	fail(mustPick(t, old, ""))
	next := reload(t, old, Config{Static: targets("10.1.5.1:8000"), Breaker: &breaker.Settings{ConsecutiveFailures: 5}})
	b := breakerOf(t, reg, "10.1.5.1:8000", "")
	if b.State() != breaker.Open {
		t.Fatalf("state after reload %v, want open", b.State())
	}
	if got := b.Settings().ConsecutiveFailures; got != 5 {
		t.Fatalf("new settings not applied: consecutive_failures %d", got)
	}
	if _, err := pickModel(next, ""); err == nil {
		t.Fatal("the new pool picked the upstream whose breaker is open")
	}
	if n := reg.EntryRefs("10.1.5.1:8000"); n != 1 {
		t.Fatalf("entry held %d times after the reload, want 1", n)
	}
}

// scope model: a reload keeps every model's breaker of the pool, not only
// those the new config happens to see traffic for.
func TestScopeModelBreakersSurviveReload(t *testing.T) {
	reg := NewRegistry(nil)
	cfg := Config{Static: targets("10.9.5.1:8000"), ScopeModel: true,
		Breaker: &breaker.Settings{ConsecutiveFailures: 1, OpenFor: time.Minute, MinOpen: time.Minute}}
	old := startPool(t, reg, cfg)
	fail(mustPick(t, old, "reload-model"))
	next := reload(t, old, cfg)
	if _, err := pickModel(next, "reload-model"); err == nil {
		t.Fatal("the model's open breaker was lost in the reload")
	}
}

// Requests still running on the old config after a reload are evidence
// for the new config's breakers, judged by the new settings; the old
// config's own breakers keep its settings for what it still picks.
func TestOldConfigsRequestsAreEvidenceForTheNewSettings(t *testing.T) {
	reg := NewRegistry(nil)
	const addr = "10.9.2.1:8000"
	old := startPool(t, reg, Config{Static: targets(addr), Breaker: &breaker.Settings{ConsecutiveFailures: 1}})
	var running []proxy.Upstream
	for range 4 {
		running = append(running, mustPick(t, old, ""))
	}
	next := reload(t, old, Config{Static: targets(addr), Breaker: &breaker.Settings{ConsecutiveFailures: 5}})
	if got := breakerOf(t, reg, addr, "").Settings().ConsecutiveFailures; got != 5 {
		t.Fatalf("consecutive_failures %d, want the new config's 5", got)
	}
	for _, up := range running {
		fail(up)
	}
	if st := next.BreakerState(addr, ""); st != "closed" {
		t.Fatalf("4 failures of the old config's requests tripped a breaker that wants 5: %s", st)
	}
	fail(mustPick(t, next, ""))
	if st := next.BreakerState(addr, ""); st != "open" {
		t.Fatalf("the fifth failure in a row on the upstream left the new config's breaker %s, want open", st)
	}
}

// Regression: Provision applied a new config's settings to the shared
// entries at once, so a config that then failed to load (built, never
// started, released) changed the running config's breakers.
func TestFailedConfigLoadChangesNoLiveSetting(t *testing.T) {
	reg := NewRegistry(nil)
	a := startPool(t, reg, Config{Static: targets("10.2.1.1:8000"), Breaker: &breaker.Settings{ConsecutiveFailures: 3}})
	mustPick(t, a, "").Done(nil)

	b, err := reg.NewPool(Config{Static: targets("10.2.1.1:8000"), Breaker: &breaker.Settings{ConsecutiveFailures: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if got := breakerOf(t, reg, "10.2.1.1:8000", "").Settings().ConsecutiveFailures; got != 3 {
		t.Fatalf("a config only provisioned changed consecutive_failures to %d", got)
	}
	b.Release() // another part of the new config failed: it never starts
	// A config whose own construction fails (an upstream listed twice).
	if _, err := reg.NewPool(Config{Static: targets("10.2.1.1:8000", "10.2.1.1:8000"), Breaker: &breaker.Settings{ConsecutiveFailures: 1}}); err == nil {
		t.Fatal("a pool listing an upstream twice was built")
	}

	br := breakerOf(t, reg, "10.2.1.1:8000", "")
	if got := br.Settings().ConsecutiveFailures; got != 3 {
		t.Fatalf("after the failed load consecutive_failures is %d, want the running config's 3", got)
	}
	if n := reg.EntryRefs("10.2.1.1:8000"); n != 1 {
		t.Fatalf("entry held %d times after the failed load, want 1", n)
	}
	for i := 1; i <= 3; i++ {
		fail(mustPick(t, a, ""))
		want := breaker.Closed
		if i == 3 {
			want = breaker.Open
		}
		if br.State() != want {
			t.Fatalf("after %d failure(s) the breaker is %v, want %v", i, br.State(), want)
		}
	}
}

// A config that started and then stopped (another of its apps failed to
// start) never changed the running config's verdicts: each handler's
// breaker keeps its own settings.
func TestAConfigThatStartsAndStopsLeavesTheRunningSettings(t *testing.T) {
	reg := NewRegistry(nil)
	a := startPool(t, reg, Config{Static: targets("10.2.2.1:8000"), Breaker: &breaker.Settings{ConsecutiveFailures: 3}})
	mustPick(t, a, "").Done(nil)
	br := a.Breakers(a.static[0].e)[""]
	b := startPool(t, reg, Config{Static: targets("10.2.2.1:8000"), Breaker: &breaker.Settings{ConsecutiveFailures: 1}})
	b.Deactivate()
	b.Release()
	if got := br.Settings().ConsecutiveFailures; got != 3 {
		t.Fatalf("after another config started and stopped consecutive_failures is %d, want the running config's 3", got)
	}
	fail(mustPick(t, a, ""))
	if br.State() != breaker.Closed {
		t.Fatal("one failure tripped the running config's breaker that wants 3")
	}
}

// Regression: after its Cleanup, a request still running on the old config
// took new references (scope model keys, dynamic upstreams) that nobody
// would release.
func TestOldPoolTakesNoRefsAfterRelease(t *testing.T) {
	t.Run("static, scope model", func(t *testing.T) {
		reg := NewRegistry(nil)
		old := startPool(t, reg, Config{Static: targets("10.9.1.1:8000"), ScopeModel: true, Breaker: &breaker.Settings{}})
		old.Deactivate()
		old.Release()                   // Cleanup ran: the config was replaced
		up := mustPick(t, old, "llama") // a request whose body was still uploading
		finish(up, proxy.AttemptSuccess)
		if n := reg.EntryRefs("10.9.1.1:8000"); n != 0 {
			t.Fatalf("entry referenced %d time(s) after its only pool was released", n)
		}
		if _, ok := reg.Entry("10.9.1.1:8000"); ok {
			t.Fatal("entry recreated by a released pool")
		}
	})
	t.Run("dynamic", func(t *testing.T) {
		reg := NewRegistry(nil)
		addrs := []string{"10.9.1.2:8000"}
		src := func(*http.Request) ([]Target, error) { return targets(addrs...), nil }
		old := startPool(t, reg, Config{Key: "dynamic:released", Source: src, Breaker: &breaker.Settings{}})
		finish(mustPick(t, old, ""), proxy.AttemptSuccess)
		old.Deactivate()
		old.Release()
		addrs = []string{"10.9.1.3:8000"} // the source now returns another pod
		finish(mustPick(t, old, ""), proxy.AttemptSuccess)
		for _, a := range []string{"10.9.1.2:8000", "10.9.1.3:8000"} {
			if _, ok := reg.Entry(a); ok || reg.EntryRefs(a) != 0 {
				t.Fatalf("%s still held (%d refs) after the only pool was released", a, reg.EntryRefs(a))
			}
		}
		if n := reg.state.Len(); n != 0 {
			t.Fatalf("%d pool states kept after release", n)
		}
	})
}

// Regression: a request on a released pool asking for a model the pool
// never held (scope model) or for an upstream the registry forgot crashed
// or took references.
func TestReleasedPoolPickingUnheldModelDoesNotCrash(t *testing.T) {
	reg := NewRegistry(nil)
	cfg := Config{Static: targets("10.2.3.1:8000", "10.2.3.2:8000"), ScopeModel: true, Breaker: &breaker.Settings{}}
	old := startPool(t, reg, cfg)
	next := reload(t, old, Config{Static: targets("10.2.3.1:8000"), ScopeModel: true, Breaker: &breaker.Settings{}})
	for _, tc := range []struct{ addr, model string }{
		{"10.2.3.9:8000", ""}, {"10.2.3.9:8000", "never-held"}, {"10.2.3.2:8000", "never-held"}, {"10.2.3.1:8000", "never-held"}, {"", "x"},
	} {
		if st := old.BreakerState(tc.addr, tc.model); st != "" {
			t.Errorf("BreakerState(%q, %q) = %q on a released pool, want \"\"", tc.addr, tc.model, st)
		}
	}
	refs := reg.EntryRefs("10.2.3.1:8000")
	for _, tried := range [][]string{nil, {"10.2.3.1:8000"}, {"10.2.3.2:8000"}} {
		up, err := pickModel(old, "never-held", tried...)
		if err != nil {
			t.Fatalf("pick on the released pool (tried %v): %v", tried, err)
		}
		finish(up, proxy.AttemptSuccess)
	}
	if n := reg.EntryRefs("10.2.3.1:8000"); n != refs {
		t.Fatalf("picks on the released pool changed the entry's refs from %d to %d", refs, n)
	}
	if _, ok := reg.Entry("10.2.3.2:8000"); ok {
		t.Fatal("the upstream only the released pool listed came back")
	}
	if st := next.BreakerState("10.2.3.1:8000", "never-held"); st != "closed" && st != "" {
		t.Fatalf("live entry's breaker for the new model: %q", st)
	}

	// A dynamic pool, released, meeting an address no entry exists for.
	dyn := startPool(t, reg, Config{Key: "dynamic:unheld", ScopeModel: true, Breaker: &breaker.Settings{},
		Source: func(*http.Request) ([]Target, error) { return targets("10.2.3.7:8000"), nil }})
	dyn.Deactivate()
	dyn.Release()
	up, err := pickModel(dyn, "never-held")
	if err != nil {
		t.Fatalf("pick on the released dynamic pool: %v", err)
	}
	fail(up)
	if st := dyn.BreakerState("10.2.3.7:8000", "never-held"); st != "" {
		t.Fatalf("BreakerState %q for an upstream the registry never held", st)
	}
	if _, ok := reg.Entry("10.2.3.7:8000"); ok || reg.EntryRefs("10.2.3.7:8000") != 0 {
		t.Fatal("a released dynamic pool put an entry in the registry")
	}
}

// Regression: a breaker of a destroyed entry (an attempt of a released
// config ending afterwards) reported its transitions, so its gauge came
// back and stayed for good.
func TestDestroyedEntryBreakerTransitionsRecreateNoGauges(t *testing.T) {
	obs := newFakeObserver()
	reg := NewRegistry(obs)
	p := startPool(t, reg, Config{Static: targets("10.2.4.1:8000"), Breaker: &breaker.Settings{ConsecutiveFailures: 2}})
	ups := []proxy.Upstream{mustPick(t, p, ""), mustPick(t, p, "")}
	p.Deactivate()
	p.Release()
	if _, ok := obs.gauge("10.2.4.1:8000", ""); ok {
		t.Fatal("gauge kept after the entry was destroyed")
	}
	n := obs.count()
	for _, up := range ups {
		fail(up) // the released config's attempts fail afterwards: the breaker trips
	}
	for _, e := range obs.eventsSince(n) {
		if strings.HasPrefix(e, "transition ") || strings.HasPrefix(e, "created ") {
			t.Fatalf("destroyed entry's breaker reported %q", e)
		}
	}
	if _, ok := obs.gauge("10.2.4.1:8000", ""); ok {
		t.Fatal("gauge recreated by a destroyed entry's breaker")
	}
	// A pick on the released pool creates no breaker either.
	fail(mustPick(t, p, ""))
	if got := obs.eventsSince(n); len(got) != 0 {
		t.Fatalf("events after destruction: %q", got)
	}
}

// The hedger of a released pool takes no tracker references.
func TestOldPoolHedgerTakesNoRefsAfterRelease(t *testing.T) {
	reg := NewRegistry(nil)
	p := startPool(t, reg, Config{Key: "review-pool", Static: targets("10.2.5.1:8000"), Hedge: &HedgeConfig{Policy: hedgeFixed(time.Second)}})
	h := p.Hedging()
	p.Deactivate()
	p.Release()
	info := proxy.RequestInfo{Model: "review-model", Stream: true}
	h.Observe(info, time.Second) // a request finishing on the old pool
	if _, ok := h.Delay(info); !ok {
		t.Fatal("no delay on a released pool")
	}
	if n := reg.state.Len(); n != 0 {
		t.Fatalf("%d pool states referenced after release", n)
	}
}
