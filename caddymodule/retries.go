package caddymodule

import (
	"errors"
	"fmt"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/llmproxy/caddy-llm-proxy/budget"
	"github.com/llmproxy/caddy-llm-proxy/hedge"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// RetryConfig configures the retry budget and backoff. Retries happen only
// before commit, only for retryable failures (DESIGN §3), each to another
// upstream while one exists, and within max_attempts. The budget is shared
// by every request to the same upstream pool, survives reloads, and bounds
// extra load (retries and hedges together) as a fraction of traffic. On by
// default with the defaults below.
type RetryConfig struct {
	// Ratio allows retries while retries ≤ Ratio × requests over Window.
	// Default: 0.1 (at most 10% extra load, whatever the failure rate).
	Ratio float64 `json:"ratio,omitempty"`

	// Window is the rolling window of the ratio budget. Default: 10s.
	Window caddy.Duration `json:"window,omitempty"`

	// MinPerSec is a floor of retries per second that the ratio budget
	// always allows, so low-traffic pools can still retry: a token bucket
	// of one second's worth (MinPerSec tokens, at least 1) refilled at
	// MinPerSec per second, used once the ratio part is spent. Default: 3.
	MinPerSec float64 `json:"min_per_sec,omitempty"`

	// Bucket replaces the ratio budget with a token bucket: each retry
	// takes a token; tokens refill at a fixed rate up to a maximum.
	// Default: none (the ratio budget).
	Bucket *TokenBucket `json:"bucket,omitempty"`

	// BackoffBase is the base of the full-jitter backoff: retry n waits
	// uniformly in [0, min(BackoffCap, BackoffBase·2^n)]. Default: 100ms.
	BackoffBase caddy.Duration `json:"backoff_base,omitempty"`

	// BackoffCap caps the backoff, and the longest upstream Retry-After a
	// retry waits for (within stream_timeout); a longer one reaches the
	// client with its 429/503 at once. Default: 2s.
	BackoffCap caddy.Duration `json:"backoff_cap,omitempty"`
}

// TokenBucket is the token-bucket form of the retry budget.
type TokenBucket struct {
	// MaxTokens is the bucket's size: the largest burst of retries.
	// Required, at least 1; no default.
	MaxTokens float64 `json:"max_tokens"`
	// RefillPerSec is the rate at which tokens come back, per second.
	// Required, above 0; no default.
	RefillPerSec float64 `json:"refill_per_sec"`
}

// upstreamConfig converts the config (nil: defaults) for the pool; it
// refuses what the Caddyfile refuses, so JSON configs get the same errors.
func (rc *RetryConfig) upstreamConfig() (upstream.RetryConfig, error) {
	if rc == nil {
		rc = new(RetryConfig)
	}
	if rc.Bucket != nil && (rc.Ratio != 0 || rc.Window != 0 || rc.MinPerSec != 0) {
		return upstream.RetryConfig{}, errors.New("retries: bucket replaces ratio, window and min_per_sec; use one form")
	}
	if rc.Bucket != nil && (rc.Bucket.MaxTokens < 1 || rc.Bucket.RefillPerSec <= 0) {
		return upstream.RetryConfig{}, fmt.Errorf("retries: bucket %g %g: want max_tokens ≥ 1 and a positive refill_per_sec", rc.Bucket.MaxTokens, rc.Bucket.RefillPerSec)
	}
	if rc.BackoffBase < 0 || rc.BackoffCap < 0 {
		return upstream.RetryConfig{}, errors.New("retries: negative backoff")
	}
	out := upstream.RetryConfig{
		Ratio: rc.Ratio, Window: time.Duration(rc.Window), MinPerSec: rc.MinPerSec,
		Backoff: budget.Backoff{Base: time.Duration(rc.BackoffBase), Cap: time.Duration(rc.BackoffCap)},
	}
	if rc.Bucket != nil {
		out.BucketMax, out.BucketRefill = rc.Bucket.MaxTokens, rc.Bucket.RefillPerSec
	}
	return out, nil
}

// HedgeConfig turns on hedged requests: when no first event has arrived
// after the hedge delay, a backup attempt goes to another upstream and the
// first to produce an event wins; the other is cancelled at once. Off
// unless configured: hedging costs upstream load. Backups draw from the
// retry budget too, and go only to an upstream whose breaker is closed,
// from a primary whose breaker is closed.
type HedgeConfig struct {
	// After is a fixed hedge delay. Exclusive with Percentile; one of the
	// two is required (no default).
	After caddy.Duration `json:"after,omitempty"`

	// Percentile (no default; exclusive with After) sets the delay to this quantile (0.95 for p95) of the
	// recently observed TTFT of the pool and model (a histogram with a 60s
	// half-life), clamped to [Min, Max]. Dean and Barroso ("The Tail at
	// Scale", CACM 2013) hedge at p95.
	Percentile float64 `json:"percentile,omitempty"`

	// Min is the shortest percentile delay. Default: no bound.
	Min caddy.Duration `json:"min,omitempty"`

	// Max is the longest percentile delay. Default: no bound.
	Max caddy.Duration `json:"max,omitempty"`

	// Fallback is the percentile delay while fewer than 20 TTFTs have been
	// seen. Default: Max, else 1s.
	Fallback caddy.Duration `json:"fallback,omitempty"`

	// MaxRatio caps the share of requests that may hedge over a rolling
	// 10s window. Default: 0.1.
	MaxRatio float64 `json:"max_ratio,omitempty"`

	// MinPerSec is a floor of hedges per second that the cap always
	// allows (a reservoir of MinPerSec × 10s), so that a pool with little
	// traffic, where stragglers hurt most, still hedges: without it a pool
	// under 10 requests per 10s could never hedge at max_ratio 0.1.
	// Default: 1; -1 turns the floor off.
	MinPerSec float64 `json:"min_per_sec,omitempty"`

	// MaxHedges is the most backups per request (each also counts against
	// max_attempts). Default: 1.
	MaxHedges int `json:"max_hedges,omitempty"`
}

// upstreamConfig converts the config for the pool, with the checks the
// Caddyfile makes: every backup is an attempt, so max_hedges must leave
// room within maxAttempts.
func (c *HedgeConfig) upstreamConfig(maxAttempts int) (*upstream.HedgeConfig, error) {
	if c == nil {
		return nil, nil
	}
	p := hedge.DelayPolicy{Fixed: time.Duration(c.After), Percentile: c.Percentile,
		Min: time.Duration(c.Min), Max: time.Duration(c.Max), Fallback: time.Duration(c.Fallback)}
	if err := p.Validate(); err != nil {
		return nil, fmt.Errorf("hedge: %w", err)
	}
	if c.MaxHedges < 0 || c.MaxHedges > 9 {
		return nil, fmt.Errorf("hedge: max_hedges %d: want a whole number from 1 to 9", c.MaxHedges)
	}
	if c.MaxRatio < 0 || c.MaxRatio > 1 {
		return nil, fmt.Errorf("hedge: max_ratio %g: want a ratio in (0, 1]", c.MaxRatio)
	}
	if hedges := max(c.MaxHedges, 1); hedges >= maxAttempts {
		return nil, fmt.Errorf("hedge: %d backup(s) need max_attempts of at least %d (it is %d): every backup is an attempt", hedges, hedges+1, maxAttempts)
	}
	return &upstream.HedgeConfig{
		Policy:    p,
		Cap:       hedge.RateCapConfig{MaxRatio: c.MaxRatio, MinPerSec: c.MinPerSec},
		MaxHedges: c.MaxHedges,
	}, nil
}
