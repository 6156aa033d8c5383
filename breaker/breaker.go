package breaker

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// Option configures a Breaker (New).
type Option func(*options)

type options struct {
	clock    clock.Reader
	rand     func() float64
	listener func(Transition)
	store    Store
	storeKey string
	detector bool
}

func buildOptions(opts []Option) options {
	o := options{clock: clock.Real, rand: rand.Float64}
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// WithClock sets the clock (default clock.Real). Tests pass a fake one.
func WithClock(c clock.Reader) Option {
	return func(o *options) {
		if c != nil {
			o.clock = c
		}
	}
}

// WithRand sets the source of the cooldown jitter: a function returning
// values in [0, 1), safe for concurrent use (default math/rand/v2.Float64).
// 0 means no jitter (the cooldown's base); values toward 1 lengthen it up
// to +2 × OpenJitter (see cooldownLocked). A value outside [0, 1) counts as 0.
func WithRand(f func() float64) Option {
	return func(o *options) {
		if f != nil {
			o.rand = f
		}
	}
}

// WithListener sets a function called once for each state change, in order,
// for logs, metrics and events. It is called without the breaker's lock held
// (so it may call the breaker's methods), by whichever goroutine caused the
// change or by another one delivering at the same time; it should be quick.
func WithListener(f func(Transition)) Option {
	return func(o *options) { o.listener = f }
}

// WithStore sets the Store that holds the open state shared beyond this
// breaker (see Store). Default none. A store that is also a Fleet shares
// the trip counts too: the breaker joins it in New and reports every
// closed-state failure and the successes that end a fleet run to it (see
// Fleet).
func WithStore(s Store) Option {
	return func(o *options) { o.store = s }
}

// WithStoreKey names the breaker in its Store (and Fleet) by k instead of
// its key: breakers shown under one name (an upstream) that must keep
// apart in a store (handlers with other settings) differ by it.
func WithStoreKey(k string) Option {
	return func(o *options) { o.storeKey = k }
}

// WithOutlierDetector leaves the statistical rules (Failures, FailureRatio,
// SlowRatio) to an outlier detector outside the breaker: the breaker only
// counts their outcomes (FailureCount, RatioCounts) and never trips on them
// itself; the detector reads the counts on its own schedule and opens it
// with Eject. Hard evidence (ConsecutiveFailures runs) still trips it at
// once. Default off: the breaker judges every rule itself (tenant breakers,
// standalone use). A pool's breakers take it because the pool's ejection
// cap must be decided with the whole pool in view, which a breaker cannot
// do under its own lock.
func WithOutlierDetector() Option {
	return func(o *options) { o.detector = true }
}

// config is a breaker's immutable settings with the rolling windows that
// belong to them. It is replaced, never modified, so the closed-state hot
// path reads it with one atomic load.
type config struct {
	s     Settings // effective: defaults applied, invalid values replaced
	raw   Settings // as given, for fresh
	fails *window  // FailuresWindow; failures only
	ratio *window  // RatioWindow: every success and failure (RatioCounts)
}

func newConfig(raw Settings, now time.Time, old *config) *config {
	c := &config{s: raw.sanitize(), raw: raw}
	if old != nil && old.s.FailuresWindow == c.s.FailuresWindow {
		c.fails = old.fails
	} else {
		c.fails = newWindow(now, c.s.FailuresWindow)
	}
	// The ratio window is always kept: the pool's outlier rules read it
	// (RatioCounts) whatever the breaker's own rules.
	if old != nil && old.s.RatioWindow == c.s.RatioWindow {
		c.ratio = old.ratio
	} else {
		c.ratio = newWindow(now, c.s.RatioWindow)
	}
	return c
}

// fresh returns c with empty windows, for a breaker that closes.
func (c *config) fresh(now time.Time) *config { return newConfig(c.raw, now, nil) }

// gateForever is the gate of a breaker forced open until closed.
const gateForever = math.MaxInt64

// Breaker is one key's circuit breaker. It is safe for concurrent use; build
// it with New.
type Breaker struct {
	// word is the state in its low 2 bits and a generation above, bumped on
	// every transition: a permit remembers the word it was issued under, so
	// the outcome of a call that outlived its state is ignored.
	word atomic.Uint64
	// gate (Open) is when a probe may first be let in, in nanoseconds since
	// base; gateForever when forced open until closed.
	gate atomic.Int64
	// busyUntil (HalfOpen) is until when every probe slot is certainly
	// taken, in nanoseconds since base; 0 when a slot may be free.
	busyUntil atomic.Int64
	// consec is the current run of failures.
	consec atomic.Int64
	// observed (Open, HalfOpen) marks a trip by TripObserved, whose
	// recovery is by Observe only: Allow and AllowProbe refuse without the
	// lock while it is set. Written under mu, before the word.
	observed atomic.Bool
	// evidence (Open, HalfOpen) is the Evidence that holds it, written
	// under mu with every open.
	evidence atomic.Uint32
	// lastLife is the time of the last success or first token (Live), in
	// nanoseconds since base; noLife before any.
	lastLife atomic.Int64
	// hardRun is the current run of Down outcomes since the last sign of
	// life or answer.
	hardRun atomic.Int64
	// runStart is when the current run of Down outcomes began, in
	// nanoseconds since base: only an attempt issued since then that the
	// upstream answers ends it (an older stream ending says nothing of
	// new connections).
	runStart atomic.Int64
	// brokenRun is when a sign of life last broke a run of Down outcomes
	// (the upstream refuses some connections and serves others), in
	// nanoseconds since base; noLife before any. Within RatioWindow of
	// it, a run of Down outcomes is no hard evidence (see doneFailure).
	brokenRun atomic.Int64
	// peer is the pool's failure ratio (SetPeerRatio), as float64 bits.
	peer atomic.Uint64
	// heldRatio is the failure ratio, as float64 bits, on which the last
	// hold on statistical evidence rests (HeldRatio).
	heldRatio atomic.Uint64
	// probation (Closed) is until when a breaker that recovered from a
	// hold on statistical evidence stays on probation (OnProbation), in
	// nanoseconds since base; 0 when not.
	probation atomic.Int64
	cfg       atomic.Pointer[config]
	// dirty is the flag Join returned: key's fleet consecutive count may
	// be non-zero, so a success must tell the fleet. It points to
	// notDirty (never set) without a fleet, so the success path reads one
	// atomic value either way. It sits beside the other fields of the
	// success path, in their cache line.
	dirty *atomic.Bool

	key      string
	base     time.Time // the clock at creation; gate and busyUntil count from it
	clock    clock.Reader
	rand     func() float64
	listener func(Transition)
	store    Store
	// storeKey is the breaker's name in store and fleet (WithStoreKey,
	// else key).
	storeKey string
	// detector is WithOutlierDetector: the statistical rules are an outlier
	// detector's, not this breaker's.
	detector bool
	// fleet is store when it is a Fleet, else nil.
	fleet Fleet
	// left is set by Close.
	left atomic.Bool
	// pushed is set while pushes holds verdicts from the fleet (Adopt,
	// AdoptClose) waiting for the lock; pushMu guards pushes.
	pushed atomic.Bool
	pushMu sync.Mutex
	pushes []push

	mu            sync.Mutex
	local         bool // open by its own trip rules in fleet mode: not published
	since         time.Time
	openedAt      time.Time
	openUntil     time.Time // cooldown end, pushed out by ExtendOpen
	minOpenUntil  time.Time // openedAt + MinOpen, when useMinOpen
	useMinOpen    bool      // false for Retry-After, store and forced opens
	forced        bool      // ForceOpen
	forever       bool      // ForceOpen without a duration
	reopens       int
	probes        []probe
	lastProbe     uint64
	successes     int
	probeFails    int // failed probes tolerated in this half-open
	probeDowns    int // refused or reset probes in a row in this half-open
	lastFailure   string
	lastFailureAt time.Time
	pending       []Transition

	notifyMu sync.Mutex // serializes listener calls
}

// probe is a half-open permit that is out.
type probe struct {
	id       uint64
	deadline time.Time // issued + ProbeTimeout
}

// New returns a closed breaker for key with settings s (defaults applied;
// a field that Validate rejects takes its default instead, so callers should
// validate configuration first). With a Store that reports key as open, the
// breaker starts open.
func New(key string, s Settings, opts ...Option) *Breaker {
	o := buildOptions(opts)
	now := o.clock.Now()
	b := &Breaker{
		key:      key,
		base:     now,
		clock:    o.clock,
		rand:     o.rand,
		listener: o.listener,
		store:    o.store,
		storeKey: cmp.Or(o.storeKey, key),
		detector: o.detector,
		dirty:    &notDirty,
		since:    now,
	}
	b.cfg.Store(newConfig(s, now, nil))
	b.lastLife.Store(noLife)
	b.brokenRun.Store(noLife)
	b.joinFleet()
	if b.store != nil {
		b.mu.Lock()
		b.adoptStoreLocked(now)
		b.unlock()
	}
	return b
}

// Key returns the breaker's key.
func (b *Breaker) Key() string { return b.key }

// StoreKey returns the breaker's name in its store and fleet (WithStoreKey,
// else Key).
func (b *Breaker) StoreKey() string { return b.storeKey }

// Settings returns the effective settings: defaults applied, invalid values
// replaced.
func (b *Breaker) Settings() Settings { return b.cfg.Load().s }

// State returns the current state. It reads one atomic word and does not
// apply time-based changes that are due (a cooldown that is over shows as
// Open until the next Allow takes the probe); Snapshot does.
func (b *Breaker) State() State { return stateOf(b.word.Load()) }

func stateOf(w uint64) State { return State(w & 3) }

// mono returns t as nanoseconds since the breaker's creation (monotonic when
// the clock provides it).
func (b *Breaker) mono(t time.Time) int64 { return int64(t.Sub(b.base)) }

// Permit is the right to make one call, from Allow or AllowProbe. It is a
// small value: the closed-state path allocates nothing. The zero Permit (a
// refusal) may be Done, which does nothing, so callers can defer Done before
// looking at ok. Do not copy a permit that is in use: Done is idempotent per
// copy.
type Permit struct {
	b         *Breaker
	word      uint64 // the state word it was issued under
	probe     uint64 // probe id; 0 for a closed-state permit
	synthetic bool   // from AllowProbe: the gateway's own probe
	done      bool
	// issued is when the permit was issued, in nanoseconds since the
	// breaker's base: its outcome ends a run of Down outcomes only when
	// the attempt began within the run (see runStart).
	issued int64
	// quiet keeps the outcome from the Fleet: it was heard from another
	// breaker with the same key, which reported it (Hear).
	quiet bool
}

// Probe reports whether the permit is a half-open probe, whose outcome
// decides between closing and re-opening the breaker.
func (p Permit) Probe() bool { return p.probe != 0 }

// Allow asks for a permit for one call. In Closed it always succeeds,
// without a lock. In Open it fails until the cooldown (and MinOpen) is over;
// then exactly one caller moves the breaker to HalfOpen and gets a probe
// permit. In HalfOpen at most HalfOpenProbes probe permits are out at once.
// With Settings.ActiveProbing, Allow never gives probe permits: user traffic
// waits for AllowProbe's synthetic probes to close the breaker. A breaker
// tripped by TripObserved refuses every call, without a lock, until
// observations close it (see Observe).
func (b *Breaker) Allow() (Permit, bool) {
	w := b.word.Load()
	if stateOf(w) == Closed {
		return Permit{b: b, word: w, issued: b.mono(b.clock.Now())}, true
	}
	return b.allowSlow(w, false)
}

// AllowProbe asks for a probe permit for a synthetic probe sent by the
// gateway itself (active probing: a health URI or a tiny chat completion).
// It succeeds when Allow would give a probe permit, whatever ActiveProbing
// says, and fails in Closed (there is nothing to probe) and on a breaker
// tripped by TripObserved (a saturated server answers a probe fine; only an
// observation may close it).
func (b *Breaker) AllowProbe() (Permit, bool) {
	w := b.word.Load()
	if stateOf(w) == Closed {
		return Permit{}, false
	}
	return b.allowSlow(w, true)
}

func (b *Breaker) allowSlow(w uint64, synthetic bool) (Permit, bool) {
	userBlocked := !synthetic && b.cfg.Load().s.ActiveProbing
	if userBlocked || b.observed.Load() {
		return Permit{}, false
	}
	now := b.clock.Now()
	t := b.mono(now)
	// Refusals before a probe is due take no lock.
	switch stateOf(w) {
	case Open:
		if t < b.gate.Load() {
			return Permit{}, false
		}
	case HalfOpen:
		if t < b.busyUntil.Load() {
			return Permit{}, false
		}
	}

	b.mu.Lock()
	b.tickLocked(now)
	var p Permit
	ok := false
	switch w = b.word.Load(); {
	case b.observed.Load(): // tripped by TripObserved meanwhile
	case stateOf(w) == Closed:
		if !synthetic {
			p, ok = Permit{b: b, word: w, issued: t}, true
		}
	case stateOf(w) == Open:
		if !b.forever && t >= b.gate.Load() {
			b.halfOpenLocked(now)
			p, ok = b.takeProbeLocked(now, synthetic)
		}
	case stateOf(w) == HalfOpen:
		p, ok = b.takeProbeLocked(now, synthetic)
	}
	b.unlock()
	return p, ok
}

// halfOpenLocked moves an open breaker whose cooldown is over to HalfOpen.
func (b *Breaker) halfOpenLocked(now time.Time) {
	b.forced = false
	b.probeFails, b.probeDowns = 0, 0
	b.toLocked(HalfOpen, now, fmt.Sprintf("cooldown over after %s", now.Sub(b.openedAt)))
}

// takeProbeLocked hands out a probe permit if a slot is free.
func (b *Breaker) takeProbeLocked(now time.Time, synthetic bool) (Permit, bool) {
	c := b.cfg.Load()
	if len(b.probes) >= c.s.HalfOpenProbes {
		return Permit{}, false
	}
	b.lastProbe++
	b.probes = append(b.probes, probe{id: b.lastProbe, deadline: now.Add(c.s.ProbeTimeout)})
	b.updateBusyLocked()
	return Permit{b: b, word: b.word.Load(), probe: b.lastProbe, synthetic: synthetic, issued: b.mono(now)}, true
}

// updateBusyLocked publishes until when Allow may refuse without the lock.
func (b *Breaker) updateBusyLocked() {
	c := b.cfg.Load()
	if stateOf(b.word.Load()) != HalfOpen || len(b.probes) < c.s.HalfOpenProbes {
		b.busyUntil.Store(0)
		return
	}
	until := b.probes[0].deadline
	for _, p := range b.probes[1:] {
		if p.deadline.Before(until) {
			until = p.deadline
		}
	}
	if b.successes >= c.s.RecoverySuccesses && b.minOpenUntil.Before(until) {
		until = b.minOpenUntil // it closes then
	}
	b.busyUntil.Store(b.mono(until))
}

// Done records the outcome of the call the permit covered. ttft is the
// call's time to first token, for the slow-call rule (0 = unknown, never
// slow); reason says what happened ("http 502", "first byte timeout") and is
// kept as the last failure and in transitions. Done must be called exactly
// once per permit, on every path, so callers defer it — in a closure, so
// that the outcome is read when the call ends, and left Neutral if the
// gateway panics (see the package example); a second call is a no-op.
// The outcome of a permit issued before the breaker last changed state (a
// call in flight when it opened, or before Reset) is ignored.
func (p *Permit) Done(o Outcome, ttft time.Duration, reason string) {
	b := p.b
	if b == nil || p.done {
		return
	}
	p.done = true
	if p.probe != 0 {
		b.doneProbe(p.word, p.probe, p.synthetic, o, ttft, reason)
		return
	}
	if o == Neutral || b.word.Load() != p.word {
		return
	}
	c := b.cfg.Load()
	slow := o == Success && c.s.SlowTTFT > 0 && ttft > c.s.SlowTTFT
	if o == Success {
		// The server answered: a run of Down outcomes ends. A slow call
		// is a failure for the rules, so only a timely success dates the
		// last success (a first token, slow or not, does through Live).
		now := b.clock.Now()
		b.breakRunFor(now, p.issued)
		if !slow {
			b.lastLife.Store(b.mono(now))
			// The hot path: no lock; one atomic add, and stores only
			// where a run of failures ends.
			c.ratio.record(now, false, false)
			if b.consec.Load() != 0 {
				b.consec.Store(0)
			}
			if b.dirty.Load() && !p.quiet {
				b.fleet.Success(b.storeKey) // ends the fleet's run; rare
			}
			return
		}
	}
	b.doneFailure(p.word, p.issued, slow, o == Down, p.quiet, ttft, reason)
}

// failureReason composes the reason recorded for a failure.
func failureReason(slow bool, ttft, slowTTFT time.Duration, reason string) string {
	if !slow {
		if reason == "" {
			return "failure"
		}
		return reason
	}
	r := fmt.Sprintf("slow call: ttft %s > %s", ttft, slowTTFT)
	if reason != "" {
		r += " (" + reason + ")"
	}
	return r
}

// doneFailure records a failure (or slow call) of a closed-state permit and
// trips the breaker if a rule fires; down marks a Down outcome. The rules,
// in order (DESIGN §4, hard and statistical evidence):
//
//   - hard: ConsecutiveFailures Down outcomes in a row with no sign of life
//     or answer between them (a dead or hanging server), unless a sign of
//     life broke such a run within RatioWindow (an upstream that refuses
//     some connections and serves others; see breakRun), or ConsecutiveFailures
//     failures of any kind in a row with no success or first token within
//     RatioWindow (a server that fails everything);
//   - statistical: the Failures, FailureRatio and SlowRatio rules when
//     configured, unless WithOutlierDetector leaves them to the pool's
//     detector, which adds its own and opens the breaker with Eject.
//
// Failures amid successes never trip the ConsecutiveFailures rule: under
// uniform partial failure every upstream has runs of failures, and opening
// on them turns 50% success into 0%.
func (b *Breaker) doneFailure(w uint64, issued int64, slow, down, quiet bool, ttft time.Duration, reason string) {
	now := b.clock.Now()
	b.mu.Lock()
	defer b.unlock()
	if b.word.Load() != w {
		return
	}
	c := b.cfg.Load()
	s := c.s
	reason = failureReason(slow, ttft, s.SlowTTFT, reason)
	n := int(b.consec.Add(1))
	hr := 0
	if down {
		if hr = int(b.hardRun.Add(1)); hr == 1 {
			b.runStart.Store(b.mono(now))
		}
	} else if issued >= b.runStart.Load() {
		b.hardRun.Store(0) // the server answered a new attempt
	}
	c.fails.record(now, true, false)
	b.lastFailure, b.lastFailureAt = reason, now
	silent := !b.lifeWithin(now, s.RatioWindow)
	// An upstream that refuses some connections and serves others (see
	// breakRun): its runs of Down outcomes are no hard evidence here. (A
	// Fleet still hears of every Down outcome: its own rules judge them.)
	flaky := down && b.runBrokenWithin(now, s.RatioWindow)
	if b.fleet != nil && !quiet && (down || silent || s.AnyRun) {
		// Only what may be hard evidence is the fleet's business: its
		// rules count runs of failures, and a run amid this gateway's
		// successes is no outage (under uniform partial failure every
		// gateway sees such runs). Down outcomes and failures with no
		// success in the window are reported; the tenant breakers
		// (AnyRun) report every failure.
		b.fleet.Failure(b.storeKey, s, now, reason)
		// A fleet that opens key on this failure pushes to this breaker
		// too: apply it now, rather than tripping locally on top of it.
		if b.applyPushesLocked(); b.word.Load() != w {
			return
		}
	}
	c.ratio.record(now, true, slow)
	rc := c.ratio.sum(now)
	var why string
	ev := Hard
	switch fc := c.fails.sum(now).failures; {
	case s.ConsecutiveFailures > 0 && hr >= s.ConsecutiveFailures && !flaky:
		why = fmt.Sprintf("%d consecutive connection failures or first-byte timeouts, no sign of life between them", hr)
	case s.ConsecutiveFailures > 0 && s.AnyRun && n >= s.ConsecutiveFailures:
		why = fmt.Sprintf("%d consecutive failures", n)
	case s.ConsecutiveFailures > 0 && silent && n >= s.ConsecutiveFailures:
		why = fmt.Sprintf("%d consecutive failures, no success within %s", n, s.RatioWindow)
	case s.Failures > 0 && fc >= s.Failures:
		why, ev = fmt.Sprintf("%d failures within %s", fc, s.FailuresWindow), Statistical
	case s.FailureRatio > 0 && rc.requests >= s.MinRequests &&
		float64(rc.failures) >= s.FailureRatio*float64(rc.requests):
		why, ev = fmt.Sprintf("failure ratio %d/%d ≥ %g within %s", rc.failures, rc.requests, s.FailureRatio, s.RatioWindow), Statistical
	case s.SlowRatio > 0 && rc.requests >= s.MinRequests &&
		float64(rc.slow) >= s.SlowRatio*float64(rc.requests):
		why, ev = fmt.Sprintf("slow call ratio %d/%d ≥ %g within %s", rc.slow, rc.requests, s.SlowRatio, s.RatioWindow), Statistical
	}
	if why != "" && ev == Statistical && b.detector {
		// The pool's outlier detector judges these counts, with the
		// whole pool and its ejection cap in view (WithOutlierDetector).
		why = ""
	}
	if why != "" {
		why += "; last: " + reason
		b.openLocked(now, now.Add(b.cooldownLocked()), true, false, why)
		b.evidence.Store(uint32(ev))
		if ev == Statistical {
			b.holdRatioLocked(rc.failures, rc.requests)
		}
		if b.fleet != nil {
			// The fleet decides from the fleet's counts (Fleet.Failure);
			// this verdict protects this gateway alone.
			b.local = true
			return
		}
		b.publishOpenLocked(why)
		return
	}
	if b.store != nil {
		b.adoptStoreLocked(now)
	}
}

// doneProbe records the outcome of a half-open probe.
//
// Recovery is judged against the pool: a Down outcome or a failed synthetic
// probe re-opens at once (hard evidence, cooldown grown), except a Down
// outcome of an upstream that refuses only some connections (a probe
// success in this half-open, or a run broken within RatioWindow: see
// breakRun), which is judged as an error answer is; a user probe that
// the upstream answered with an error is tolerated while the failures stay
// within what an upstream failing like its pool would give before
// RecoverySuccesses successes (allowedProbeFailures of PeerRatio), so that
// under uniform failure a half-open upstream closes instead of flapping.
// In a healthy pool (PeerRatio 0) the first failure re-opens, as before.
func (b *Breaker) doneProbe(w, id uint64, synthetic bool, o Outcome, ttft time.Duration, reason string) {
	now := b.clock.Now()
	b.mu.Lock()
	defer b.unlock()
	if b.word.Load() != w || !b.removeProbeLocked(id) {
		return // the breaker moved on, or the probe timed out already
	}
	c := b.cfg.Load()
	slow := o == Success && c.s.SlowTTFT > 0 && ttft > c.s.SlowTTFT
	if o == Success {
		// The run that opened the breaker ends; a probe's success after
		// a trip is recovery, not the flakiness breakRun dates.
		b.hardRun.Store(0)
		if !slow {
			b.lastLife.Store(b.mono(now))
		}
	}
	// A refused or timed-out probe of an upstream that refuses only some
	// connections (see breakRun) is judged as any other failed probe.
	// So is one that follows a probe success of this half-open: the
	// server answers some connections.
	//
	// But ConsecutiveFailures refused or reset probes in a row, with no
	// success between them, are a dead server whatever its pool does: the
	// hard-evidence rule, so that a server that dies in a pool failing
	// (nearly) everything, or alone in its pool, is not routed to until
	// maxProbeFailures probes have failed.
	if o == Down {
		b.probeDowns++
	} else if o != Neutral {
		b.probeDowns = 0
	}
	deadRun := c.s.ConsecutiveFailures > 0 && b.probeDowns >= c.s.ConsecutiveFailures
	down := o == Down && (deadRun || b.successes == 0 && !b.runBrokenWithin(now, c.s.RatioWindow))
	switch {
	case o == Neutral:
	case down || (synthetic && (o == Failure || o == Down || slow)):
		reason = failureReason(slow, ttft, c.s.SlowTTFT, reason)
		b.probeFailedLocked(now, "probe failed: "+reason)
		return
	case o == Failure || o == Down || slow:
		b.probeFails++
		if allowed := allowedProbeFailures(b.PeerRatio(), c.s.RecoverySuccesses); b.probeFails > allowed {
			reason = "probe failed: " + failureReason(slow, ttft, c.s.SlowTTFT, reason)
			if allowed > 0 {
				reason = fmt.Sprintf("%d probes failed, more than the %d its pool's failure ratio %.2f explains; last: %s",
					b.probeFails, allowed, b.PeerRatio(), reason)
			}
			ev := b.evidence.Load()
			if b.successes > 0 {
				// It answered a probe: not down, nor failing everything,
				// but failing more than its pool: an outlier. Its pool's
				// detector counts it against the ejection cap at its
				// next run, and pardons the mildest hold over the cap.
				if ev != uint32(Statistical) {
					b.holdRatioLocked(b.probeFails, b.probeFails+b.successes)
				}
				ev = uint32(Statistical)
			}
			b.probeFailedLocked(now, reason)
			b.evidence.Store(ev) // still what it was: an outlier, or down
			return
		}
	default:
		b.successes++
		if b.fleet != nil && !b.local && !b.observed.Load() {
			b.fleet.ProbeSuccess(b.storeKey, c.s) // recovery counted fleet-wide
		}
	}
	b.tickLocked(now)
	b.updateBusyLocked()
}

func (b *Breaker) removeProbeLocked(id uint64) bool {
	for i, p := range b.probes {
		if p.id == id {
			b.probes = append(b.probes[:i], b.probes[i+1:]...)
			return true
		}
	}
	return false
}

// probeFailedLocked re-opens a half-open breaker with the grown cooldown,
// counting a failure. It keeps the observed mark (a Retry-After on a
// breaker that TripObserved opened).
//
// The re-open of a local trip (fleet mode) stays local: the failed probe is
// more of the evidence that this gateway's rules judged to be its own.
func (b *Breaker) probeFailedLocked(now time.Time, reason string) {
	b.consec.Add(1)
	b.cfg.Load().fails.record(now, true, false)
	b.reopenLocked(now, b.observed.Load(), b.local, reason)
}

// reopenLocked re-opens a half-open breaker with the grown cooldown, marked
// observed or not, and publishes it unless local. With a Fleet the
// cooldown grows from the larger of its own and the fleet's re-open count,
// and the re-open is published with the count (Fleet.Reopen).
func (b *Breaker) reopenLocked(now time.Time, observed, local bool, reason string) {
	b.lastFailure, b.lastFailureAt = reason, now
	if b.fleet != nil && !local {
		b.reopens = max(b.reopens, b.fleet.Reopens(b.storeKey)) // the fleet's re-opens
	}
	b.reopens++
	b.openLocked(now, now.Add(b.cooldownLocked()), true, observed, reason)
	if local {
		b.local = true
		return
	}
	if b.fleet != nil {
		b.fleet.Reopen(b.storeKey, b.gateTimeLocked(), reason, b.reopens)
		return
	}
	b.publishOpenLocked(reason)
}

// tickLocked applies the time-based changes that are due: probes past
// ProbeTimeout fail, and a half-open breaker whose recovery waited for
// MinOpen closes.
func (b *Breaker) tickLocked(now time.Time) {
	if stateOf(b.word.Load()) != HalfOpen {
		return
	}
	c := b.cfg.Load()
	for _, p := range b.probes {
		if !now.Before(p.deadline) {
			b.probeFailedLocked(now, fmt.Sprintf("probe timed out after %s", c.s.ProbeTimeout))
			return
		}
	}
	if b.successes >= c.s.RecoverySuccesses && !now.Before(b.minOpenUntil) {
		ejected := Evidence(b.evidence.Load()) == Statistical
		b.closeLocked(now, b.recoveredLocked(""), false, !b.local)
		if ejected {
			b.probation.Store(b.mono(now.Add(c.s.RatioWindow)))
		}
	}
}

// recoveredLocked is the reason a half-open breaker closes, with the
// verdict that closed it when known.
func (b *Breaker) recoveredLocked(last string) string {
	what := "probe successes"
	if b.observed.Load() {
		what = "healthy observations"
	}
	r := fmt.Sprintf("%d consecutive %s", b.successes, what)
	if last != "" {
		r += "; last: " + last
	}
	return r
}

// cooldownLocked is the jittered cooldown of an open: the base is
// min(OpenFor × 2^reopens, MaxOpen), raised to MinOpen, and the jitter
// spreads it upward over [base, base × (1 + 2 × OpenJitter)), so that
// MinOpen never cancels it (with the default OpenFor = MinOpen = 10s a
// symmetric jitter clamped at MinOpen put half of all first trips at
// exactly 10s). Near MaxOpen the range slides down to
// [MaxOpen × (1 − OpenJitter), MaxOpen), never below MinOpen.
func (b *Breaker) cooldownLocked() time.Duration {
	s := b.cfg.Load().s
	d := s.OpenFor
	for i := 0; i < b.reopens && d < s.MaxOpen; i++ {
		d *= 2
	}
	floor := max(s.MinOpen, 0)
	lo := max(min(d, s.MaxOpen), floor)
	hi := time.Duration(float64(lo) * (1 + 2*OpenJitter))
	if hi > s.MaxOpen {
		hi = max(s.MaxOpen, lo)
		lo = max(min(lo, time.Duration(float64(hi)*(1-OpenJitter))), floor)
	}
	r := b.rand()
	if !(r >= 0 && r < 1) {
		r = 0
	}
	return lo + time.Duration(r*float64(hi-lo))
}

// openLocked moves the breaker to Open until `until` (zero: forced open
// until closed, as the fleet may say; see Adopt), and until MinOpen is
// over if useMinOpen; observed marks a trip by TripObserved.
func (b *Breaker) openLocked(now, until time.Time, useMinOpen, observed bool, reason string) {
	forever := until.IsZero()
	if forever {
		until = now
	}
	b.openedAt = now
	b.openUntil = until
	b.useMinOpen = useMinOpen
	b.minOpenUntil = b.minOpenFromLocked(now)
	b.forced, b.forever = forever, forever
	b.local = false
	b.observed.Store(observed)
	// Callers with statistical evidence say so after; an observed trip
	// has its own mark (Observed).
	if observed {
		b.evidence.Store(uint32(EvidenceNone))
	} else {
		b.evidence.Store(uint32(Hard))
	}
	b.setGateLocked()
	b.probes = b.probes[:0]
	b.successes = 0
	b.busyUntil.Store(0)
	b.toLocked(Open, now, reason)
}

// publishOpenLocked tells the store that the breaker is open, and why.
func (b *Breaker) publishOpenLocked(reason string) {
	if b.store != nil {
		b.store.PutOpen(b.storeKey, b.gateTimeLocked(), reason)
	}
}

// gateTimeLocked is when an open breaker may first let a probe in; zero
// when forced open until closed.
func (b *Breaker) gateTimeLocked() time.Time {
	if b.forever {
		return time.Time{}
	}
	if b.minOpenUntil.After(b.openUntil) {
		return b.minOpenUntil
	}
	return b.openUntil
}

func (b *Breaker) minOpenFromLocked(openedAt time.Time) time.Time {
	if !b.useMinOpen {
		return openedAt
	}
	return openedAt.Add(max(b.cfg.Load().s.MinOpen, 0))
}

func (b *Breaker) setGateLocked() {
	if b.forever {
		b.gate.Store(gateForever)
		return
	}
	b.gate.Store(b.mono(b.gateTimeLocked()))
}

// closeLocked moves the breaker to Closed with empty windows and counters;
// reset also forgets the last failure; publish tells the store.
func (b *Breaker) closeLocked(now time.Time, reason string, reset, publish bool) {
	b.cfg.Store(b.cfg.Load().fresh(now))
	b.consec.Store(0)
	b.hardRun.Store(0)
	b.reopens = 0
	b.probes = b.probes[:0]
	b.successes = 0
	b.probeFails, b.probeDowns = 0, 0
	b.forced, b.forever = false, false
	b.local = false
	b.observed.Store(false)
	b.evidence.Store(uint32(EvidenceNone))
	b.probation.Store(0)
	b.openedAt, b.openUntil, b.minOpenUntil, b.useMinOpen = time.Time{}, time.Time{}, time.Time{}, false
	b.busyUntil.Store(0)
	if reset {
		b.lastFailure, b.lastFailureAt = "", time.Time{}
	}
	b.toLocked(Closed, now, reason)
	if reset {
		b.since = now
	}
	if publish && b.store != nil {
		b.store.ClearOpen(b.storeKey)
	}
}

// toLocked publishes state st with a new generation and queues the
// transition for the listener if the state changed.
func (b *Breaker) toLocked(st State, now time.Time, reason string) {
	w := b.word.Load()
	from := stateOf(w)
	b.word.Store((w>>2+1)<<2 | uint64(st))
	if from == st {
		return
	}
	b.since = now
	if b.listener == nil {
		return
	}
	t := Transition{
		Key:                 b.key,
		From:                from,
		To:                  st,
		At:                  now,
		Reason:              reason,
		ConsecutiveFailures: int(b.consec.Load()),
		FailuresInWindow:    b.cfg.Load().fails.sum(now).failures,
	}
	if st == Open {
		t.OpenUntil = b.gateTimeLocked()
	}
	if st != Closed {
		t.Evidence = Evidence(b.evidence.Load())
	}
	b.pending = append(b.pending, t)
}

// unlock applies the fleet's verdicts that were pushed while the lock was
// held (see Adopt), releases the lock and delivers queued transitions.
//
// Every release of mu goes through here, or happens inside deliver, which
// only unlock calls: so a push that found the lock taken is seen by the
// check after the release below, and applied by whichever goroutine then
// takes the lock, never left waiting for the breaker's next use.
func (b *Breaker) unlock() {
	for {
		b.applyPushesLocked()
		deliver := len(b.pending) > 0
		b.mu.Unlock()
		if deliver {
			b.deliver()
		}
		if !b.pushed.Load() || !b.mu.TryLock() {
			return
		}
	}
}

// deliver calls the listener for queued transitions, in order, one
// goroutine at a time. A goroutine that finds another delivering leaves its
// transitions to it; the deliverer looks again after letting go.
func (b *Breaker) deliver() {
	for {
		if !b.notifyMu.TryLock() {
			return
		}
		b.drain()
		b.mu.Lock()
		more := len(b.pending) > 0
		b.mu.Unlock()
		if !more {
			return
		}
	}
}

func (b *Breaker) drain() {
	defer b.notifyMu.Unlock()
	for {
		b.mu.Lock()
		q := b.pending
		b.pending = nil
		b.mu.Unlock()
		if len(q) == 0 {
			return
		}
		for _, t := range q {
			b.listener(t)
		}
	}
}

// RetryAt returns the earliest time the breaker may accept a call again, for
// the Retry-After of a 503: zero if Allow would succeed now. In Open it is
// the end of the cooldown (and MinOpen), or now+MaxOpen as a hint when
// forced open until closed; in HalfOpen with every slot taken, the time the
// oldest probe times out (a slot is certain to free by then, usually much
// sooner); with ActiveProbing, and on a breaker tripped by TripObserved,
// never zero outside Closed (now when a probe or an observation is due: in
// HalfOpen, the next observation decides).
func (b *Breaker) RetryAt() time.Time {
	if stateOf(b.word.Load()) == Closed {
		return time.Time{}
	}
	now := b.clock.Now()
	b.mu.Lock()
	defer b.unlock()
	b.tickLocked(now)
	s := b.cfg.Load().s
	var at time.Time
	switch stateOf(b.word.Load()) {
	case Closed:
		return time.Time{}
	case Open:
		if b.forever {
			return now.Add(s.MaxOpen)
		}
		at = b.gateTimeLocked()
	case HalfOpen:
		if len(b.probes) >= s.HalfOpenProbes {
			at = b.probes[0].deadline
			for _, p := range b.probes[1:] {
				if p.deadline.Before(at) {
					at = p.deadline
				}
			}
		}
	}
	if !at.After(now) {
		if !s.ActiveProbing && !b.observed.Load() {
			return time.Time{}
		}
		at = now
	}
	return at
}

// ProbeDue reports whether a synthetic probe may be sent now (active
// probing): the breaker is open with its cooldown over, or half-open with a
// free probe slot. The gateway then calls AllowProbe. It is false on a
// breaker tripped by TripObserved: only observations recover it.
func (b *Breaker) ProbeDue() bool {
	if stateOf(b.word.Load()) == Closed || b.observed.Load() {
		return false
	}
	now := b.clock.Now()
	b.mu.Lock()
	defer b.unlock()
	b.tickLocked(now)
	switch stateOf(b.word.Load()) {
	case Open:
		return !b.forever && b.mono(now) >= b.gate.Load()
	case HalfOpen:
		return len(b.probes) < b.cfg.Load().s.HalfOpenProbes
	}
	return false
}

// ExtendOpen applies an upstream's Retry-After (from a 429 or 503): the
// upstream asked for no traffic for d. It opens the breaker until
// max(current end, now+d), with d clamped to MaxOpen:
//   - Open: the cooldown end moves out to now+d if that is later (a breaker
//     forced open until closed is left alone);
//   - Closed: it opens for exactly d (MinOpen does not apply: the upstream
//     said when), without counting as a re-open;
//   - HalfOpen: the Retry-After answers the probe: it re-opens for exactly
//     d, counting the failure but not a re-open (the upstream said when;
//     a grown cooldown would double what it asked for).
//
// A probe's outcome that comes after its ExtendOpen is ignored (the
// breaker moved on), so callers give a probe's Retry-After first.
//
// A breaker that TripObserved opened stays observed: a Retry-After says
// nothing about the saturation being over, so it moves the cooldown end out
// (Open) or re-opens (HalfOpen) as above, and recovery is still by Observe.
//
// When it ends the breaker half-opens as after any trip. d ≤ 0 and d >
// MaxRetryAfter (junk) are ignored. Callers record the call's failure with
// Done as well; the order does not matter.
func (b *Breaker) ExtendOpen(d time.Duration, reason string) {
	if d <= 0 || d > MaxRetryAfter {
		return
	}
	now := b.clock.Now()
	b.mu.Lock()
	defer b.unlock()
	b.tickLocked(now)
	s := b.cfg.Load().s
	until := now.Add(min(d, s.MaxOpen))
	reason = fmt.Sprintf("retry-after %s", d) + suffix(reason)
	switch stateOf(b.word.Load()) {
	case Open:
		if b.forever || !until.After(b.openUntil) {
			return
		}
		b.openUntil = until
		b.local = false // the upstream said so: it applies fleet-wide
		b.setGateLocked()
		b.publishOpenLocked(reason)
	case Closed:
		b.openLocked(now, until, false, false, reason)
		b.publishOpenLocked(reason)
	case HalfOpen:
		b.consec.Add(1)
		b.cfg.Load().fails.record(now, true, false)
		b.lastFailure, b.lastFailureAt = reason, now
		ev := b.evidence.Load()
		b.openLocked(now, until, false, b.observed.Load(), reason)
		if !b.observed.Load() {
			b.evidence.Store(ev) // what held it before still does
		}
		b.publishOpenLocked(reason)
	}
}

func suffix(reason string) string {
	if reason == "" {
		return ""
	}
	return ": " + reason
}

// ForceOpen opens the breaker by operator decision (admin API, draining a
// server for maintenance): for d, after which it half-opens as usual, or
// with d ≤ 0 until ForceClose or Reset. MaxOpen does not cap d. It does not
// count as a re-open. It clears the mark of TripObserved: once the forced
// open ends, the breaker half-opens and recovers by probes.
func (b *Breaker) ForceOpen(d time.Duration, reason string) {
	now := b.clock.Now()
	b.mu.Lock()
	defer b.unlock()
	reason = "forced open" + suffix(reason)
	until := now.Add(d)
	if d <= 0 {
		until = now
	}
	// Set the gate before the word goes Open, so lock-free readers never
	// see Open with an old gate.
	b.forced, b.forever, b.useMinOpen = true, d <= 0, false
	b.local = false
	b.observed.Store(false)
	b.evidence.Store(uint32(Hard))
	b.openedAt, b.openUntil, b.minOpenUntil = now, until, now
	b.setGateLocked()
	b.probes = b.probes[:0]
	b.successes = 0
	b.busyUntil.Store(0)
	b.toLocked(Open, now, reason)
	b.publishOpenLocked(reason)
}

// ForceClose closes the breaker by operator decision: windows, counters and
// re-open count start afresh; the last failure is kept for the admin API.
func (b *Breaker) ForceClose(reason string) {
	now := b.clock.Now()
	b.mu.Lock()
	defer b.unlock()
	b.closeLocked(now, "forced closed"+suffix(reason), false, true)
}

// Reset returns the breaker to the state of a new one: closed, with no
// history. Permits issued before are ignored when they are done.
func (b *Breaker) Reset() {
	now := b.clock.Now()
	b.mu.Lock()
	defer b.unlock()
	b.closeLocked(now, "reset", true, true)
}

// SetSettings replaces the rules, keeping the state (a config reload): new
// thresholds apply from the next recorded outcome; an open breaker keeps
// its cooldown end, clamped to now+MaxOpen, with MinOpen counted from when
// it opened; a half-open breaker closes at once if it already has the new
// RecoverySuccesses (and MinOpen is over). The rolling windows keep their
// counts unless their duration changed.
func (b *Breaker) SetSettings(s Settings) {
	now := b.clock.Now()
	b.mu.Lock()
	defer b.unlock()
	c := newConfig(s, now, b.cfg.Load())
	b.cfg.Store(c)
	switch stateOf(b.word.Load()) {
	case Open:
		if b.forced {
			break
		}
		if lim := now.Add(c.s.MaxOpen); b.openUntil.After(lim) {
			b.openUntil = lim
		}
		b.minOpenUntil = b.minOpenFromLocked(b.openedAt)
		b.setGateLocked()
	case HalfOpen:
		b.minOpenUntil = b.minOpenFromLocked(b.openedAt)
		b.tickLocked(now)
		b.updateBusyLocked()
	}
}

// Snapshot returns the breaker's state for the admin API, after applying
// the time-based changes that are due.
func (b *Breaker) Snapshot() Snapshot {
	now := b.clock.Now()
	b.mu.Lock()
	defer b.unlock()
	b.tickLocked(now)
	c := b.cfg.Load()
	snap := Snapshot{
		Key:                 b.key,
		State:               stateOf(b.word.Load()),
		Since:               b.since,
		ConsecutiveFailures: int(b.consec.Load()),
		FailuresInWindow:    c.fails.sum(now).failures,
		Forced:              b.forced,
		Observed:            b.observed.Load(),
		Local:               b.local,
		ProbesInFlight:      len(b.probes),
		ProbeSuccesses:      b.successes,
		ProbeFailures:       b.probeFails,
		PeerRatio:           b.PeerRatio(),
		Reopens:             b.reopens,
		LastFailure:         b.lastFailure,
		LastFailureAt:       b.lastFailureAt,
	}
	if c.s.FailureRatio > 0 || c.s.SlowRatio > 0 {
		rc := c.ratio.sum(now)
		snap.RequestsInWindow, snap.SlowInWindow = rc.requests, rc.slow
	}
	if snap.State != Closed {
		snap.Evidence = Evidence(b.evidence.Load())
	}
	if snap.State == Open {
		snap.OpenUntil = b.gateTimeLocked()
	}
	switch {
	case b.observed.Load():
	case snap.State == Open:
		snap.ProbeDue = !b.forever && b.mono(now) >= b.gate.Load()
	case snap.State == HalfOpen:
		snap.ProbeDue = len(b.probes) < c.s.HalfOpenProbes
	}
	return snap
}

// adoptStoreLocked opens a closed breaker that the store reports open
// (another gateway, or an earlier life of this key, tripped it).
func (b *Breaker) adoptStoreLocked(now time.Time) {
	if stateOf(b.word.Load()) != Closed {
		return
	}
	until, reason, ok := b.store.OpenUntil(b.storeKey, now)
	if !ok {
		return
	}
	s := b.cfg.Load().s
	if lim := now.Add(s.MaxOpen); until.IsZero() || until.After(lim) {
		until = lim
	}
	if !until.After(now) {
		return
	}
	b.openLocked(now, until, false, false, "open in store"+suffix(reason))
}
