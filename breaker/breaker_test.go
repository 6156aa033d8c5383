package breaker_test

import (
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

func TestStateAndOutcomeNames(t *testing.T) {
	for st, want := range map[breaker.State]string{breaker.Closed: "closed", breaker.HalfOpen: "half_open", breaker.Open: "open", 7: "state(7)"} {
		if got := st.String(); got != want {
			t.Errorf("State(%d).String() = %q, want %q", st, got, want)
		}
	}
	// The gauge values are part of the metrics contract.
	if breaker.Closed != 0 || breaker.HalfOpen != 1 || breaker.Open != 2 {
		t.Error("state gauge values changed")
	}
	for o, want := range map[breaker.Outcome]string{breaker.Success: "success", breaker.Failure: "failure", breaker.Neutral: "neutral"} {
		if got := o.String(); got != want {
			t.Errorf("Outcome(%d).String() = %q, want %q", o, got, want)
		}
	}
	var st breaker.State
	if err := st.UnmarshalText([]byte("half_open")); err != nil || st != breaker.HalfOpen {
		t.Errorf("UnmarshalText(half_open) = %v, %v", st, err)
	}
	if err := st.UnmarshalText([]byte("ajar")); err == nil {
		t.Error("UnmarshalText(ajar) succeeded")
	}
}

// tripAndProbe trips the breaker, waits out the cooldown and takes the probe.
func (f *fixture) tripAndProbe() breaker.Permit {
	f.t.Helper()
	f.fail(3)
	f.clk.Advance(f.openFor())
	return f.probe()
}

func TestCooldownGrowsAndIsCapped(t *testing.T) {
	s := breaker.Settings{OpenFor: 10 * time.Second, MaxOpen: 100 * time.Second, MinOpen: -1}
	f := newFixture(t, s)
	f.fail(3)
	// At the cap the jitter range is [80% of MaxOpen, MaxOpen): no jitter
	// (rand 0) is its low end.
	want := []time.Duration{10, 20, 40, 80, 80, 80}
	for i, w := range want {
		got := f.openFor()
		if got != w*time.Second {
			t.Fatalf("open %d: cooldown %s, want %s", i, got, w*time.Second)
		}
		f.clk.Advance(got - 1)
		if _, ok := f.b.Allow(); ok {
			t.Fatalf("open %d: allowed 1ns before the cooldown ends", i)
		}
		f.clk.Advance(1)
		p := f.probe()
		p.Done(breaker.Failure, 0, "still down")
		if got := f.b.Snapshot().Reopens; got != i+1 {
			t.Fatalf("reopens = %d, want %d", got, i+1)
		}
	}

	// Closing resets the growth.
	f.clk.Advance(f.openFor())
	for range 2 {
		p := f.probe()
		p.Done(breaker.Success, 0, "")
	}
	f.wantState(breaker.Closed)
	f.clk.Advance(31 * time.Second) // the probes' successes leave the window
	f.fail(3)
	if got := f.openFor(); got != 10*time.Second {
		t.Fatalf("cooldown after recovery = %s, want 10s", got)
	}
}

func TestCooldownJitter(t *testing.T) {
	tests := []struct {
		name    string
		r       float64
		reopens int
		want    time.Duration
	}{
		{"low end is the base", 0, 0, 10 * time.Second},
		{"middle is +20%", 0.5, 0, 12 * time.Second},
		{"high end approaches +40%", 0.75, 0, 13 * time.Second},
		{"jitter applies to grown cooldown", 0, 2, 40 * time.Second},
		{"near the cap the range slides down to end at it", 0.99, 5, 59880 * time.Millisecond},
		{"near the cap the low end is 80% of it", 0, 5, 48 * time.Second},
		{"out-of-range rand means no jitter", 7, 0, 10 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := breaker.Settings{OpenFor: 10 * time.Second, MaxOpen: time.Minute, MinOpen: -1}
			r := 0.5
			f := newFixture(t, s, breaker.WithRand(func() float64 { return r }))
			if tt.reopens == 0 {
				r = tt.r
			}
			f.fail(3)
			for i := range tt.reopens {
				if i == tt.reopens-1 {
					r = tt.r
				}
				f.clk.Advance(f.openFor())
				p := f.probe()
				p.Done(breaker.Failure, 0, "")
			}
			if got := f.openFor(); got != tt.want {
				t.Fatalf("cooldown = %s, want %s", got, tt.want)
			}
		})
	}
}

