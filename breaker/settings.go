package breaker

import (
	"errors"
	"fmt"
	"time"
)

// Defaults applied by Settings.WithDefaults to zero-valued fields.
const (
	DefaultConsecutiveFailures = 3
	DefaultFailuresWindow      = 30 * time.Second
	DefaultMinRequests         = 20
	DefaultRatioWindow         = 30 * time.Second
	DefaultMinOpen             = 10 * time.Second
	DefaultOpenFor             = 10 * time.Second
	DefaultMaxOpen             = 5 * time.Minute
	DefaultHalfOpenProbes      = 1
	DefaultRecoverySuccesses   = 2
	DefaultProbeTimeout        = 60 * time.Second
)

// OpenJitter is the relative jitter applied to every open cooldown: the
// cooldown (at least MinOpen) is multiplied by a factor drawn uniformly from
// [1, 1+2×OpenJitter), so that breakers and gateways which tripped together
// do not all probe a recovering server at the same instant. The jitter is
// applied above the MinOpen floor, never cancelled by it (near MaxOpen the
// range slides down to end there).
const OpenJitter = 0.2

// MaxRetryAfter is the largest Retry-After that ExtendOpen accepts. A longer
// one is taken for junk (typically an HTTP date or a millisecond count read
// as seconds) and ignored; shorter ones are clamped to MaxOpen.
const MaxRetryAfter = 24 * time.Hour

