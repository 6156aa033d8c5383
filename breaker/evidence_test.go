package breaker_test

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// calls runs one call per outcome, in order, failing the test on a refusal.
func (f *fixture) calls(os ...breaker.Outcome) {
	f.t.Helper()
	for _, o := range os {
		if !f.call(o, 0) {
			f.t.Fatalf("Allow refused in %s before %s", f.b.State(), o)
		}
	}
}

const (
	ok   = breaker.Success
	bad  = breaker.Failure
	down = breaker.Down
)

// Runs of failures amid successes are no outage: under uniform partial
// failure every upstream has them, and the consecutive rule used to open
// on them (issue 19: 50% success became 0%).
func TestFailuresAmidSuccessesNeverTripTheConsecutiveRule(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	rng := rand.New(rand.NewPCG(19, 1))
	f.succeed(1)
	for range 2000 {
		o := ok
		if rng.Float64() < 0.75 {
			o = bad
		}
		f.calls(o)
		f.clk.Advance(50 * time.Millisecond)
	}
	f.wantState(breaker.Closed)
}

// Hard evidence keeps the fast trip: three refused connections in a row,
// with no sign of life between them, open a breaker whose upstream served
// a moment ago.
func TestDownRunTripsAtOnceAsHardEvidence(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	f.succeed(100)
	f.calls(down, down)
	f.wantState(breaker.Closed)
	f.calls(down)
	f.wantState(breaker.Open)
	if e := f.b.Evidence(); e != breaker.Hard {
		t.Fatalf("evidence %q, want hard", e)
	}
}

// A first token on another connection (Live), a success, or any answer
// from the server breaks a run of Down outcomes: a burst of refused
// connections while other streams of the same server run is no dead server.
// A sign of life that broke a run also marks the upstream as one that
// refuses some connections and serves others: for RatioWindow after it, a
// run of Down outcomes is no hard evidence (an upstream refusing half its
// dials at random has runs of three every fourteen attempts or so); once
// RatioWindow passes without a success, a run trips as before.
func TestSignOfLifeBreaksADownRun(t *testing.T) {
	for name, between := range map[string]func(f *fixture){
		"first token": func(f *fixture) { f.b.Live() },
		"success":     func(f *fixture) { f.calls(ok) },
		"http 503":    func(f *fixture) { f.calls(bad) },
	} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t, breaker.Settings{})
			f.succeed(1)
			f.calls(down, down)
			between(f)
			f.calls(down, down)
			f.wantState(breaker.Closed)
			f.calls(down)
			if name == "http 503" {
				// An error answer is no sign of life: no flakiness.
				f.wantState(breaker.Open)
				return
			}
			f.calls(down, down, down, down)
			f.wantState(breaker.Closed)
			f.clk.Advance(f.b.Settings().RatioWindow)
			for i := 0; i < 3 && f.b.State() == breaker.Closed; i++ {
				f.calls(down)
			}
			f.wantState(breaker.Open)
			if e := f.b.Evidence(); e != breaker.Hard {
				t.Fatalf("evidence %q, want hard", e)
			}
		})
	}
}

// A sign of life is a new attempt that got an answer: long streams that
// began before an upstream started resetting every new connection, and end
// well (or cut) during the run, do not break it, so the run trips on hard
// evidence after ConsecutiveFailures as for a server with no streams.
func TestOlderStreamEndingIsNoSignOfLife(t *testing.T) {
	for name, end := range map[string]breaker.Outcome{"success": breaker.Success, "cut": breaker.Failure} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t, breaker.Settings{})
			f.succeed(10)
			var streams []breaker.Permit
			for range 2 {
				p, ok := f.b.Allow()
				if !ok {
					t.Fatal("Allow refused")
				}
				streams = append(streams, p)
			}
			f.clk.Advance(10 * time.Second) // within RatioWindow of the last success
			f.calls(down)
			streams[0].Done(end, 0, "stream ended")
			f.calls(down)
			streams[1].Done(end, 0, "stream ended")
			f.calls(down)
			f.wantState(breaker.Open)
			if e := f.b.Evidence(); e != breaker.Hard {
				t.Fatalf("evidence %q, want hard", e)
			}
		})
	}
}

