package breaker_test

import (
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/breaker/breakertest"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// fleetFixture is n simulated gateways sharing one SharedMemory, each with
// its own breaker for key "up1", on one fake clock.
type fleetFixture struct {
	t   *testing.T
	clk *clocktest.Fake
	sm  *breakertest.SharedMemory
	gw  []*fixture // gw[i].b is gateway i's breaker
}

func newFleet(t *testing.T, n, minReporters int, s breaker.Settings) *fleetFixture {
	t.Helper()
	ff := &fleetFixture{t: t, clk: newClock()}
	ff.sm = breakertest.NewSharedMemory(ff.clk, minReporters)
	for i := range n {
		ff.gw = append(ff.gw, ff.join(i, s))
	}
	return ff
}

// join builds a breaker for "up1" in gateway i.
func (ff *fleetFixture) join(i int, s breaker.Settings) *fixture {
	f := &fixture{t: ff.t, clk: ff.clk, rec: new(recorder)}
	f.b = breaker.New("up1", s, breaker.WithClock(ff.clk), noJitter, breaker.WithListener(f.rec.listen),
		breaker.WithStore(ff.sm.Instance(fmt.Sprintf("gw%d", i))))
	return f
}

func (ff *fleetFixture) wantStates(want ...breaker.State) {
	ff.t.Helper()
	for i, f := range ff.gw {
		if got := f.b.State(); got != want[i] {
			ff.t.Fatalf("gateway %d: state %s, want %s (snapshot %+v)", i, got, want[i], f.b.Snapshot())
		}
	}
}

func (ff *fleetFixture) fleetOpen() (time.Time, string, bool) {
	return ff.sm.Instance("observer").OpenUntil("up1", ff.clk.Now())
}

func TestFleetTripsOnTheFleetsCount(t *testing.T) {
	ff := newFleet(t, 3, 1, breaker.Settings{})
	ff.gw[0].down(1)
	ff.gw[1].down(1)
	ff.wantStates(breaker.Closed, breaker.Closed, breaker.Closed)
	if c := ff.sm.Counts("up1"); c.Consecutive != 2 || c.Reporters != 2 || c.Joined != 3 {
		t.Fatalf("counts %+v", c)
	}
	ff.clk.Advance(time.Second)
	ff.gw[2].down(1) // the fleet's third failure: every gateway opens
	ff.wantStates(breaker.Open, breaker.Open, breaker.Open)
	until, reason, ok := ff.fleetOpen()
	if !ok || !until.Equal(ff.clk.Now().Add(10*time.Second)) ||
		reason != "fleet: 3 consecutive failures from 3 gateways; last: down (gw2)" {
		t.Fatalf("fleet entry %v %q %v", until, reason, ok)
	}
	for i, f := range ff.gw {
		s := f.b.Snapshot()
		if !s.OpenUntil.Equal(until) || s.Local || s.Reopens != 0 {
			t.Fatalf("gateway %d: %+v", i, s)
		}
		ts := f.rec.all()
		if len(ts) != 1 || ts[0].To != breaker.Open || ts[0].Reason != reason || !ts[0].OpenUntil.Equal(until) {
			t.Fatalf("gateway %d: transitions %+v", i, ts)
		}
	}
	if c := ff.sm.Counts("up1"); c.Consecutive != 0 || c.Reporters != 0 || c.InWindow != 0 {
		t.Fatalf("counts after the fleet opened %+v", c)
	}

	// A gateway started while it is open sees it open with its remaining
	// time.
	ff.clk.Advance(4 * time.Second)
	late := ff.join(3, breaker.Settings{})
	if s := late.b.Snapshot(); s.State != breaker.Open || !s.OpenUntil.Equal(until) {
		t.Fatalf("late gateway %+v", s)
	}
}

func TestFleetSuccessEndsTheFleetsRun(t *testing.T) {
	ff := newFleet(t, 3, 1, breaker.Settings{})
	ff.gw[0].down(2)
	ff.gw[1].succeed(1) // another gateway's success resets the fleet's run
	if c := ff.sm.Counts("up1"); c.Consecutive != 0 || c.Reporters != 0 || c.InWindow != 2 {
		t.Fatalf("counts after a success %+v", c)
	}
	ff.gw[2].down(2) // 4 failures, but the fleet's run is 2
	ff.wantStates(breaker.Closed, breaker.Closed, breaker.Closed)
	ff.gw[1].down(1)
	ff.wantStates(breaker.Open, breaker.Open, breaker.Open)
	if _, reason, _ := ff.fleetOpen(); !strings.HasPrefix(reason, "fleet: 3 consecutive failures from 2 gateways") {
		t.Fatalf("reason %q", reason)
	}
}

func TestFleetFailuresWithinWindow(t *testing.T) {
	s := breaker.Settings{ConsecutiveFailures: -1, Failures: 4, FailuresWindow: 10 * time.Second}
	ff := newFleet(t, 2, 1, s)
	ff.gw[0].down(1)
	ff.gw[1].succeed(1)
	ff.gw[1].down(1)
	ff.clk.Advance(11 * time.Second) // both expire
	ff.gw[0].down(1)
	ff.gw[1].succeed(3)
	ff.gw[1].down(2)
	ff.wantStates(breaker.Closed, breaker.Closed)
	ff.clk.Advance(5 * time.Second)
	ff.gw[0].down(1)
	ff.wantStates(breaker.Open, breaker.Open)
	if _, reason, _ := ff.fleetOpen(); !strings.HasPrefix(reason, "fleet: 4 failures within 10s from 2 gateways") {
		t.Fatalf("reason %q", reason)
	}
}

// TestFleetMinReportersKeepsOneGatewaysPathLocal: with min_reporters 2,
// one gateway whose network path to the upstream is broken opens only its
// own breaker, and its probes and recovery stay local; a second gateway's
// failure then opens the key fleet-wide.
func TestFleetMinReportersKeepsOneGatewaysPathLocal(t *testing.T) {
	ff := newFleet(t, 3, 2, breaker.Settings{})
	ff.gw[0].down(3)
	if _, ok := ff.gw[0].b.Allow(); ok {
		t.Fatal("gateway 0 allowed a call after its own trip")
	}
	ff.wantStates(breaker.Open, breaker.Closed, breaker.Closed)
	if s := ff.gw[0].b.Snapshot(); !s.Local || !strings.Contains(s.LastFailure, "down") {
		t.Fatalf("gateway 0 %+v", s)
	}
	if _, _, ok := ff.fleetOpen(); ok {
		t.Fatal("one gateway's failures opened the fleet")
	}
	if c := ff.sm.Counts("up1"); c.Consecutive != 3 || c.Reporters != 1 {
		t.Fatalf("counts %+v", c)
	}

	// Its failed probe re-opens it, locally; its recovery closes it, locally.
	ff.clk.Advance(10 * time.Second)
	p := ff.gw[0].probe()
	p.Done(breaker.Failure, 0, "")
	ff.wantStates(breaker.Open, breaker.Closed, breaker.Closed)
	if s := ff.gw[0].b.Snapshot(); !s.Local || s.Reopens != 1 {
		t.Fatalf("after the failed probe %+v", s)
	}
	if _, _, ok := ff.fleetOpen(); ok {
		t.Fatal("a local re-open was published")
	}
	ff.gw[1].succeed(1) // the fleet's run ends
	ff.clk.Advance(20 * time.Second)
	for range 2 {
		p := ff.gw[0].probe()
		p.Done(breaker.Success, 0, "")
	}
	ff.wantStates(breaker.Closed, breaker.Closed, breaker.Closed)

	// Now gateway 0 trips locally again, and gateway 1 reports once: two
	// reporters, the fleet opens, and every gateway adopts it.
	ff.gw[0].down(3)
	ff.clk.Advance(2 * time.Second)
	ff.gw[1].down(1)
	ff.wantStates(breaker.Open, breaker.Open, breaker.Open)
	until, reason, ok := ff.fleetOpen()
	if !ok || !strings.HasPrefix(reason, "fleet: 4 consecutive failures from 2 gateways") {
		t.Fatalf("fleet entry %v %q %v", until, reason, ok)
	}
	s0 := ff.gw[0].b.Snapshot()
	if s0.Local || !s0.OpenUntil.Equal(until) {
		t.Fatalf("gateway 0 did not adopt the fleet's verdict: %+v (fleet until %v)", s0, until)
	}
}

func TestFleetVerdictsThatApplyFleetWide(t *testing.T) {
	s := breaker.Settings{MinOpen: -1}
	tests := []struct {
		name   string
		act    func(ff *fleetFixture)
		want   breaker.State // of the other gateways
		reason string        // substring of the others' transition
	}{
		{"ForceOpen", func(ff *fleetFixture) { ff.gw[0].b.ForceOpen(time.Minute, "maintenance") }, breaker.Open, "forced open: maintenance"},
		{"ForceOpen until closed", func(ff *fleetFixture) { ff.gw[0].b.ForceOpen(0, "drain") }, breaker.Open, "forced open: drain"},
		{"Retry-After", func(ff *fleetFixture) { ff.gw[0].b.ExtendOpen(30*time.Second, "http 429") }, breaker.Open, "retry-after 30s: http 429"},
		{"TripObserved", func(ff *fleetFixture) { ff.gw[0].b.TripObserved("saturation: kv 99%") }, breaker.Open, "saturation: kv 99%"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ff := newFleet(t, 3, 1, s)
			tc.act(ff)
			ff.wantStates(breaker.Open, tc.want, tc.want)
			for _, f := range ff.gw[1:] {
				ts := f.rec.all()
				if len(ts) != 1 || !strings.Contains(ts[0].Reason, tc.reason) {
					t.Fatalf("transitions %+v", ts)
				}
				if f.b.Observed() {
					t.Fatal("the observed mark travelled")
				}
			}
			// And an operator's close closes them all.
			ff.gw[2].b.ForceClose("done")
			ff.wantStates(breaker.Closed, breaker.Closed, breaker.Closed)
			if _, _, ok := ff.fleetOpen(); ok {
				t.Fatal("still open in the fleet")
			}
		})
	}
}

