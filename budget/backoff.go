package budget

import (
	"math/rand/v2"
	"time"
)

// Defaults of Backoff.
const (
	// DefaultBackoffBase is the ceiling of the first retry's delay: 100ms.
	DefaultBackoffBase = 100 * time.Millisecond
	// DefaultBackoffCap is the largest ceiling of any delay: 2s.
	DefaultBackoffCap = 2 * time.Second
)

// NoDeadline, passed as Delay's remaining, means the request has no
// deadline.
const NoDeadline time.Duration = 0

// Backoff computes retry delays with full jitter, as in Marc Brooker,
// "Exponential Backoff and Jitter", AWS Architecture Blog, 2015: the delay
// before retry number attempt (0 for the first retry) is drawn uniformly from
//
//	[0, min(Cap, Base × 2^attempt)]
//
// Full jitter spreads the retries of requests that failed together, so they
// do not arrive together again, and of the jitter schemes in that article it
// does the least work for the same completion time. The zero Backoff is
// useful: Base 100ms, Cap 2s, math/rand/v2.
type Backoff struct {
	// Base is the ceiling of the first retry's delay; it doubles with each
	// retry. Zero or negative: DefaultBackoffBase (100ms).
	Base time.Duration
	// Cap bounds the ceiling whatever the attempt. Zero or negative:
	// DefaultBackoffCap (2s). A Cap below Base makes every ceiling Cap.
	Cap time.Duration
	// Rand returns a number in [0, 1); tests inject it for deterministic
	// delays. Values outside [0, 1] (and NaN) are clamped into it. Nil:
	// math/rand/v2's Float64, safe for concurrent use and allocation-free.
	Rand func() float64
}

// Delay returns how long to wait before retry number attempt (0 for the
// first retry; negative counts as 0), and whether to retry at all.
//
// remaining is what is left of the request's deadline: NoDeadline (0) for
// none. Pass it less whatever an attempt needs at the least, since a delay
// may use all of it. A negative remaining means the deadline has passed:
// the answer is (0, false).
//
// Without a Retry-After (retryAfter ≤ 0) the delay is drawn from
// [0, min(Cap, Base × 2^attempt, remaining)], so it never exceeds the
// deadline, and ok is true.
//
// With a Retry-After (retryAfter > 0, clamped to MaxRetryAfter) the upstream
// has asked for a minimum: the delay is max(retryAfter, jittered draw), at
// least retryAfter and still jittered so that the requests it turned away do
// not all return at the same instant. If retryAfter does not fit in
// remaining, Delay returns (retryAfter, false): the caller returns the
// 429/503 at once, with the returned value as its Retry-After, instead of
// sleeping through the deadline.
func (b Backoff) Delay(attempt int, retryAfter, remaining time.Duration) (d time.Duration, ok bool) {
	if remaining < 0 {
		return 0, false
	}
	retryAfter = min(retryAfter, MaxRetryAfter)
	if retryAfter > 0 && remaining > 0 && retryAfter > remaining {
		return retryAfter, false
	}
	ceil := b.Ceiling(attempt)
	if remaining > 0 {
		ceil = min(ceil, remaining)
	}
	return max(retryAfter, b.jitter(ceil)), true
}

// Ceiling returns min(Cap, Base × 2^attempt), the largest delay Delay may
// draw for retry number attempt without a Retry-After or a deadline. It
// does not overflow, however large attempt is.
func (b Backoff) Ceiling(attempt int) time.Duration {
	base, cp := b.Base, b.Cap
	if base <= 0 {
		base = DefaultBackoffBase
	}
	if cp <= 0 {
		cp = DefaultBackoffCap
	}
	attempt = max(attempt, 0)
	// base × 2^attempt ≤ cp exactly when base ≤ ⌊cp / 2^attempt⌋.
	if attempt >= 63 || base > cp>>attempt {
		return cp
	}
	return base << attempt
}

// jitter returns a uniform draw from [0, ceil].
func (b Backoff) jitter(ceil time.Duration) time.Duration {
	r := rand.Float64
	if b.Rand != nil {
		r = b.Rand
	}
	x := r()
	switch {
	case !(x > 0): // also NaN
		return 0
	case x >= 1:
		return ceil
	}
	f := x * float64(ceil)
	if f >= float64(ceil) { // rounding near 2^63 could overflow
		return ceil
	}
	return time.Duration(f)
}
