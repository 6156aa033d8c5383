package breaker_test

import (
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// step is one event in a trip-rule scenario.
type step struct {
	advance time.Duration
	outcome breaker.Outcome
	ttft    time.Duration
	n       int // repeat; 0 means 1
}

func S(n int) step                        { return step{outcome: breaker.Success, n: n} }
func F(n int) step                        { return step{outcome: breaker.Failure, n: n} }
func N(n int) step                        { return step{outcome: breaker.Neutral, n: n} }
func Slow(n int, ttft time.Duration) step { return step{outcome: breaker.Success, ttft: ttft, n: n} }
func Wait(d time.Duration) step           { return step{advance: d} }

func TestTripRules(t *testing.T) {
	noConsec := breaker.Settings{ConsecutiveFailures: -1}
	tests := []struct {
		name       string
		s          breaker.Settings
		steps      []step
		want       breaker.State
		wantReason string // substring of the trip reason
	}{
		{name: "default trips after 3 consecutive failures", steps: []step{F(3)}, want: breaker.Open, wantReason: "3 consecutive failures"},
		{name: "2 consecutive failures stay closed", steps: []step{F(2)}, want: breaker.Closed},
		{name: "a success breaks the run", steps: []step{F(2), S(1), F(2)}, want: breaker.Closed},
		{name: "neutral does not break the run", steps: []step{F(2), N(5), F(1)}, want: breaker.Open},
		{name: "consecutive threshold is configurable", s: breaker.Settings{ConsecutiveFailures: 5}, steps: []step{F(4)}, want: breaker.Closed},
		{name: "consecutive 5 trips at 5", s: breaker.Settings{ConsecutiveFailures: 5}, steps: []step{F(5)}, want: breaker.Open},
		{name: "consecutive -1 disables", s: noConsec, steps: []step{F(100)}, want: breaker.Closed},

		{name: "failures within window trip", s: breaker.Settings{ConsecutiveFailures: -1, Failures: 5, FailuresWindow: 10 * time.Second},
			steps: []step{F(1), S(3), Wait(time.Second), F(1), S(3), F(1), Wait(time.Second), F(1), S(1), F(1)}, want: breaker.Open, wantReason: "5 failures within 10s"},
		{name: "failures outside window expire", s: breaker.Settings{ConsecutiveFailures: -1, Failures: 5, FailuresWindow: 10 * time.Second},
			steps: []step{F(4), Wait(11 * time.Second), F(4)}, want: breaker.Closed},
		{name: "failures window expires bucket by bucket", s: breaker.Settings{ConsecutiveFailures: -1, Failures: 5, FailuresWindow: 10 * time.Second},
			steps: []step{F(2), Wait(5 * time.Second), F(2), Wait(6 * time.Second), F(1)}, want: breaker.Closed},
		{name: "failures window still holds recent bucket", s: breaker.Settings{ConsecutiveFailures: -1, Failures: 5, FailuresWindow: 10 * time.Second},
			steps: []step{F(2), Wait(5 * time.Second), F(2), Wait(4 * time.Second), F(1)}, want: breaker.Open},

		{name: "failure ratio needs min requests", s: breaker.Settings{ConsecutiveFailures: -1, FailureRatio: 0.5, MinRequests: 10},
			steps: []step{S(1), F(1), S(1), F(1), S(1), F(1), S(1), F(1)}, want: breaker.Closed},
		{name: "failure ratio trips at min requests", s: breaker.Settings{ConsecutiveFailures: -1, FailureRatio: 0.5, MinRequests: 10},
			steps: []step{S(1), F(1), S(1), F(1), S(1), F(1), S(1), F(1), S(1), F(1)}, want: breaker.Open, wantReason: "failure ratio 5/10"},
		{name: "failure ratio below threshold stays closed", s: breaker.Settings{ConsecutiveFailures: -1, FailureRatio: 0.5, MinRequests: 10},
			steps: []step{S(7), F(3), S(10), F(4)}, want: breaker.Closed},
		{name: "neutral is not a request", s: breaker.Settings{ConsecutiveFailures: -1, FailureRatio: 0.5, MinRequests: 10},
			steps: []step{N(50), F(5), S(4)}, want: breaker.Closed},
		{name: "failure ratio window forgets old successes", s: breaker.Settings{ConsecutiveFailures: -1, FailureRatio: 0.5, MinRequests: 4, RatioWindow: 10 * time.Second},
			steps: []step{S(100), Wait(11 * time.Second), S(2), F(2)}, want: breaker.Open},
		{name: "failure ratio window keeps recent successes", s: breaker.Settings{ConsecutiveFailures: -1, FailureRatio: 0.5, MinRequests: 4, RatioWindow: 10 * time.Second},
			steps: []step{S(100), Wait(9 * time.Second), S(2), F(2)}, want: breaker.Closed},
		{name: "default min requests is 20", s: breaker.Settings{ConsecutiveFailures: -1, FailureRatio: 0.1},
			steps: []step{F(2), S(17)}, want: breaker.Closed},
		{name: "default min requests reached", s: breaker.Settings{ConsecutiveFailures: -1, FailureRatio: 0.1},
			steps: []step{S(18), F(2)}, want: breaker.Open},

		{name: "slow calls count as failures", s: breaker.Settings{SlowTTFT: 2 * time.Second},
			steps: []step{Slow(3, 3*time.Second)}, want: breaker.Open, wantReason: "slow call: ttft 3s > 2s"},
		{name: "ttft at threshold is not slow", s: breaker.Settings{SlowTTFT: 2 * time.Second},
			steps: []step{Slow(10, 2*time.Second)}, want: breaker.Closed},
		{name: "unknown ttft is not slow", s: breaker.Settings{SlowTTFT: 2 * time.Second},
			steps: []step{Slow(10, 0)}, want: breaker.Closed},
		{name: "slow ttft off by default", steps: []step{Slow(10, time.Hour)}, want: breaker.Closed},
		{name: "slow calls feed the failure ratio", s: breaker.Settings{ConsecutiveFailures: -1, SlowTTFT: time.Second, FailureRatio: 0.5, MinRequests: 4},
			steps: []step{S(1), Slow(1, 5*time.Second), S(1), Slow(1, 5*time.Second)}, want: breaker.Open, wantReason: "failure ratio 2/4"},

		{name: "slow ratio trips", s: breaker.Settings{ConsecutiveFailures: -1, SlowTTFT: time.Second, SlowRatio: 0.5, MinRequests: 4},
			steps: []step{S(1), Slow(1, 5*time.Second), S(1), Slow(1, 5*time.Second)}, want: breaker.Open, wantReason: "slow call ratio 2/4"},
		{name: "slow ratio ignores plain failures", s: breaker.Settings{ConsecutiveFailures: -1, SlowTTFT: time.Second, SlowRatio: 0.5, MinRequests: 4},
			steps: []step{S(1), F(1), S(1), F(1), Slow(1, 5*time.Second)}, want: breaker.Closed},
		{name: "slow ratio needs min requests", s: breaker.Settings{ConsecutiveFailures: -1, SlowTTFT: time.Second, SlowRatio: 0.5, MinRequests: 10},
			steps: []step{Slow(5, 5*time.Second)}, want: breaker.Closed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t, tt.s)
			for _, st := range tt.steps {
				f.clk.Advance(st.advance)
				if st.advance != 0 {
					continue
				}
				for range max(st.n, 1) {
					if !f.call(st.outcome, st.ttft) {
						t.Fatalf("refused before the end of the scenario (state %s)", f.b.State())
					}
				}
			}
			f.wantState(tt.want)
			trs := f.rec.all()
			if tt.want == breaker.Closed {
				if len(trs) != 0 {
					t.Fatalf("transitions = %+v, want none", trs)
				}
				return
			}
			if len(trs) != 1 || trs[0].From != breaker.Closed || trs[0].To != breaker.Open {
				t.Fatalf("transitions = %+v, want one closed→open", trs)
			}
			if !strings.Contains(trs[0].Reason, tt.wantReason) {
				t.Errorf("reason = %q, want it to contain %q", trs[0].Reason, tt.wantReason)
			}
		})
	}
}

