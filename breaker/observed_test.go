package breaker_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

const saturated = "saturation: queue wait p99 7.2s > 5s for 30s"

// observe feeds o and reports the state after it.
func (f *fixture) observe(o breaker.Observation) breaker.State {
	f.t.Helper()
	f.b.Observe(o, "queue wait p99 "+o.String())
	return f.b.State()
}

// wantRefusesEverything checks that nothing is let through a breaker that
// recovers by observation.
func (f *fixture) wantRefusesEverything() {
	f.t.Helper()
	if p, ok := f.b.Allow(); ok {
		f.t.Fatalf("Allow gave a permit (probe %v) in %s while observed", p.Probe(), f.b.State())
	}
	if _, ok := f.b.AllowProbe(); ok {
		f.t.Fatalf("AllowProbe gave a permit in %s while observed", f.b.State())
	}
	if f.b.ProbeDue() {
		f.t.Fatalf("ProbeDue in %s while observed", f.b.State())
	}
	if f.b.RetryAt().IsZero() {
		f.t.Fatalf("RetryAt zero in %s while observed", f.b.State())
	}
}

// transitions returns the listener's transitions as "from>to: reason".
func (f *fixture) transitions() []string {
	var out []string
	for _, t := range f.rec.all() {
		out = append(out, t.From.String()+">"+t.To.String()+": "+t.Reason)
	}
	return out
}

