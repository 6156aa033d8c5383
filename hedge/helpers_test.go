package hedge_test

import (
	"sync/atomic"
	"time"
)

// t0 is the fake clock's start.
var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// fakeClock is a Clock moved by hand; safe for concurrent use.
type fakeClock struct{ ns atomic.Int64 }

func newClock() *fakeClock { return new(fakeClock) }

func (c *fakeClock) Now() time.Time          { return t0.Add(time.Duration(c.ns.Load())) }
func (c *fakeClock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

// relErr returns |got-want|/want.
func relErr(got, want time.Duration) float64 {
	d := float64(got - want)
	if d < 0 {
		d = -d
	}
	return d / float64(want)
}
