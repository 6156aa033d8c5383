// Package breaker is the gateway's circuit breaker: one state machine per key
// (an upstream's dial address, optionally with the model), that stops sending
// traffic to an upstream which is down or degraded and lets it back in through
// a few probe requests once it may have recovered.
//
// The states and their vocabulary follow the usual breakers (Michael Nygard's
// Release It!, sony/gobreaker, resilience4j, failsafe-go):
//
//	Closed   --trip rule fires-------------------------->  Open
//	Open     --cooldown (OpenFor, grown) and MinOpen over->  HalfOpen (one caller gets the probe permit)
//	HalfOpen --RecoverySuccesses probe successes--------->  Closed
//	HalfOpen --a probe fails, is slow or times out------->  Open (cooldown ×2)
//
// Evidence (DESIGN §4). A breaker opens on hard evidence that its upstream
// is down or hanging (a run of Down outcomes with no sign of life between
// them, failures with no success in the window, a failed synthetic probe,
// Retry-After, an operator) or on statistical evidence that it fails more
// than it should (its own ratio rules, or, with WithOutlierDetector, its
// pool's outlier detector, which applies those rules and its own and opens
// it through Eject). Evidence says which; a pool routes over statistically held
// upstreams when too few remain (the panic rule, in upstream/). In
// HalfOpen a probe the upstream answered with an error is tolerated while
// the failures stay within what its pool's failure ratio (SetPeerRatio)
// explains, so that under uniform failure recovery does not flap.
//
// A breaker trips in one of two ways, into the same state machine (the same
// cooldown, max(OpenFor × 2^reopens capped by MaxOpen, MinOpen), jittered
// upward):
//
//   - On errors, seen in user traffic: the trip rules of Settings, which are
//     consecutive failures, N failures within a duration, failure ratio over a
//     rolling window, and slow calls (a successful call whose time to first
//     token exceeds SlowTTFT counts as a failure; SlowRatio is a separate
//     ratio rule for slow calls alone). A Retry-After (ExtendOpen) and an
//     operator (ForceOpen) open it the same way. It recovers by probes: once
//     the cooldown is over, a few calls (user requests, or with
//     ActiveProbing the gateway's synthetic probes) decide between Closed and
//     Open.
//   - On a signal observed outside user traffic (TripObserved): the gateway
//     scrapes an inference server's /metrics and sees queue-wait p99 or
//     KV-cache usage above a threshold for a sustained time. Such a server
//     answers a /health probe, and even a small request, fine; so this trip
//     recovers by observation alone (Observe). No call is let through,
//     neither user request nor synthetic probe: Allow and AllowProbe
//     refuse, ProbeDue is false, RetryAt is never zero.
//
// An observed trip moves on observations:
//
//	Closed   --TripObserved------------------------------>  Open (observed)
//	Open     --Observe after the cooldown and MinOpen----->  HalfOpen (observed), then as below
//	HalfOpen --RecoverySuccesses ObservedHealthy---------->  Closed
//	HalfOpen --ObservedUnhealthy, or TripObserved--------->  Open (observed, cooldown ×2)
//
// ObservedUnknown (no usable signal: a failed scrape, a stale metric) starts
// the run of healthy observations again and never re-opens. Closing,
// ForceOpen, ForceClose and Reset clear the observed mark; a Retry-After on
// an observed breaker moves its cooldown end out and leaves it observed.
// TripObserved leaves a breaker open for errors alone (it refuses already,
// and keeps its own recovery) and turns a half-open one into an observed
// open.
//
// Recording is explicit. The caller asks for a Permit with Allow, runs the
// attempt, and reports the outcome with Permit.Done: Success (with its TTFT),
// Failure, or Neutral for attempts that say nothing about the upstream (client
// gone, hedge loser, config unloaded). Done must run on every path, so callers
// defer it:
//
//	p, ok := b.Allow()
//	if !ok {
//		// refused: pick another upstream; b.RetryAt() says when this one may accept
//	}
//	outcome, ttft, reason := breaker.Neutral, time.Duration(0), "" // a panic stays neutral
//	defer func() { p.Done(outcome, ttft, reason) }()
//
// A Store (WithStore) shares a breaker's open state beyond one Breaker
// value: a new breaker of a key that is open starts open. A Fleet, a Store
// that also shares the trip counts, makes a fleet of gateways open a key
// once, on the fleet's failures (DESIGN §9): the breaker reports its
// closed-state failures (Fleet.Failure) and the successes that end a fleet
// run (Fleet.Success, only while the fleet's flag is set), and the fleet's
// verdicts come back as pushes (Adopt, AdoptClose) that never call the
// store again. A breaker's own trip rules still open it in fleet mode, but
// locally: that trip, its re-opens and its recovery are not published,
// while operator actions, Retry-After, observed trips and the probes of a
// fleet verdict are (see Fleet for the table). breakertest.SharedMemory (breaker/breakertest) is the
// in-process Fleet for tests and simulations; fleet/ has the Redis one.
// Close tells the fleet that a breaker's owner dropped it.
//
// The package is pure Go: no goroutines, no timers, no I/O. Every time-based
// rule (window expiry, cooldown, probe timeout) is evaluated lazily when the
// breaker is next used, against an injected Clock, so nothing leaks and tests
// never sleep.
//
// In the closed state Allow and a successful Done take no lock and allocate
// nothing: the state is one atomic word and the rolling windows are atomic
// bucket counters. The mutex is taken on failures, on transitions and in the
// open and half-open states (where refusals are themselves lock-free until a
// probe is due, and always on an observed trip).
package breaker
