// Package budget holds the retry arithmetic of the gateway: how many retries
// it may schedule (a retry budget), how long it waits before each one
// (full-jitter backoff) and what an upstream's Retry-After asks for. Pure Go:
// no net/http, no Caddy, no goroutines; time comes from an injected Clock so
// that tests never sleep.
//
// # Budgets
//
// A [Budget] decides whether a retry may be scheduled. Retries and hedges
// (backup requests) draw from the same budget, so together they stay within
// its bound. Two forms exist:
//
//   - [Ratio], the default: retries may be up to a share of the original
//     requests seen over a rolling window, plus a small floor per second so
//     that a quiet service can still retry (a bucket of one second of it,
//     so a burst never spends more than a second's floor at once). Whatever the failure rate, the
//     load sent upstream stays below (1 + ratio) × the offered load plus the
//     floor, where unbounded retries would send λ/(1−f) at failure rate f.
//   - [Bucket], a token bucket refilled with time, for operators who prefer
//     a fixed burst and rate independent of traffic.
//
// Both are safe for concurrent use, lock-free and allocation-free, and both
// charge a retry when it is granted (scheduled), not when it runs: a retry
// waiting out its backoff already counts, so a burst of failures cannot
// over-draw the budget while its retries sleep.
//
// # Backoff
//
// [Backoff] draws delays with full jitter and bounds them by the request's
// remaining deadline and by an upstream's Retry-After; [ParseRetryAfter]
// reads that header.
package budget
