package caddymodule

import (
	"fmt"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// BreakerConfig configures the circuit breakers, one per upstream (or per
// upstream and model). Breakers are on by default with the defaults below;
// state is kept across config reloads, and new settings apply to it.
type BreakerConfig struct {
	// Disabled turns breakers off ("breaker off"). Default: false.
	Disabled bool `json:"disabled,omitempty"`

	// Scope is "upstream" (one breaker per upstream dial address) or
	// "model" (one per upstream and requested model, for servers that host
	// several models). Default: "upstream".
	Scope string `json:"scope,omitempty"`

	// ConsecutiveFailures opens the breaker after this many failures in a
	// row. Default: 3; -1 disables the rule.
	ConsecutiveFailures int `json:"consecutive_failures,omitempty"`

	// Failures opens the breaker when this many failures fall within
	// FailuresWindow. Default: 0 (rule off).
	Failures int `json:"failures,omitempty"`

	// FailuresWindow is the rolling window of the Failures rule.
	// Default: 30s.
	FailuresWindow caddy.Duration `json:"failures_window,omitempty"`

	// FailureRatio opens the breaker when failures/requests over
	// RatioWindow reach it, once MinRequests requests were seen.
	// Default: 0 (rule off).
	FailureRatio float64 `json:"failure_ratio,omitempty"`

	// MinRequests is the least number of requests in RatioWindow before a
	// ratio rule may fire. Default: 20.
	MinRequests int `json:"min_requests,omitempty"`

	// RatioWindow is the rolling window of FailureRatio and SlowRatio.
	// Default: 30s.
	RatioWindow caddy.Duration `json:"window,omitempty"`

	// SlowTTFT makes a successful attempt whose time to first token is
	// above it count as a failure (a degraded server answers 200 while its
	// TTFT climbs). Default: 0 (off).
	SlowTTFT caddy.Duration `json:"slow_ttft,omitempty"`

	// SlowRatio opens the breaker when slow calls/requests over RatioWindow
	// reach it (requires SlowTTFT). Default: 0 (rule off).
	SlowRatio float64 `json:"slow_ratio,omitempty"`

	// MinOpen is the least time an open breaker stays open, even if a
	// probe succeeds. Default: 10s.
	MinOpen caddy.Duration `json:"min_open,omitempty"`

	// OpenFor is the cooldown before half-open; it doubles (with ±20%
	// jitter) on each consecutive re-open, up to MaxOpen. Default: 10s.
	OpenFor caddy.Duration `json:"open_for,omitempty"`

	// MaxOpen caps the grown cooldown and a Retry-After extension.
	// Default: 5m.
	MaxOpen caddy.Duration `json:"max_open,omitempty"`

	// HalfOpenProbes is how many probe requests may be in flight at once
	// while half-open. Default: 1.
	HalfOpenProbes int `json:"half_open_probes,omitempty"`

	// RecoverySuccesses is how many consecutive probe successes close the
	// breaker. Default: 2.
	RecoverySuccesses int `json:"recovery_successes,omitempty"`

	// MaxEjection is the share of the pool's upstreams that may be held
	// open on statistical evidence (failing more than the rest of the pool,
	// or nearly always) at once, at least one: max(1, ⌊N × MaxEjection⌋).
	// Hard evidence (connections refused or reset, first-byte timeouts, no
	// success in the window) is not capped. Default: 0.3.
	MaxEjection float64 `json:"max_ejection,omitempty"`

	// PanicThreshold: when fewer than this share of the pool's upstreams
	// are available and some are held open on statistical evidence, the
	// pool routes over every upstream not held by hard evidence (Envoy's
	// panic threshold). -1 turns the rule off ("panic_threshold off").
	// Default: 0.5.
	PanicThreshold float64 `json:"panic_threshold,omitempty"`

	// Probe, when set, makes the gateway probe an open upstream itself
	// once its cooldown is over, instead of risking a user request: users
	// are routed elsewhere until RecoverySuccesses probes succeed.
	// Default: none (user requests are the probes).
	Probe *ActiveProbe `json:"probe,omitempty"`
}

// ActiveProbe is a synthetic request sent to an open upstream.
type ActiveProbe struct {
	// URI is the path of a GET probe, e.g. "/health". Default: "/health"
	// when Chat is empty.
	URI string `json:"uri,omitempty"`

	// Chat is a JSON body POSTed to /v1/chat/completions instead of the
	// GET; the probe succeeds on a 2xx with a complete body. Keep it small
	// (max_tokens 1). Default: none.
	Chat string `json:"chat,omitempty"`

	// Interval is the time between probes while the breaker is open.
	// Default: 5s.
	Interval caddy.Duration `json:"interval,omitempty"`
}

// settings converts the config into breaker settings; probeTimeout is the
// handler's first_byte_timeout, so a hanging probe fails at the same time a
// hanging user attempt would.
func (c *BreakerConfig) settings(probeTimeout time.Duration) breaker.Settings {
	if c == nil {
		c = &BreakerConfig{}
	}
	return breaker.Settings{
		ConsecutiveFailures: c.ConsecutiveFailures,
		Failures:            c.Failures,
		FailuresWindow:      time.Duration(c.FailuresWindow),
		FailureRatio:        c.FailureRatio,
		MinRequests:         c.MinRequests,
		RatioWindow:         time.Duration(c.RatioWindow),
		SlowTTFT:            time.Duration(c.SlowTTFT),
		SlowRatio:           c.SlowRatio,
		MinOpen:             time.Duration(c.MinOpen),
		OpenFor:             time.Duration(c.OpenFor),
		MaxOpen:             time.Duration(c.MaxOpen),
		HalfOpenProbes:      c.HalfOpenProbes,
		RecoverySuccesses:   c.RecoverySuccesses,
		ProbeTimeout:        probeTimeout,
		ActiveProbing:       c.Probe != nil,
	}
}

// validate checks what a Caddyfile would refuse too, so JSON configs get the
// same errors.
func (c *BreakerConfig) validate() error {
	if c == nil || c.Disabled {
		return nil
	}
	if c.Scope != "" && c.Scope != "upstream" && c.Scope != "model" {
		return fmt.Errorf("breaker: unknown scope %q: want upstream or model", c.Scope)
	}
	if p := c.Probe; p != nil {
		if p.URI != "" && p.Chat != "" {
			return fmt.Errorf("breaker probe: use uri or chat, not both")
		}
		if p.Interval < 0 {
			return fmt.Errorf("breaker probe: negative interval %v", time.Duration(p.Interval))
		}
	}
	if err := c.settings(0).Validate(); err != nil {
		return fmt.Errorf("breaker: %w", err)
	}
	if c.PanicThreshold < 0 && c.PanicThreshold != -1 {
		return fmt.Errorf("breaker: panic_threshold %v: want a ratio in (0, 1], or -1 (off)", c.PanicThreshold)
	}
	if err := c.ejection().Validate(); err != nil {
		return fmt.Errorf("breaker: %w", err)
	}
	return nil
}

// ejection returns the pool's ejection cap and panic rule (defaults for
// zero fields, as upstream.Ejection applies them).
func (c *BreakerConfig) ejection() upstream.Ejection {
	if c == nil {
		return upstream.Ejection{}
	}
	return upstream.Ejection{MaxEjection: c.MaxEjection, PanicThreshold: c.PanicThreshold}
}

// prober returns the active prober of the config, nil without one.
func (c *BreakerConfig) prober(t *transport, timeout time.Duration) *upstream.Prober {
	if c == nil || c.Probe == nil {
		return nil
	}
	return &upstream.Prober{
		Transport: t,
		URI:       c.Probe.URI,
		Chat:      c.Probe.Chat,
		Interval:  time.Duration(c.Probe.Interval),
		Timeout:   timeout,
	}
}