func TestFirstOpenIsJitteredToo(t *testing.T) {
	f := newFixture(t, breaker.Settings{MinOpen: -1}, breaker.WithRand(func() float64 { return 0.75 }))
	f.fail(3)
	if got := f.openFor(); got != 13*time.Second {
		t.Fatalf("first cooldown = %s, want 13s (10s +30%%)", got)
	}
}

func TestMinOpenDelaysHalfOpen(t *testing.T) {
	f := newFixture(t, breaker.Settings{OpenFor: 5 * time.Second, MinOpen: 30 * time.Second, MaxOpen: time.Minute})
	f.fail(3)
	if got := f.openFor(); got != 30*time.Second {
		t.Fatalf("open for %s, want MinOpen 30s", got)
	}
	f.clk.Advance(6 * time.Second) // cooldown over, MinOpen not
	if _, ok := f.b.Allow(); ok {
		t.Fatal("half-opened before MinOpen")
	}
	if f.b.ProbeDue() {
		t.Fatal("ProbeDue before MinOpen")
	}
	if got := f.b.RetryAt(); !got.Equal(t0.Add(30 * time.Second)) {
		t.Fatalf("RetryAt = %s, want t0+30s", got.Sub(t0))
	}
	f.clk.Advance(24 * time.Second)
	f.probe()
}

func TestProbeSuccessBeforeMinOpenDoesNotClose(t *testing.T) {
	f := newFixture(t, breaker.Settings{OpenFor: 10 * time.Second, MinOpen: 10 * time.Second})
	p := f.tripAndProbe() // at t0+10s
	// A reload raises MinOpen while the probe runs.
	f.b.SetSettings(breaker.Settings{OpenFor: 10 * time.Second, MinOpen: time.Minute})
	p.Done(breaker.Success, 0, "")
	p = f.probe()
	p.Done(breaker.Success, 0, "")
	f.wantState(breaker.HalfOpen)
	if got := f.b.Snapshot().ProbeSuccesses; got != 2 {
		t.Fatalf("probe successes = %d, want 2", got)
	}
	f.clk.Advance(49*time.Second + 999*time.Millisecond)
	f.b.Snapshot()
	f.wantState(breaker.HalfOpen)
	f.clk.Advance(time.Millisecond)
	if p, ok := f.b.Allow(); !ok || p.Probe() {
		t.Fatalf("Allow at MinOpen = probe %v ok %v, want a closed permit", p.Probe(), ok)
	}
	f.wantState(breaker.Closed)
}

func TestRecoverySuccesses(t *testing.T) {
	t.Run("two successes close", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		p := f.tripAndProbe()
		p.Done(breaker.Success, 0, "")
		f.wantState(breaker.HalfOpen)
		p = f.probe()
		p.Done(breaker.Success, 0, "")
		f.wantState(breaker.Closed)
		s := f.b.Snapshot()
		if s.ConsecutiveFailures != 0 || s.FailuresInWindow != 0 || s.Reopens != 0 {
			t.Fatalf("closed breaker kept counts: %+v", s)
		}
		if s.LastFailure == "" {
			t.Error("last failure forgotten on close")
		}
	})
	t.Run("a failure after a success re-opens with the grown cooldown", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		p := f.tripAndProbe()
		p.Done(breaker.Success, 0, "")
		p = f.probe()
		p.Done(breaker.Failure, 0, "http 503")
		if got := f.openFor(); got != 20*time.Second {
			t.Fatalf("cooldown = %s, want 20s", got)
		}
		p = f.tripAndProbeAgain()
		p.Done(breaker.Success, 0, "")
		f.wantState(breaker.HalfOpen) // the earlier success no longer counts
	})
	t.Run("a slow probe is a failure", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{SlowTTFT: time.Second})
		p := f.tripAndProbe()
		p.Done(breaker.Success, 3*time.Second, "")
		f.wantState(breaker.Open)
		if got := f.b.Snapshot().LastFailure; !strings.Contains(got, "slow call") {
			t.Fatalf("last failure = %q", got)
		}
	})
	t.Run("configurable", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{RecoverySuccesses: 3})
		p := f.tripAndProbe()
		for range 2 {
			p.Done(breaker.Success, 0, "")
			p = f.probe()
		}
		p.Done(breaker.Success, 0, "")
		f.wantState(breaker.Closed)
	})
}

