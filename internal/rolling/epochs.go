package rolling

import (
	"sync/atomic"
	"time"
)

// MinWidth is the narrowest bucket: NewEpochs stretches a window shorter
// than Buckets × MinWidth (10ms) to that. Narrower buckets are of no use to
// any caller and would run the epochs out (MaxEpoch) sooner: 2^36 buckets of
// 1µs last 19 hours.
const MinWidth = time.Millisecond

// Epochs maps times to bucket epochs: the bucket of width Width that holds
// t, counting from 1 for [base, base+width). Times before base fall into
// epoch 1. Epochs end at MaxEpoch: from base + (MaxEpoch−1) × Width on (2.2
// years at MinWidth, see CountBits) every time maps to MaxEpoch, so that a
// window stops forgetting (and counts up to CountMax) rather than wrapping
// around into epochs its counters read as stale.
//
// It caches the last epoch computed, so that most calls cost one atomic
// load and a multiplication rather than a division; the cache is written
// about once per bucket width, so a caller whose counters are written on
// every event keeps them on other cache lines. Safe for concurrent use;
// must not be copied after first use. Build it with NewEpochs.
type Epochs struct {
	base  time.Time     // epoch 1 starts here
	width time.Duration // bucket width: window / Buckets, at least MinWidth
	last  atomic.Uint64 // latest epoch computed; 0 before the first
}

// NewEpochs returns the epochs of a rolling window of length window (split
// into Buckets buckets of window/Buckets, rounded down to the nanosecond,
// and at least MinWidth) whose first bucket starts at base.
func NewEpochs(base time.Time, window time.Duration) Epochs {
	return Epochs{base: base, width: max(window/Buckets, MinWidth)}
}

// Width returns the bucket width: window/Buckets, at least MinWidth. The
// window actually kept is Buckets × Width.
func (e *Epochs) Width() time.Duration { return e.width }

// Base returns the time at which epoch 1 starts.
func (e *Epochs) Base() time.Time { return e.base }

// Epoch returns the bucket epoch of t, in [1, MaxEpoch]: 1 for t before
// base + Width (including times before base), MaxEpoch from base +
// (MaxEpoch−1) × Width on. No lock, no allocation.
func (e *Epochs) Epoch(t time.Time) uint64 {
	d := t.Sub(e.base)
	if d < 0 {
		return 1
	}
	ep := e.last.Load()
	if lo := time.Duration(ep-1) * e.width; ep != 0 && d >= lo && d-lo < e.width {
		return ep
	}
	return e.slow(d)
}

// slow computes the epoch of an offset d ≥ 0 from base and caches it. Kept
// apart so that Epoch stays small enough to inline.
func (e *Epochs) slow(d time.Duration) uint64 {
	ep := min(uint64(d/e.width)+1, MaxEpoch)
	e.last.Store(ep)
	return ep
}