// Failures of any kind with no success in the window are hard: a server
// that answers 503 to everything is down.
func TestFailuresWithNoSuccessInTheWindowAreHard(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	f.succeed(5)
	f.calls(bad, bad, bad, bad, bad)
	f.wantState(breaker.Closed) // the successes are 0s old
	f.clk.Advance(29 * time.Second)
	f.calls(bad)
	f.wantState(breaker.Closed)
	f.clk.Advance(2 * time.Second) // the last success leaves the window
	f.calls(bad)
	f.wantState(breaker.Open)
	if e := f.b.Evidence(); e != breaker.Hard {
		t.Fatalf("evidence %q, want hard", e)
	}
}

// The breaker's own ratio rules are statistical evidence.
func TestRatioRuleIsStatisticalEvidence(t *testing.T) {
	f := newFixture(t, breaker.Settings{FailureRatio: 0.5, MinRequests: 10})
	f.succeed(5)
	f.calls(bad, bad, bad, bad, bad)
	f.wantState(breaker.Open)
	if e := f.b.Evidence(); e != breaker.Statistical {
		t.Fatalf("evidence %q, want statistical", e)
	}
}

// Eject opens a closed breaker on the pool's statistical evidence, and
// nothing else.
func TestEject(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	if !f.b.Eject("outlier", 0.1) {
		t.Fatal("Eject refused on a closed breaker")
	}
	s := f.b.Snapshot()
	if s.State != breaker.Open || s.Evidence != breaker.Statistical || s.PeerRatio != 0.1 || s.LastFailure != "ejected: outlier" {
		t.Fatalf("after Eject: %+v", s)
	}
	if got := f.openFor(); got != 10*time.Second {
		t.Fatalf("ejected for %s, want the 10s cooldown", got)
	}
	if f.b.Eject("again", 0.1) {
		t.Fatal("Eject on an open breaker")
	}
}

// A breaker back from an ejection stays on probation until its ratio
// window holds MinRequests requests, or RatioWindow passes: its pool keeps
// its place under the ejection cap meanwhile. A hard open's recovery, an
// operator's close and a fresh open end or give none.
func TestProbationAfterAnEjection(t *testing.T) {
	recovered := func(t *testing.T) *fixture {
		f := newFixture(t, breaker.Settings{})
		f.b.Eject("outlier", 0.1)
		f.clk.Advance(f.openFor())
		for f.b.State() != breaker.Closed {
			p := f.probe()
			p.Done(ok, 0, "")
		}
		if !f.b.OnProbation() {
			t.Fatalf("closed after an ejection, not on probation: %+v", f.b.Snapshot())
		}
		return f
	}
	t.Run("until MinRequests", func(t *testing.T) {
		f := recovered(t)
		f.succeed(19)
		if !f.b.OnProbation() {
			t.Fatal("off probation after 19 of 20 requests")
		}
		f.succeed(1)
		if f.b.OnProbation() {
			t.Fatal("still on probation with 20 requests in the window")
		}
	})
	t.Run("until RatioWindow", func(t *testing.T) {
		f := recovered(t)
		f.clk.Advance(30*time.Second - time.Nanosecond)
		if !f.b.OnProbation() {
			t.Fatal("off probation before RatioWindow")
		}
		f.clk.Advance(time.Nanosecond)
		if f.b.OnProbation() {
			t.Fatal("still on probation after RatioWindow")
		}
	})
	t.Run("forced close", func(t *testing.T) {
		f := recovered(t)
		f.b.ForceOpen(time.Minute, "operator")
		f.b.ForceClose("operator")
		if f.b.OnProbation() {
			t.Fatal("on probation after an operator's close")
		}
	})
	t.Run("hard open", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.succeed(1)
		f.calls(down, down, down)
		f.wantState(breaker.Open)
		f.clk.Advance(f.openFor())
		for f.b.State() != breaker.Closed {
			p := f.probe()
			p.Done(ok, 0, "")
		}
		if f.b.OnProbation() {
			t.Fatal("on probation after a hard open's recovery")
		}
	})
}

