package breaker

import (
	"fmt"
	"math"
	"time"
)

// Evidence is what holds a breaker open (DESIGN §4, hard and statistical
// evidence). A pool routes around an upstream held by hard evidence
// whatever happens to the rest of the pool; one held by statistical
// evidence only while enough of the pool remains (the panic rule, see
// upstream.Pool).
type Evidence uint8

const (
	// EvidenceNone: the breaker is closed.
	EvidenceNone Evidence = iota
	// Hard evidence says the upstream is down or hanging: a run of
	// ConsecutiveFailures refused, reset or timed-out connections and
	// first-byte timeouts (Down outcomes) with no sign of life (a success,
	// or a first token on any attempt: Live) and no answer between them; a
	// run of ConsecutiveFailures failures of any kind with no success or
	// first token within RatioWindow; a failed synthetic probe;
	// and what the upstream or an operator said (Retry-After, ForceOpen),
	// the fleet's verdicts and the saturation trips.
	Hard
	// Statistical evidence says the upstream fails more often than it
	// should: the pool's outlier and near-total rules (Eject) and the
	// breaker's own Failures, FailureRatio and SlowRatio rules.
	Statistical
)

var evidenceNames = [...]string{EvidenceNone: "", Hard: "hard", Statistical: "statistical"}

// String returns "hard", "statistical", or "" for none.
func (e Evidence) String() string {
	if int(e) < len(evidenceNames) {
		return evidenceNames[e]
	}
	return fmt.Sprintf("evidence(%d)", e)
}

// MarshalText encodes the evidence as its String, for the admin API.
func (e Evidence) MarshalText() ([]byte, error) { return []byte(e.String()), nil }

// UnmarshalText parses evidence written by MarshalText.
func (e *Evidence) UnmarshalText(b []byte) error {
	for i, n := range evidenceNames {
		if string(b) == n {
			*e = Evidence(i)
			return nil
		}
	}
	return fmt.Errorf("breaker evidence %q: want hard or statistical", b)
}

// ProbeFailureQuantile is the confidence with which a half-open breaker
// held by statistical evidence tells "fails like its pool" from "still an
// outlier": it re-opens only after more failed probes than an upstream
// failing at the pool's rate would give, before RecoverySuccesses
// successes, with probability 1 − ProbeFailureQuantile.
const ProbeFailureQuantile = 0.99

// maxProbeFailures bounds the failed probes a half-open breaker tolerates,
// even in a pool that fails (nearly) everything.
const maxProbeFailures = 50

// allowedProbeFailures is the number of failed probes an upstream failing
// with probability p may give before its r-th success, at the
// ProbeFailureQuantile: the quantile of the negative binomial distribution
// NB(r, 1−p), capped by maxProbeFailures. p ≤ 0 (a healthy pool) allows
// none, as a plain breaker does.
func allowedProbeFailures(p float64, r int) int {
	if !(p > 0) {
		return 0
	}
	if p >= 1 {
		return maxProbeFailures
	}
	// P(F = k) = C(k+r−1, k) p^k (1−p)^r, summed until the quantile.
	pk := math.Pow(1-p, float64(r)) // k = 0
	cum := pk
	for k := 0; k < maxProbeFailures; k++ {
		if cum >= ProbeFailureQuantile {
			return k
		}
		pk *= p * float64(k+r) / float64(k+1)
		cum += pk
	}
	return maxProbeFailures
}

// Evidence returns what holds the breaker open or half-open, without a
// lock; EvidenceNone when closed.
func (b *Breaker) Evidence() Evidence {
	if stateOf(b.word.Load()) == Closed {
		return EvidenceNone
	}
	return Evidence(b.evidence.Load())
}