// tripAndProbeAgain waits out the current cooldown and takes the probe.
func (f *fixture) tripAndProbeAgain() breaker.Permit {
	f.t.Helper()
	f.clk.Advance(f.openFor())
	return f.probe()
}

func TestHalfOpenAdmitsOneProbe(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	f.tripAndProbe()
	for range 10 {
		if _, ok := f.b.Allow(); ok {
			t.Fatal("second permit while the probe is out")
		}
	}
	if s := f.b.Snapshot(); s.ProbesInFlight != 1 || s.State != breaker.HalfOpen {
		t.Fatalf("snapshot %+v", s)
	}
}

func TestHalfOpenProbesLimit(t *testing.T) {
	f := newFixture(t, breaker.Settings{HalfOpenProbes: 3, RecoverySuccesses: 5})
	ps := []breaker.Permit{f.tripAndProbe(), f.probe(), f.probe()}
	if _, ok := f.b.Allow(); ok {
		t.Fatal("fourth probe admitted")
	}
	ps[1].Done(breaker.Success, 0, "")
	p := f.probe()
	if _, ok := f.b.Allow(); ok {
		t.Fatal("probe admitted over the limit after a release")
	}
	// One failure re-opens; the other probes' outcomes no longer count.
	ps[0].Done(breaker.Failure, 0, "")
	f.wantState(breaker.Open)
	ps[2].Done(breaker.Success, 0, "")
	p.Done(breaker.Success, 0, "")
	f.wantState(breaker.Open)
	if s := f.b.Snapshot(); s.ProbesInFlight != 0 {
		t.Fatalf("probes in flight after re-open = %d", s.ProbesInFlight)
	}
}

func TestNeutralReleasesProbeSlotWithoutVerdict(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	p := f.tripAndProbe()
	p.Done(breaker.Neutral, 0, "client gone")
	f.wantState(breaker.HalfOpen)
	s := f.b.Snapshot()
	if s.ProbesInFlight != 0 || s.ProbeSuccesses != 0 || s.ConsecutiveFailures != 3 {
		t.Fatalf("neutral probe left %+v", s)
	}
	p = f.probe()
	p.Done(breaker.Success, 0, "")
	p = f.probe()
	p.Done(breaker.Success, 0, "")
	f.wantState(breaker.Closed)
}

func TestDoneTwiceIsNoop(t *testing.T) {
	t.Run("closed", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		for range 2 {
			p, _ := f.b.Allow()
			p.Done(breaker.Failure, 0, "")
			p.Done(breaker.Failure, 0, "")
		}
		f.wantState(breaker.Closed)
		if got := f.b.Snapshot().ConsecutiveFailures; got != 2 {
			t.Fatalf("consecutive failures = %d, want 2", got)
		}
	})
	t.Run("probe", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		p := f.tripAndProbe()
		p.Done(breaker.Success, 0, "")
		p.Done(breaker.Success, 0, "")
		f.wantState(breaker.HalfOpen)
		if got := f.b.Snapshot().ProbeSuccesses; got != 1 {
			t.Fatalf("probe successes = %d, want 1", got)
		}
	})
	t.Run("refusal", func(t *testing.T) {
		var p breaker.Permit
		p.Done(breaker.Failure, 0, "") // the zero permit is inert
		if p.Probe() {
			t.Fatal("zero permit is a probe")
		}
	})
}

