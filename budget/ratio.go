package budget

import (
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
	"github.com/llmproxy/caddy-llm-proxy/internal/rolling"
)

// Defaults of RatioConfig.
const (
	// DefaultRatio is the share of original requests that may be retried:
	// 0.1, one retry per ten requests (the Google SRE book's per-client
	// retry budget; Finagle and Envoy default to 0.2).
	DefaultRatio = 0.1
	// DefaultWindow is the rolling window over which requests earn retries
	// and retries are charged: 10s, as Finagle's ttl.
	DefaultWindow = 10 * time.Second
	// DefaultMinPerSec is the floor of retries per second granted whatever
	// the traffic: 3 (the default; Envoy's retry_budget also lets
	// 3 retries through whatever the traffic, as min_retry_concurrency).
	DefaultMinPerSec = 3.0
)

// Off, set as RatioConfig.Ratio or RatioConfig.MinPerSec, turns that part of
// the budget off (a zero value means "use the default"). With both off the
// budget never grants a retry.
const Off = -1.0

// RatioConfig configures a Ratio budget. Zero fields take their defaults.
type RatioConfig struct {
	// Ratio is the share of original requests that may be retried over
	// the window, in [0, 1]; default 0.1. Off (-1) means none: only the
	// MinPerSec floor. Values above 1 are refused: at 1 the budget
	// already lets a dead fleet receive twice its offered load, beyond it
	// the budget no longer bounds a retry storm any better than
	// max_attempts does, and "10" is most likely a mistyped 10%.
	Ratio float64
	// Window is the rolling window over which requests earn retries and
	// retries are charged; default 10s, at least MinWindow (100ms). It is
	// kept as ten buckets, so it forgets Window/10 at a time.
	Window time.Duration
	// MinPerSec is the floor: retries per second granted whatever the
	// traffic, so that a service with little traffic can still retry;
	// default 3. It is a token bucket of one second's worth (MinPerSec
	// tokens, at least 1) refilled at MinPerSec per second, drawn on only
	// when the ratio part is spent: a burst of failures gets at most one
	// second of the floor at once, never MinPerSec × Window. Off (-1)
	// means no floor.
	MinPerSec float64
}

// withDefaults returns c with zero fields set to their defaults and Off
// fields set to zero, or an error naming the first invalid field.
func (c RatioConfig) withDefaults() (RatioConfig, error) {
	switch {
	case c.Ratio == 0:
		c.Ratio = DefaultRatio
	case c.Ratio == Off:
		c.Ratio = 0
	case !(c.Ratio > 0 && c.Ratio <= 1): // also refuses NaN
		return c, fmt.Errorf("retry budget: ratio %v: must be in [0, 1] (a share of requests, not a percentage; above 1 a budget bounds nothing)", c.Ratio)
	}
	switch {
	case c.Window == 0:
		c.Window = DefaultWindow
	case c.Window < MinWindow:
		return c, fmt.Errorf("retry budget: window %v: must be at least %v", c.Window, MinWindow)
	}
	switch {
	case c.MinPerSec == 0:
		c.MinPerSec = DefaultMinPerSec
	case c.MinPerSec == Off:
		c.MinPerSec = 0
	case !(c.MinPerSec > 0 && c.MinPerSec <= 1e6): // also refuses NaN, +Inf
		return c, fmt.Errorf("retry budget: min_per_sec %v: must be in [0, 1e6]", c.MinPerSec)
	}
	return c, nil
}

// Ratio is the default retry budget: a retry is granted while the retries
// charged to the ratio in the rolling window, this one included, number at
// most Ratio × (original requests in the window); past that, while the
// floor (a token bucket of max(1, MinPerSec) tokens refilled at MinPerSec
// per second) holds a token.
//
// It follows Finagle's RetryBudget (deposits per request that expire after a
// ttl, plus minRetriesPerSec; Finagle's defaults are 20% and 10/s over 10s)
// and the Google SRE book's per-client retry budget (10%). Finagle grants
// its floor as a reserve of minRetriesPerSec × ttl, which a burst spends at
// once (30 retries for 3/s over 10s); here the floor holds one second, so
// that the promise "1 + Ratio, plus the floor per elapsed second" holds in
// bursts too. Envoy's retry_budget (budget_percent, min_retry_concurrency)
// bounds the same ratio over active rather than recent requests. gRPC's
// retryThrottling and the AWS SDKs' retry quota are token buckets: see
// Bucket.
//
// Bound. Over any run that starts when the budget is created and lasts T,
// the retries granted are at most
//
//	Ratio × requests + max(1, MinPerSec) + MinPerSec × T
//
// whatever the interleaving of concurrent calls (MinPerSec = 0: no floor
// term): a ratio retry's window is the ten buckets ending with the one it is
// charged to, the last retry of the run saw every ratio retry of its
// window, and every request earns Ratio in one window at most; the floor is
// a Bucket, whose own bound is exact. Since retries and requests leave the
// window together, a retry granted late in its window keeps counting after
// the requests that earned it have left, which only makes the budget
// stricter.
//
// The window is ten buckets advanced lazily by the injected clock; there is
// no goroutine. Request and TryRetry are lock-free and allocate nothing.
type Ratio struct {
	cfg RatioConfig
	ep  clockEpochs
	_   [64]byte
	// cur holds the epoch of the newest bucket that was charged a ratio
	// retry and its ratio retries. Every grant is one compare-and-swap of
	// this word, so concurrent TryRetry calls cannot over-grant.
	cur atomic.Uint64
	// past holds the final ratio retry count of older epochs, as (epoch,
	// count) words; the caller that moves cur to a newer epoch stores the
	// old epoch's count here first.
	past [rolling.Buckets]atomic.Uint64
	_    [64]byte
	reqs rolling.Ring
	// floor is the MinPerSec token bucket; nil without a floor. Its
	// grants are counted in floorRetries for Stats.
	floor        *Bucket
	floorRetries rolling.Ring
}