// Live records a sign of life of the upstream: a first token (or complete
// body) arrived on one of its attempts. The gateway calls it at commit, for
// every attempt; a success (Done) is one too. It breaks a run of Down
// outcomes (see Hard): a burst of refused connections while other
// connections to the same server stream tokens is no dead server. It also
// dates the last success that the "no success in the window" rule looks
// at. Lock-free; allocates nothing.
func (b *Breaker) Live() {
	now := b.clock.Now()
	b.lastLife.Store(b.mono(now))
	b.breakRun(now)
}

// breakRun ends a run of Down outcomes at a sign of life, and dates the
// break: an upstream that refuses some connections while it serves others
// (runs of Down outcomes broken by successes) is no dead server, and for
// RatioWindow after such a break a run of Down outcomes is not hard
// evidence; it counts as failures for the statistical rules, and as hard
// only once no success came within RatioWindow. Without this, an
// upstream refusing half its dials at random gave a run of three within
// about fourteen attempts, was held open on hard evidence, and, needing
// two probe successes in a row with every refused probe doubling the
// cooldown, stayed open: alone in its pool it served under 1% of requests
// instead of the 50% a direct connection gets. A server that dies after
// serving steadily has no broken run and still trips after three.
func (b *Breaker) breakRun(now time.Time) {
	if b.hardRun.Load() != 0 {
		b.hardRun.Store(0)
		b.brokenRun.Store(b.mono(now))
	}
}

// breakRunFor is breakRun for the success of an attempt issued at issued
// (nanoseconds since base): only an attempt that began within the run is
// a sign of life. A long stream that began before the upstream started
// refusing or resetting new connections, and ends well now, proves
// nothing about them: an upstream that resets every new connection while
// its older streams end well would never be held on hard evidence and,
// failing at once, would draw the traffic of a least-loaded pick.
func (b *Breaker) breakRunFor(now time.Time, issued int64) {
	if issued >= b.runStart.Load() {
		b.breakRun(now)
	}
}

// runBrokenWithin reports whether a sign of life broke a run of Down
// outcomes within d before now (see breakRun).
func (b *Breaker) runBrokenWithin(now time.Time, d time.Duration) bool {
	last := b.brokenRun.Load()
	return last != noLife && b.mono(now)-last < int64(d)
}

// SetPeerRatio tells the breaker the failure ratio of the rest of its pool
// (0 to 1), by which a half-open breaker held by statistical evidence, or
// one whose probe an upstream answered with an error, judges its probes:
// an upstream that fails like its pool closes (see allowedProbeFailures).
// A value outside [0, 1] is ignored. Lock-free.
func (b *Breaker) SetPeerRatio(r float64) {
	if r >= 0 && r <= 1 {
		b.peer.Store(math.Float64bits(r))
	}
}

// PeerRatio returns the last SetPeerRatio (0 before any).
func (b *Breaker) PeerRatio() float64 { return math.Float64frombits(b.peer.Load()) }

// Eject opens a closed breaker on statistical evidence found by its pool
// (an outlier against the pool, or failing nearly always): reason says
// which, peer is the failure ratio of the rest of the pool (SetPeerRatio),
// by which its recovery is judged. It reports whether the breaker opened;
// a breaker that is not closed is left alone. The cooldown is the usual one
// (OpenFor, jittered, MinOpen). With a Fleet the ejection is local, as an
// own trip rule's is: a pool's statistics are this gateway's.
func (b *Breaker) Eject(reason string, peer float64) bool {
	now := b.clock.Now()
	b.mu.Lock()
	defer b.unlock()
	if stateOf(b.word.Load()) != Closed {
		return false
	}
	b.SetPeerRatio(peer)
	rc := b.RatioCounts()
	b.holdRatioLocked(rc.Failures, rc.Requests)
	reason = "ejected: " + reason
	b.lastFailure, b.lastFailureAt = reason, now
	b.openLocked(now, now.Add(b.cooldownLocked()), true, false, reason)
	b.evidence.Store(uint32(Statistical))
	if b.fleet != nil {
		b.local = true
		return true
	}
	b.publishOpenLocked(reason)
	return true
}