// Recovery judged fairly: a half-open upstream whose probes fail at the
// pool's rate closes; one that fails more re-opens, with a grown cooldown.
func TestHalfOpenJudgedAgainstThePool(t *testing.T) {
	t.Run("fails like its pool: closes", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.b.Eject("outlier", 0.5)
		f.clk.Advance(f.openFor())
		for _, o := range []breaker.Outcome{bad, ok, bad, bad, ok} {
			p := f.probe()
			p.Done(o, 0, o.String())
		}
		f.wantState(breaker.Closed)
	})
	t.Run("fails more than its pool: re-opens, grown", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.b.Eject("outlier", 0.5)
		f.clk.Advance(f.openFor())
		// NB(2, 0.5) at 99%: 9 failures before the second success.
		for i := range 10 {
			if i > 0 {
				f.wantState(breaker.HalfOpen)
			}
			p := f.probe()
			p.Done(bad, 0, "http 503")
		}
		f.wantState(breaker.Open)
		if got, e := f.openFor(), f.b.Evidence(); got != 20*time.Second || e != breaker.Statistical {
			t.Fatalf("re-opened for %s with %q evidence, want 20s, statistical", got, e)
		}
	})
	t.Run("healthy pool: the first failure re-opens", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.b.Eject("outlier", 0)
		f.clk.Advance(f.openFor())
		p := f.probe()
		p.Done(bad, 0, "http 503")
		f.wantState(breaker.Open)
	})
	t.Run("a Down probe is hard evidence at once", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.b.Eject("outlier", 0.9)
		f.clk.Advance(f.openFor())
		p := f.probe()
		p.Done(down, 0, "connection refused")
		f.wantState(breaker.Open)
		if e := f.b.Evidence(); e != breaker.Hard {
			t.Fatalf("evidence %q, want hard", e)
		}
	})
	t.Run("a failed synthetic probe is hard evidence", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.b.Eject("outlier", 0.9)
		f.clk.Advance(f.openFor())
		p, ok := f.b.AllowProbe()
		if !ok {
			t.Fatal("no synthetic probe")
		}
		p.Done(bad, 0, "probe: http 503")
		f.wantState(breaker.Open)
		if e := f.b.Evidence(); e != breaker.Hard {
			t.Fatalf("evidence %q, want hard", e)
		}
	})
}

// Issue 19, item 5: with the defaults (OpenFor = MinOpen = 10s) the first
// trips of many breakers spread over the whole jitter range, [10s, 14s),
// instead of half of them landing on exactly 10s.
func TestFirstTripsSpreadOverTheJitterRange(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 19))
	clk := newClock()
	const n = 2000
	var buckets [4]int
	atFloor := 0
	for range n {
		b := breaker.New("up", breaker.Settings{}, breaker.WithClock(clk), breaker.WithRand(rng.Float64))
		for range 3 {
			p, _ := b.Allow()
			p.Done(breaker.Down, 0, "connection refused")
		}
		d := b.Snapshot().OpenUntil.Sub(clk.Now())
		if d < breaker.DefaultMinOpen || d >= 14*time.Second {
			t.Fatalf("first cooldown %s outside [10s, 14s)", d)
		}
		if d == breaker.DefaultMinOpen {
			atFloor++
		}
		buckets[int((d-breaker.DefaultMinOpen)/time.Second)]++
	}
	if atFloor > n/100 {
		t.Fatalf("%d of %d first trips at exactly min_open: the floor cancels the jitter", atFloor, n)
	}
	for i, c := range buckets {
		if c < n/4*8/10 || c > n/4*12/10 {
			t.Fatalf("second %d of the range holds %d of %d first trips, want about a quarter (%v)", 10+i, c, n, buckets)
		}
	}
}

// A breaker that recovered starts a new run of Down outcomes from zero: the
// run that opened it does not carry over into the closed state.
func TestRecoveryResetsTheDownRun(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	f.calls(down, down, down)
	f.wantState(breaker.Open)
	f.clk.Advance(f.openFor())
	for range 2 {
		p := f.probe()
		p.Done(ok, 0, "")
	}
	f.wantState(breaker.Closed)
	f.calls(down, down)
	f.wantState(breaker.Closed)
	f.calls(down)
	f.wantState(breaker.Open)
}

