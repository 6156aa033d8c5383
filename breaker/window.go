package breaker

import (
	"sync/atomic"
	"time"
)

// windowBuckets is the number of buckets in a rolling window: a window of
// 30s is kept as 10 buckets of 3s, so it forgets old calls 3s at a time.
const windowBuckets = 10

// A counter word holds a bucket epoch in its high bits and a count in its low
// bits, so that a counter is advanced to a new epoch and counted in one
// compare-and-swap, without a lock.
const (
	countBits = 24
	countMask = 1<<countBits - 1
	// countMax leaves headroom below the mask so that adders racing past
	// the saturation check can never carry into the epoch bits.
	countMax = countMask - 1<<16
)

// counter is one atomic (epoch, count) word.
type counter struct{ w atomic.Uint64 }

// add counts one event in epoch ep (ep ≥ 1).
func (c *counter) add(ep uint64) {
	for {
		old := c.w.Load()
		switch oe := old >> countBits; {
		case oe == ep:
			if old&countMask < countMax {
				// A reset racing in between moves this event to the
				// newer bucket, one bucket late: harmless.
				c.w.Add(1)
			}
			return
		case oe < ep:
			if c.w.CompareAndSwap(old, ep<<countBits|1) {
				return
			}
		default:
			// The bucket already moved on (this caller read the clock
			// before another did): count the event in the newer bucket.
			if old&countMask < countMax {
				c.w.Add(1)
			}
			return
		}
	}
}

// get returns the count if the counter is in an epoch within (ep-n, ep].
func (c *counter) get(ep uint64) int {
	w := c.w.Load()
	if oe := w >> countBits; oe <= ep && oe+windowBuckets > ep {
		return int(w & countMask)
	}
	return 0
}

// bucket is one slice of a window. Each counter carries its own epoch.
type bucket struct {
	requests, failures, slow counter
}

// window is a rolling window of windowBuckets buckets advanced by the times
// given to it; it has no timer. Safe for concurrent use without a lock.
type window struct {
	base  time.Time     // epoch 1 starts here
	width time.Duration // bucket width = window / windowBuckets
	// last caches the latest epoch computed, so that most calls check it
	// with a multiplication instead of dividing. Read by every call and
	// written once per bucket width, it sits apart from the counters.
	last    atomic.Uint64
	_       [56]byte
	buckets [windowBuckets]bucket
}

func newWindow(base time.Time, d time.Duration) *window {
	// Buckets narrower than a millisecond are not useful and would run the
	// 40-bit epoch out within days.
	return &window{base: base, width: max(d/windowBuckets, time.Millisecond)}
}

// epoch returns the bucket epoch of t, starting at 1 (0 marks an unused
// counter). Times before base fall into epoch 1.
func (w *window) epoch(t time.Time) uint64 {
	d := t.Sub(w.base)
	if d < 0 {
		return 1
	}
	ep := w.last.Load()
	if lo := time.Duration(ep-1) * w.width; ep != 0 && d >= lo && d-lo < w.width {
		return ep
	}
	ep = uint64(d/w.width) + 1
	w.last.Store(ep)
	return ep
}

func (w *window) bucket(ep uint64) *bucket { return &w.buckets[ep%windowBuckets] }

// record counts a call at t: a request, and a failure and/or slow call.
func (w *window) record(t time.Time, failure, slow bool) {
	ep := w.epoch(t)
	b := w.bucket(ep)
	b.requests.add(ep)
	if failure {
		b.failures.add(ep)
	}
	if slow {
		b.slow.add(ep)
	}
}

// counts are the sums over a window.
type counts struct{ requests, failures, slow int }

// sum returns the counts of the window ending at t.
func (w *window) sum(t time.Time) counts {
	ep := w.epoch(t)
	var c counts
	for i := range w.buckets {
		b := &w.buckets[i]
		c.requests += b.requests.get(ep)
		c.failures += b.failures.get(ep)
		c.slow += b.slow.get(ep)
	}
	return c
}