// holdRatioLocked records failures/requests as the ratio a hold on
// statistical evidence rests on (1 with no requests: nothing but
// failures were seen).
func (b *Breaker) holdRatioLocked(failures, requests int) {
	r := 1.0
	if requests > 0 {
		r = float64(failures) / float64(requests)
	}
	b.heldRatio.Store(math.Float64bits(r))
}

// HeldRatio returns the failure ratio (0 to 1) on which the breaker's last
// hold on statistical evidence rests: its ratio window's when its pool
// ejected it or its own ratio rules tripped, its probes' when it re-opened
// as an outlier from a hold on hard evidence; 0 before any. Its pool
// compares it with a worse outlier's when the ejection cap is full
// (Pardon). Lock-free.
func (b *Breaker) HeldRatio() float64 { return math.Float64frombits(b.heldRatio.Load()) }

// Pardon ends a hold on statistical evidence before its time, because its
// pool found a worse outlier and its ejection cap has no place for both:
// an open or half-open breaker held on statistics closes (as on recovery,
// with empty windows; reason is the transition's), and a closed one on
// probation leaves probation. It reports whether it freed a place. Hard
// evidence, an operator's forced open and a fleet's verdict are never
// pardoned. Without this the cap's place went to whichever outlier
// tripped first: of 10%, 30% and 60% failing replicas under a cap of one,
// a 30% one ejected while the 60% one was held on hard evidence kept the
// place, and the 60% one served beside it.
func (b *Breaker) Pardon(reason string) bool {
	now := b.clock.Now()
	b.mu.Lock()
	defer b.unlock()
	switch st := stateOf(b.word.Load()); {
	case st == Closed:
		if !b.OnProbation() {
			return false
		}
		b.probation.Store(0)
		return true
	case Evidence(b.evidence.Load()) != Statistical || b.forced || b.forever:
		return false
	case b.fleet != nil && !b.local:
		return false // the fleet's verdict, not this pool's
	}
	b.closeLocked(now, "pardoned: "+reason, false, !b.local)
	return true
}

// OnProbation reports whether the breaker closed after a hold on
// statistical evidence (Eject) less than RatioWindow ago and its ratio
// window has not yet seen MinRequests requests: its pool still counts it
// against the ejection cap. Without this, a pool's worst upstream that
// closed after its cooldown, with an empty window, left its place to the
// next worst, judged against the best alone (of 10%, 30% and 60% failing
// replicas under a cap of one, the 30% one took the place and the 60%
// one served in turn, half the time). Once the window holds MinRequests,
// the upstream is judged on them like any other. Lock-free.
func (b *Breaker) OnProbation() bool {
	until := b.probation.Load()
	if until == 0 || stateOf(b.word.Load()) != Closed {
		return false
	}
	now := b.clock.Now()
	if b.mono(now) >= until {
		return false
	}
	c := b.cfg.Load()
	return c.ratio != nil && c.ratio.sum(now).requests < c.s.MinRequests
}

// lifeWithin reports whether the upstream showed a sign of life (Live, or
// a success) within d before now.
func (b *Breaker) lifeWithin(now time.Time, d time.Duration) bool {
	last := b.lastLife.Load()
	return last != noLife && b.mono(now)-last < int64(d)
}

// noLife is lastLife before any sign of life.
const noLife = math.MinInt64

// Hear gives the breaker the outcome of an attempt on its upstream that
// another breaker let through: handlers in front of one upstream each
// keep their own verdict, and each judges every attempt on the upstream
// by its own rules (as Caddy's handlers each judge a host's shared
// counters). issued is when that attempt began; the outcome counts as a
// closed-state permit's issued then would (Done). report false keeps it
// from the Fleet: a breaker with the same key reported it already. A
// breaker that is not closed only counts it (Tally), for its pool's
// outlier detector: its recovery is its own probes'. The outcome of a
// pick routed over the breaker itself (panic, past the cap) comes here
// too.
func (b *Breaker) Hear(o Outcome, issued time.Time, ttft time.Duration, reason string, report bool) {
	w := b.word.Load()
	if stateOf(w) != Closed {
		b.Tally(o, ttft)
		return
	}
	p := Permit{b: b, word: w, issued: b.mono(issued), quiet: !report}
	p.Done(o, ttft, reason)
}

