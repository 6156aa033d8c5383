package proxy

import (
	"slices"
	"sync"
	"testing"
	"time"
)

// fakeClock is a Clock that moves only when a test advances it. AfterFunc
// callbacks run synchronously inside Advance, so that what they cause
// (a cancelled context) has happened when Advance returns.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer
	armed  chan struct{} // closed and replaced whenever a timer is armed
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC), armed: make(chan struct{})}
}

type fakeTimer struct {
	c      *fakeClock
	ch     chan time.Time // nil for AfterFunc timers
	f      func()
	d      time.Duration
	when   time.Time
	active bool
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) NewTimer(d time.Duration) Timer {
	t := &fakeTimer{c: c, ch: make(chan time.Time, 1)}
	t.Reset(d)
	return t
}

func (c *fakeClock) AfterFunc(d time.Duration, f func()) Timer {
	t := &fakeTimer{c: c, f: f}
	t.Reset(d)
	return t
}

func (t *fakeTimer) C() <-chan time.Time { return t.ch }

func (t *fakeTimer) Stop() bool {
	t.c.mu.Lock()
	defer t.c.mu.Unlock()
	was := t.active
	t.active = false
	t.drain()
	return was
}

func (t *fakeTimer) Reset(d time.Duration) bool {
	c := t.c
	c.mu.Lock()
	was := t.active
	t.drain()
	t.d, t.when, t.active = d, c.now.Add(d), true
	if !slices.Contains(c.timers, t) {
		c.timers = append(c.timers, t)
	}
	close(c.armed)
	c.armed = make(chan struct{})
	c.mu.Unlock()
	if d <= 0 {
		c.Advance(0)
	}
	return was
}

// drain drops a value not yet received, as time.Timer does since Go 1.23.
func (t *fakeTimer) drain() {
	if t.ch != nil {
		select {
		case <-t.ch:
		default:
		}
	}
}

// Advance moves the clock by d and fires the timers that fall due, in
// deadline order. It returns how many fired.
func (c *fakeClock) Advance(d time.Duration) int {
	c.mu.Lock()
	c.now = c.now.Add(d)
	var due []*fakeTimer
	for _, t := range c.timers {
		if t.active && !t.when.After(c.now) {
			t.active = false
			due = append(due, t)
		}
	}
	c.timers = slices.DeleteFunc(c.timers, func(t *fakeTimer) bool { return !t.active })
	now := c.now
	c.mu.Unlock()
	slices.SortStableFunc(due, func(a, b *fakeTimer) int { return a.when.Compare(b.when) })
	for _, t := range due {
		if t.f != nil {
			t.f()
		} else {
			select {
			case t.ch <- now:
			default:
			}
		}
	}
	return len(due)
}

// waitTimer waits until a timer of duration d is armed: the code under test
// has reached the wait that the test is about to cut short.
func (c *fakeClock) waitTimer(t *testing.T, d time.Duration) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		c.mu.Lock()
		found := slices.ContainsFunc(c.timers, func(ft *fakeTimer) bool { return ft.active && ft.d == d })
		armed := c.armed
		c.mu.Unlock()
		if found {
			return
		}
		select {
		case <-armed:
		case <-deadline:
			t.Fatalf("no %v timer was armed", d)
		}
	}
}

func TestFakeClockFiresInOrderAndResetDropsStaleValues(t *testing.T) {
	c := newFakeClock()
	var order []int
	c.AfterFunc(2*time.Second, func() { order = append(order, 2) })
	c.AfterFunc(time.Second, func() { order = append(order, 1) })
	tm := c.NewTimer(time.Second)
	if n := c.Advance(3 * time.Second); n != 3 || !slices.Equal(order, []int{1, 2}) {
		t.Fatalf("fired %d, order %v", n, order)
	}
	tm.Reset(time.Second)
	select {
	case <-tm.C():
		t.Fatal("a stale value survived Reset")
	default:
	}
	if tm.Stop() != true || tm.Stop() != false {
		t.Fatal("Stop must report whether the timer was active")
	}
}