func (f *fixture) wantTransitions(want ...string) {
	f.t.Helper()
	got := f.transitions()
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		f.t.Fatalf("transitions:\n  %s\nwant:\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
}

func TestObservationNames(t *testing.T) {
	for o, want := range map[breaker.Observation]string{breaker.ObservedUnknown: "unknown", breaker.ObservedHealthy: "healthy",
		breaker.ObservedUnhealthy: "unhealthy", 9: "observation(9)"} {
		if got := o.String(); got != want {
			t.Errorf("Observation(%d).String() = %q, want %q", o, got, want)
		}
	}
	if breaker.ObservedUnknown != 0 {
		t.Error("the zero Observation is not unknown")
	}
}

func TestTripObservedOpensAClosedBreaker(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	f.b.TripObserved(saturated)
	f.wantState(breaker.Open)
	if !f.b.Observed() {
		t.Fatal("not observed")
	}
	s := f.b.Snapshot()
	want := breaker.Snapshot{Key: "up1", State: breaker.Open, Since: t0, OpenUntil: t0.Add(10 * time.Second),
		Observed: true, LastFailure: saturated, LastFailureAt: t0}
	if s != want {
		t.Fatalf("snapshot =\n %+v\nwant\n %+v", s, want)
	}
	trs := f.rec.all()
	if len(trs) != 1 || trs[0].Reason != saturated || !trs[0].OpenUntil.Equal(t0.Add(10*time.Second)) {
		t.Fatalf("transitions %+v", trs)
	}
	f.b.TripObserved("again") // already observed: nothing
	if got := f.b.Snapshot(); got != want || len(f.rec.all()) != 1 {
		t.Fatalf("second TripObserved changed the breaker: %+v", got)
	}
}

func TestObservedBreakerRefusesEveryCall(t *testing.T) {
	for _, active := range []bool{false, true} {
		t.Run(map[bool]string{false: "user probes", true: "active probing"}[active], func(t *testing.T) {
			f := newFixture(t, breaker.Settings{ActiveProbing: active})
			f.b.TripObserved(saturated)

			// Open, in the cooldown: RetryAt is the cooldown end.
			f.wantRefusesEverything()
			if got := f.b.RetryAt(); !got.Equal(t0.Add(10 * time.Second)) {
				t.Fatalf("open RetryAt = t0%+v, want the cooldown end", got.Sub(t0))
			}

			// Open, cooldown over: no probe takes it to HalfOpen.
			f.clk.Advance(time.Minute)
			f.wantRefusesEverything()
			f.wantState(breaker.Open)
			if got := f.b.RetryAt(); !got.Equal(f.clk.Now()) {
				t.Fatalf("RetryAt after the cooldown = now%+v, want now", got.Sub(f.clk.Now()))
			}

			// HalfOpen: observations decide; RetryAt is now.
			if f.observe(breaker.ObservedHealthy) != breaker.HalfOpen {
				t.Fatalf("state %s after the first healthy observation", f.b.State())
			}
			f.wantRefusesEverything()
			if got := f.b.RetryAt(); !got.Equal(f.clk.Now()) {
				t.Fatalf("half-open RetryAt = now%+v, want now", got.Sub(f.clk.Now()))
			}
			if s := f.b.Snapshot(); s.ProbesInFlight != 0 || s.ProbeSuccesses != 1 || !s.Observed {
				t.Fatalf("half-open snapshot %+v", s)
			}
		})
	}
}

func TestObservationsCloseAnObservedBreaker(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	f.b.TripObserved(saturated)
	f.clk.Advance(10 * time.Second)
	if f.observe(breaker.ObservedHealthy) != breaker.HalfOpen {
		t.Fatal("not half-open after the cooldown and one healthy observation")
	}
	if f.observe(breaker.ObservedHealthy) != breaker.Closed {
		t.Fatal("not closed after RecoverySuccesses healthy observations")
	}
	if f.b.Observed() || f.b.Snapshot().Observed {
		t.Fatal("still observed after closing")
	}
	f.wantTransitions(
		"closed>open: "+saturated,
		"open>half_open: cooldown over after 10s",
		"half_open>closed: 2 consecutive healthy observations; last: queue wait p99 healthy",
	)
	if p, ok := f.b.Allow(); !ok || p.Probe() {
		t.Fatal("closed breaker refused a user call")
	}
	f.observe(breaker.ObservedUnhealthy) // closed: nothing
	f.wantState(breaker.Closed)
	if len(f.rec.all()) != 3 {
		t.Fatal("Observe on a closed breaker made a transition")
	}
}

func TestObserveDuringTheCooldownDoesNothing(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	f.b.TripObserved(saturated)
	f.clk.Advance(10*time.Second - 1)
	before := f.b.Snapshot()
	for _, o := range []breaker.Observation{breaker.ObservedHealthy, breaker.ObservedUnhealthy, breaker.ObservedUnknown, breaker.ObservedHealthy} {
		f.observe(o)
	}
	if after := f.b.Snapshot(); after != before {
		t.Fatalf("observations in the cooldown changed the breaker:\n before %+v\n after  %+v", before, after)
	}
	f.clk.Advance(1)
	if f.observe(breaker.ObservedUnknown) != breaker.HalfOpen {
		t.Fatal("an unknown observation after the cooldown did not half-open")
	}
	if got := f.b.Snapshot().ProbeSuccesses; got != 0 {
		t.Fatalf("successes = %d after an unknown observation", got)
	}
}

func TestObservedUnknownBreaksAHealthyRun(t *testing.T) {
	f := newFixture(t, breaker.Settings{RecoverySuccesses: 3})
	f.b.TripObserved(saturated)
	f.clk.Advance(10 * time.Second)
	steps := []struct {
		o         breaker.Observation
		want      breaker.State
		successes int
	}{
		{breaker.ObservedHealthy, breaker.HalfOpen, 1},
		{breaker.ObservedHealthy, breaker.HalfOpen, 2},
		{breaker.ObservedUnknown, breaker.HalfOpen, 0},
		{breaker.ObservedHealthy, breaker.HalfOpen, 1},
		{breaker.ObservedHealthy, breaker.HalfOpen, 2},
		{breaker.ObservedUnknown, breaker.HalfOpen, 0},
		{breaker.ObservedUnknown, breaker.HalfOpen, 0},
		{breaker.ObservedHealthy, breaker.HalfOpen, 1},
		{breaker.ObservedHealthy, breaker.HalfOpen, 2},
		{breaker.ObservedHealthy, breaker.Closed, 0},
	}
	for i, st := range steps {
		if got := f.observe(st.o); got != st.want {
			t.Fatalf("step %d (%s): state %s, want %s", i, st.o, got, st.want)
		}
		if got := f.b.Snapshot().ProbeSuccesses; got != st.successes {
			t.Fatalf("step %d (%s): successes %d, want %d", i, st.o, got, st.successes)
		}
	}
	if got := f.rec.all(); len(got) != 3 {
		t.Fatalf("%d transitions, want 3 (unknown never re-opens)", len(got))
	}
}

func TestObservedUnhealthyReopensWithTheGrownCooldown(t *testing.T) {
	f := newFixture(t, breaker.Settings{OpenFor: 10 * time.Second, MaxOpen: 30 * time.Second, MinOpen: -1})
	f.b.TripObserved(saturated)
	f.clk.Advance(10 * time.Second)
	f.observe(breaker.ObservedHealthy)
	if f.observe(breaker.ObservedUnhealthy) != breaker.Open {
		t.Fatal("unhealthy observation did not re-open")
	}
	if got := f.openFor(); got != 20*time.Second {
		t.Fatalf("cooldown after re-open = %s, want 20s", got)
	}
	s := f.b.Snapshot()
	if !s.Observed || s.Reopens != 1 || s.ProbeSuccesses != 0 || s.LastFailure != "queue wait p99 unhealthy" {
		t.Fatalf("after re-open %+v", s)
	}
	f.wantRefusesEverything()

	// Unhealthy straight after the cooldown: half-opens, re-opens, capped.
	f.clk.Advance(20 * time.Second)
	f.observe(breaker.ObservedUnhealthy)
	if got := f.openFor(); got != 24*time.Second {
		t.Fatalf("cooldown after the second re-open = %s, want 24s (the low end of the jitter at MaxOpen 30s)", got)
	}
	f.wantTransitions(
		"closed>open: "+saturated,
		"open>half_open: cooldown over after 10s",
		"half_open>open: queue wait p99 unhealthy",
		"open>half_open: cooldown over after 20s",
		"half_open>open: queue wait p99 unhealthy",
	)

	// Recovery resets the growth.
	f.clk.Advance(30 * time.Second)
	f.observe(breaker.ObservedHealthy)
	f.observe(breaker.ObservedHealthy)
	f.wantState(breaker.Closed)
	f.b.TripObserved(saturated)
	if got := f.openFor(); got != 10*time.Second {
		t.Fatalf("cooldown after recovery = %s, want 10s", got)
	}
}

func TestObservedTripRespectsMinOpen(t *testing.T) {
	f := newFixture(t, breaker.Settings{OpenFor: 5 * time.Second, MinOpen: 30 * time.Second, MaxOpen: time.Minute})
	f.b.TripObserved(saturated)
	if got := f.openFor(); got != 30*time.Second {
		t.Fatalf("open for %s, want MinOpen 30s", got)
	}
	f.clk.Advance(6 * time.Second) // cooldown over, MinOpen not
	if f.observe(breaker.ObservedHealthy) != breaker.Open {
		t.Fatal("half-opened before MinOpen")
	}
	if got := f.b.RetryAt(); !got.Equal(t0.Add(30 * time.Second)) {
		t.Fatalf("RetryAt = t0%+v, want t0+30s", got.Sub(t0))
	}
	f.clk.Advance(24 * time.Second)
	if f.observe(breaker.ObservedHealthy) != breaker.HalfOpen {
		t.Fatal("not half-open at MinOpen")
	}

	// A reload raises MinOpen: healthy observations wait for it to close.
	f.b.SetSettings(breaker.Settings{OpenFor: 5 * time.Second, MinOpen: 40 * time.Second, MaxOpen: time.Minute})
	if f.observe(breaker.ObservedHealthy) != breaker.HalfOpen {
		t.Fatal("closed before the raised MinOpen")
	}
	f.clk.Advance(10 * time.Second)
	if s := f.b.Snapshot(); s.State != breaker.Closed || s.Observed {
		t.Fatalf("snapshot at the raised MinOpen %+v, want closed", s)
	}
	trs := f.rec.all()
	if last := trs[len(trs)-1]; last.Reason != "2 consecutive healthy observations" {
		t.Fatalf("closing reason %q", last.Reason)
	}
}

func TestTripObservedReopensAHalfOpenBreaker(t *testing.T) {
	t.Run("half-open on errors", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		p := f.tripAndProbe()
		f.b.TripObserved(saturated)
		f.wantState(breaker.Open)
		if got := f.openFor(); got != 20*time.Second {
			t.Fatalf("cooldown = %s, want 20s (grown)", got)
		}
		if !f.b.Observed() {
			t.Fatal("not observed")
		}
		p.Done(breaker.Success, 0, "") // the dropped probe's outcome is ignored
		if s := f.b.Snapshot(); s.ProbeSuccesses != 0 || s.ProbesInFlight != 0 || s.ConsecutiveFailures != 3 {
			t.Fatalf("snapshot %+v", s)
		}
		f.clk.Advance(20 * time.Second)
		f.wantRefusesEverything()
		f.wantState(breaker.Open)
	})
	t.Run("half-open on observations", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.b.TripObserved(saturated)
		f.clk.Advance(10 * time.Second)
		f.observe(breaker.ObservedHealthy)
		f.b.TripObserved("saturation: kv cache 99% > 95% for 30s")
		if got := f.openFor(); got != 20*time.Second {
			t.Fatalf("cooldown = %s, want 20s", got)
		}
		f.wantTransitions(
			"closed>open: "+saturated,
			"open>half_open: cooldown over after 10s",
			"half_open>open: saturation: kv cache 99% > 95% for 30s",
		)
	})
}

