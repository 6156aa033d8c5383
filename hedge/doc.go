// Package hedge holds the policy half of hedged requests: when a backup
// attempt may start and how many may start. The race itself (starting the
// backup on another upstream, committing the first attempt to produce its
// first SSE data event, cancelling the losers through their own contexts)
// lives in the gateway's attempt loop.
//
// Hedging follows Dean and Barroso, "The Tail at Scale", Communications of
// the ACM 56(2), 2013: send a backup request once the first one has been
// outstanding longer than the 95th percentile of recent latency, which cut
// their p99.9 from 1,800 ms to 74 ms for about 2% more requests. Here the
// latency is time to first token (TTFT), tracked per pool and model:
//
//   - LatencyTracker is a time-decayed histogram of observed TTFTs that
//     answers percentile queries (relative error ≤ 5%, half-life 60s by
//     default);
//   - DelayPolicy turns it into a hedge delay, fixed (`after 300ms`) or a
//     percentile clamped to bounds (`after p95 min 100ms max 2s`), parsed
//     from the Caddyfile by ParseAfter;
//   - RateCap bounds the share of requests that may hedge over a rolling
//     window (10% over 10s by default) plus a floor (1 hedge a second by
//     default, for pools with little traffic), so that hedging never adds
//     more load than that, whatever the fleet does.
//
// A typical request, in the gateway:
//
//	cap.Request()
//	delay := policy.Delay(tracker) // start the hedge timer
//	// ... when it fires before the first event, and the next candidate's
//	// breaker is closed:
//	if cap.TryHedge() { /* start the backup */ }
//	// ... on commit:
//	tracker.Observe(ttftOfTheWinner)
//
// Everything here is pure Go with an injected Clock: no goroutines, no
// timers, no I/O. Observe, Quantile, Request and TryHedge allocate nothing
// and are safe for concurrent use.
package hedge
