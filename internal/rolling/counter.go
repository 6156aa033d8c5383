package rolling

import "sync/atomic"

// Buckets is the number of buckets in a rolling window: a 10s window is kept
// as 10 buckets of 1s and forgets its oldest second at a time.
const Buckets = 10

// A counter word holds a bucket epoch in its high EpochBits bits and a count
// in its low CountBits bits.
//
// Why 28 bits of count: it is the widest need of the three users. The
// budgets count requests and retries per bucket for windows of any length; a
// 10s window (1s buckets) saturates at CountMax, 267 million events a second,
// and a 1h window (6min buckets) at 742 thousand a second. Breakers and the
// hedge cap used 24 bits; 28 only widens them.
//
// Why that leaves enough epoch: the remaining 36 bits number 2^36 ≈ 6.9·10^10
// buckets from the base time. At the narrowest bucket any user allows,
// MinWidth (1ms; a breaker window below 10ms is stretched to that), that is
// 795 days (2.2 years) after the base time; at a budget's narrowest (10ms
// buckets, a 100ms window) 21.8 years; at the default 10s windows 2,177
// years. Epochs stops at MaxEpoch instead of wrapping (see Epochs.Epoch).
const (
	// CountBits is the width of a word's count, in bits.
	CountBits = 28
	// EpochBits is the width of a word's epoch, in bits: 64 − CountBits.
	EpochBits = 64 - CountBits
	// CountMask masks a word's count: 2^28 − 1.
	CountMask = 1<<CountBits - 1
	// CountMax is the largest count a Counter reaches: 2^28 − 1 − 2^20
	// (267,386,879). It leaves 2^20 of headroom below CountMask so that
	// adders racing past the saturation check can never carry into the
	// epoch bits (that would take more than a million goroutines between
	// one check and its add). A saturated counter under-counts.
	CountMax = CountMask - 1<<20
	// MaxEpoch is the largest epoch a word holds: 2^36 − 1.
	MaxEpoch = 1<<EpochBits - 1
)

// Pack returns the counter word for count n (at most CountMask) in epoch ep
// (at most MaxEpoch).
func Pack(ep, n uint64) uint64 { return ep<<CountBits | n }

// Unpack splits a counter word into its epoch and its count.
func Unpack(w uint64) (ep, n uint64) { return w >> CountBits, w & CountMask }

// InWindow reports whether a bucket of epoch e lies within the window of
// Buckets buckets ending with epoch ep, that is e in (ep−Buckets, ep]. Epoch
// 0 (an unused word) is never in a window.
func InWindow(e, ep uint64) bool { return e != 0 && e <= ep && e+Buckets > ep }

// Counter is one bucket's count of events, as one atomic (epoch, count)
// word: the count belongs to the word's epoch and is read as 0 once that
// epoch has left the window. The zero value is an empty counter. Safe for
// concurrent use; it must not be copied after first use.
type Counter struct{ w atomic.Uint64 }

// Add counts one event in epoch ep (1 ≤ ep ≤ MaxEpoch). Each event is
// counted exactly once, until the count reaches CountMax: in epoch ep, or,
// if the counter has already moved on to a newer epoch (this caller read the
// clock before another did), in that newer epoch. A counter holding an older
// epoch is reset to a count of 1 in ep. No lock, no allocation: one atomic
// add, or one compare-and-swap when the epoch changes.
func (c *Counter) Add(ep uint64) {
	for {
		old := c.w.Load()
		oe, n := Unpack(old)
		if oe < ep {
			if c.w.CompareAndSwap(old, Pack(ep, 1)) {
				return
			}
			continue
		}
		if n < CountMax {
			// A reset racing in between moves this event to the
			// newer epoch: still counted once.
			c.w.Add(1)
		}
		return
	}
}

// Get returns the count, in [0, CountMax], if the counter's epoch is within
// the window ending with epoch ep (see InWindow), and 0 otherwise.
func (c *Counter) Get(ep uint64) uint64 {
	e, n := Unpack(c.w.Load())
	if InWindow(e, ep) {
		// Adders racing past the saturation check may each add one more
		// (the headroom keeps them out of the epoch bits).
		return min(n, CountMax)
	}
	return 0
}

// Load returns the counter's word, for Unpack.
func (c *Counter) Load() uint64 { return c.w.Load() }

// Ring is a rolling window of Buckets counters: the counter of epoch ep is
// ring[ep%Buckets]. The zero value is an empty ring. Safe for concurrent
// use without a lock; it must not be copied after first use.
type Ring [Buckets]Counter

// Add counts one event in epoch ep (1 ≤ ep ≤ MaxEpoch); see Counter.Add.
func (r *Ring) Add(ep uint64) { r[ep%Buckets].Add(ep) }

// Sum returns the events counted in the window ending with epoch ep, in
// [0, Buckets × CountMax]. Counters that move on concurrently are read as 0
// or as their newer count; either way no event outside the window is
// included.
func (r *Ring) Sum(ep uint64) uint64 {
	var s uint64
	for i := range r {
		s += r[i].Get(ep)
	}
	return s
}