func TestTripObservedLeavesABreakerOpenForAnotherReason(t *testing.T) {
	tests := []struct {
		name  string
		setup func(f *fixture)
	}{
		{"errors", func(f *fixture) { f.fail(3) }},
		{"retry-after", func(f *fixture) { f.b.ExtendOpen(time.Minute, "http 429") }},
		{"forced for a while", func(f *fixture) { f.b.ForceOpen(time.Hour, "maintenance") }},
		{"forced until closed", func(f *fixture) { f.b.ForceOpen(0, "drain") }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t, breaker.Settings{})
			tt.setup(f)
			f.clk.Advance(time.Second)
			before := f.b.Snapshot()
			f.b.TripObserved(saturated)
			f.b.Observe(breaker.ObservedUnhealthy, "")
			if after := f.b.Snapshot(); after != before || f.b.Observed() {
				t.Fatalf("TripObserved changed an open breaker:\n before %+v\n after  %+v", before, after)
			}
			if len(f.rec.all()) != 1 {
				t.Fatalf("transitions %v", f.transitions())
			}
		})
	}
	t.Run("errors, cooldown over but not yet half-open", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.fail(3)
		f.clk.Advance(10 * time.Second)
		f.b.TripObserved(saturated)
		if got := f.openFor(); got != 20*time.Second || !f.b.Observed() {
			t.Fatalf("open for %s, observed %v; want an observed re-open for 20s", got, f.b.Observed())
		}
		f.wantTransitions(
			"closed>open: 3 consecutive failures, no success within 30s; last: failure",
			"open>half_open: cooldown over after 10s",
			"half_open>open: "+saturated,
		)
	})
	t.Run("Observe does not recover an error trip", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.fail(3)
		f.clk.Advance(10 * time.Second)
		for range 3 {
			f.observe(breaker.ObservedHealthy)
		}
		f.wantState(breaker.Open)
		f.probe() // its own recovery: probes
	})
}

