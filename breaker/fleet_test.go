package breaker_test

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

func TestAdopt(t *testing.T) {
	s := breaker.Settings{MinOpen: 30 * time.Second}
	st := new(countingFleet)
	t.Run("closed opens until then, without MinOpen", func(t *testing.T) {
		f := newFixture(t, s, breaker.WithStore(st))
		f.b.Adopt(f.clk.Now().Add(5*time.Second), "fleet: 3 consecutive failures")
		snap := f.b.Snapshot()
		if snap.State != breaker.Open || !snap.OpenUntil.Equal(f.clk.Now().Add(5*time.Second)) || snap.Reopens != 0 || snap.Forced {
			t.Fatalf("%+v", snap)
		}
		if ts := f.rec.all(); len(ts) != 1 || ts[0].Reason != "fleet: 3 consecutive failures" {
			t.Fatalf("transitions %+v", ts)
		}
		f.clk.Advance(5 * time.Second)
		f.probe()
	})
	t.Run("half-open opens, not as a re-open; its probe is stale", func(t *testing.T) {
		f := newFixture(t, s, breaker.WithStore(st))
		f.b.ForceOpen(time.Second, "")
		f.clk.Advance(time.Second)
		p := f.probe()
		f.b.Adopt(f.clk.Now().Add(time.Minute), "")
		p.Done(breaker.Success, 0, "")
		snap := f.b.Snapshot()
		if snap.State != breaker.Open || snap.Reopens != 0 || snap.ProbeSuccesses != 0 || !snap.OpenUntil.Equal(f.clk.Now().Add(time.Minute)) {
			t.Fatalf("%+v", snap)
		}
		if ts := f.rec.all(); ts[len(ts)-1].Reason != "open in fleet" {
			t.Fatalf("transitions %+v", ts)
		}
	})
	t.Run("an observed half-open breaker stays observed", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{MinOpen: -1}, breaker.WithStore(st))
		f.b.TripObserved("saturation")
		f.clk.Advance(10 * time.Second)
		f.b.Observe(breaker.ObservedHealthy, "")
		f.wantState(breaker.HalfOpen)
		f.b.Adopt(f.clk.Now().Add(time.Minute), "")
		if snap := f.b.Snapshot(); snap.State != breaker.Open || !snap.Observed || snap.Reopens != 0 {
			t.Fatalf("%+v", snap)
		}
	})
	t.Run("open extends only to a later end", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{}, breaker.WithStore(st))
		f.b.ForceOpen(10*time.Second, "")
		f.b.Adopt(f.clk.Now().Add(5*time.Second), "")
		if d := f.openFor(); d != 10*time.Second {
			t.Fatalf("open for %s, want 10s", d)
		}
		f.b.Adopt(f.clk.Now().Add(time.Minute), "")
		if d := f.openFor(); d != time.Minute {
			t.Fatalf("open for %s, want 1m", d)
		}
		if n := len(f.rec.all()); n != 1 {
			t.Fatalf("%d transitions, want 1", n)
		}
	})
	t.Run("a local trip takes the fleet's end, even an earlier one", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{ConsecutiveFailures: 3, OpenFor: time.Minute}, breaker.WithStore(st))
		f.fail(3)
		if snap := f.b.Snapshot(); snap.State != breaker.Open || !snap.Local {
			t.Fatalf("after its own rules tripped: %+v", snap)
		}
		f.b.Adopt(f.clk.Now().Add(20*time.Second), "fleet: 3 consecutive failures")
		if d := f.openFor(); d != 20*time.Second {
			t.Fatalf("open for %s, want the fleet's 20s (its own cooldown of 1m and MinOpen give way)", d)
		}
		if f.b.Snapshot().Local {
			t.Fatal("still a local trip")
		}
	})
	t.Run("zero means until closed", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{}, breaker.WithStore(st))
		f.b.Adopt(time.Time{}, "forced open: drain")
		f.clk.Advance(time.Hour)
		if _, ok := f.b.Allow(); ok {
			t.Fatal("allowed")
		}
		if snap := f.b.Snapshot(); snap.State != breaker.Open || !snap.Forced || !snap.OpenUntil.IsZero() {
			t.Fatalf("%+v", snap)
		}
		f.b.AdoptClose("")
		f.wantState(breaker.Closed)
		if ts := f.rec.all(); ts[len(ts)-1].Reason != "closed in fleet" {
			t.Fatalf("transitions %+v", ts)
		}
	})
	t.Run("a past end does nothing", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{}, breaker.WithStore(st))
		f.b.Adopt(f.clk.Now(), "")
		f.wantState(breaker.Closed)
	})
	t.Run("close of open and half-open", func(t *testing.T) {
		f := newFixture(t, breaker.Settings{MinOpen: -1}, breaker.WithStore(st))
		f.fail(3)
		f.b.AdoptClose("recovered elsewhere")
		f.wantState(breaker.Closed)
		f.fail(3)
		f.clk.Advance(10 * time.Second)
		p := f.probe()
		f.b.AdoptClose("")
		p.Done(breaker.Failure, 0, "") // stale
		f.wantState(breaker.Closed)
		if snap := f.b.Snapshot(); snap.ConsecutiveFailures != 0 || snap.FailuresInWindow != 0 {
			t.Fatalf("%+v", snap)
		}
		f.b.AdoptClose("") // closed: nothing
		if ts := f.rec.all(); len(ts) != 5 {
			t.Fatalf("transitions %+v", ts)
		}
	})
}