// IssuedAt returns when the permit was issued (zero for a refusal), for
// Hear.
func (p *Permit) IssuedAt() time.Time {
	if p.b == nil {
		return time.Time{}
	}
	return p.b.base.Add(time.Duration(p.issued))
}

// FailureCount returns the failures (slow calls included) in the breaker's
// FailuresWindow at now, as its Failures rule counts them. An outlier
// detector (WithOutlierDetector) reads it, with RatioCounts, off the
// request path. It takes no lock.
func (b *Breaker) FailureCount() int {
	return b.cfg.Load().fails.sum(b.clock.Now()).failures
}

// Tally counts the outcome of an attempt made without a permit, because
// the breaker's pool routed over it (the pool in panic, the upstream past
// the ejection cap, or opened by the saturation rules and the only one
// left), in the windows that FailureCount and RatioCounts read: a Success
// as a request (a slow one, TTFT above SlowTTFT, also as a failure and a
// slow call), a Failure or Down as a request and a failure, Neutral not at
// all. It changes nothing else: no state, no run of failures, no sign of
// life, no fleet report; the pool's outlier detector judges the counts at
// its next run. Without it those outcomes were lost, and an upstream
// routed over in panic looked to its pool as it did when it was ejected.
// It takes no lock.
func (b *Breaker) Tally(o Outcome, ttft time.Duration) {
	if o == Neutral {
		return
	}
	c := b.cfg.Load()
	now := b.clock.Now()
	slow := o == Success && c.s.SlowTTFT > 0 && ttft > c.s.SlowTTFT
	failed := o != Success || slow
	if failed {
		c.fails.record(now, true, false)
	}
	c.ratio.record(now, failed, slow)
}

// CarryOver makes b, a closed breaker built to replace old (a reload's new
// breaker for the same handler), take old's verdict: open since old opened
// and until old's cooldown ends (a half-open or due old: a probe is due at
// once), with old's evidence, held and peer ratios, re-open count and
// saturation mark, so that its pool's outlier detector and cap see the
// same hold; forced open by an operator stays forced until the same end.
// It is no transition (the handler's verdict did not change): the
// listener hears nothing, and nothing is published (old's store or fleet
// holds the verdict already). Nothing changes when old is closed or b is
// not.
func (b *Breaker) CarryOver(old *Breaker, reason string) {
	snap := old.Snapshot()
	if snap.State == Closed {
		return
	}
	old.mu.Lock()
	reopens, local, openedAt := old.reopens, old.local, old.openedAt
	old.mu.Unlock()
	ev, held, peer, observed := old.evidence.Load(), old.heldRatio.Load(), old.peer.Load(), old.observed.Load()
	now := b.clock.Now()
	until := snap.OpenUntil
	if snap.Forced && !until.IsZero() && !until.After(now) {
		return // the operator's timed open is over
	}
	if !snap.Forced && !until.After(now) {
		until = now
	}
	b.mu.Lock()
	defer b.unlock()
	if stateOf(b.word.Load()) != Closed {
		return
	}
	n := len(b.pending)
	b.reopens = reopens
	b.openLocked(now, until, false, observed, reason) // until zero: forced until closed
	if snap.Forced {
		b.forced = true
		b.setGateLocked()
	}
	b.local = local && !snap.Forced
	b.evidence.Store(ev)
	b.heldRatio.Store(held)
	b.peer.Store(peer)
	b.openedAt, b.since = openedAt, snap.Since
	b.pending = b.pending[:n]
}
