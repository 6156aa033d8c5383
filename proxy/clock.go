package proxy

import "time"

// Clock is the lifecycle's source of time: request and attempt start times,
// and the timers behind first_byte_timeout, stream_idle_timeout,
// stream_timeout, the hedge delay, backoff sleeps and the drain of a
// finished stream. Tests pass a fake so that they do not sleep.
// Implementations must be safe for concurrent use.
type Clock interface {
	// Now returns the current time.
	Now() time.Time
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

// realClock is the Clock of package time.
type realClock struct{}

func (realClock) Now() time.Time                 { return time.Now() }
func (realClock) NewTimer(d time.Duration) Timer { return realTimer{time.NewTimer(d)} }
func (realClock) AfterFunc(d time.Duration, f func()) Timer {
	return realTimer{time.AfterFunc(d, f)}
}

// realTimer is one pointer wide, so converting it to Timer does not allocate.
// stoppedTimer is a Timer that has fired or been stopped: what an attempt
// keeps in place of its first-byte timer once it has committed.
type stoppedTimer struct{}

func (stoppedTimer) C() <-chan time.Time      { return nil }
func (stoppedTimer) Stop() bool               { return false }
func (stoppedTimer) Reset(time.Duration) bool { return false }

type realTimer struct{ t *time.Timer }

func (t realTimer) C() <-chan time.Time        { return t.t.C }
func (t realTimer) Stop() bool                 { return t.t.Stop() }
func (t realTimer) Reset(d time.Duration) bool { return t.t.Reset(d) }
