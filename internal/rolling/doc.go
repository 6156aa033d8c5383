// Package rolling is the lock-free rolling-window counter shared by the
// circuit breakers (breaker), the retry budgets (budget) and the hedge-rate
// cap (hedge).
//
// A rolling window of length W is kept as Buckets (10) buckets of W/10 each,
// aligned to a base time and advanced lazily by the times given to it: there
// is no timer and no goroutine. At any time the window covers the current
// bucket and the nine before it, that is between 0.9 W and W of history, and
// forgets W/10 at a time.
//
// The pieces:
//
//   - Epochs maps a time to its bucket epoch: 1 for the first bucket after
//     the base time, 2 for the next, and so on (0 marks an unused counter).
//     Most calls hit a cached last epoch and pay one atomic load and a
//     multiplication instead of a division.
//   - Counter is one atomic word packing an epoch (high EpochBits bits) with
//     a count (low CountBits bits), so that moving a bucket to a new epoch
//     and counting in it is one compare-and-swap, without a lock.
//   - Ring is Buckets counters indexed by epoch modulo Buckets, summed over
//     the window.
//
// Pack, Unpack, InWindow and CountMax let callers build their own words on
// the same layout (budget's retry charge, for instance).
//
// What sits on top (a breaker's request, failure and slow counts and its trip
// rules; a budget's retry accounting; the hedge cap's mutex-guarded hedge
// buckets) belongs to those packages. This package imports only the standard
// library and allocates nothing after construction.
package rolling