func TestFleetProbesOfAFleetVerdict(t *testing.T) {
	ff := newFleet(t, 3, 1, breaker.Settings{MinOpen: -1})
	ff.gw[0].down(1)
	ff.gw[1].down(1)
	ff.gw[2].down(1)
	ff.wantStates(breaker.Open, breaker.Open, breaker.Open)

	// Gateway 1's probe fails: it re-opens with the grown cooldown and the
	// others follow.
	ff.clk.Advance(10 * time.Second)
	p := ff.gw[1].probe()
	p.Done(breaker.Failure, 0, "http 502")
	ff.wantStates(breaker.Open, breaker.Open, breaker.Open)
	want := ff.clk.Now().Add(20 * time.Second)
	for i, f := range ff.gw {
		if s := f.b.Snapshot(); !s.OpenUntil.Equal(want) {
			t.Fatalf("gateway %d: open until %v, want %v", i, s.OpenUntil, want)
		}
	}
	// Gateway 2 recovers: the others close without probing.
	ff.clk.Advance(20 * time.Second)
	for range 2 {
		p := ff.gw[2].probe()
		p.Done(breaker.Success, 0, "")
	}
	ff.wantStates(breaker.Closed, breaker.Closed, breaker.Closed)
	if ts := ff.gw[0].rec.all(); ts[len(ts)-1].Reason != "closed in fleet by gw2: 2 probe successes" {
		t.Fatalf("gateway 0 transitions %+v", ts)
	}
}

