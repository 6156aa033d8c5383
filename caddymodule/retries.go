package caddymodule

import (
	"fmt"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/llmproxy/caddy-llm-proxy/budget"
	"github.com/llmproxy/caddy-llm-proxy/hedge"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
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
	// always allows, so low-traffic pools can still retry. Default: 3.
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
	MaxTokens float64 `json:"max_tokens"`
	// RefillPerSec is the rate at which tokens come back.
	RefillPerSec float64 `json:"refill_per_sec"`
}

// HedgeConfig turns on hedged requests: when no first event has arrived
// after the hedge delay, a backup attempt goes to another upstream and the
// first to produce an event wins; the other is cancelled at once. Off
// unless configured: hedging costs upstream load. Backups draw from the
// retry budget too, and go only to an upstream whose breaker is closed,
// from a primary whose breaker is closed.
type HedgeConfig struct {
	// After is a fixed hedge delay. Exclusive with Percentile.
	After caddy.Duration `json:"after,omitempty"`

	// Percentile sets the delay to this quantile (0.95 for p95) of the
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

	// MaxHedges is the most backups per request (each also counts against
	// max_attempts). Default: 1.
	MaxHedges int `json:"max_hedges,omitempty"`
}

func (c *HedgeConfig) policy() hedge.DelayPolicy {
	return hedge.DelayPolicy{Fixed: time.Duration(c.After), Percentile: c.Percentile,
		Min: time.Duration(c.Min), Max: time.Duration(c.Max), Fallback: time.Duration(c.Fallback)}
}

// Defaults of RetryConfig and HedgeConfig.
const (
	defaultRetryRatio     = 0.1
	defaultRetryWindow    = 10 * time.Second
	defaultRetryMinPerSec = 3
	defaultBackoffBase    = 100 * time.Millisecond
	defaultBackoffCap     = 2 * time.Second
)

// parseRetries parses a retries block; d is at "retries".
func parseRetries(d *caddyfile.Dispenser) (*RetryConfig, error) {
	rc := new(RetryConfig)
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		args := d.RemainingArgs()
		switch name {
		case "ratio":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			r, err := parseRatio(d, name, args[0])
			if err != nil {
				return nil, err
			}
			rc.Ratio = r
		case "window":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			dur, err := parsePositiveDuration(d, "retries window", args[0])
			if err != nil {
				return nil, err
			}
			rc.Window = caddy.Duration(dur)
		case "min_per_sec":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			f, err := parseNonNegative(d, name, args[0])
			if err != nil {
				return nil, err
			}
			rc.MinPerSec = f
		case "bucket":
			if len(args) != 2 {
				return nil, d.Errf("want: bucket <max_tokens> <refill_per_sec>")
			}
			maxTokens, err := parseNonNegative(d, "bucket max_tokens", args[0])
			if err != nil || maxTokens < 1 {
				return nil, d.Errf("bad bucket max_tokens %q: want a number ≥ 1", args[0])
			}
			refill, err := parseNonNegative(d, "bucket refill_per_sec", args[1])
			if err != nil || refill <= 0 {
				return nil, d.Errf("bad bucket refill_per_sec %q: want a positive number such as 0.5", args[1])
			}
			rc.Bucket = &TokenBucket{MaxTokens: maxTokens, RefillPerSec: refill}
		case "backoff":
			if len(args) != 2 {
				return nil, d.Errf("want: backoff <base> <cap>")
			}
			base, err := parsePositiveDuration(d, "backoff base", args[0])
			if err != nil {
				return nil, err
			}
			capD, err := parsePositiveDuration(d, "backoff cap", args[1])
			if err != nil {
				return nil, err
			}
			if capD < base {
				return nil, d.Errf("backoff cap %v is below its base %v", capD, base)
			}
			rc.BackoffBase, rc.BackoffCap = caddy.Duration(base), caddy.Duration(capD)
		default:
			return nil, d.Errf("unrecognized retries option %q", name)
		}
	}
	if rc.Bucket != nil && (rc.Ratio != 0 || rc.Window != 0 || rc.MinPerSec != 0) {
		return nil, d.Err("retries: bucket replaces ratio, window and min_per_sec; use one form")
	}
	return rc, nil
}

