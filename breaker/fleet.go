package breaker

import (
	"sync/atomic"
	"time"
)

// Fleet is a Store that also shares the trip counts, so that a fleet of
// gateways opens a key once, on the fleet's failures, instead of each
// gateway after its own (DESIGN §9): the number of user requests that
// discover an outage is then the trip threshold for the whole fleet, not
// per instance, plus those already in flight. fleet/ implements it on
// Redis; breaker/breakertest.SharedMemory is the in-process one, for tests
// and simulations.
// A Breaker built WithStore of a Fleet finds it by type assertion.
//
// The breaker reports, the fleet decides, and the fleet's decisions come
// back as pushes:
//
//   - Join is called once, in New. The fleet remembers the breaker, to push
//     its verdicts on key to it, and returns a flag that it sets while key's
//     fleet consecutive count may be non-zero (after any gateway's failure;
//     at the least after this one's) and clears when the count is zero.
//   - Failure is called for every failure the breaker records while closed
//     that may be hard evidence (a Down outcome, or a failure with no
//     success or first token within RatioWindow; every failure of an
//     AnyRun breaker), under the breaker's lock, with the breaker's
//     effective settings (the fleet applies the ConsecutiveFailures and
//     Failures/FailuresWindow rules to its counts, and may apply the
//     ratio rules to the sums of every gateway's RatioCounts), the
//     breaker's clock time and the failure's reason.
//   - Success is called by a closed-state success only while the flag is
//     set: a success resets a non-zero fleet consecutive count, and a zero
//     one costs nothing (the success path stays one atomic load, without a
//     lock, an allocation or an interface call).
//   - When the fleet's counts fire a rule, the fleet opens key fleet-wide
//     (PutOpen's state, with the remaining time for breakers created later)
//     and calls Adopt on every joined breaker of key, in every gateway,
//     including the one whose failure crossed the threshold; AdoptClose when
//     key closes (another gateway's breaker recovered, or an operator closed
//     it). Pushes never call the store back.
//   - Leave is called by Close, when the breaker's owner drops it.
//
// In fleet mode a breaker's own trip rules still open it (local protection
// while the fleet's store is away, and a min_reporters above 1 keeps one
// gateway's broken network path to itself), but that local trip is not
// published: the fleet's verdict comes from the fleet's counts. Who
// publishes what:
//
//	event                                   store call   fleet-wide
//	own trip rule fires (closed)            Failure      only if the fleet's counts fire
//	probe failure re-opens a local trip     none         no: more of the same local evidence
//	probe failure re-opens any other open   Reopen       yes, with the fleet's re-open count
//	probe success of any other open         ProbeSuccess yes: counted toward the fleet's recovery
//	half-open recovery of a local trip      none         no
//	half-open recovery of any other open    ClearOpen    yes
//	Retry-After (ExtendOpen)                PutOpen      yes: the upstream said so
//	TripObserved, unhealthy observation     PutOpen      yes: a signal of the server
//	ForceOpen, ForceClose, Reset            Put/Clear    yes: an operator said so
//	Adopt, AdoptClose (the fleet's pushes)  none         (they are the fleet's verdicts)
//
// Without a Fleet (a plain Store, or none) every open and close is
// published as before and the trip rules count this breaker's calls only.
//
// Implementations must not block (Failure is called under the breaker's
// lock and Success on the request path: a Redis store queues them) and must
// be safe for concurrent use. They may push from anywhere, even from within
// Failure or PutOpen (so under the calling breaker's lock): Adopt and
// AdoptClose never wait for a breaker's lock.
type Fleet interface {
	Store
	// Join registers b as key's breaker in this gateway and returns the
	// flag "key's fleet consecutive count may be non-zero", which the
	// fleet sets and clears and the breaker only reads. Breakers of one
	// key in one gateway may share a flag. It must not be nil.
	Join(key string, b *Breaker) *atomic.Bool
	// Leave forgets b: no more pushes to it. Calls for a breaker that
	// has left (outcomes of permits still out) may still come.
	Leave(key string, b *Breaker)
	// Failure counts one closed-state failure of key in this gateway:
	// s are the reporting breaker's effective settings, at its clock's
	// time, reason what failed.
	Failure(key string, s Settings, at time.Time, reason string)
	// Success resets key's fleet consecutive count (and its reporters).
	Success(key string)
	// ProbeSuccess counts one successful half-open probe of key in this
	// gateway, by a breaker open on a fleet verdict (not a local trip,
	// not TripObserved), with that breaker's effective settings. The
	// fleet counts probe successes over every gateway since key last
	// opened or re-opened, and when they reach s.RecoverySuccesses it
	// closes key fleet-wide: AdoptClose on every joined breaker of key,
	// in every gateway, this one's included. So the fleet closes after
	// RecoverySuccesses probe successes in all, not that many per
	// gateway (a breaker still closes on its own count as well). It is
	// called under the breaker's lock.
	ProbeSuccess(key string, s Settings)
	// Reopens returns the fleet's count of key's consecutive re-opens
	// (failed half-open probes) since it last closed, from memory: a
	// breaker re-opening key grows its cooldown from the larger of this
	// and its own count, so cooldown growth follows the fleet's re-opens
	// whichever gateway probed before.
	Reopens(key string) int
	// Reopen is PutOpen for a failed half-open probe that re-opens key
	// until `until`: reopens is the re-open count the cooldown grew from,
	// this re-open included, which the fleet keeps with the open state
	// (Reopens) until key closes. It is called under the breaker's lock.
	Reopen(key string, until time.Time, reason string, reopens int)
}