// TestFleetRecoverySuccessesCountedFleetWide: recovery_successes 3, and
// each gateway's breaker sees one probe succeed: the third closes the key
// on all three, though none has three of its own. A failed probe in
// between starts the fleet's count afresh.
func TestFleetRecoverySuccessesCountedFleetWide(t *testing.T) {
	ff := newFleet(t, 3, 1, breaker.Settings{MinOpen: -1, RecoverySuccesses: 3})
	for _, f := range ff.gw {
		f.down(1)
	}
	ff.wantStates(breaker.Open, breaker.Open, breaker.Open)
	ff.clk.Advance(10 * time.Second)

	succeed := func(i int) {
		t.Helper()
		p := ff.gw[i].probe()
		p.Done(breaker.Success, 0, "")
	}
	succeed(0)
	succeed(1)
	if c := ff.sm.Counts("up1"); c.Recovered != 2 {
		t.Fatalf("counts %+v, want 2 probe successes", c)
	}
	// Gateway 2 is still open on its cooldown's end; its probe fails.
	p := ff.gw[2].probe()
	p.Done(breaker.Failure, 0, "http 502")
	ff.wantStates(breaker.Open, breaker.Open, breaker.Open)
	if c := ff.sm.Counts("up1"); c.Recovered != 0 || c.Reopens != 1 {
		t.Fatalf("counts %+v after a failed probe, want the successes forgotten and 1 re-open", c)
	}

	ff.clk.Advance(20 * time.Second)
	succeed(2)
	succeed(0)
	ff.wantStates(breaker.HalfOpen, breaker.Open, breaker.HalfOpen)
	p = ff.gw[1].probe()
	p.Done(breaker.Success, 0, "")
	ff.wantStates(breaker.Closed, breaker.Closed, breaker.Closed)
	for i, f := range ff.gw {
		ts := f.rec.all()
		if last := ts[len(ts)-1]; last.Reason != "closed in fleet by gw1: 3 probe successes" {
			t.Fatalf("gateway %d closed with %q", i, last.Reason)
		}
		if s := f.b.Snapshot(); s.Reopens != 0 || s.ProbeSuccesses != 0 {
			t.Fatalf("gateway %d after the fleet's close: %+v", i, s)
		}
	}
	if _, _, open := ff.fleetOpen(); open {
		t.Fatal("still open in the fleet")
	}
	if c := ff.sm.Counts("up1"); c.Recovered != 0 || c.Reopens != 0 {
		t.Fatalf("counts %+v after the close", c)
	}
}