// retryGate adapts the pool's budget and the backoff to proxy.Retries.
type retryGate struct {
	budget  budget.Budget
	backoff budget.Backoff
}

func (g *retryGate) Request()       { g.budget.Request() }
func (g *retryGate) TryRetry() bool { return g.budget.TryRetry() }

// Backoff never waits past the backoff cap: a longer Retry-After is the
// client's to honour, and it gets the 429/503 with it at once.
func (g *retryGate) Backoff(n int, retryAfter, remaining time.Duration) (time.Duration, bool) {
	if remaining <= 0 || remaining > g.backoff.Cap {
		remaining = g.backoff.Cap
	}
	return g.backoff.Delay(n, retryAfter, remaining)
}

// budgetEntry holds a pool's retry budget in budgetPool, so it survives
// reloads (DESIGN §5).
type budgetEntry struct{ budget.Budget }

func (budgetEntry) Destruct() error { return nil }

// budgetPool holds budgets by pool identity and settings: a reload with the
// same upstreams and settings keeps the budget's window.
var budgetPool = caddy.NewUsagePool()

// provisionRetries builds the retry gate from the config.
func (h *Handler) provisionRetries() error {
	rc := h.Retries
	if rc == nil {
		rc = new(RetryConfig)
	}
	bo := budget.Backoff{Base: time.Duration(rc.BackoffBase), Cap: time.Duration(rc.BackoffCap)}
	if bo.Base <= 0 {
		bo.Base = defaultBackoffBase
	}
	if bo.Cap <= 0 {
		bo.Cap = defaultBackoffCap
	}
	if bo.Cap < bo.Base {
		return fmt.Errorf("retries: backoff cap %v is below its base %v", bo.Cap, bo.Base)
	}
	var key string
	var construct func() (caddy.Destructor, error)
	if rc.Bucket != nil {
		key = fmt.Sprintf("budget|%s|bucket|%g|%g", h.poolKey, rc.Bucket.MaxTokens, rc.Bucket.RefillPerSec)
		construct = func() (caddy.Destructor, error) {
			b, err := budget.NewBucket(rc.Bucket.MaxTokens, rc.Bucket.RefillPerSec, budget.SystemClock{})
			return budgetEntry{b}, err
		}
	} else {
		cfg := budget.RatioConfig{Ratio: rc.Ratio, Window: time.Duration(rc.Window), MinPerSec: rc.MinPerSec}
		key = fmt.Sprintf("budget|%s|ratio|%g|%v|%g", h.poolKey, cfg.Ratio, cfg.Window, cfg.MinPerSec)
		construct = func() (caddy.Destructor, error) {
			b, err := budget.NewRatio(cfg, budget.SystemClock{})
			return budgetEntry{b}, err
		}
	}
	v, _, err := budgetPool.LoadOrNew(key, construct)
	if err != nil {
		return fmt.Errorf("retries: %w", err)
	}
	h.budgetKey = key
	h.retryGate = &retryGate{budget: v.(budgetEntry).Budget, backoff: bo}
	return nil
}

// parseHedge parses a hedge block; d is at "hedge".
func parseHedge(d *caddyfile.Dispenser) (*HedgeConfig, error) {
	hc := new(HedgeConfig)
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	sawAfter := false
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		args := d.RemainingArgs()
		switch name {
		case "after":
			p, err := hedge.ParseAfter(args)
			if err != nil {
				return nil, d.Err(err.Error())
			}
			hc.After, hc.Percentile = caddy.Duration(p.Fixed), p.Percentile
			hc.Min, hc.Max, hc.Fallback = caddy.Duration(p.Min), caddy.Duration(p.Max), caddy.Duration(p.Fallback)
			sawAfter = true
		case "max_ratio":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			r, err := parseRatio(d, name, args[0])
			if err != nil {
				return nil, err
			}
			hc.MaxRatio = r
		case "max_hedges":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			n, err := strconv.Atoi(args[0])
			if err != nil || n < 1 || n > 9 {
				return nil, d.Errf("bad max_hedges %q: want a whole number from 1 to 9", args[0])
			}
			hc.MaxHedges = n
		default:
			return nil, d.Errf("unrecognized hedge option %q", name)
		}
	}
	if !sawAfter {
		return nil, d.Err("hedge: after is required (after <duration> or after p<NN>)")
	}
	return hc, nil
}