// An upstream held on hard evidence because its first answers were all
// errors ("no success in the window") that then answers a probe is no
// longer failing everything: when later probes fail more than its pool's
// ratio explains, it re-opens as an outlier (statistical evidence, within
// the pool's cap and panic rule), not as a dead server. Without a probe
// success it stays hard.
func TestProbeSuccessTurnsHardIntoStatistical(t *testing.T) {
	for _, succeeded := range []bool{true, false} {
		f := newFixture(t, breaker.Settings{})
		f.calls(bad, bad, bad) // never served: no success in the window
		f.wantState(breaker.Open)
		if e := f.b.Evidence(); e != breaker.Hard {
			t.Fatalf("evidence %q after three errors and no success, want hard", e)
		}
		f.b.SetPeerRatio(0.1) // allows 2 failed probes before 2 successes
		f.clk.Advance(f.openFor())
		if succeeded {
			p := f.probe()
			p.Done(ok, 0, "")
		}
		for range 3 {
			p := f.probe()
			p.Done(bad, 0, "http 503")
		}
		f.wantState(breaker.Open)
		want := breaker.Hard
		if succeeded {
			want = breaker.Statistical
		}
		if e := f.b.Evidence(); e != want {
			t.Fatalf("probe success %v: re-opened on %q evidence, want %q (%+v)", succeeded, e, want, f.b.Snapshot())
		}
	}
}

// Under WithOutlierDetector the breaker's own statistical rules (failure
// ratio, slow call ratio, failures in a window) never trip it: it counts
// their outcomes for the pool's detector (RatioCounts, FailureCount), and
// hard evidence still trips it at once. Without the option the same
// outcomes trip it on its own ratio rule.
func TestOutlierDetectorLeavesStatisticalRulesToThePool(t *testing.T) {
	s := breaker.Settings{ConsecutiveFailures: 3, Failures: 5, FailureRatio: 0.5, SlowTTFT: time.Second, SlowRatio: 0.5, MinRequests: 4}
	run := func(f *fixture) {
		t.Helper()
		for range 4 {
			f.call(breaker.Success, 0)
			f.call(breaker.Failure, 0)
		}
		f.call(breaker.Success, 2*time.Second) // slow: a failure for the slow rule
		f.call(breaker.Failure, 0)
	}
	f := newFixture(t, s, breaker.WithOutlierDetector())
	run(f)
	f.wantState(breaker.Closed)
	if rc := f.b.RatioCounts(); rc.Requests != 10 || rc.Failures != 6 || rc.Slow != 1 {
		t.Fatalf("ratio counts %+v, want 6 failures (1 slow) in 10", rc)
	}
	if n := f.b.FailureCount(); n != 6 {
		t.Fatalf("failure count %d, want 6", n)
	}

	own := newFixture(t, s)
	run(own)
	own.wantState(breaker.Open)
	if ev := own.b.Evidence(); ev != breaker.Statistical {
		t.Fatalf("without the detector: evidence %v, want statistical", ev)
	}

	// Hard evidence under the detector: three refused connections in a row.
	g := newFixture(t, s, breaker.WithOutlierDetector())
	g.down(3)
	g.wantState(breaker.Open)
	if ev := g.b.Evidence(); ev != breaker.Hard {
		t.Fatalf("evidence %v, want hard: the detector takes statistics only", ev)
	}
}

// Tally counts an outcome that had no permit in the windows the detector
// reads, and changes nothing else: an open breaker stays open with its
// cooldown, and no run of failures grows.
func TestTallyCountsWithoutAPermit(t *testing.T) {
	f := newFixture(t, breaker.Settings{SlowTTFT: time.Second}, breaker.WithOutlierDetector())
	f.b.Eject("outlier", 0)
	until := f.b.Snapshot().OpenUntil
	f.b.Tally(breaker.Failure, 0)
	f.b.Tally(breaker.Down, 0)
	f.b.Tally(breaker.Success, 2*time.Second)
	f.b.Tally(breaker.Success, 0)
	f.b.Tally(breaker.Neutral, 0)
	if rc := f.b.RatioCounts(); rc.Requests != 4 || rc.Failures != 3 || rc.Slow != 1 {
		t.Fatalf("ratio counts %+v, want 3 failures (1 slow) in 4", rc)
	}
	if n := f.b.FailureCount(); n != 3 {
		t.Fatalf("failure count %d, want 3", n)
	}
	if s := f.b.Snapshot(); s.State != breaker.Open || !s.OpenUntil.Equal(until) || s.ConsecutiveFailures != 0 {
		t.Fatalf("after Tally: %+v, want open until %v, no run of failures", s, until)
	}
}