func TestObservedMarkIsCleared(t *testing.T) {
	observedOpen := func(t *testing.T) *fixture {
		f := newFixture(t, breaker.Settings{})
		f.b.TripObserved(saturated)
		return f
	}
	t.Run("ForceOpen: recovers by probes after it", func(t *testing.T) {
		f := observedOpen(t)
		f.b.ForceOpen(time.Minute, "maintenance")
		if f.b.Observed() {
			t.Fatal("observed after ForceOpen")
		}
		f.clk.Advance(time.Minute)
		f.probe()
	})
	t.Run("ForceClose", func(t *testing.T) {
		f := observedOpen(t)
		f.b.ForceClose("")
		if f.b.Observed() {
			t.Fatal("observed after ForceClose")
		}
		f.succeed(1)
	})
	t.Run("Reset", func(t *testing.T) {
		f := observedOpen(t)
		f.b.Reset()
		if s := f.b.Snapshot(); s != (breaker.Snapshot{Key: "up1", State: breaker.Closed, Since: t0}) {
			t.Fatalf("after Reset %+v", s)
		}
	})
	t.Run("an error trip after recovery is not observed", func(t *testing.T) {
		f := observedOpen(t)
		f.clk.Advance(10 * time.Second)
		f.observe(breaker.ObservedHealthy)
		f.observe(breaker.ObservedHealthy)
		f.fail(3)
		if f.b.Observed() {
			t.Fatal("error trip observed")
		}
		f.clk.Advance(f.openFor())
		f.probe()
	})
}