// TestAdoptCallsNoStore: pushes are the fleet's verdicts, not news for it.
func TestAdoptCallsNoStore(t *testing.T) {
	st := new(countingFleet)
	f := newFixture(t, breaker.Settings{}, breaker.WithStore(st))
	f.b.Adopt(f.clk.Now().Add(time.Minute), "")
	f.b.Adopt(f.clk.Now().Add(2*time.Minute), "")
	f.b.AdoptClose("")
	f.b.Adopt(time.Time{}, "")
	f.b.AdoptClose("")
	if p, c := st.puts.Load(), st.clears.Load(); p != 0 || c != 0 {
		t.Fatalf("PutOpen %d, ClearOpen %d; want none", p, c)
	}
}

// TestLocalTripIsNotPublished: in fleet mode a trip by the breaker's own
// rules is not PutOpen; without a fleet it is (unchanged).
func TestLocalTripIsNotPublished(t *testing.T) {
	st := new(countingFleet)
	f := newFixture(t, breaker.Settings{MinOpen: -1}, breaker.WithStore(st))
	f.fail(3)
	f.wantState(breaker.Open)
	if st.puts.Load() != 0 || st.failures.Load() != 3 {
		t.Fatalf("PutOpen %d, Failure %d; want 0, 3", st.puts.Load(), st.failures.Load())
	}
	if got := st.lastSettings(); got != (breaker.Settings{MinOpen: -1}).WithDefaults() {
		t.Fatalf("Failure got settings %+v", got)
	}
	f.clk.Advance(10 * time.Second)
	p := f.probe()
	p.Done(breaker.Success, 0, "")
	p = f.probe()
	p.Done(breaker.Success, 0, "")
	f.wantState(breaker.Closed)
	if st.clears.Load() != 0 {
		t.Fatal("the recovery of a local trip was published")
	}

	ms := breaker.NewMemoryStore()
	g := newFixture(t, breaker.Settings{}, breaker.WithStore(ms))
	g.fail(3)
	if _, _, ok := ms.OpenUntil("up1", g.clk.Now()); !ok {
		t.Fatal("without a fleet the trip is not published")
	}
}

// Only what may be hard evidence reaches the fleet: 5xx amid this
// gateway's successes do not (under uniform partial failure every gateway
// sees runs of them, and the fleet would open every key); Down outcomes
// and failures with no success in the window do.
func TestFleetToldOnlyOfHardEvidence(t *testing.T) {
	st := new(countingFleet)
	f := newFixture(t, breaker.Settings{}, breaker.WithStore(st))
	f.succeed(10)
	f.fail(2)
	f.succeed(1)
	f.fail(2)
	if n := st.failures.Load(); n != 0 {
		t.Fatalf("%d failures amid successes reported to the fleet, want 0", n)
	}
	f.down(1)
	if n := st.failures.Load(); n != 1 {
		t.Fatalf("%d failures reported after a Down outcome, want 1", n)
	}
	f.clk.Advance(31 * time.Second) // the last success leaves the window
	f.fail(1)
	if n := st.failures.Load(); n != 2 {
		t.Fatalf("%d failures reported with no success in the window, want 2", n)
	}
}

// TestSuccessCallsTheFleetOnlyWhileDirty: the closed-state success path
// tells the fleet only while its flag says the fleet's run may be non-zero.
func TestSuccessCallsTheFleetOnlyWhileDirty(t *testing.T) {
	st := new(countingFleet)
	f := newFixture(t, breaker.Settings{}, breaker.WithStore(st))
	f.succeed(1000)
	if n := st.successes.Load(); n != 0 {
		t.Fatalf("%d Success calls on a clean fleet", n)
	}
	f.down(1) // the fake sets the flag on Failure, clears it on Success
	f.succeed(10)
	if n := st.successes.Load(); n != 1 {
		t.Fatalf("%d Success calls, want 1", n)
	}
	st.dirty.Store(true) // another gateway failed
	f.succeed(1)
	if n := st.successes.Load(); n != 2 {
		t.Fatalf("%d Success calls, want 2", n)
	}
	if st.joins.Load() != 1 {
		t.Fatalf("%d joins", st.joins.Load())
	}
}

