package admission

import (
	"context"
	"errors"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

type acquired struct {
	name   string
	rel    func()
	waited time.Duration
	err    error
}

// start runs Acquire on its own goroutine and returns its result channel.
func start(g *Gate, ctx context.Context, name string, tier Tier) chan acquired {
	ch := make(chan acquired, 1)
	go func() {
		rel, w, err := g.Acquire(ctx, name, tier)
		ch <- acquired{name, rel, w, err}
	}()
	return ch
}

// queued waits (yielding, never sleeping) until the gate holds n waiters.
func queued(t *testing.T, g *Gate, n int) {
	t.Helper()
	for i := 0; ; i++ {
		g.mu.Lock()
		got := len(g.q)
		g.mu.Unlock()
		if got == n {
			return
		}
		if i > 1e6 {
			t.Fatalf("queue holds %d, want %d", got, n)
		}
		runtime.Gosched()
	}
}

// enqueue starts an Acquire that must wait, and waits until it does.
func enqueue(t *testing.T, g *Gate, name string, tier Tier) chan acquired {
	t.Helper()
	g.mu.Lock()
	n := len(g.q)
	g.mu.Unlock()
	ch := start(g, context.Background(), name, tier)
	queued(t, g, n+1)
	return ch
}

func mustAcquire(t *testing.T, g *Gate, name string, tier Tier) func() {
	t.Helper()
	rel, w, err := g.Acquire(context.Background(), name, tier)
	if err != nil || w != 0 {
		t.Fatalf("Acquire(%s): waited %s, %v", name, w, err)
	}
	return rel
}

func refusalCode(err error) string {
	var r *Refusal
	if errors.As(err, &r) {
		return r.Code
	}
	if err != nil {
		return err.Error()
	}
	return ""
}

func fixed(n int) func() int { return func() int { return n } }

var (
	high = Tier{Name: "high", Priority: 10}
	mid  = Tier{Name: "mid", Priority: 5}
	low  = Tier{Name: "low", Priority: 0}
	shed = Tier{Name: "shed", Priority: -1}
)

func TestAdmitsAtOnceWhileSlotsAreFree(t *testing.T) {
	for _, capacity := range []func() int{nil, fixed(0), fixed(-1), fixed(3)} {
		obs := newRec()
		g := NewGate(GateConfig{Capacity: capacity}, newFakeClock(), obs)
		for range 3 {
			mustAcquire(t, g, "a", shed) // even a sheddable tier
		}
		if obs.inflight["shed"] != 3 || obs.lastDecision() != "a/shed/admitted" {
			t.Fatalf("inflight %v, decision %q", obs.inflight, obs.lastDecision())
		}
	}
}

func TestSheddableTierIsRefusedWhenSaturated(t *testing.T) {
	obs := newRec()
	g := NewGate(GateConfig{Capacity: fixed(1)}, newFakeClock(), obs)
	rel := mustAcquire(t, g, "a", low)
	_, _, err := g.Acquire(context.Background(), "b", shed)
	var r *Refusal
	if !errors.As(err, &r) || r.Code != CodeSaturated || r.Status != 429 || r.RetryAfter != time.Second {
		t.Fatalf("got %v", err)
	}
	if obs.lastDecision() != "b/shed/saturated" || !g.Saturated() {
		t.Fatalf("decision %q", obs.lastDecision())
	}
	rel()
	mustAcquire(t, g, "b", shed)
}

func TestQueueOrdersByPriorityThenArrival(t *testing.T) {
	g := NewGate(GateConfig{Capacity: fixed(1)}, newFakeClock(), nil)
	rel := mustAcquire(t, g, "holder", low)
	var chs []chan acquired
	for _, w := range []struct {
		name string
		tier Tier
	}{{"low1", low}, {"high1", high}, {"mid1", mid}, {"low2", low}, {"high2", high}} {
		chs = append(chs, enqueue(t, g, w.name, w.tier))
	}
	got := []string{}
	for range chs {
		rel()
		var a acquired
		select {
		case a = <-chs[0]:
		case a = <-chs[1]:
		case a = <-chs[2]:
		case a = <-chs[3]:
		case a = <-chs[4]:
		}
		if a.err != nil {
			t.Fatalf("%s: %v", a.name, a.err)
		}
		got = append(got, a.name)
		rel = a.rel
	}
	want := []string{"high1", "high2", "mid1", "low1", "low2"}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("served %v, want %v", got, want)
		}
	}
}