// NewRatio returns a Ratio budget. Zero fields of c take their defaults
// (DefaultRatio, DefaultWindow, DefaultMinPerSec); an invalid field is an
// error that names it. The window starts at clk.Now().
func NewRatio(c RatioConfig, clk clock.Reader) (*Ratio, error) {
	if clk == nil {
		return nil, errors.New("retry budget: nil clock")
	}
	c, err := c.withDefaults()
	if err != nil {
		return nil, err
	}
	r := &Ratio{cfg: c, ep: newClockEpochs(clk, c.Window)}
	r.cfg.Window = r.ep.Width() * rolling.Buckets
	if c.MinPerSec > 0 {
		if r.floor, err = NewBucket(max(1, c.MinPerSec), c.MinPerSec, clk); err != nil {
			return nil, fmt.Errorf("retry budget: floor: %w", err)
		}
	}
	return r, nil
}

// Config returns the configuration in use: defaults applied, Off fields as
// 0, Window rounded down to a multiple of 10ns.
func (r *Ratio) Config() RatioConfig { return r.cfg }

// Request records one original request, which earns Ratio retries for the
// next Window.
func (r *Ratio) Request() { r.reqs.Add(r.ep.now()) }

// TryRetry grants a retry (or hedge) and charges it at once, or refuses it:
// from the ratio part while it lasts, else from the floor. See Ratio for the
// rule.
func (r *Ratio) TryRetry() bool {
	now := r.ep.now()
	for {
		w := r.cur.Load()
		ep, n := r.state(w, now)
		if n >= rolling.CountMax || !r.fits(ep, n+1+r.pastRetries(ep)) {
			break
		}
		if r.cur.CompareAndSwap(w, rolling.Pack(ep, n+1)) {
			return true
		}
	}
	if r.floor != nil && r.floor.TryRetry() {
		r.floorRetries.Add(now)
		return true
	}
	return false
}

// state returns the epoch a retry asked for at epoch now is charged to (the
// newer of now and cur's epoch, so that the charged epoch never goes back)
// and the retries already charged to it. Before moving to a newer epoch it
// stores the old epoch's count in past, where every later reader sees it.
func (r *Ratio) state(w, now uint64) (ep, n uint64) {
	ep, n = rolling.Unpack(w)
	if now <= ep {
		return ep, n
	}
	if ep != 0 {
		r.keep(ep, n)
	}
	return now, 0
}

// keep records that epoch ep had n retries, unless a newer epoch or a
// larger count for ep is already there (a slower caller storing an older
// reading).
func (r *Ratio) keep(ep, n uint64) {
	p := &r.past[ep%rolling.Buckets]
	for {
		old := p.Load()
		oe, on := rolling.Unpack(old)
		if oe > ep || (oe == ep && on >= n) {
			return
		}
		if p.CompareAndSwap(old, rolling.Pack(ep, n)) {
			return
		}
	}
}

// pastRetries returns the retries charged to the epochs of the window ending
// with ep, except ep itself.
func (r *Ratio) pastRetries(ep uint64) uint64 {
	var s uint64
	for i := range r.past {
		if e, n := rolling.Unpack(r.past[i].Load()); e < ep && rolling.InWindow(e, ep) {
			s += n
		}
	}
	return s
}

// fits reports whether ratio retries charged in the window ending with ep
// are within the ratio part of the budget.
func (r *Ratio) fits(ep, retries uint64) bool {
	return float64(retries) <= r.cfg.Ratio*float64(r.reqs.Sum(ep))
}

// Stats reports the requests and retries in the window and the retries
// available now.
func (r *Ratio) Stats() Stats {
	ep, n := r.state(r.cur.Load(), r.ep.now())
	retries := n + r.pastRetries(ep)
	reqs := r.reqs.Sum(ep)
	avail := max(0, math.Floor(r.cfg.Ratio*float64(reqs)-float64(retries)))
	if r.floor != nil {
		avail += float64(r.floor.Stats().Available)
	}
	return Stats{
		Window:    r.cfg.Window,
		Requests:  int(reqs),
		Retries:   int(retries + r.floorRetries.Sum(ep)),
		Available: int(min(avail, rolling.CountMax)),
	}
}