// notDirty is the flag of every breaker without a fleet: never set.
var notDirty atomic.Bool

// joinFleet joins the store when it is a Fleet.
func (b *Breaker) joinFleet() {
	f, ok := b.store.(Fleet)
	if !ok {
		return
	}
	b.fleet = f
	if d := f.Join(b.storeKey, b); d != nil {
		b.dirty = d
	}
}

// Close tells the breaker's Fleet that its owner no longer uses it (an
// upstream dropped by a reload, breakers turned off): the fleet stops
// pushing to it. It is idempotent, and does nothing without a Fleet. The
// breaker keeps working: the outcomes of permits still out are recorded
// and still reach the fleet, since they are real observations.
func (b *Breaker) Close() {
	if b.left.CompareAndSwap(false, true) && b.fleet != nil {
		b.fleet.Leave(b.storeKey, b)
	}
}

// Adopt applies the fleet's verdict that key is open until `until` (zero:
// until an operator closes it), for reason (kept as given, for the
// transition):
//
//   - Closed or HalfOpen: it opens until then, as a Store entry opens a new
//     breaker: MinOpen does not apply, it is not a re-open (the cooldown
//     does not grow), probes out are dropped (their outcomes ignored). A
//     half-open breaker that TripObserved opened stays observed. The
//     listener sees the transition as usual.
//   - Open: the cooldown end moves out to `until` if that is later (zero:
//     open until closed); a local trip (its own rules, not published)
//     takes `until` as its cooldown end even when it is earlier, so that
//     the gateway whose failures opened the key fleet-wide ends its
//     cooldown with the others. It is no longer a local trip.
//
// A non-zero `until` that is not after now does nothing. Adopt never calls
// the store (no echo between gateways). It never waits for the breaker's
// lock either, so a fleet may push from within a call that holds it: a
// push that finds the lock taken is applied by the lock's holder before it
// lets go, otherwise before Adopt returns. Safe for concurrent use.
func (b *Breaker) Adopt(until time.Time, reason string) {
	if reason == "" {
		reason = "open in fleet"
	}
	b.post(push{kind: pushOpen, until: until, reason: reason})
}

// AdoptClose applies the fleet's verdict that key closed (another gateway's
// breaker recovered, or an operator closed it): an open or half-open
// breaker closes with empty windows and counters, as on recovery; a closed
// one is left alone. Like Adopt it never calls the store and never waits
// for the lock.
func (b *Breaker) AdoptClose(reason string) {
	if reason == "" {
		reason = "closed in fleet"
	}
	b.post(push{kind: pushClose, reason: reason})
}