func TestProbeTimeoutCountsAsFailure(t *testing.T) {
	f := newFixture(t, breaker.Settings{ProbeTimeout: 30 * time.Second})
	hung := f.tripAndProbe()
	// While it hangs, no second probe goes out.
	f.clk.Advance(30*time.Second - 1)
	if _, ok := f.b.Allow(); ok {
		t.Fatal("second probe while the first hangs")
	}
	if got := f.b.RetryAt(); !got.Equal(f.clk.Now().Add(1)) {
		t.Fatalf("RetryAt = now%+v, want the probe deadline", got.Sub(f.clk.Now()))
	}
	f.clk.Advance(1)
	if _, ok := f.b.Allow(); ok {
		t.Fatal("allowed at the probe timeout")
	}
	f.wantState(breaker.Open)
	trs := f.rec.all()
	if last := trs[len(trs)-1]; last.From != breaker.HalfOpen || last.To != breaker.Open || last.Reason != "probe timed out after 30s" {
		t.Fatalf("last transition %+v", last)
	}
	if got := f.openFor(); got != 20*time.Second {
		t.Fatalf("cooldown after timeout = %s, want 20s", got)
	}
	// The slot is free: after the cooldown a new probe goes out, and the
	// hung probe's late outcome is ignored.
	f.clk.Advance(20 * time.Second)
	p := f.probe()
	hung.Done(breaker.Success, 0, "")
	if s := f.b.Snapshot(); s.ProbeSuccesses != 0 || s.ProbesInFlight != 1 {
		t.Fatalf("late outcome counted: %+v", s)
	}
	p.Done(breaker.Success, 0, "")
}

func TestProbeTimeoutSeenBySnapshotAndProbeDue(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	f.tripAndProbe()
	f.clk.Advance(breaker.DefaultProbeTimeout)
	if s := f.b.Snapshot(); s.State != breaker.Open || s.ProbesInFlight != 0 {
		t.Fatalf("snapshot after probe timeout %+v", s)
	}
}

func TestExtendOpen(t *testing.T) {
	const maxOpen = 5 * time.Minute
	tests := []struct {
		name      string
		setup     func(f *fixture)
		d         time.Duration
		wantState breaker.State
		wantFor   time.Duration // remaining open time when Open
	}{
		{name: "opens a closed breaker for exactly d", d: 3 * time.Second, wantState: breaker.Open, wantFor: 3 * time.Second},
		{name: "clamped to max_open when closed", d: time.Hour, wantState: breaker.Open, wantFor: maxOpen},
		{name: "zero ignored", d: 0, wantState: breaker.Closed},
		{name: "negative ignored", d: -time.Second, wantState: breaker.Closed},
		{name: "absurd ignored", d: breaker.MaxRetryAfter + time.Second, wantState: breaker.Closed},
		{name: "extends an open breaker", setup: func(f *fixture) { f.fail(3) }, d: time.Minute, wantState: breaker.Open, wantFor: time.Minute},
		{name: "never shortens", setup: func(f *fixture) { f.fail(3) }, d: time.Second, wantState: breaker.Open, wantFor: 10 * time.Second},
		{name: "clamped to max_open when open", setup: func(f *fixture) { f.fail(3) }, d: 10 * time.Hour, wantState: breaker.Open, wantFor: maxOpen},
		{name: "junk leaves an open breaker alone", setup: func(f *fixture) { f.fail(3) }, d: -5, wantState: breaker.Open, wantFor: 10 * time.Second},
		{name: "re-opens a half-open breaker for d, not the grown cooldown", setup: func(f *fixture) { f.tripAndProbe() }, d: time.Second, wantState: breaker.Open, wantFor: time.Second},
		{name: "re-opens a half-open breaker for a long d", setup: func(f *fixture) { f.tripAndProbe() }, d: time.Minute, wantState: breaker.Open, wantFor: time.Minute},
		{name: "leaves a forced breaker alone", setup: func(f *fixture) { f.b.ForceOpen(0, "") }, d: time.Minute, wantState: breaker.Open},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t, breaker.Settings{})
			if tt.setup != nil {
				tt.setup(f)
			}
			f.b.ExtendOpen(tt.d, "http 429")
			f.wantState(tt.wantState)
			if tt.wantFor != 0 {
				if got := f.openFor(); got != tt.wantFor {
					t.Fatalf("open for %s, want %s", got, tt.wantFor)
				}
			}
		})
	}
}