// TestFleetLocalTripRecoversOnItsOwnCount: a local trip's probes are not
// the fleet's: they do not count toward a fleet recovery.
func TestFleetLocalTripRecoversOnItsOwnCount(t *testing.T) {
	ff := newFleet(t, 2, 2, breaker.Settings{MinOpen: -1, RecoverySuccesses: 2})
	ff.gw[0].down(3)
	ff.wantStates(breaker.Open, breaker.Closed)
	ff.clk.Advance(10 * time.Second)
	p := ff.gw[0].probe()
	p.Done(breaker.Success, 0, "")
	if c := ff.sm.Counts("up1"); c.Recovered != 0 {
		t.Fatalf("counts %+v, want a local trip's success not counted", c)
	}
	ff.wantStates(breaker.HalfOpen, breaker.Closed)
	p = ff.gw[0].probe()
	p.Done(breaker.Success, 0, "")
	ff.wantStates(breaker.Closed, breaker.Closed)
}

// TestFleetCooldownGrowsWithTheFleetsReopens: each failed probe comes from
// another gateway, whose own breaker never re-opened before; the cooldown
// doubles with the fleet's re-opens all the same (10s, 20s, 40s, 80s),
// and starts again from open_for once the fleet closed.
func TestFleetCooldownGrowsWithTheFleetsReopens(t *testing.T) {
	ff := newFleet(t, 3, 1, breaker.Settings{MinOpen: -1, MaxOpen: time.Hour})
	for _, f := range ff.gw {
		f.down(1)
	}
	want := 10 * time.Second
	for round, i := range []int{0, 1, 2, 0} {
		ff.clk.Advance(want)
		p := ff.gw[i].probe()
		p.Done(breaker.Failure, 0, "http 502")
		want *= 2
		for j, f := range ff.gw {
			if got := f.openFor(); got != want {
				t.Fatalf("round %d (gateway %d probed): gateway %d open for %v, want %v", round, i, j, got, want)
			}
		}
		if s := ff.gw[i].b.Snapshot(); s.Reopens != round+1 {
			t.Fatalf("round %d: the prober's re-opens %d, want the fleet's %d", round, s.Reopens, round+1)
		}
		if c := ff.sm.Counts("up1"); c.Reopens != round+1 {
			t.Fatalf("round %d: the fleet's re-opens %d", round, c.Reopens)
		}
	}
	ff.clk.Advance(want)
	for range 2 {
		p := ff.gw[1].probe()
		p.Done(breaker.Success, 0, "")
	}
	ff.wantStates(breaker.Closed, breaker.Closed, breaker.Closed)
	for _, f := range ff.gw {
		f.down(1)
	}
	ff.clk.Advance(10 * time.Second)
	p := ff.gw[2].probe()
	p.Done(breaker.Failure, 0, "http 502")
	if got := ff.gw[0].openFor(); got != 20*time.Second {
		t.Fatalf("after the fleet closed and tripped again: open for %v, want 20s (one re-open)", got)
	}
}

