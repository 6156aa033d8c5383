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

// rule is one constraint on Settings, stated once: bad reports a
// violation (with defaults applied) as the message Validate returns, and
// fix replaces the offending field with a workable value (sanitize), d
// being the defaults. Rules are applied in order, so a fix may rely on
// the fields of the rules before it (open_for's on max_open's).
type rule struct {
	bad func(s Settings) string
	fix func(s *Settings, d Settings)
}

// rules are every constraint on Settings; Validate reports them and
// sanitize enforces them, so the two cannot disagree.
var rules = []rule{
	{func(s Settings) string {
		return cond(s.ConsecutiveFailures < -1, "consecutive_failures %d: must be positive, or -1 to disable", s.ConsecutiveFailures)
	}, func(s *Settings, d Settings) { s.ConsecutiveFailures = d.ConsecutiveFailures }},
	{func(s Settings) string { return cond(s.Failures < 0, "failures %d: must not be negative", s.Failures) },
		func(s *Settings, d Settings) { s.Failures = 0 }},
	{func(s Settings) string {
		return cond(s.FailuresWindow < 0, "failures window %s: must be positive", s.FailuresWindow)
	}, func(s *Settings, d Settings) { s.FailuresWindow = d.FailuresWindow }},
	{func(s Settings) string { // also rejects NaN
		return cond(!(s.FailureRatio >= 0 && s.FailureRatio <= 1), "failure_ratio %v: must be within [0, 1]", s.FailureRatio)
	}, func(s *Settings, d Settings) { s.FailureRatio = 0 }},
	{func(s Settings) string {
		return cond(!(s.SlowRatio >= 0 && s.SlowRatio <= 1), "slow_ratio %v: must be within [0, 1]", s.SlowRatio)
	}, func(s *Settings, d Settings) { s.SlowRatio = 0 }},
	{func(s Settings) string {
		return cond(s.MinRequests < 1, "min_requests %d: must be positive", s.MinRequests)
	},
		func(s *Settings, d Settings) { s.MinRequests = d.MinRequests }},
	{func(s Settings) string {
		return cond(s.RatioWindow < 0, "ratio window %s: must be positive", s.RatioWindow)
	},
		func(s *Settings, d Settings) { s.RatioWindow = d.RatioWindow }},
	{func(s Settings) string { return cond(s.SlowTTFT < 0, "slow_ttft %s: must not be negative", s.SlowTTFT) },
		func(s *Settings, d Settings) { s.SlowTTFT = 0 }},
	{func(s Settings) string {
		return cond(s.SlowRatio > 0 && s.SlowTTFT <= 0, "slow_ratio %v: needs slow_ttft", s.SlowRatio)
	}, func(s *Settings, d Settings) { s.SlowRatio = 0 }},
	{func(s Settings) string { return cond(s.MaxOpen < 0, "max_open %s: must be positive", s.MaxOpen) },
		func(s *Settings, d Settings) { s.MaxOpen = d.MaxOpen }},
	{func(s Settings) string { return cond(s.OpenFor < 0, "open_for %s: must be positive", s.OpenFor) },
		func(s *Settings, d Settings) { s.OpenFor = min(d.OpenFor, s.MaxOpen) }},
	{func(s Settings) string {
		return cond(s.OpenFor > s.MaxOpen, "open_for %s: must not exceed max_open %s", s.OpenFor, s.MaxOpen)
	}, func(s *Settings, d Settings) { s.OpenFor = min(d.OpenFor, s.MaxOpen) }},
	{func(s Settings) string {
		return cond(s.MinOpen > s.MaxOpen, "min_open %s: must not exceed max_open %s", s.MinOpen, s.MaxOpen)
	}, func(s *Settings, d Settings) { s.MinOpen = s.MaxOpen }},
	{func(s Settings) string {
		return cond(s.HalfOpenProbes < 1, "half_open_probes %d: must be positive", s.HalfOpenProbes)
	}, func(s *Settings, d Settings) { s.HalfOpenProbes = d.HalfOpenProbes }},
	{func(s Settings) string {
		return cond(s.RecoverySuccesses < 1, "recovery_successes %d: must be positive", s.RecoverySuccesses)
	}, func(s *Settings, d Settings) { s.RecoverySuccesses = d.RecoverySuccesses }},
	{func(s Settings) string {
		return cond(s.ProbeTimeout < 0, "probe timeout %s: must be positive", s.ProbeTimeout)
	},
		func(s *Settings, d Settings) { s.ProbeTimeout = d.ProbeTimeout }},
}

// cond returns the formatted message when bad, else "".
func cond(bad bool, format string, args ...any) string {
	if !bad {
		return ""
	}
	return fmt.Sprintf(format, args...)
}

// Validate reports every field that is out of range, after defaults are
// applied (one error per rule broken, joined). Breakers built from invalid
// Settings use the default in place of each invalid field; configuration
// code should call Validate and refuse.
func (s Settings) Validate() error {
	s = s.WithDefaults()
	var errs []error
	for _, r := range rules {
		if msg := r.bad(s); msg != "" {
			errs = append(errs, errors.New(msg))
		}
	}
	return errors.Join(errs...)
}

// sanitize returns s with defaults applied and every invalid field replaced
// by its default (the fixes of the rules Validate reports), so that a
// breaker always has workable rules.
func (s Settings) sanitize() Settings {
	s = s.WithDefaults()
	d := Settings{}.WithDefaults()
	for _, r := range rules {
		if r.bad(s) != "" {
			r.fix(&s, d)
		}
	}
	return s
}
