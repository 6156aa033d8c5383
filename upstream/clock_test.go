package upstream

import (
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// loopClock is a fake clock with timers (a proxy.Clock) for the probe and
// scrape loops: time moves only by Advance, which fires the due timers.
// Tests synchronise on the timers armed (awaitArmed): a loop arms its
// next timer once its probe or scrape is done, so no test sleeps.
type loopClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*loopTimer
	armed  chan struct{} // closed and replaced whenever a timer is armed
}

type loopTimer struct {
	c      *loopClock
	ch     chan time.Time // nil for AfterFunc timers
	f      func()
	when   time.Time
	active bool
}

// newLoopClock starts at the wall clock's time (so that helpers mixing it
// with time.Now stay within staleness bounds); only Advance moves it.
func newLoopClock() *loopClock {
	return &loopClock{now: time.Now(), armed: make(chan struct{})}
}

func (c *loopClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *loopClock) NewTimer(d time.Duration) clock.Timer {
	t := &loopTimer{c: c, ch: make(chan time.Time, 1)}
	t.Reset(d)
	return t
}

func (c *loopClock) AfterFunc(d time.Duration, f func()) clock.Timer {
	t := &loopTimer{c: c, f: f}
	t.Reset(d)
	return t
}

func (t *loopTimer) C() <-chan time.Time { return t.ch }

func (t *loopTimer) Stop() bool {
	t.c.mu.Lock()
	defer t.c.mu.Unlock()
	was := t.active
	t.active = false
	return was
}

func (t *loopTimer) Reset(d time.Duration) bool {
	c := t.c
	c.mu.Lock()
	was := t.active
	t.when, t.active = c.now.Add(d), true
	if !slices.Contains(c.timers, t) {
		c.timers = append(c.timers, t)
	}
	close(c.armed)
	c.armed = make(chan struct{})
	c.mu.Unlock()
	return was
}

// Advance moves time on by d and fires every timer due by then.
func (c *loopClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	now := c.now
	var due []*loopTimer
	c.timers = slices.DeleteFunc(c.timers, func(t *loopTimer) bool {
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
			select {
			case t.ch <- now:
			default:
			}
		} else {
			go t.f()
		}
	}
}

// Armed returns the number of timers waiting to fire.
func (c *loopClock) Armed() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, t := range c.timers {
		if t.active {
			n++
		}
	}
	return n
}

// Tickers returns the number of NewTimer timers waiting to fire: a probe
// or scrape loop waiting for its next tick holds one; a probe or scrape
// in flight holds none, only its timeout (an AfterFunc timer).
func (c *loopClock) Tickers() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, t := range c.timers {
		if t.active && t.ch != nil {
			n++
		}
	}
	return n
}

// awaitTickers waits until n NewTimer timers are armed (n scrape loops
// have scraped and wait for their next tick), failing the test after 5s
// of real time.
func (c *loopClock) awaitTickers(t testing.TB, n int) {
	t.Helper()
	settle(t, "scrape loops waiting for their next tick", func() bool { return c.Tickers() >= n })
}

// awaitArmed waits (on the clock's own signal, never a sleep) until n
// timers are armed, failing the test after 5s of real time.
func (c *loopClock) awaitArmed(t testing.TB, n int) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		c.mu.Lock()
		ch := c.armed
		c.mu.Unlock()
		if c.Armed() >= n {
			return
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("%d timers armed after 5s, want %d", c.Armed(), n)
		}
	}
}

// settle waits until cond holds, yielding the processor between looks
// (never sleeping: no time passes on a loopClock meanwhile), failing the
// test after 5s of real time. It is for handoffs between goroutines that
// take no clock time: a loop exiting, a probe's answer landing.
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

// awaitIdle waits until the probe loops of reg are idle: one NewTimer
// timer armed (the loop waits for its next tick, its probe done; a probe
// in flight holds only its timeout, an AfterFunc timer) or no loop
// running.
func (c *loopClock) awaitIdle(t testing.TB, reg *Registry) {
	t.Helper()
	settle(t, "the probe loop neither armed its timer nor stopped", func() bool { return c.Tickers() >= 1 || reg.ProbeLoops() == 0 })
}

// step advances the clock by d (the loop's tick fires) and waits until the
// probe loops are idle again.
func (c *loopClock) step(t testing.TB, reg *Registry, d time.Duration) {
	t.Helper()
	c.awaitIdle(t, reg)
	c.Advance(d)
	c.awaitIdle(t, reg)
}
