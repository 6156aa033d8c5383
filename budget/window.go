package budget

import (
	"sync/atomic"
	"time"
)

// windowBuckets is the number of buckets in a rolling window: a window of
// 10s is kept as 10 buckets of 1s, so it forgets old events 1s at a time.
const windowBuckets = 10

// MinWindow is the shortest rolling window accepted (buckets of 10ms).
// Shorter windows make no sense for retries and would run the epoch counter
// (below) out within years.
const MinWindow = 100 * time.Millisecond

// A counter word holds a bucket epoch in its high bits and a count in its low
// bits, so that a counter is moved to a new epoch and counted in one
// compare-and-swap, without a lock. 36 bits of epoch at the narrowest bucket
// (10ms) last 21 years of process lifetime; 28 bits of count allow 268
// million events per bucket.
const (
	countBits = 28
	countMask = 1<<countBits - 1
	// countMax leaves headroom below the mask so that adders racing past
	// the saturation check can never carry into the epoch bits. A
	// saturated request counter under-counts, which only lowers capacity.
	countMax = countMask - 1<<20
)

// pack returns the counter word for count n in epoch ep.
func pack(ep, n uint64) uint64 { return ep<<countBits | n }

// unpack splits a counter word.
func unpack(w uint64) (ep, n uint64) { return w >> countBits, w & countMask }

// inWindow reports whether a bucket of epoch e is within the window of
// windowBuckets buckets ending with epoch ep.
func inWindow(e, ep uint64) bool { return e != 0 && e <= ep && e+windowBuckets > ep }

// counter is one atomic (epoch, count) word.
type counter struct{ w atomic.Uint64 }

// add counts one event in epoch ep (ep ≥ 1). Each event is counted exactly
// once, in epoch ep or, if the bucket has already moved on (this caller read
// the clock before another did), in the newer epoch.
func (c *counter) add(ep uint64) {
	for {
		old := c.w.Load()
		oe, n := unpack(old)
		if oe < ep {
			if c.w.CompareAndSwap(old, pack(ep, 1)) {
				return
			}
			continue
		}
		if n < countMax {
			// A reset racing in between moves this event to the
			// newer bucket: still counted once.
			c.w.Add(1)
		}
		return
	}
}

// get returns the count if the counter's epoch is in the window ending at ep.
func (c *counter) get(ep uint64) uint64 {
	e, n := unpack(c.w.Load())
	if inWindow(e, ep) {
		return n
	}
	return 0
}

// clockEpochs maps the times of an injected clock to bucket epochs.
type clockEpochs struct {
	clock Clock
	base  time.Time     // epoch 1 starts here
	width time.Duration // bucket width = window / windowBuckets
	// last caches the latest epoch computed, so that most calls check it
	// with a multiplication instead of dividing.
	last atomic.Uint64
}

func newClockEpochs(clock Clock, window time.Duration) clockEpochs {
	return clockEpochs{clock: clock, base: clock.Now(), width: window / windowBuckets}
}

// now returns the epoch of the clock's current time, starting at 1 (0 marks
// an unused counter). Times before base fall into epoch 1.
func (c *clockEpochs) now() uint64 {
	d := c.clock.Now().Sub(c.base)
	if d < 0 {
		return 1
	}
	ep := c.last.Load()
	if lo := time.Duration(ep-1) * c.width; ep != 0 && d >= lo && d-lo < c.width {
		return ep
	}
	ep = uint64(d/c.width) + 1
	c.last.Store(ep)
	return ep
}

// requestRing counts requests over a rolling window of windowBuckets
// buckets. Safe for concurrent use without a lock.
type requestRing [windowBuckets]counter

func (r *requestRing) add(ep uint64) { r[ep%windowBuckets].add(ep) }

// sum returns the requests in the window ending with epoch ep. Counters
// that move on concurrently are read as 0 or as their newer count; either
// way no request outside the window is included.
func (r *requestRing) sum(ep uint64) uint64 {
	var s uint64
	for i := range r {
		s += r[i].get(ep)
	}
	return s
}