func TestExtendOpenEndsInHalfOpen(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	f.b.ExtendOpen(2*time.Second, "http 429")
	trs := f.rec.all()
	if len(trs) != 1 || trs[0].Reason != "retry-after 2s: http 429" || !trs[0].OpenUntil.Equal(t0.Add(2*time.Second)) {
		t.Fatalf("transitions %+v", trs)
	}
	if got := f.b.RetryAt(); !got.Equal(t0.Add(2 * time.Second)) {
		t.Fatalf("RetryAt = %v", got)
	}
	f.clk.Advance(2 * time.Second)
	p := f.probe()
	p.Done(breaker.Success, 0, "")
	if got := f.b.Snapshot().Reopens; got != 0 {
		t.Fatalf("retry-after open counted as re-open: %d", got)
	}
}

func TestSetSettingsAppliesToExistingState(t *testing.T) {
	t.Run("lower threshold applies to the current run", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{ConsecutiveFailures: 5})
		f.fail(2)
		f.b.SetSettings(breaker.Settings{ConsecutiveFailures: 3})
		f.fail(1)
		f.wantState(breaker.Open)
	})
	t.Run("window counts survive a reload", func(t *testing.T) {
		s := breaker.Settings{ConsecutiveFailures: -1, Failures: 4}
		f := newFixture(t, s)
		f.fail(3)
		s.SlowTTFT = time.Second // unrelated change
		f.b.SetSettings(s)
		f.fail(1)
		f.wantState(breaker.Open)
	})
	t.Run("open time clamped to new max_open", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.b.ExtendOpen(4*time.Minute, "")
		f.b.SetSettings(breaker.Settings{MaxOpen: time.Minute})
		if got := f.openFor(); got != time.Minute {
			t.Fatalf("open for %s, want 1m", got)
		}
	})
	t.Run("new min_open applies to an open breaker", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.fail(3)
		f.b.SetSettings(breaker.Settings{MinOpen: 40 * time.Second})
		if got := f.openFor(); got != 40*time.Second {
			t.Fatalf("open for %s, want 40s", got)
		}
	})
	t.Run("lower recovery successes closes a half-open breaker", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{RecoverySuccesses: 3})
		p := f.tripAndProbe()
		p.Done(breaker.Success, 0, "")
		f.b.SetSettings(breaker.Settings{RecoverySuccesses: 1})
		f.wantState(breaker.Closed)
	})
	t.Run("Settings reports the effective values", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.b.SetSettings(breaker.Settings{HalfOpenProbes: -4})
		if got := f.b.Settings(); got != (breaker.Settings{}).WithDefaults() {
			t.Fatalf("settings = %+v", got)
		}
	})
}

