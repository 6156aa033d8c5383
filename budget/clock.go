package budget

import "time"

// Clock is the budgets' source of time. It is injected so that tests move
// time by hand and never sleep.
type Clock interface {
	// Now returns the current time. Budgets compare the times it returns
	// with one another only, so a clock need not follow the wall clock.
	// A clock that steps backwards never makes a budget grant more.
	Now() time.Time
}

// SystemClock is the real clock: time.Now, with its monotonic reading.
type SystemClock struct{}

// Now returns time.Now().
func (SystemClock) Now() time.Time { return time.Now() }