// ProbeNow ends the cooldown of an open breaker at once, so that its next
// call, or the active prober, takes the half-open probe: the fleet gave
// this gateway the key's probe lease (one prober per upstream for the whole
// fleet, DESIGN §9). Other states, and a breaker forced open until closed,
// are left alone. Like Adopt it never calls the store and never waits for
// the lock.
func (b *Breaker) ProbeNow(reason string) {
	if reason == "" {
		reason = "probe lease won"
	}
	b.post(push{kind: pushProbeNow, reason: reason})
}

// push is one verdict from the fleet, waiting for the lock.
type push struct {
	kind   pushKind
	until  time.Time
	reason string
}

type pushKind uint8

const (
	pushClose    pushKind = iota // AdoptClose
	pushOpen                     // Adopt
	pushProbeNow                 // ProbeNow
)

// post queues p and applies it now if the lock is free; otherwise the
// lock's holder applies it in unlock.
func (b *Breaker) post(p push) {
	b.pushMu.Lock()
	b.pushes = append(b.pushes, p)
	b.pushed.Store(true)
	b.pushMu.Unlock()
	if b.mu.TryLock() {
		b.unlock()
	}
}

// applyPushesLocked applies the queued pushes, in order.
func (b *Breaker) applyPushesLocked() {
	if !b.pushed.Load() {
		return
	}
	b.pushMu.Lock()
	q := b.pushes
	b.pushes = nil
	b.pushed.Store(false)
	b.pushMu.Unlock()
	now := b.clock.Now()
	for _, p := range q {
		switch p.kind {
		case pushOpen:
			b.adoptLocked(now, p.until, p.reason)
		case pushClose:
			b.adoptCloseLocked(now, p.reason)
		case pushProbeNow:
			b.probeNowLocked(now)
		}
	}
}

// adoptLocked is Adopt under the lock. It applies no time-based change
// (tickLocked may publish), since the verdict supersedes them.
func (b *Breaker) adoptLocked(now, until time.Time, reason string) {
	forever := until.IsZero()
	if !forever && !until.After(now) {
		return
	}
	switch stateOf(b.word.Load()) {
	case Closed:
		b.openLocked(now, until, false, false, reason)
	case HalfOpen:
		b.openLocked(now, until, false, b.observed.Load(), reason)
	case Open:
		wasLocal := b.local
		b.local = false
		switch {
		case b.forever:
		case forever:
			b.forced, b.forever = true, true
			b.setGateLocked()
		case wasLocal:
			// A local trip's own (jittered) cooldown gives way to the
			// fleet's verdict, earlier or later: every gateway's breaker
			// of the key then ends its cooldown at the same time.
			b.openUntil, b.minOpenUntil, b.useMinOpen = until, b.openedAt, false
			b.setGateLocked()
		case until.After(b.gateTimeLocked()):
			b.openUntil = until
			b.setGateLocked()
		}
	}
}

// probeNowLocked is ProbeNow under the lock: the cooldown (and MinOpen)
// ends now.
func (b *Breaker) probeNowLocked(now time.Time) {
	if stateOf(b.word.Load()) != Open || b.forever {
		return
	}
	b.openUntil, b.minOpenUntil, b.useMinOpen = now, now, false
	b.setGateLocked()
}

// adoptCloseLocked is AdoptClose under the lock.
func (b *Breaker) adoptCloseLocked(now time.Time, reason string) {
	if stateOf(b.word.Load()) == Closed {
		return
	}
	b.closeLocked(now, reason, false, false)
}

// RatioCounts are the sums of a breaker's RatioWindow (RatioCounts).
type RatioCounts struct {
	// Requests, Failures and Slow are the successes and failures, the
	// failures (slow calls included) and the slow calls in the window.
	Requests, Failures, Slow int
}

// RatioCounts returns the sums of the breaker's RatioWindow at now, as its
// FailureRatio and SlowRatio rules see them; all zero when both rules are
// off. A Fleet reads them (off the request path) to decide the ratio rules
// on the fleet's sums. It takes no lock.
func (b *Breaker) RatioCounts() RatioCounts {
	c := b.cfg.Load()
	if c.ratio == nil {
		return RatioCounts{}
	}
	rc := c.ratio.sum(b.clock.Now())
	return RatioCounts{Requests: rc.requests, Failures: rc.failures, Slow: rc.slow}
}