// hedger implements proxy.Hedging for one handler: the delay policy, the
// pool's hedge-rate cap and its TTFT trackers (both kept across reloads).
type hedger struct {
	policy    hedge.DelayPolicy
	cap       *hedge.RateCap
	maxHedges int
	h         *Handler
}

func (g *hedger) Delay(info proxy.RequestInfo) (time.Duration, bool) {
	d := g.policy.Delay(g.h.tracker(info))
	mode := "json"
	if info.Stream {
		mode = "stream"
	}
	metrics.hedgeDelay.WithLabelValues(modelLabel(info.Model), mode).Set(d.Seconds())
	return d, true
}
func (g *hedger) Request()       { g.cap.Request() }
func (g *hedger) TryHedge() bool { return g.cap.TryHedge() }
func (g *hedger) MaxHedges() int { return g.maxHedges }
func (g *hedger) Observe(info proxy.RequestInfo, ttft time.Duration) {
	g.h.tracker(info).Observe(ttft)
}

// hedgeEntry holds a rate cap or a TTFT tracker in hedgePool.
type hedgeEntry struct{ v any }

func (hedgeEntry) Destruct() error { return nil }

// hedgePool holds hedge-rate caps ("cap|pool|ratio") and TTFT trackers
// ("ttft|pool|model|stream") across reloads.
var hedgePool = caddy.NewUsagePool()

// provisionHedging builds the hedger; nil config leaves hedging off.
func (h *Handler) provisionHedging() error {
	hc := h.Hedge
	if hc == nil {
		return nil
	}
	p := hc.policy()
	if err := p.Validate(); err != nil {
		return fmt.Errorf("hedge: %w", err)
	}
	if hc.MaxHedges < 0 || hc.MaxRatio < 0 || hc.MaxRatio > 1 {
		return fmt.Errorf("hedge: max_hedges %d or max_ratio %g out of range", hc.MaxHedges, hc.MaxRatio)
	}
	capKey := fmt.Sprintf("cap|%s|%g", h.poolKey, hc.MaxRatio)
	v, _, err := hedgePool.LoadOrNew(capKey, func() (caddy.Destructor, error) {
		c, err := hedge.NewRateCap(hc.MaxRatio, 0, hedge.SystemClock{})
		return hedgeEntry{c}, err
	})
	if err != nil {
		return fmt.Errorf("hedge: %w", err)
	}
	h.hedgeKeys = append(h.hedgeKeys, capKey)
	h.hedger = &hedger{policy: p, cap: v.(hedgeEntry).v.(*hedge.RateCap), maxHedges: max(hc.MaxHedges, 1), h: h}
	return nil
}

// tracker returns the TTFT tracker of the pool for the request's model and
// mode (streamed TTFT and a full JSON body are different quantities).
func (h *Handler) tracker(info proxy.RequestInfo) *hedge.LatencyTracker {
	key := fmt.Sprintf("ttft|%s|%s|%t", h.poolKey, modelLabel(info.Model), info.Stream)
	if v, ok := h.trackers.Load(key); ok {
		return v.(*hedge.LatencyTracker)
	}
	h.stateMu.Lock()
	defer h.stateMu.Unlock()
	if v, ok := h.trackers.Load(key); ok {
		return v.(*hedge.LatencyTracker)
	}
	if h.cleaned {
		// A request finishing on a replaced config: share the current
		// tracker if there is one, without taking a reference.
		if e, ok := poolPeek(hedgePool, key).(hedgeEntry); ok {
			return e.v.(*hedge.LatencyTracker)
		}
		return hedge.NewLatencyTracker(0, hedge.SystemClock{})
	}
	v, _, _ := hedgePool.LoadOrNew(key, func() (caddy.Destructor, error) {
		return hedgeEntry{hedge.NewLatencyTracker(0, hedge.SystemClock{})}, nil
	})
	t := v.(hedgeEntry).v.(*hedge.LatencyTracker)
	h.trackers.Store(key, t)
	h.hedgeKeys = append(h.hedgeKeys, key)
	return t
}