// Settings are a breaker's trip, cooldown and recovery rules. Any trip rule
// that fires opens the breaker. A zero field takes the default documented on
// it (see WithDefaults), so the zero Settings is a working breaker that opens
// after 3 consecutive failures.
//
// A "failure" below is a Done with Outcome Failure, or a Success whose TTFT is
// above SlowTTFT (a slow call). Neutral outcomes are not counted at all, not
// even as requests.
type Settings struct {
	// ConsecutiveFailures is the hard-evidence rule (see Hard): the
	// breaker opens after this many Down outcomes in a row with no sign of
	// life between them (no success, no Live), unless a sign of life broke
	// such a run within RatioWindow (an upstream that refuses some
	// connections while it serves others is no dead server); or after
	// this many failures of any kind in a row when no success or first
	// token came within
	// RatioWindow. Runs of failures amid successes never fire it: under
	// uniform partial failure every upstream has them (gobreaker's
	// ConsecutiveFailures and Envoy's consecutive_5xx fire on any run, and
	// turn 50% success into 0%). Default 3; -1 disables the rule.
	ConsecutiveFailures int

	// AnyRun makes ConsecutiveFailures fire on any run of failures, amid
	// successes or not, as plain breakers do. For breakers whose failures
	// are not a sample of a pool of interchangeable servers: the tenant
	// breakers (admission/) set it. Default false.
	AnyRun bool

	// Failures opens the breaker when this many failures fall within
	// FailuresWindow (e.g. 10 within 30s), whatever the successes in
	// between. 0 (the default) disables the rule.
	Failures int

	// FailuresWindow is the rolling window of the Failures rule, and of the
	// "failures in window" figure in snapshots and transitions even when
	// the rule is off. Default 30s.
	FailuresWindow time.Duration

	// FailureRatio opens the breaker when failures/requests over RatioWindow
	// reach this ratio (0 < r ≤ 1), provided at least MinRequests requests
	// were recorded in the window (resilience4j's failureRateThreshold with
	// minimumNumberOfCalls). 0 (the default) disables the rule.
	FailureRatio float64

	// MinRequests is the number of requests (successes and failures, not
	// neutral outcomes) RatioWindow must hold before FailureRatio or
	// SlowRatio may fire. Default 20.
	MinRequests int

	// RatioWindow is the rolling window of FailureRatio and SlowRatio, of
	// the counts a pool's outlier rules read (RatioCounts), and the window
	// of "no success in the window" (ConsecutiveFailures); kept as 10
	// buckets of RatioWindow/10. Default 30s.
	RatioWindow time.Duration

	// SlowTTFT makes a successful call whose time to first token is above
	// it count as a failure: a degraded upstream keeps answering 200 while
	// TTFT climbs from half a second to forty (resilience4j's
	// slowCallDurationThreshold; there slow calls have only their own rate
	// rule, here they also feed every failure rule). A TTFT of 0 (unknown)
	// is never slow. 0 (the default) disables slow calls.
	SlowTTFT time.Duration

	// SlowRatio opens the breaker when slow calls/requests over RatioWindow
	// reach this ratio (0 < r ≤ 1), with at least MinRequests requests
	// (resilience4j's slowCallRateThreshold). Requires SlowTTFT. 0 (the
	// default) disables the rule.
	SlowRatio float64

	// MinOpen is the least time the breaker stays away from Closed once it
	// opens: it neither half-opens nor closes before it, even if probes
	// succeed. Default 10s; a negative value means no minimum.
	MinOpen time.Duration

	// OpenFor is the cooldown between opening and half-opening. It doubles
	// on each consecutive re-open (a probe failed), and every cooldown is
	// jittered upward by up to 2 × OpenJitter above its base
	// max(min(OpenFor × 2^reopens, MaxOpen), MinOpen), capped by MaxOpen. Envoy's outlier detection grows its ejection
	// linearly instead (base_ejection_time × times ejected, capped by
	// max_ejection_time, plus max_ejection_time_jitter); doubling reaches
	// the cap in fewer failed probes. Default 10s.
	OpenFor time.Duration

	// MaxOpen caps the grown cooldown and any Retry-After extension
	// (ExtendOpen). It does not cap ForceOpen. Default 5m.
	MaxOpen time.Duration

	// HalfOpenProbes is the number of probe permits that may be out at once
	// in the half-open state (gobreaker's MaxRequests; resilience4j's
	// permittedNumberOfCallsInHalfOpenState). Default 1.
	HalfOpenProbes int

	// RecoverySuccesses is the number of consecutive probe successes that
	// close the breaker (failsafe-go's success threshold). A probe failure
	// re-opens it at once. Default 2.
	RecoverySuccesses int

	// ProbeTimeout bounds a probe: a probe permit older than this counts as
	// a failed probe the next time the breaker is used, and its slot is
	// freed, so that a hanging probe can never wedge the breaker half-open.
	// Its Done, if it ever comes, is ignored. The gateway sets it to its
	// first_byte_timeout. Default 60s.
	ProbeTimeout time.Duration

	// ActiveProbing reserves the half-open probe slots for synthetic probes
	// sent by the gateway itself (ProbeDue, AllowProbe): user traffic is
	// refused until RecoverySuccesses synthetic probes have succeeded, so no
	// user request is risked on a server that may still hang.
	// Default false: user requests are the probes.
	ActiveProbing bool
}

// WithDefaults returns s with every zero field set to its default.
func (s Settings) WithDefaults() Settings {
	if s.ConsecutiveFailures == 0 {
		s.ConsecutiveFailures = DefaultConsecutiveFailures
	}
	if s.FailuresWindow == 0 {
		s.FailuresWindow = DefaultFailuresWindow
	}
	if s.MinRequests == 0 {
		s.MinRequests = DefaultMinRequests
	}
	if s.RatioWindow == 0 {
		s.RatioWindow = DefaultRatioWindow
	}
	if s.MinOpen == 0 {
		s.MinOpen = DefaultMinOpen
	}
	if s.OpenFor == 0 {
		s.OpenFor = DefaultOpenFor
	}
	if s.MaxOpen == 0 {
		s.MaxOpen = DefaultMaxOpen
	}
	if s.HalfOpenProbes == 0 {
		s.HalfOpenProbes = DefaultHalfOpenProbes
	}
	if s.RecoverySuccesses == 0 {
		s.RecoverySuccesses = DefaultRecoverySuccesses
	}
	if s.ProbeTimeout == 0 {
		s.ProbeTimeout = DefaultProbeTimeout
	}
	return s
}