// Calls in flight when the breaker opened say nothing about it afterwards:
// their outcomes neither extend the open nor count.
func TestOutcomesOfStalePermitsAreIgnored(t *testing.T) {
	f := newFixture(t, breaker.Settings{})
	var inflight []breaker.Permit
	for range 5 {
		p, _ := f.b.Allow()
		inflight = append(inflight, p)
	}
	f.fail(3)
	f.wantState(breaker.Open)
	before := f.b.Snapshot()
	for i := range inflight {
		inflight[i].Done(breaker.Failure, 0, "late")
	}
	after := f.b.Snapshot()
	if after != before {
		t.Fatalf("stale outcomes changed the breaker:\n before %+v\n after  %+v", before, after)
	}

	// Permits from before Reset are stale too.
	f.b.Reset()
	p, _ := f.b.Allow()
	f.b.Reset()
	p.Done(breaker.Failure, 0, "before reset")
	if s := f.b.Snapshot(); s.ConsecutiveFailures != 0 || s.FailuresInWindow != 0 {
		t.Fatalf("outcome from before Reset counted: %+v", s)
	}
}

func TestSnapshotCounts(t *testing.T) {
	f := newFixture(t, breaker.Settings{ConsecutiveFailures: 10, FailureRatio: 0.9, SlowTTFT: time.Second})
	f.succeed(3)
	f.fail(2)
	f.call(breaker.Success, 2*time.Second)
	s := f.b.Snapshot()
	want := breaker.Snapshot{Key: "up1", State: breaker.Closed, Since: t0, ConsecutiveFailures: 3,
		FailuresInWindow: 3, RequestsInWindow: 6, SlowInWindow: 1,
		LastFailure: "slow call: ttft 2s > 1s (success)", LastFailureAt: t0}
	if s != want {
		t.Fatalf("snapshot =\n %+v\nwant\n %+v", s, want)
	}
}
