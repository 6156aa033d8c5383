package hedge

import "time"

// Clock is the package's source of time, injected so that tests move time by
// hand and never sleep.
type Clock interface {
	// Now returns the current time. Times are only compared with one
	// another, so a clock need not follow the wall clock.
	Now() time.Time
}

// SystemClock is the real clock: time.Now, with its monotonic reading. It is
// the default wherever a nil Clock is given.
type SystemClock struct{}

// Now returns time.Now().
func (SystemClock) Now() time.Time { return time.Now() }