// Validate reports every field that is out of range, after defaults are
// applied. Breakers built from invalid Settings use the default in place of
// each invalid field; configuration code should call Validate and refuse.
func (s Settings) Validate() error {
	s = s.WithDefaults()
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if s.ConsecutiveFailures < -1 {
		bad("consecutive_failures %d: must be positive, or -1 to disable", s.ConsecutiveFailures)
	}
	if s.Failures < 0 {
		bad("failures %d: must not be negative", s.Failures)
	}
	if s.FailuresWindow < 0 {
		bad("failures window %s: must be positive", s.FailuresWindow)
	}
	if !(s.FailureRatio >= 0 && s.FailureRatio <= 1) { // also rejects NaN
		bad("failure_ratio %v: must be within [0, 1]", s.FailureRatio)
	}
	if !(s.SlowRatio >= 0 && s.SlowRatio <= 1) {
		bad("slow_ratio %v: must be within [0, 1]", s.SlowRatio)
	}
	if s.MinRequests < 1 {
		bad("min_requests %d: must be positive", s.MinRequests)
	}
	if s.RatioWindow < 0 {
		bad("ratio window %s: must be positive", s.RatioWindow)
	}
	if s.SlowTTFT < 0 {
		bad("slow_ttft %s: must not be negative", s.SlowTTFT)
	}
	if s.SlowRatio > 0 && s.SlowTTFT == 0 {
		bad("slow_ratio %v: needs slow_ttft", s.SlowRatio)
	}
	if s.OpenFor < 0 {
		bad("open_for %s: must be positive", s.OpenFor)
	}
	if s.MaxOpen < 0 {
		bad("max_open %s: must be positive", s.MaxOpen)
	}
	if s.OpenFor > s.MaxOpen {
		bad("open_for %s: must not exceed max_open %s", s.OpenFor, s.MaxOpen)
	}
	if s.MinOpen > s.MaxOpen {
		bad("min_open %s: must not exceed max_open %s", s.MinOpen, s.MaxOpen)
	}
	if s.HalfOpenProbes < 1 {
		bad("half_open_probes %d: must be positive", s.HalfOpenProbes)
	}
	if s.RecoverySuccesses < 1 {
		bad("recovery_successes %d: must be positive", s.RecoverySuccesses)
	}
	if s.ProbeTimeout < 0 {
		bad("probe timeout %s: must be positive", s.ProbeTimeout)
	}
	return errors.Join(errs...)
}

// sanitize returns s with defaults applied and every invalid field replaced
// by its default, so that a breaker always has workable rules.
func (s Settings) sanitize() Settings {
	s = s.WithDefaults()
	d := Settings{}.WithDefaults()
	if s.ConsecutiveFailures < -1 {
		s.ConsecutiveFailures = d.ConsecutiveFailures
	}
	if s.Failures < 0 {
		s.Failures = 0
	}
	if s.FailuresWindow < 0 {
		s.FailuresWindow = d.FailuresWindow
	}
	if !(s.FailureRatio >= 0 && s.FailureRatio <= 1) {
		s.FailureRatio = 0
	}
	if !(s.SlowRatio >= 0 && s.SlowRatio <= 1) || s.SlowTTFT <= 0 {
		s.SlowRatio = 0
	}
	if s.MinRequests < 1 {
		s.MinRequests = d.MinRequests
	}
	if s.RatioWindow < 0 {
		s.RatioWindow = d.RatioWindow
	}
	if s.SlowTTFT < 0 {
		s.SlowTTFT = 0
	}
	if s.MaxOpen < 0 {
		s.MaxOpen = d.MaxOpen
	}
	if s.OpenFor < 0 || s.OpenFor > s.MaxOpen {
		s.OpenFor = min(d.OpenFor, s.MaxOpen)
	}
	if s.MinOpen > s.MaxOpen {
		s.MinOpen = s.MaxOpen
	}
	if s.HalfOpenProbes < 1 {
		s.HalfOpenProbes = d.HalfOpenProbes
	}
	if s.RecoverySuccesses < 1 {
		s.RecoverySuccesses = d.RecoverySuccesses
	}
	if s.ProbeTimeout < 0 {
		s.ProbeTimeout = d.ProbeTimeout
	}
	return s
}