func TestOperatorControls(t *testing.T) {
	t.Run("force open for a duration then half-open", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.b.ForceOpen(time.Hour, "maintenance") // MaxOpen does not cap it
		s := f.b.Snapshot()
		if s.State != breaker.Open || !s.Forced || !s.OpenUntil.Equal(t0.Add(time.Hour)) {
			t.Fatalf("snapshot %+v", s)
		}
		f.clk.Advance(time.Hour - 1)
		if _, ok := f.b.Allow(); ok {
			t.Fatal("allowed while forced open")
		}
		f.clk.Advance(1)
		f.probe()
		if f.b.Snapshot().Forced {
			t.Error("still forced after half-opening")
		}
	})
	t.Run("force open until closed", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.b.ForceOpen(0, "drain")
		f.clk.Advance(24 * time.Hour)
		if _, ok := f.b.Allow(); ok {
			t.Fatal("allowed while forced open until closed")
		}
		if f.b.ProbeDue() {
			t.Fatal("probe due while forced open")
		}
		if got := f.b.RetryAt(); !got.Equal(f.clk.Now().Add(breaker.DefaultMaxOpen)) {
			t.Fatalf("RetryAt = now%+v, want now+MaxOpen", got.Sub(f.clk.Now()))
		}
		if s := f.b.Snapshot(); !s.OpenUntil.IsZero() {
			t.Fatalf("open until %v, want zero", s.OpenUntil)
		}
		f.b.ForceClose("done")
		f.wantState(breaker.Closed)
		trs := f.rec.all()
		if len(trs) != 2 || trs[0].Reason != "forced open: drain" || trs[1].Reason != "forced closed: done" {
			t.Fatalf("transitions %+v", trs)
		}
	})
	t.Run("force open drops probes in flight", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		p := f.tripAndProbe()
		f.b.ForceOpen(time.Minute, "")
		p.Done(breaker.Success, 0, "")
		if s := f.b.Snapshot(); s.ProbesInFlight != 0 || s.ProbeSuccesses != 0 {
			t.Fatalf("snapshot %+v", s)
		}
	})
	t.Run("force close keeps the last failure, reset forgets it", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.fail(3)
		f.b.ForceClose("")
		s := f.b.Snapshot()
		if s.State != breaker.Closed || s.ConsecutiveFailures != 0 || s.FailuresInWindow != 0 || s.LastFailure != "failure" {
			t.Fatalf("after ForceClose %+v", s)
		}
		f.fail(2) // counts start afresh
		f.wantState(breaker.Closed)
		f.clk.Advance(time.Second)
		f.b.Reset()
		s = f.b.Snapshot()
		want := breaker.Snapshot{Key: "up1", State: breaker.Closed, Since: t0.Add(time.Second)}
		if s != want {
			t.Fatalf("after Reset %+v", s)
		}
	})
	t.Run("reset an open breaker", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		p := f.tripAndProbe()
		p.Done(breaker.Failure, 0, "")
		f.b.Reset()
		f.wantState(breaker.Closed)
		f.fail(3)
		if got := f.openFor(); got != 10*time.Second {
			t.Fatalf("cooldown after reset = %s, want 10s", got)
		}
	})
}

func TestActiveProbingKeepsUsersOutOfHalfOpen(t *testing.T) {
	f := newFixture(t, breaker.Settings{ActiveProbing: true})
	if f.b.ProbeDue() {
		t.Fatal("probe due while closed")
	}
	if _, ok := f.b.AllowProbe(); ok {
		t.Fatal("synthetic probe permitted while closed")
	}
	f.fail(3)
	if f.b.ProbeDue() {
		t.Fatal("probe due during the cooldown")
	}
	f.clk.Advance(10 * time.Second)
	if _, ok := f.b.Allow(); ok {
		t.Fatal("user request admitted as a probe")
	}
	f.wantState(breaker.Open)
	if !f.b.ProbeDue() {
		t.Fatal("probe not due after the cooldown")
	}
	if got := f.b.RetryAt(); !got.Equal(f.clk.Now()) {
		t.Fatalf("RetryAt = %v, want now", got)
	}
	p, ok := f.b.AllowProbe()
	if !ok || !p.Probe() {
		t.Fatal("synthetic probe refused")
	}
	if f.b.ProbeDue() {
		t.Fatal("probe due while one is in flight")
	}
	if _, ok := f.b.AllowProbe(); ok {
		t.Fatal("second synthetic probe admitted")
	}
	p.Done(breaker.Success, 0, "")
	f.wantState(breaker.HalfOpen)
	if _, ok := f.b.Allow(); ok {
		t.Fatal("user request admitted in half-open")
	}
	if !f.b.ProbeDue() {
		t.Fatal("next probe not due")
	}
	p, _ = f.b.AllowProbe()
	p.Done(breaker.Success, 0, "")
	f.wantState(breaker.Closed)
	if p, ok := f.b.Allow(); !ok || p.Probe() {
		t.Fatal("user request refused after recovery")
	}
}