// Pardon frees a place under the ejection cap: an ejection (open or half
// open) closes and a probation ends; hard evidence and an operator's open
// are left alone. HeldRatio is the ratio the ejection rested on.
func TestPardon(t *testing.T) {
	t.Run("ejected", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.succeed(6)
		f.fail(4)
		f.b.Eject("outlier", 0.1)
		if r := f.b.HeldRatio(); r != 0.4 {
			t.Fatalf("held ratio %v, want 4/10", r)
		}
		if !f.b.Pardon("worse outlier") {
			t.Fatal("an ejection not pardoned")
		}
		if s := f.b.Snapshot(); s.State != breaker.Closed || s.Evidence != breaker.EvidenceNone || f.b.OnProbation() {
			t.Fatalf("after Pardon: %+v", s)
		}
		ts := f.rec.all()
		if last := ts[len(ts)-1]; last.To != breaker.Closed || last.Reason != "pardoned: worse outlier" {
			t.Fatalf("last transition %+v", last)
		}
		if f.b.Pardon("again") {
			t.Fatal("a closed breaker pardoned")
		}
	})
	t.Run("half open", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.b.Eject("outlier", 0.1)
		f.clk.Advance(f.openFor())
		f.probe()
		if !f.b.Pardon("worse") || f.b.State() != breaker.Closed {
			t.Fatalf("half-open ejection: %+v", f.b.Snapshot())
		}
	})
	t.Run("probation", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.b.Eject("outlier", 0.1)
		f.clk.Advance(f.openFor())
		for f.b.State() != breaker.Closed {
			p := f.probe()
			p.Done(ok, 0, "")
		}
		if !f.b.OnProbation() || !f.b.Pardon("worse") || f.b.OnProbation() {
			t.Fatalf("probation not ended: %+v", f.b.Snapshot())
		}
	})
	t.Run("hard and forced", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{})
		f.down(3)
		if f.b.Evidence() != breaker.Hard || f.b.Pardon("worse") || f.b.State() != breaker.Open {
			t.Fatalf("hard evidence pardoned: %+v", f.b.Snapshot())
		}
		g := newFixture(t, breaker.Settings{})
		g.b.Eject("outlier", 0.1)
		g.b.ForceOpen(time.Minute, "operator")
		if g.b.Pardon("worse") || g.b.State() != breaker.Open {
			t.Fatalf("an operator's open pardoned: %+v", g.b.Snapshot())
		}
	})
}

// A half-open upstream that refuses or resets ConsecutiveFailures probes in
// a row, with no success between them, is dead whatever its pool does: it
// re-opens on hard evidence at the third, even after a probe success in
// this half-open and in a pool that fails everything (whose ratio would
// otherwise tolerate maxProbeFailures failed probes, and panic route over
// it). Fewer in a row stay tolerated like the pool's failures.
func TestRefusedProbesInARowAreHardEvidenceWhateverThePool(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	f.calls(bad, bad, bad)
	f.wantState(breaker.Open)
	probe := func(o breaker.Outcome, why string) {
		t.Helper()
		p := f.probe()
		p.Done(o, 0, why)
	}
	f.b.SetPeerRatio(1) // the pool (or the upstream alone in it) fails everything
	f.clk.Advance(f.openFor())
	probe(ok, "") // a sign of life: the run of refusals is not
	for i := range 2 {
		probe(down, "connect_error")
		if s := f.b.State(); s != breaker.HalfOpen {
			t.Fatalf("after %d refused probes: %v, want half-open (tolerated like the pool)", i+1, s)
		}
	}
	probe(bad, "http 503") // an answer breaks the run
	for range 2 {
		probe(down, "connect_error")
	}
	f.wantState(breaker.HalfOpen)
	probe(down, "connect_error")
	f.wantState(breaker.Open)
	if e := f.b.Evidence(); e != breaker.Hard {
		t.Fatalf("re-opened on %q evidence after three refused probes in a row, want hard (%+v)", e, f.b.Snapshot())
	}
}