func TestRetryAfterOnAnObservedBreaker(t *testing.T) {
	t.Run("open: extends the cooldown, stays observed", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.b.TripObserved(saturated)
		f.b.ExtendOpen(time.Minute, "http 503")
		if got := f.openFor(); got != time.Minute || !f.b.Observed() {
			t.Fatalf("open for %s, observed %v", got, f.b.Observed())
		}
		f.clk.Advance(time.Minute)
		f.wantRefusesEverything()
		if f.observe(breaker.ObservedHealthy) != breaker.HalfOpen {
			t.Fatal("not half-open after the extended cooldown")
		}
	})
	t.Run("half-open: re-opens, stays observed", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.b.TripObserved(saturated)
		f.clk.Advance(10 * time.Second)
		f.observe(breaker.ObservedHealthy)
		f.b.ExtendOpen(time.Minute, "http 503")
		if got := f.openFor(); got != time.Minute || !f.b.Observed() {
			t.Fatalf("open for %s, observed %v", got, f.b.Observed())
		}
	})
}

// Calls let through before the observed trip end afterwards: their
// failures are stale and trip nothing, and no call is let through to fail.
func TestErrorsWhileObservedOpenChangeNothing(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	var inflight []breaker.Permit
	for range 5 {
		p, _ := f.b.Allow()
		inflight = append(inflight, p)
	}
	f.b.TripObserved(saturated)
	before := f.b.Snapshot()
	for i := range inflight {
		inflight[i].Done(breaker.Failure, 0, "http 502")
	}
	if after := f.b.Snapshot(); after != before {
		t.Fatalf("stale failures changed the breaker:\n before %+v\n after  %+v", before, after)
	}
	f.clk.Advance(10 * time.Second)
	f.wantRefusesEverything()
	f.observe(breaker.ObservedHealthy)
	f.observe(breaker.ObservedHealthy)
	f.wantState(breaker.Closed)
}

func TestObservedTripInTheStore(t *testing.T) {
	st := breaker.NewMemoryStore()
	f := newFixture(t, breaker.Settings{MinOpen: -1}, breaker.WithStore(st))
	f.b.TripObserved(saturated)
	if until, reason, ok := st.OpenUntil("up1", f.clk.Now()); !ok || !until.Equal(t0.Add(10*time.Second)) || reason != saturated {
		t.Fatalf("store = %v %q %v", until, reason, ok)
	}
	f.clk.Advance(10 * time.Second)
	f.observe(breaker.ObservedUnhealthy)
	if until, reason, ok := st.OpenUntil("up1", f.clk.Now()); !ok || !until.Equal(f.clk.Now().Add(20*time.Second)) || reason != "queue wait p99 unhealthy" {
		t.Fatalf("store after re-open = %v %q %v", until, reason, ok)
	}
	f.clk.Advance(20 * time.Second)
	f.observe(breaker.ObservedHealthy)
	f.observe(breaker.ObservedHealthy)
	if _, _, ok := st.OpenUntil("up1", f.clk.Now()); ok {
		t.Fatal("store still open after close")
	}
}

func TestSnapshotJSONMarksObserved(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	enc := func() string {
		b, err := json.Marshal(f.b.Snapshot())
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	if got := enc(); strings.Contains(got, "observed") {
		t.Fatalf("closed snapshot JSON %s mentions observed", got)
	}
	f.b.TripObserved(saturated)
	if got := enc(); !strings.Contains(got, `"observed":true`) || !strings.Contains(got, `"state":"open"`) {
		t.Fatalf("observed snapshot JSON %s", got)
	}
}