func TestListenerGetsEachTransitionOnce(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	f.fail(3)
	f.clk.Advance(10 * time.Second)
	p := f.probe()
	p.Done(breaker.Failure, 0, "http 502")
	f.clk.Advance(20 * time.Second)
	p = f.probe()
	p.Done(breaker.Success, 0, "")
	p = f.probe()
	p.Done(breaker.Success, 0, "")
	f.b.Snapshot() // observing does not transition again

	trs := f.rec.all()
	type tr struct {
		from, to        breaker.State
		at              time.Duration
		reason          string
		consec, windowF int
		openUntil       time.Duration
	}
	want := []tr{
		{breaker.Closed, breaker.Open, 0, "3 consecutive failures, no success within 30s; last: failure", 3, 3, 10 * time.Second},
		{breaker.Open, breaker.HalfOpen, 10 * time.Second, "cooldown over after 10s", 3, 3, -1},
		{breaker.HalfOpen, breaker.Open, 10 * time.Second, "probe failed: http 502", 4, 4, 30 * time.Second},
		// The 3 failures at t0 have left the 30s window (3s buckets).
		{breaker.Open, breaker.HalfOpen, 30 * time.Second, "cooldown over after 20s", 4, 1, -1},
		{breaker.HalfOpen, breaker.Closed, 30 * time.Second, "2 consecutive probe successes", 0, 0, -1},
	}
	if len(trs) != len(want) {
		t.Fatalf("got %d transitions %+v, want %d", len(trs), trs, len(want))
	}
	for i, w := range want {
		g := trs[i]
		ou := time.Duration(-1)
		if !g.OpenUntil.IsZero() {
			ou = g.OpenUntil.Sub(t0)
		}
		got := tr{g.From, g.To, g.At.Sub(t0), g.Reason, g.ConsecutiveFailures, g.FailuresInWindow, ou}
		if got != w || g.Key != "up1" {
			t.Errorf("transition %d = %+v (key %q), want %+v", i, got, g.Key, w)
		}
	}
}

func TestListenerMayCallTheBreaker(t *testing.T) {
	clk := newClock()
	var b *breaker.Breaker
	var states []breaker.State
	b = breaker.New("k", breaker.Settings{}, breaker.WithClock(clk), breaker.WithListener(func(tr breaker.Transition) {
		states = append(states, b.Snapshot().State)
		if tr.To == breaker.Open && tr.From == breaker.Closed {
			b.ForceOpen(0, "listener") // a nested transition is delivered after this one
		}
	}))
	for range 3 {
		p, _ := b.Allow()
		p.Done(breaker.Failure, 0, "")
	}
	if len(states) != 1 || b.Snapshot().Forced != true {
		t.Fatalf("states seen %v, forced %v", states, b.Snapshot().Forced)
	}
}

func TestRetryAt(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	if got := f.b.RetryAt(); !got.IsZero() {
		t.Fatalf("closed RetryAt = %v", got)
	}
	f.fail(3)
	if got := f.b.RetryAt(); !got.Equal(t0.Add(10 * time.Second)) {
		t.Fatalf("open RetryAt = %v", got)
	}
	f.clk.Advance(10 * time.Second)
	if got := f.b.RetryAt(); !got.IsZero() {
		t.Fatalf("RetryAt after cooldown = %v, want zero (a probe may go)", got)
	}
	f.probe()
	if got := f.b.RetryAt(); !got.Equal(f.clk.Now().Add(breaker.DefaultProbeTimeout)) {
		t.Fatalf("half-open RetryAt = now%+v", got.Sub(f.clk.Now()))
	}
}

// callUpstream is the pattern the gateway uses: the permit is released by a
// defer on every path, and a panic in the gateway is neutral.
func callUpstream(b *breaker.Breaker, attempt func() (time.Duration, error)) (err error) {
	p, ok := b.Allow()
	if !ok {
		return errRefused
	}
	outcome, ttft, reason := breaker.Neutral, time.Duration(0), "panic"
	defer func() { p.Done(outcome, ttft, reason) }()
	ttft, err = attempt()
	if err != nil {
		outcome, reason = breaker.Failure, err.Error()
		return err
	}
	outcome, reason = breaker.Success, ""
	return nil
}

type refusedError struct{}

func (refusedError) Error() string { return "breaker open" }

var errRefused error = refusedError{}

