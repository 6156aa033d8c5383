// Package clock is the one source of time for every package that reads
// time or waits: the breakers, budgets, hedging, admission, saturation
// scrapes, the upstream registry's loops and the request lifecycle. Each
// takes a Clock so that its tests move time by hand (clocktest.Fake) and
// never sleep.
package clock

import "time"

// Reader is the part of a Clock that reads the time: what the primitives
// that never wait (breaker windows, retry budgets, hedge statistics)
// take, so that a caller may hand them any source of time. Times are only
// compared with one another, so a clock need not follow the wall clock.
type Reader interface {
	// Now returns the current time.
	Now() time.Time
}

// Clock reads the time and makes timers: what the code that waits takes
// (timeouts, queues, probe and scrape loops). Implementations are safe for
// concurrent use.
type Clock interface {
	Reader
	// NewTimer returns a timer that sends the time on its C channel once
	// d has passed, as time.NewTimer.
	NewTimer(d time.Duration) Timer
	// AfterFunc returns a timer that calls f in its own goroutine once d
	// has passed, as time.AfterFunc; its C is nil.
	AfterFunc(d time.Duration, f func()) Timer
}

// Timer is a timer made by a Clock, with the semantics of time.Timer since
// Go 1.23: after Stop or Reset returns, no stale value is received from C.
type Timer interface {
	// C is the channel on which a NewTimer timer delivers; nil for an
	// AfterFunc timer.
	C() <-chan time.Time
	// Stop prevents the timer from firing; it reports whether it did
	// (false when the timer had already fired or been stopped).
	Stop() bool
	// Reset changes the timer to fire after d; it reports whether the
	// timer had been active.
	Reset(d time.Duration) bool
}

// Real is the clock of package time, with its monotonic readings.
var Real Clock = realClock{}

// Or returns c, or Real when c is nil: the default of every constructor
// that takes a Clock.
func Or(c Clock) Clock {
	if c == nil {
		return Real
	}
	return c
}

type realClock struct{}

func (realClock) Now() time.Time                 { return time.Now() }
func (realClock) NewTimer(d time.Duration) Timer { return realTimer{time.NewTimer(d)} }
func (realClock) AfterFunc(d time.Duration, f func()) Timer {
	return realTimer{time.AfterFunc(d, f)}
}

// realTimer is one pointer wide, so converting it to Timer does not
// allocate.
type realTimer struct{ t *time.Timer }

func (t realTimer) C() <-chan time.Time        { return t.t.C }
func (t realTimer) Stop() bool                 { return t.t.Stop() }
func (t realTimer) Reset(d time.Duration) bool { return t.t.Reset(d) }

// Stopped is a Timer that has fired or been stopped and never fires: a
// placeholder for a timer that is no longer needed. Its C is nil.
var Stopped Timer = stoppedTimer{}

type stoppedTimer struct{}

func (stoppedTimer) C() <-chan time.Time      { return nil }
func (stoppedTimer) Stop() bool               { return false }
func (stoppedTimer) Reset(time.Duration) bool { return false }
