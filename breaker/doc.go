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
// Trip rules (Settings): consecutive failures, N failures within a duration,
// failure ratio over a rolling window, and slow calls (a successful call whose
// time to first token exceeds SlowTTFT counts as a failure; SlowRatio is a
// separate ratio rule for slow calls alone).
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
// The package is pure Go: no goroutines, no timers, no I/O. Every time-based
// rule (window expiry, cooldown, probe timeout) is evaluated lazily when the
// breaker is next used, against an injected Clock, so nothing leaks and tests
// never sleep.
//
// In the closed state Allow and a successful Done take no lock and allocate
// nothing: the state is one atomic word and the rolling windows are atomic
// bucket counters. The mutex is taken on failures, on transitions and in the
// open and half-open states (where refusals are themselves lock-free until a
// probe is due).
package breaker
