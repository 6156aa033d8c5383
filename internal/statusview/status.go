// Package statusview turns a gateway's admin API state into the text of
// `caddy llm-proxy status`: a table of upstreams (breaker state, in-flight,
// saturation score and age, last failure), a table of tenants (tier,
// in-flight, queued, usage in the window, breaker) and the fleet state,
// readable at 80 columns.
//
// It knows the JSON of the admin API's GET endpoints (Endpoints) and
// nothing of Caddy or HTTP: the command fetches the bodies, combines them
// into one object keyed by endpoint (the shape of `--json`), and hands the
// decoded Status to Render.
package statusview

import (
	"encoding/json"
	"fmt"
	"time"
)

// Endpoints are the admin API's GET endpoints that a Status is made of,
// in the order the command fetches them: endpoint e is served at
// /llm_proxy/<e>, and its body is the value of key e in the combined
// object (`caddy llm-proxy status --json`).
var Endpoints = []string{"breakers", "saturation", "tenants", "fleet", "pools"}

// Status is one gateway's state: the decoded bodies of GET
// /llm_proxy/breakers, /llm_proxy/saturation, /llm_proxy/tenants,
// /llm_proxy/fleet and /llm_proxy/pools, under the endpoints' names. Fields the view does not
// show are not decoded.
type Status struct {
	Breakers   []Breaker    `json:"breakers"`
	Saturation []Saturation `json:"saturation"`
	Tenants    []Tenant     `json:"tenants"`
	Fleet      Fleet        `json:"fleet"`
	Pools      []Pool       `json:"pools"`
}

// Pool is one pool of GET /llm_proxy/pools (the JSON of the module's
// upstream.PoolStatus): its outlier state and the pool-wide rule.
type Pool struct {
	// Key identifies the pool; Handler names the handler it serves.
	Key     string `json:"key"`
	Handler string `json:"handler"`
	// Ejected is the upstreams held open on statistical evidence, of at
	// most MaxEjected.
	Ejected    int `json:"ejected"`
	MaxEjected int `json:"max_ejected"`
	// Panic: the pool routes over its ejected upstreams.
	Panic bool `json:"panic"`
	// Failed: the pool failed as a whole, since FailedSince, for
	// FailedReason; it answers 503 but for probes.
	Failed       bool      `json:"failed"`
	FailedSince  time.Time `json:"failed_since"`
	FailedReason string    `json:"failed_reason"`
}

// Breaker is one upstream breaker of GET /llm_proxy/breakers (the JSON of
// the module's upstream.BreakerView).
type Breaker struct {
	// Key is the breaker's key: the upstream's dial address, then
	// "|<model>" under scope model (gateways of earlier versions put
	// "~<policy>" after the address for some handlers).
	Key string `json:"key"`
	// Upstream is the dial address; Model the model under scope model.
	Upstream string `json:"upstream"`
	Model    string `json:"model"`
	// Policy is the fingerprint of the breaker's settings.
	Policy string `json:"policy"`
	// Handler names the handler (site) whose breaker it is ("" from
	// gateways of earlier versions, which shared breakers between
	// handlers and listed them in Handlers).
	Handler string `json:"handler"`
	// Pools are the pool labels of the handlers whose requests the
	// breaker governs.
	Pools []string `json:"pools"`
	// Handlers are the names of the handlers (sites) whose requests the
	// breaker governs (the Caddyfile's `name`, else "Caddyfile:<line>").
	Handlers []string `json:"handlers"`
	BreakerState
	// Inflight is the attempts in progress to the upstream.
	Inflight int64 `json:"inflight"`
	// Scope is "fleet" or "local"; OpenedBy the instance that opened it
	// fleet-wide.
	Scope    string `json:"scope"`
	OpenedBy string `json:"opened_by"`
}