// TestFleetConcurrentUse: several gateways' breakers used at once while the
// fleet pushes; run with -race. Nothing deadlocks, and once the traffic
// stops an operator's close reaches every gateway.
func TestFleetConcurrentUse(t *testing.T) {
	clk := newClock()
	sm := breakertest.NewSharedMemory(clk, 1)
	const gws = 4
	var bs []*breaker.Breaker
	for i := range gws {
		bs = append(bs, breaker.New("up1", breaker.Settings{MinOpen: -1, OpenFor: time.Millisecond},
			breaker.WithClock(clk), breaker.WithStore(sm.Instance(fmt.Sprint(i))),
			breaker.WithListener(func(breaker.Transition) {})))
	}
	var wg sync.WaitGroup
	var stop atomic.Bool
	for i := range gws * 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			b := bs[i%gws]
			for n := 0; !stop.Load(); n++ {
				switch n % 13 {
				case 0:
					b.ForceOpen(time.Millisecond, "")
				case 5:
					b.Adopt(clk.Now().Add(time.Millisecond), "")
				case 7:
					b.AdoptClose("")
				case 11:
					clk.Advance(time.Millisecond)
					b.ProbeDue()
				default:
					if p, ok := b.Allow(); ok {
						o := breaker.Success
						if n%3 == 0 {
							o = breaker.Failure
						}
						p.Done(o, 0, "")
					}
				}
			}
		}()
	}
	time.Sleep(200 * time.Millisecond) // a race test: real concurrency
	stop.Store(true)
	wg.Wait()
	bs[0].ForceOpen(0, "")
	bs[0].ForceClose("")
	for i, b := range bs {
		if b.State() != breaker.Closed {
			t.Fatalf("gateway %d: %+v", i, b.Snapshot())
		}
	}
}

func TestSharedMemoryPushesNoMoreToABreakerThatLeft(t *testing.T) {
	ff := newFleet(t, 2, 1, breaker.Settings{})
	ff.gw[1].b.Close()
	if c := ff.sm.Counts("up1"); c.Joined != 1 {
		t.Fatalf("joined %d after Close, want 1", c.Joined)
	}
	ff.gw[0].b.ForceOpen(time.Minute, "")
	ff.wantStates(breaker.Open, breaker.Closed)
}

// TestFleetLocalTripThenAFleetWideVerdict: a local trip (min_reporters 2)
// becomes fleet-wide when this gateway learns something that applies to
// every gateway: a Retry-After, or an observed saturation.
func TestFleetLocalTripThenAFleetWideVerdict(t *testing.T) {
	tests := []struct {
		name string
		act  func(b *breaker.Breaker, clk *clocktest.Fake)
	}{
		{"Retry-After while open", func(b *breaker.Breaker, _ *clocktest.Fake) { b.ExtendOpen(time.Minute, "http 503") }},
		{"Retry-After answers its probe", func(b *breaker.Breaker, clk *clocktest.Fake) {
			clk.Advance(10 * time.Second)
			p, _ := b.Allow()
			b.ExtendOpen(time.Minute, "http 503")
			p.Done(breaker.Failure, 0, "http 503")
		}},
		{"TripObserved once its cooldown is over", func(b *breaker.Breaker, clk *clocktest.Fake) {
			clk.Advance(10 * time.Second)
			b.TripObserved("saturation")
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ff := newFleet(t, 2, 2, breaker.Settings{})
			ff.gw[0].down(3)
			ff.wantStates(breaker.Open, breaker.Closed)
			tc.act(ff.gw[0].b, ff.clk)
			ff.wantStates(breaker.Open, breaker.Open)
			if ff.gw[0].b.Snapshot().Local {
				t.Fatal("still local")
			}
		})
	}
}
