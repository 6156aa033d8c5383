// Package clocktest is the one fake clock of the project's tests: time
// moves only when a test advances it, and timers fire then, in deadline
// order, so that tests never sleep.
package clocktest

import (
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// Start is the time a Fake made by New(time.Time{}) starts at.
var Start = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// Fake is a clock.Clock moved by hand. Advance fires the timers that fall
// due, each with Now at its own deadline; an AfterFunc callback runs on the
// goroutine that called Advance, so what it causes (a cancelled context, a
// released slot) has happened when Advance returns. Safe for concurrent use.
type Fake struct {
	mu     sync.Mutex
	start  time.Time
	now    time.Time
	timers []*timer
	seq    uint64
	armed  chan struct{} // closed and replaced whenever a timer is armed
}

var _ clock.Clock = (*Fake)(nil)

// New returns a Fake at start (Start when start is zero).
func New(start time.Time) *Fake {
	if start.IsZero() {
		start = Start
	}
	return &Fake{start: start, now: start, armed: make(chan struct{})}
}

type timer struct {
	c      *Fake
	ch     chan time.Time // nil for AfterFunc timers
	f      func()
	d      time.Duration
	when   time.Time
	seq    uint64 // arming order: ties fire in the order they were armed
	active bool
}

// Now returns the fake's current time.
func (c *Fake) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Elapsed returns the time advanced since the fake was made.
func (c *Fake) Elapsed() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now.Sub(c.start)
}

// NewTimer returns a timer that delivers on C once Advance passes d.
func (c *Fake) NewTimer(d time.Duration) clock.Timer {
	t := &timer{c: c, ch: make(chan time.Time, 1)}
	t.Reset(d)
	return t
}

// AfterFunc returns a timer that calls f, inside Advance, once Advance
// passes d.
func (c *Fake) AfterFunc(d time.Duration, f func()) clock.Timer {
	t := &timer{c: c, f: f}
	t.Reset(d)
	return t
}

func (t *timer) C() <-chan time.Time { return t.ch }

func (t *timer) Stop() bool {
	t.c.mu.Lock()
	defer t.c.mu.Unlock()
	was := t.active
	t.active = false
	t.drain()
	return was
}

func (t *timer) Reset(d time.Duration) bool {
	c := t.c
	c.mu.Lock()
	was := t.active
	t.drain()
	c.seq++
	t.d, t.when, t.seq, t.active = d, c.now.Add(d), c.seq, true
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
func (t *timer) drain() {
	if t.ch != nil {
		select {
		case <-t.ch:
		default:
		}
	}
}

// Advance moves the clock on by d and fires the timers that fall due, in
// deadline order (ties in arming order), Now reading each one's deadline
// as it fires; a timer armed by a callback fires too if it falls due by
// then. It returns how many fired.
func (c *Fake) Advance(d time.Duration) int {
	c.mu.Lock()
	end := c.now.Add(d)
	fired := 0
	for {
		var due *timer
		for _, t := range c.timers {
			if t.active && !t.when.After(end) && (due == nil || t.when.Before(due.when) || t.when.Equal(due.when) && t.seq < due.seq) {
				due = t
			}
		}
		if due == nil {
			break
		}
		due.active = false
		if due.when.After(c.now) {
			c.now = due.when
		}
		now := c.now
		c.mu.Unlock()
		if due.f != nil {
			due.f()
		} else {
			select {
			case due.ch <- now:
			default:
			}
		}
		fired++
		c.mu.Lock()
	}
	c.now = end
	c.timers = slices.DeleteFunc(c.timers, func(t *timer) bool { return !t.active })
	c.mu.Unlock()
	return fired
}

// Set moves the clock to start+d (never backwards) and fires what falls
// due, as Advance.
func (c *Fake) Set(d time.Duration) {
	c.Advance(max(0, d-c.Elapsed()))
}

// Armed returns the timers waiting to fire: NewTimer ones (a loop waiting
// for its next tick) and AfterFunc ones (a timeout).
func (c *Fake) Armed() (timers, funcs int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, t := range c.timers {
		switch {
		case !t.active:
		case t.ch != nil:
			timers++
		default:
			funcs++
		}
	}
	return timers, funcs
}

// ArmedFor reports whether a timer of duration d is armed.
func (c *Fake) ArmedFor(d time.Duration) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.ContainsFunc(c.timers, func(t *timer) bool { return t.active && t.d == d })
}

// WaitTimer waits until a timer of duration d is armed: the code under
// test has reached the wait that the test is about to cut short. It fails
// tb after 5 s of real time.
func (c *Fake) WaitTimer(tb testing.TB, d time.Duration) {
	tb.Helper()
	deadline := time.After(5 * time.Second)
	for {
		c.mu.Lock()
		found := slices.ContainsFunc(c.timers, func(t *timer) bool { return t.active && t.d == d })
		armed := c.armed
		c.mu.Unlock()
		if found {
			return
		}
		select {
		case <-armed:
		case <-deadline:
			tb.Fatalf("no %v timer was armed", d)
		}
	}
}

// Settle waits until cond holds, yielding the processor between looks
// (never sleeping: no time passes on a Fake meanwhile); it fails tb with
// what after 5 s of real time.
func Settle(tb testing.TB, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("after 5s: %s", what)
		}
		runtime.Gosched()
	}
}

// Frozen is a clock that always reads the same time and whose timers never
// fire: for benchmarks that measure a primitive's own cost without
// time.Now's, lock-free where Fake takes a mutex.
type Frozen time.Time

var _ clock.Clock = Frozen{}

// Now returns the frozen time.
func (f Frozen) Now() time.Time { return time.Time(f) }

// NewTimer returns a timer that never fires.
func (Frozen) NewTimer(time.Duration) clock.Timer { return clock.Stopped }

// AfterFunc returns a timer that never fires.
func (Frozen) AfterFunc(time.Duration, func()) clock.Timer { return clock.Stopped }
