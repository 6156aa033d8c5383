package breaker

import "fmt"

// Observation is one observed verdict on a breaker tripped by TripObserved:
// what the gateway saw of the signal that tripped it (a saturation metric
// scraped from the server's /metrics), outside user traffic.
type Observation uint8

const (
	// ObservedUnknown: no usable signal (scrape failed, metric missing or
	// stale). It breaks a run of healthy observations and never re-opens.
	ObservedUnknown Observation = iota
	// ObservedHealthy: the signal is back under its threshold. It counts
	// as a probe success would.
	ObservedHealthy
	// ObservedUnhealthy: the signal is still over its threshold. It
	// re-opens a half-open breaker as a failed probe would.
	ObservedUnhealthy
)

var observationNames = [...]string{ObservedUnknown: "unknown", ObservedHealthy: "healthy", ObservedUnhealthy: "unhealthy"}

// String returns "unknown", "healthy" or "unhealthy".
func (o Observation) String() string {
	if int(o) < len(observationNames) {
		return observationNames[o]
	}
	return fmt.Sprintf("observation(%d)", o)
}

// TripObserved opens the breaker because of a signal observed outside user
// traffic; reason says which (e.g. "saturation: queue wait p99 7.2s > 5s for
// 30s"). Such a breaker is marked observed (Observed, Snapshot.Observed):
// it recovers through Observe alone, so that no user request and no
// synthetic probe is risked on a server that answers a /health probe fine
// while its queue overflows. Until it closes, Allow and AllowProbe refuse,
// ProbeDue is false and RetryAt is never zero.
//
//   - Closed: it opens with the cooldown, as a trip rule would (MinOpen
//     applies; the cooldown grows on each re-open).
//   - HalfOpen (whatever opened it): it re-opens as a failed probe would,
//     with the grown cooldown, now marked observed. Probes in flight are
//     dropped; their outcomes are ignored.
//   - Open and observed: nothing.
//   - Open for another reason (trip rule, Retry-After, ForceOpen, store):
//     nothing, since it is refusing already and keeps its own recovery;
//     except when its cooldown is over and it has not half-opened yet only
//     because no call came to take the probe: then it half-opens and
//     re-opens observed as in HalfOpen, rather than letting the next user
//     request probe a saturated server.
//
// The reason is kept as the last failure and given to the listener and the
// Store (PutOpen, as for any open); no failure is counted
// (ConsecutiveFailures and the windows are about calls). The Store does not
// carry the observed mark: a breaker that adopts the open state from it
// (another gateway) recovers by probes once the cooldown is over, unless its
// own observations trip it.
func (b *Breaker) TripObserved(reason string) {
	if reason == "" {
		reason = "observed signal"
	}
	now := b.clock.Now()
	b.mu.Lock()
	defer b.unlock()
	b.tickLocked(now)
	switch stateOf(b.word.Load()) {
	case Closed:
		b.lastFailure, b.lastFailureAt = reason, now
		b.openLocked(now, now.Add(b.cooldownLocked()), true, true, reason)
		b.publishOpenLocked(reason)
	case Open:
		if b.observed.Load() || b.forever || b.mono(now) < b.gate.Load() {
			return
		}
		b.halfOpenLocked(now)
		b.reopenLocked(now, true, false, reason)
	case HalfOpen:
		b.reopenLocked(now, true, false, reason)
	}
}

// Observe feeds one observation to a breaker that TripObserved opened. On
// any other breaker (closed, or open for another reason) it does nothing,
// without taking the lock, so a scraper may call it on every scrape.
//
//   - Open, with the cooldown (and MinOpen) not over: nothing, whatever o.
//   - Open, with the cooldown over: it moves to HalfOpen ("cooldown over
//     after …"), then takes o as below.
//   - HalfOpen: ObservedHealthy counts a success, and RecoverySuccesses
//     consecutive ones close it ("2 consecutive healthy observations; last:
//     <reason>"; if MinOpen was raised meanwhile, it closes once MinOpen is
//     over); ObservedUnhealthy re-opens it with the grown cooldown, still
//     observed, for reason; ObservedUnknown resets the run of successes to
//     0 and leaves the state as it is.
func (b *Breaker) Observe(o Observation, reason string) {
	if !b.observed.Load() {
		return
	}
	now := b.clock.Now()
	b.mu.Lock()
	defer b.unlock()
	b.tickLocked(now)
	if !b.observed.Load() {
		return // closed or re-opened for another reason meanwhile
	}
	if stateOf(b.word.Load()) == Open {
		if b.mono(now) < b.gate.Load() {
			return
		}
		b.halfOpenLocked(now)
	}
	switch o {
	case ObservedHealthy:
		b.successes++
		if b.successes >= b.cfg.Load().s.RecoverySuccesses && !now.Before(b.minOpenUntil) {
			b.closeLocked(now, b.recoveredLocked(reason), false, !b.local)
		}
	case ObservedUnhealthy:
		if reason == "" {
			reason = "unhealthy observation"
		}
		b.reopenLocked(now, true, false, reason)
	default:
		b.successes = 0
	}
}

// Observed reports whether the breaker is open or half-open because of
// TripObserved, and so recovers by Observe alone. It reads one atomic value.
func (b *Breaker) Observed() bool { return b.observed.Load() }
