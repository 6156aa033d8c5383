package breaker

import (
	"fmt"
	"time"
)

// State is a breaker's position in its state machine. The numeric values are
// the ones the caddy_llm_proxy_breaker_state gauge reports.
type State uint8

const (
	// Closed: traffic flows; outcomes are counted against the trip rules.
	Closed State = iota // gauge value 0
	// HalfOpen: the cooldown is over; at most HalfOpenProbes probe calls
	// are let through to decide between Closed and Open.
	HalfOpen // gauge value 1
	// Open: every call is refused until the cooldown is over.
	Open // gauge value 2
)

var stateNames = [...]string{Closed: "closed", HalfOpen: "half_open", Open: "open"}

// String returns "closed", "half_open" or "open": the value of the
// {http.llm_proxy.breaker_state} placeholder and of metric labels.
func (s State) String() string {
	if int(s) < len(stateNames) {
		return stateNames[s]
	}
	return fmt.Sprintf("state(%d)", s)
}

// MarshalText encodes the state as its String, for the admin API's JSON.
func (s State) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// UnmarshalText parses a state written by MarshalText.
func (s *State) UnmarshalText(b []byte) error {
	for i, n := range stateNames {
		if string(b) == n {
			*s = State(i)
			return nil
		}
	}
	return fmt.Errorf("breaker state %q: want closed, half_open or open", b)
}

// Outcome is what the caller tells the breaker about a call (DESIGN §3,
// failure classification).
type Outcome uint8

const (
	// Success: the call worked. With a TTFT above Settings.SlowTTFT it is
	// counted as a failure (a slow call).
	Success Outcome = iota
	// Failure: the call failed in a way that counts against the upstream:
	// dial error, first-byte timeout, 5xx, 429, 5xx-like in-band error,
	// stream cut after commit.
	Failure
	// Neutral: the call says nothing about the upstream (client gone, hedge
	// loser cancelled, config unloaded, a 4xx the request earned, a panic
	// in the gateway). It touches no counter and gives no verdict, but it
	// releases a probe slot.
	Neutral
	// Down: a failure that says the server may be down or hanging rather
	// than erring: the connection was refused or reset before a response,
	// the dial timed out, or no first event came within the first-byte
	// timeout. It counts as a Failure everywhere, and a run of them with no
	// sign of life for HardQuiet is hard evidence (see Hard).
	Down
)

var outcomeNames = [...]string{Success: "success", Failure: "failure", Neutral: "neutral", Down: "down"}

// String returns "success", "failure", "neutral" or "down".
func (o Outcome) String() string {
	if int(o) < len(outcomeNames) {
		return outcomeNames[o]
	}
	return fmt.Sprintf("outcome(%d)", o)
}

// Transition describes one state change, as given to the listener (WithListener)
// for logs, metrics and Caddy events.
type Transition struct {
	// Key identifies the breaker (upstream dial address, optionally with model).
	Key string
	// From and To are the states before and after; they always differ.
	From, To State
	// At is the clock's time of the change.
	At time.Time
	// Reason says why, e.g. "3 consecutive failures; last: http 502",
	// "probe succeeded 2 times", "forced open by operator: maintenance".
	Reason string
	// ConsecutiveFailures is the run of failures at the time of the change.
	ConsecutiveFailures int
	// FailuresInWindow is the number of failures within FailuresWindow.
	FailuresInWindow int
	// OpenUntil is, when To is Open, the earliest time the breaker may
	// half-open (the later of the cooldown's end and MinOpen); zero when
	// forced open until closed, and when To is not Open.
	OpenUntil time.Time
	// Evidence is what holds it open or half-open (To not Closed).
	Evidence Evidence
}

// Snapshot is a breaker's state for the admin API
// (GET /llm_proxy/breakers) and for debugging. Times are the clock's.
type Snapshot struct {
	// Key identifies the breaker.
	Key string `json:"key"`
	// State is the current state.
	State State `json:"state"`
	// Since is the time of the last transition (or of creation, or Reset).
	Since time.Time `json:"since"`
	// ConsecutiveFailures is the current run of failures (in Open, the run
	// that tripped it, plus failed probes).
	ConsecutiveFailures int `json:"consecutive_failures"`
	// FailuresInWindow counts failures within FailuresWindow. Calls in
	// flight when the breaker opened are not counted when they end.
	FailuresInWindow int `json:"failures_in_window"`
	// RequestsInWindow counts successes and failures within RatioWindow;
	// it is reported only when a ratio rule (FailureRatio, SlowRatio) is
	// on (the window itself is always kept: the pool's statistics and
	// OnProbation read it through RatioCounts).
	RequestsInWindow int `json:"requests_in_window,omitempty"`
	// SlowInWindow counts slow calls within RatioWindow (ratio rules on).
	SlowInWindow int `json:"slow_in_window,omitempty"`
	// OpenUntil is, in Open, the earliest time it may half-open; zero
	// otherwise, and zero when forced open until closed.
	OpenUntil time.Time `json:"open_until,omitzero"`
	// ProbeDue is true in Open once the cooldown has passed (the next
	// call, or the active prober, half-opens it: an idle upstream stays
	// Open until then), and in HalfOpen while a probe slot is free; false
	// when forced open until closed or tripped by observation.
	ProbeDue bool `json:"probe_due,omitempty"`
	// Evidence is what holds it open or half-open: "hard" (the upstream
	// is down or hanging, or said so) or "statistical" (it fails more than
	// its pool); absent when closed.
	Evidence Evidence `json:"evidence,omitempty"`
	// ProbeFailures is the number of failed probes tolerated so far in
	// HalfOpen: an upstream that fails like its pool (PeerRatio) closes.
	ProbeFailures int `json:"probe_failures,omitempty"`
	// PeerRatio is the failure ratio of the rest of its pool, as its pool
	// last reported it (SetPeerRatio).
	PeerRatio float64 `json:"peer_ratio,omitempty"`
	// Forced is true when an operator forced it open (ForceOpen).
	Forced bool `json:"forced,omitempty"`
	// Observed is true when it is open or half-open because of a signal
	// observed outside user traffic (TripObserved: a saturated server's
	// /metrics); it recovers by observation only, and no call is let
	// through until it closes. ProbeSuccesses then counts healthy
	// observations.
	Observed bool `json:"observed,omitempty"`
	// Local is true when it is open or half-open by its own trip rules
	// while its store is a Fleet: a verdict that protects this gateway
	// alone and was not published (the fleet's counts decide fleet-wide).
	// It turns false when the fleet opens the key too (Adopt).
	Local bool `json:"local,omitempty"`
	// ProbesInFlight is the number of probe permits out (HalfOpen).
	ProbesInFlight int `json:"probes_in_flight"`
	// ProbeSuccesses is the number of consecutive probe successes so far
	// in HalfOpen; RecoverySuccesses of them close it.
	ProbeSuccesses int `json:"probe_successes"`
	// Reopens is the number of consecutive re-opens (failed half-opens)
	// since the breaker was last closed; the cooldown is OpenFor × 2^Reopens.
	Reopens int `json:"reopens"`
	// LastFailure is the reason given with the last failure (or observed
	// trip, or unhealthy observation that re-opened it); empty until one is
	// recorded.
	LastFailure string `json:"last_failure,omitempty"`
	// LastFailureAt is the time of the last failure; zero until one.
	LastFailureAt time.Time `json:"last_failure_at,omitzero"`
}