func TestCloseLeavesTheFleet(t *testing.T) {
	st := new(countingFleet)
	f := newFixture(t, breaker.Settings{}, breaker.WithStore(st))
	f.b.Close()
	f.b.Close()
	if st.leaves.Load() != 1 {
		t.Fatalf("%d leaves, want 1", st.leaves.Load())
	}
	newFixture(t, breaker.Settings{}).b.Close() // no store: nothing
}

// TestPushUnderTheBreakersLock: a fleet that pushes from within Failure
// (under the reporting breaker's lock) and from a listener neither
// deadlocks nor loses the push.
func TestPushUnderTheBreakersLock(t *testing.T) {
	st := &countingFleet{adoptOnFailure: true}
	f := newFixture(t, breaker.Settings{ConsecutiveFailures: 100}, breaker.WithStore(st))
	st.b = f.b
	f.fail(1)
	if s := f.b.Snapshot(); s.State != breaker.Open || s.Local {
		t.Fatalf("%+v", s)
	}
	if ts := f.rec.all(); len(ts) != 1 || ts[0].Reason != "pushed from Failure" {
		t.Fatalf("transitions %+v", ts)
	}

	// A listener that pushes back.
	var b *breaker.Breaker
	clk := newClock()
	b = breaker.New("up1", breaker.Settings{}, breaker.WithClock(clk), breaker.WithListener(func(tr breaker.Transition) {
		if tr.To == breaker.Open {
			b.AdoptClose("listener")
		}
	}))
	b.Adopt(clk.Now().Add(time.Minute), "")
	if b.State() != breaker.Closed {
		t.Fatalf("state %s", b.State())
	}
}

// countingFleet is a Fleet that counts calls. Failure sets the flag and
// Success clears it; with adoptOnFailure, Failure pushes Adopt to b at
// once, under b's lock.
type countingFleet struct {
	dirty                              atomic.Bool
	joins, leaves, failures, successes atomic.Int32
	puts, clears                       atomic.Int32
	probeSuccesses, reopens            atomic.Int32
	mu                                 sync.Mutex
	settings                           breaker.Settings
	adoptOnFailure                     bool
	b                                  *breaker.Breaker
}

func (c *countingFleet) Join(string, *breaker.Breaker) *atomic.Bool { c.joins.Add(1); return &c.dirty }
func (c *countingFleet) Leave(string, *breaker.Breaker)             { c.leaves.Add(1) }
func (c *countingFleet) Failure(_ string, s breaker.Settings, at time.Time, _ string) {
	c.failures.Add(1)
	c.mu.Lock()
	c.settings = s
	c.mu.Unlock()
	c.dirty.Store(true)
	if c.adoptOnFailure {
		c.b.Adopt(at.Add(time.Minute), "pushed from Failure")
	}
}
func (c *countingFleet) Success(string)                    { c.successes.Add(1); c.dirty.Store(false) }
func (c *countingFleet) PutOpen(string, time.Time, string) { c.puts.Add(1) }
func (c *countingFleet) ClearOpen(string)                  { c.clears.Add(1) }
func (c *countingFleet) ProbeSuccess(string, breaker.Settings) {
	c.probeSuccesses.Add(1)
}
func (c *countingFleet) Reopens(string) int { return int(c.reopens.Load()) }
func (c *countingFleet) Reopen(_ string, _ time.Time, _ string, n int) {
	c.puts.Add(1)
	c.reopens.Store(int32(n))
}
func (c *countingFleet) OpenUntil(string, time.Time) (time.Time, string, bool) {
	return time.Time{}, "", false
}
func (c *countingFleet) lastSettings() breaker.Settings {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.settings
}

func TestProbeNowEndsTheCooldown(t *testing.T) {
	st := new(countingFleet)
	f := newFixture(t, breaker.Settings{MinOpen: 30 * time.Second}, breaker.WithStore(st))
	f.b.Adopt(f.clk.Now().Add(time.Minute), "fleet: 3 consecutive failures")
	if _, ok := f.b.Allow(); ok {
		t.Fatal("allowed during the fleet's cooldown")
	}
	f.b.ProbeNow("")
	p, ok := f.b.Allow()
	if !ok || !p.Probe() {
		t.Fatalf("after ProbeNow: ok=%v probe=%v, want the half-open probe", ok, p.Probe())
	}
	if _, ok := f.b.Allow(); ok {
		t.Fatal("a second probe while the first is out")
	}
	p.Done(breaker.Success, 0, "")
	// Closed and forced-forever breakers are left alone.
	g := newFixture(t, breaker.Settings{}, breaker.WithStore(st))
	g.b.ProbeNow("")
	g.wantState(breaker.Closed)
	g.b.ForceOpen(0, "maintenance")
	g.b.ProbeNow("")
	if _, ok := g.b.Allow(); ok {
		t.Fatal("ProbeNow opened a breaker forced open until closed")
	}
}