func TestHigherPriorityDisplacesTheNewestOfTheLowestTier(t *testing.T) {
	obs := newRec()
	g := NewGate(GateConfig{Capacity: fixed(1), Queue: 3}, newFakeClock(), obs)
	mustAcquire(t, g, "holder", low)
	low1 := enqueue(t, g, "low1", low)
	low2 := enqueue(t, g, "low2", low)
	mid1 := enqueue(t, g, "mid1", mid)
	// Full. An arrival of the lowest priority is refused; mid displaces low2.
	if _, _, err := g.Acquire(context.Background(), "low3", low); refusalCode(err) != CodeQueueFull {
		t.Fatalf("low3: %v", err)
	}
	high1 := start(g, context.Background(), "high1", high)
	a := <-low2 // the newest of the lowest tier
	var r *Refusal
	if !errors.As(a.err, &r) || r.Code != CodeDisplaced || r.RetryAfter != time.Second {
		t.Fatalf("low2: %v", a.err)
	}
	queued(t, g, 3)
	if obs.depth["low"] != 1 || obs.depth["mid"] != 1 || obs.depth["high"] != 1 {
		t.Fatalf("depth %v", obs.depth)
	}
	// The next high arrival displaces low1 (the lowest tier), not the newer mid1.
	high2 := start(g, context.Background(), "high2", high)
	if a := <-low1; refusalCode(a.err) != CodeDisplaced {
		t.Fatalf("low1: %v", a.err)
	}
	queued(t, g, 3)
	high3 := start(g, context.Background(), "high3", high)
	if a := <-mid1; refusalCode(a.err) != CodeDisplaced {
		t.Fatalf("mid1: %v", a.err)
	}
	queued(t, g, 3)
	// Only equals are left: the arrival is refused, nobody is displaced.
	if _, _, err := g.Acquire(context.Background(), "high4", high); refusalCode(err) != CodeQueueFull {
		t.Fatalf("high4: %v", err)
	}
	for _, ch := range []chan acquired{high1, high2, high3} {
		select {
		case a := <-ch:
			t.Fatalf("%s decided: %v", a.name, a.err)
		default:
		}
	}
}

func TestTierShareOfTheQueue(t *testing.T) {
	g := NewGate(GateConfig{Capacity: fixed(1), Queue: 10}, newFakeClock(), nil)
	mustAcquire(t, g, "holder", low)
	capped := Tier{Name: "capped", Queue: 1}
	enqueue(t, g, "c1", capped)
	_, _, err := g.Acquire(context.Background(), "c2", capped)
	if refusalCode(err) != CodeQueueFull {
		t.Fatalf("c2: %v", err)
	}
	enqueue(t, g, "l1", low) // other tiers still have room
}

func TestQueueTimeout(t *testing.T) {
	clk, obs := newFakeClock(), newRec()
	g := NewGate(GateConfig{Capacity: fixed(1)}, clk, obs)
	rel := mustAcquire(t, g, "holder", low)
	tier := Tier{Name: "t", QueueTimeout: 5 * time.Second}
	ch := enqueue(t, g, "a", tier)
	clk.Advance(5*time.Second - time.Nanosecond)
	select {
	case a := <-ch:
		t.Fatalf("refused early: %v", a.err)
	default:
	}
	clk.Advance(time.Nanosecond)
	a := <-ch
	var r *Refusal
	if !errors.As(a.err, &r) || r.Code != CodeQueueTimeout || r.RetryAfter != time.Second || a.waited != 5*time.Second {
		t.Fatalf("got %v after %s", a.err, a.waited)
	}
	if obs.lastDecision() != "a/t/queue_timeout" || obs.depth["t"] != 0 {
		t.Fatalf("decision %q depth %v", obs.lastDecision(), obs.depth)
	}
	rel()
	mustAcquire(t, g, "b", tier)
}

// lateClock is a clock whose timers never fire: an expired request must
// still never be admitted.
type lateClock struct{ *clocktest.Fake }

func (lateClock) AfterFunc(time.Duration, func()) clock.Timer { return clock.Stopped }

func TestExpiredQueuedRequestIsNeverAdmitted(t *testing.T) {
	clk := lateClock{newFakeClock()}
	g := NewGate(GateConfig{Capacity: fixed(1)}, clk, nil)
	rel := mustAcquire(t, g, "holder", low)
	old := enqueue(t, g, "old", Tier{Name: "t", QueueTimeout: time.Second})
	clk.Advance(time.Second)
	// Its timer never fired, but the next look at the queue refuses it.
	fresh := start(g, context.Background(), "fresh", Tier{Name: "t", QueueTimeout: time.Minute})
	if a := <-old; refusalCode(a.err) != CodeQueueTimeout {
		t.Fatalf("old: %v", a.err)
	}
	queued(t, g, 1)
	rel()
	if a := <-fresh; a.err != nil {
		t.Fatalf("fresh: %v", a.err)
	}
}