func TestPanicBetweenAllowAndDoneReleasesProbe(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	f.fail(3)
	f.clk.Advance(10 * time.Second)
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("no panic")
			}
		}()
		_ = callUpstream(f.b, func() (time.Duration, error) { panic("boom") })
	}()
	s := f.b.Snapshot()
	if s.State != breaker.HalfOpen || s.ProbesInFlight != 0 || s.ConsecutiveFailures != 3 {
		t.Fatalf("after panic %+v", s)
	}
	for range 2 {
		if err := callUpstream(f.b, func() (time.Duration, error) { return time.Second, nil }); err != nil {
			t.Fatal(err)
		}
	}
	f.wantState(breaker.Closed)
}

func TestStoreSharesOpenState(t *testing.T) {
	st := breaker.NewMemoryStore()
	f := newFixture(t, breaker.Settings{}, breaker.WithStore(st))
	f.fail(3)
	until, reason, ok := st.OpenUntil("up1", f.clk.Now())
	if !ok || !until.Equal(t0.Add(10*time.Second)) || !strings.Contains(reason, "3 consecutive") {
		t.Fatalf("store = %v %q %v", until, reason, ok)
	}

	// Another breaker for the key (another gateway, or the key re-added)
	// starts open with the remaining time.
	f.clk.Advance(4 * time.Second)
	b2 := breaker.New("up1", breaker.Settings{}, breaker.WithClock(f.clk), breaker.WithStore(st))
	if s := b2.Snapshot(); s.State != breaker.Open || !s.OpenUntil.Equal(t0.Add(10*time.Second)) {
		t.Fatalf("second breaker %+v", s)
	}

	// A closed breaker adopts the shared open state on its first failure.
	b3 := breaker.New("up2", breaker.Settings{}, breaker.WithClock(f.clk), breaker.WithStore(st))
	st.PutOpen("up2", f.clk.Now().Add(time.Minute), "tripped elsewhere")
	p, _ := b3.Allow()
	p.Done(breaker.Success, 0, "")
	if b3.State() != breaker.Closed {
		t.Fatal("a success adopted the store")
	}
	p, _ = b3.Allow()
	p.Done(breaker.Failure, 0, "")
	if s := b3.Snapshot(); s.State != breaker.Open || !s.OpenUntil.Equal(f.clk.Now().Add(time.Minute)) {
		t.Fatalf("adopting breaker %+v", s)
	}

	// Closing clears the entry.
	f.clk.Advance(6 * time.Second)
	for range 2 {
		p := f.probe()
		p.Done(breaker.Success, 0, "")
	}
	if _, _, ok := st.OpenUntil("up1", f.clk.Now()); ok {
		t.Fatal("store still open after close")
	}
	// Expired entries are not open.
	st.PutOpen("up3", f.clk.Now(), "")
	if _, _, ok := st.OpenUntil("up3", f.clk.Now()); ok {
		t.Fatal("expired entry open")
	}
	st.PutOpen("up3", time.Time{}, "forever")
	if _, _, ok := st.OpenUntil("up3", f.clk.Now().Add(1000*time.Hour)); !ok {
		t.Fatal("indefinite entry not open")
	}
}

// An idle open breaker still reads Open once its cooldown has passed (only
// a call half-opens it); its snapshot says a probe is due.
func TestSnapshotSaysProbeDueOnceTheCooldownPassed(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	f.down(3)
	if s := f.b.Snapshot(); s.State != breaker.Open || s.ProbeDue {
		t.Fatalf("just opened: %+v, want open, no probe due", s)
	}
	f.clk.Advance(f.openFor())
	if s := f.b.Snapshot(); s.State != breaker.Open || !s.ProbeDue {
		t.Fatalf("cooldown over, no call: %+v, want open with a probe due", s)
	}
	p, ok := f.b.Allow()
	if !ok || !p.Probe() {
		t.Fatal("no probe after the cooldown")
	}
	if s := f.b.Snapshot(); s.State != breaker.HalfOpen || s.ProbeDue {
		t.Fatalf("probe out: %+v, want half-open with no free slot", s)
	}
	p.Done(breaker.Neutral, 0, "")
	f.b.ForceOpen(0, "drain")
	f.clk.Advance(time.Hour)
	if s := f.b.Snapshot(); s.ProbeDue {
		t.Fatalf("forced open until closed: %+v, want no probe due", s)
	}
}
