package saturation

import (
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"
)

// fakeClock is a Clock whose time moves only by Advance, which fires the
// timers due by then (a copy of upstream's loopClock). Tests synchronise
// on the timers armed (settle), never on sleeps.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer
}

type fakeTimer struct {
	c      *fakeClock
	ch     chan time.Time // nil for AfterFunc timers
	f      func()
	when   time.Time
	active bool
}

func newFakeClock() *fakeClock { return &fakeClock{now: time.Unix(1_800_000_000, 0)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) NewTimer(d time.Duration) Timer {
	return c.arm(&fakeTimer{c: c, ch: make(chan time.Time, 1)}, d)
}

func (c *fakeClock) AfterFunc(d time.Duration, f func()) Timer {
	return c.arm(&fakeTimer{c: c, f: f}, d)
}

func (c *fakeClock) arm(t *fakeTimer, d time.Duration) *fakeTimer {
	c.mu.Lock()
	defer c.mu.Unlock()
	t.when, t.active = c.now.Add(d), true
	c.timers = append(c.timers, t)
	return t
}

func (t *fakeTimer) C() <-chan time.Time { return t.ch }

func (t *fakeTimer) Stop() bool {
	t.c.mu.Lock()
	defer t.c.mu.Unlock()
	was := t.active
	t.active = false
	return was
}

// Advance moves time on by d and fires every timer due by then.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	now := c.now
	var due []*fakeTimer
	c.timers = slices.DeleteFunc(c.timers, func(t *fakeTimer) bool {
		if t.active && !t.when.After(now) {
			t.active = false
			due = append(due, t)
			return true
		}
		return !t.active
	})
	c.mu.Unlock()
	for _, t := range due {
		if t.ch != nil {
			t.ch <- now
		} else {
			go t.f()
		}
	}
}

// armed returns the NewTimer timers (a loop waiting for its next tick)
// and the AfterFunc timers (a scrape's timeout) waiting to fire.
func (c *fakeClock) armed() (tickers, timeouts int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, t := range c.timers {
		switch {
		case !t.active:
		case t.ch != nil:
			tickers++
		default:
			timeouts++
		}
	}
	return tickers, timeouts
}

// settle waits until cond holds, yielding the processor between looks
// (never sleeping: no time passes on a fakeClock meanwhile), failing the
// test after 5s of real time.
func settle(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after 5s: %s", what)
		}
		runtime.Gosched()
	}
}