func TestClientLeavingTheQueueIsRemovedAtOnce(t *testing.T) {
	clk := newFakeClock()
	c, _, _ := newCtl(t, oneTier(Tier{}))
	tk := mustReserve(t, c, Request{Tenant: "a"})
	obs := newRec()
	g := NewGate(GateConfig{Capacity: fixed(1), Controller: c}, clk, obs)
	rel := mustAcquire(t, g, "holder", low)
	ctx, cancel := context.WithCancel(context.Background())
	gone := start(g, ctx, "a", low)
	queued(t, g, 1)
	if v := view(c, "a"); v.Queued != 1 {
		t.Fatalf("controller view %+v", v)
	}
	next := enqueue(t, g, "b", low)
	cancel()
	a := <-gone
	if !errors.Is(a.err, context.Canceled) || a.rel != nil {
		t.Fatalf("got %+v", a)
	}
	queued(t, g, 1)
	if v := view(c, "a"); v.Queued != 0 {
		t.Fatalf("controller view %+v", v)
	}
	if _, funcs := clk.Armed(); funcs != 1 {
		t.Fatalf("%d timers left, want b's only", funcs)
	}
	rel()
	if a := <-next; a.err != nil || a.name != "b" {
		t.Fatalf("next: %+v", a)
	}
	tk.Settle(Usage{}, 0)
	// A context already done is not even queued.
	if _, _, err := g.Acquire(ctx, "a", low); !errors.Is(err, context.Canceled) {
		t.Fatalf("done ctx: %v", err)
	}
}

func TestNoIdleCapacityWhileAnAdmissibleRequestWaits(t *testing.T) {
	var capacity atomic.Int64
	capacity.Store(1)
	g := NewGate(GateConfig{Capacity: func() int { return int(capacity.Load()) }}, newFakeClock(), nil)
	rel := mustAcquire(t, g, "holder", low)
	a := enqueue(t, g, "a", high)
	b := enqueue(t, g, "b", low)
	// Capacity grows (an upstream recovered): asking admits the waiters.
	capacity.Store(4)
	if g.Saturated() {
		t.Fatal("saturated: a and b were not admitted when capacity grew")
	}
	for _, ch := range []chan acquired{a, b} {
		if r := <-ch; r.err != nil {
			t.Fatalf("%s: %v", r.name, r.err)
		} else {
			defer r.rel()
		}
	}
	// A new arrival finds the queue empty and every slot taken: it waits,
	// and the release of any slot admits it.
	capacity.Store(3)
	c := enqueue(t, g, "c", low)
	rel()
	if r := <-c; r.err != nil {
		t.Fatal(r.err)
	} else {
		r.rel()
	}
	// An arrival when capacity grew without anyone asking is admitted
	// directly, ahead of nobody.
	capacity.Store(10)
	mustAcquire(t, g, "d", shed)
}

func TestReleaseRunsOnce(t *testing.T) {
	obs := newRec()
	g := NewGate(GateConfig{Capacity: fixed(2)}, newFakeClock(), obs)
	a := mustAcquire(t, g, "a", low)
	mustAcquire(t, g, "b", low)
	a()
	a()
	a()
	mustAcquire(t, g, "c", low)
	if !g.Saturated() || obs.inflight["low"] != 2 {
		t.Fatalf("a triple release freed more than one slot: inflight %v", obs.inflight)
	}
}

func TestQueuedAdmissionReportsItsWait(t *testing.T) {
	clk, obs := newFakeClock(), newRec()
	g := NewGate(GateConfig{Capacity: fixed(1)}, clk, obs)
	rel := mustAcquire(t, g, "holder", low)
	ch := enqueue(t, g, "a", low)
	clk.Advance(1500 * time.Millisecond)
	rel()
	a := <-ch
	if a.err != nil || a.waited != 1500*time.Millisecond || obs.lastDecision() != "a/low/queued_admitted" {
		t.Fatalf("%+v, decision %q", a, obs.lastDecision())
	}
	if w := obs.waits[len(obs.waits)-1]; w != a.waited {
		t.Fatalf("reported wait %s", w)
	}
}

// TestAcquireSlotAllocatesNothing: a place in a gate with room, taken into
// the caller's own Slot and given back, allocates nothing (Acquire's
// release func costs two allocations).
func TestAcquireSlotAllocatesNothing(t *testing.T) {
	g := NewGate(GateConfig{Capacity: func() int { return 4 }}, newFakeClock(), nil)
	tier := Tier{Name: "std"}
	var slot Slot
	ctx := context.Background()
	if n := testing.AllocsPerRun(1000, func() {
		if _, err := g.AcquireSlot(ctx, "acme", tier, &slot); err != nil {
			t.Fatal(err)
		}
		slot.Release()
		slot.Release() // a second release does nothing
	}); n != 0 {
		t.Fatalf("AcquireSlot + Release allocate %v times, want 0", n)
	}
	if g.Saturated() {
		t.Fatal("slots leaked: the gate is saturated after every release")
	}
}

func TestPoolCapacity(t *testing.T) {
	for _, tc := range []struct{ fixed, per, healthy, want int }{
		{0, 0, 3, 0},  // unlimited
		{8, 0, 3, 8},  // fixed
		{0, 4, 3, 12}, // per upstream
		{0, 4, 0, 4},  // every breaker open: one upstream's worth, never unlimited
	} {
		if got := PoolCapacity(tc.fixed, tc.per, tc.healthy); got != tc.want {
			t.Errorf("PoolCapacity(%d, %d, %d) = %d, want %d", tc.fixed, tc.per, tc.healthy, got, tc.want)
		}
	}
}