// BreakerState is the part of a breaker snapshot (upstream or tenant
// breaker) that the view shows.
type BreakerState struct {
	// State is "closed", "half_open" or "open"; Since its last transition.
	State string    `json:"state"`
	Since time.Time `json:"since"`
	// OpenUntil is, while open, the earliest time it may half-open (zero
	// when forced open until closed).
	OpenUntil time.Time `json:"open_until"`
	// Forced: an operator forced it open; Observed: a saturation signal
	// opened it.
	Forced   bool `json:"forced"`
	Observed bool `json:"observed"`
	// ProbeDue: open with its cooldown over (the next call or probe
	// half-opens it), or half-open with a probe slot free.
	ProbeDue bool `json:"probe_due"`
	// ConsecutiveFailures is the current run of failures.
	ConsecutiveFailures int `json:"consecutive_failures"`
	// LastFailure is the reason given with the last failure, at
	// LastFailureAt (zero: none yet).
	LastFailure   string    `json:"last_failure"`
	LastFailureAt time.Time `json:"last_failure_at"`
}

// Saturation is one upstream's snapshot of GET /llm_proxy/saturation (the
// JSON of saturation.View).
type Saturation struct {
	Upstream string `json:"upstream"`
	// AgeSeconds is the age of the latest successful scrape in seconds,
	// -1 when none has succeeded; LastError the latest scrape's error.
	AgeSeconds float64 `json:"age_seconds"`
	LastError  string  `json:"last_error"`
	// Score is the saturation score (1 is saturated); ScoreKnown whether
	// its queue signal was known.
	Score      float64 `json:"score"`
	ScoreKnown bool    `json:"score_known"`
	// Inflight is this gateway's attempts in progress to the upstream.
	Inflight int64 `json:"inflight"`
}

// Tenant is one tenant of GET /llm_proxy/tenants (the JSON of
// admission.TenantView).
type Tenant struct {
	Tenant   string `json:"tenant"`
	Tier     string `json:"tier"`
	Inflight int    `json:"inflight"`
	Queued   int    `json:"queued"`
	// RequestsInWindow and TokensInWindow are the rolling minute's usage.
	RequestsInWindow int `json:"requests_in_window"`
	TokensInWindow   int `json:"tokens_in_window"`
	// MaxConcurrent, RPM and TPM are its limits (0: none).
	MaxConcurrent int `json:"max_concurrent"`
	RPM           int `json:"rpm"`
	TPM           int `json:"tpm"`
	// Breaker is its tenant breaker, nil when it has none.
	Breaker *BreakerState `json:"breaker"`
}

// Fleet is GET /llm_proxy/fleet.
type Fleet struct {
	// Mode is "fleet" (Redis in use), "local" (Redis away) or "off" (no
	// fleet configured).
	Mode       string     `json:"mode"`
	InstanceID string     `json:"instance_id"`
	Since      *time.Time `json:"since"`
	Instances  []Instance `json:"instances"`
	// Error is the instance listing's error, "" when it worked.
	Error string `json:"error"`
}

// Instance is a gateway of the fleet seen recently.
type Instance struct {
	ID       string    `json:"instance_id"`
	LastSeen time.Time `json:"last_seen"`
}

// Parse decodes the combined object (every key of Endpoints, each the
// endpoint's body). A missing key is an error naming it, so that a
// gateway without the endpoint is not shown as an idle one.
func Parse(combined []byte) (Status, error) {
	var keys map[string]json.RawMessage
	if err := json.Unmarshal(combined, &keys); err != nil {
		return Status{}, fmt.Errorf("admin API state: %w", err)
	}
	var s Status
	into := map[string]any{"breakers": &s.Breakers, "saturation": &s.Saturation, "tenants": &s.Tenants, "fleet": &s.Fleet, "pools": &s.Pools}
	for _, e := range Endpoints {
		raw, ok := keys[e]
		if !ok {
			return Status{}, fmt.Errorf("admin API state: no %q (GET /llm_proxy/%s)", e, e)
		}
		if err := json.Unmarshal(raw, into[e]); err != nil {
			return Status{}, fmt.Errorf("admin API state: GET /llm_proxy/%s: %w", e, err)
		}
	}
	return s, nil
}
