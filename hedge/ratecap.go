package hedge

import (
	"fmt"
	"math"
	"math/bits"
	"sync"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
	"github.com/llmproxy/caddy-llm-proxy/internal/rolling"
)

// Defaults of RateCapConfig (`max_ratio` in the hedge block; the floor and
// the window are not configurable in the Caddyfile).
const (
	// DefaultMaxRatio: at most 1 hedge per 10 requests, beyond the floor.
	DefaultMaxRatio = 0.1
	// DefaultMinPerSec: the floor grants 1 hedge per second whatever the
	// traffic, 10 per default window.
	DefaultMinPerSec = 1.0
	// DefaultWindow: the rolling window over which hedges and requests
	// are counted.
	DefaultWindow = 10 * time.Second
)

// Off, set as RateCapConfig.MinPerSec, turns the floor off (a zero value
// means "use the default"): hedges are then bounded by MaxRatio × requests
// alone, and a pool with fewer than 1/MaxRatio requests in the window never
// hedges.
const Off = -1.0

// MaxMinPerSec is the largest RateCapConfig.MinPerSec accepted.
const MaxMinPerSec = 1e6

// MinWindow is the shortest RateCapConfig.Window accepted (buckets of 1ms).
const MinWindow = rolling.Buckets * rolling.MinWidth

// ratioScale is the fixed-point scale of the ratio and the floor: the cap
// compares (hedges+1)·10⁶ with round(MaxRatio·10⁶)·requests + the floor in
// millionths of a hedge, in integers, so that it is exact for decimal
// settings (0.29 × 100 allows 29 hedges, which float64 arithmetic would not;
// 0.3/s over 10s allows 3).
const ratioScale = 1_000_000

// maxReserve bounds the floor, in millionths of a hedge (4.6·10¹² hedges per
// window), so that the cap's sums never overflow.
const maxReserve = 1 << 62

// RateCapConfig configures a RateCap. Zero fields take their defaults.
type RateCapConfig struct {
	// MaxRatio is the share of requests in the window that may hedge,
	// beyond the floor, in (0, 1]; default 0.1 (DefaultMaxRatio).
	MaxRatio float64
	// MinPerSec is the floor: hedges per second granted whatever the
	// traffic, so that a pool with little traffic still hedges; default 1
	// (DefaultMinPerSec), at most MaxMinPerSec. It is granted as a
	// reservoir of MinPerSec × Window hedges per window, which may be
	// spent in a burst. Off (-1) means no floor.
	MinPerSec float64
	// Window is the rolling window over which requests and hedges are
	// counted; default 10s (DefaultWindow), at least MinWindow (10ms). It
	// is kept as ten buckets, so it forgets Window/10 at a time.
	Window time.Duration
}

// withDefaults returns c with zero fields set to their defaults and Off set
// to zero, or an error naming the first invalid field.
func (c RateCapConfig) withDefaults() (RateCapConfig, error) {
	if c.MaxRatio == 0 {
		c.MaxRatio = DefaultMaxRatio
	}
	if !(c.MaxRatio > 0 && c.MaxRatio <= 1) { // also refuses NaN
		return c, fmt.Errorf("hedge rate cap: max_ratio %v must be above 0 and at most 1", c.MaxRatio)
	}
	switch {
	case c.MinPerSec == 0:
		c.MinPerSec = DefaultMinPerSec
	case c.MinPerSec == Off:
		c.MinPerSec = 0
	case !(c.MinPerSec > 0 && c.MinPerSec <= MaxMinPerSec): // also refuses NaN, +Inf
		return c, fmt.Errorf("hedge rate cap: min_per_sec %v must be above 0 and at most %g, or Off (-1)", c.MinPerSec, float64(MaxMinPerSec))
	}
	if c.Window == 0 {
		c.Window = DefaultWindow
	}
	if c.Window < MinWindow {
		return c, fmt.Errorf("hedge rate cap: window %v must be at least %v", c.Window, MinWindow)
	}
	return c, nil
}

// RateCap caps the share of requests that may hedge over a rolling window,
// above a small floor: a hedge is granted only if, counting it, the hedges
// charged in the window number at most
//
//	MaxRatio × (requests in the window) + MinPerSec × Window.
//
// So hedging adds at most MaxRatio to the upstream load, plus MinPerSec
// hedges a second, whatever the latencies do, and a fleet that has become
// slow everywhere (every request crossing the delay) is not asked for twice
// the work; while a pool with little traffic (fewer than 1/MaxRatio requests
// a window) can still hedge its stalled requests, up to MinPerSec × Window
// of them per window. The form is that of Finagle's RetryBudget (a ratio of
// deposits per request that expire after a ttl, plus a reserve of
// minRetriesPerSec × ttl), as budget.Ratio uses for retries; gRPC's retry
// throttling bounds the same ratio with a token bucket.
//
// Bound. Over any run that starts when the cap is created and lasts T, with
// W the window, the hedges granted are at most
//
//	MaxRatio × requests + MinPerSec × W × (⌊T/W⌋ + 1)
//
// exactly (in millionths of a hedge: MaxRatio and MinPerSec are rounded to
// the nearest 10⁻⁶, so decimal settings are exact), whatever the
// interleaving of concurrent calls: the last hedge of the run saw every hedge
// of its window, and the windows of the last hedges at least ten buckets
// apart do not overlap. With MinPerSec Off it is MaxRatio × requests.
//
// The window is rolling.Buckets (10) buckets of Window/10 each, aligned to
// the cap's creation and advanced lazily by the times read from the clock
// (no timer): at any time it covers the current bucket and the 9 before,
// that is between 0.9 and 1 window of history. A hedge stays charged in the
// bucket of the moment it was granted.
//
// Request takes no lock and allocates nothing (one atomic add, a
// compare-and-swap when its bucket moves on); TryHedge and Stats take a
// mutex so that concurrent TryHedge calls can never exceed the cap, and
// allocate nothing. The gateway calls Request for every request and
// TryHedge only when a hedge delay expires. The zero value is not usable:
// use NewRateCap.
type RateCap struct {
	cfg     RateCapConfig // defaults applied, Off as 0
	ratio   uint64        // round(MaxRatio · ratioScale)
	reserve uint64        // MinPerSec × Window, in hedges · ratioScale
	clock   clock.Reader
	ep      rolling.Epochs

	// requests are written by every Request, apart from the rest.
	_        [64]byte
	requests rolling.Ring
	_        [64]byte

	mu     sync.Mutex
	lastEp uint64                       // latest epoch TryHedge saw; guarded by mu
	hedges [rolling.Buckets]hedgeBucket // guarded by mu
}

type hedgeBucket struct{ epoch, n uint64 }

// NewRateCap returns a cap allowing, over a rolling window, hedges up to
// MaxRatio × requests + MinPerSec × Window (see RateCap). Zero fields of c
// take their defaults (DefaultMaxRatio, DefaultMinPerSec, DefaultWindow); an
// invalid field is an error that names it. Time is read from clk
// (clock.Real if nil); the window starts at clk.Now().
func NewRateCap(c RateCapConfig, clk clock.Reader) (*RateCap, error) {
	c, err := c.withDefaults()
	if err != nil {
		return nil, err
	}
	if clk == nil {
		clk = clock.Real
	}
	rc := &RateCap{ratio: uint64(math.Round(c.MaxRatio * ratioScale)), clock: clk}
	rc.ep = rolling.NewEpochs(clk.Now(), c.Window)
	c.Window = rc.ep.Width() * rolling.Buckets
	rc.cfg, rc.reserve = c, reserve(c.MinPerSec, c.Window)
	return rc, nil
}

// reserve returns perSec × window in millionths of a hedge, with perSec
// rounded to the nearest millionth, rounded down, at most maxReserve.
func reserve(perSec float64, window time.Duration) uint64 {
	micro := uint64(math.Round(perSec * ratioScale)) // ≤ 10¹²
	hi, lo := bits.Mul64(micro, uint64(window))
	if hi >= uint64(time.Second) {
		return maxReserve
	}
	q, _ := bits.Div64(hi, lo, uint64(time.Second))
	return min(q, maxReserve)
}

// Config returns the configuration in use: defaults applied, Off as 0,
// Window rounded down to a multiple of 10ns.
func (c *RateCap) Config() RateCapConfig { return c.cfg }

// MaxRatio returns the cap's ratio of hedges to requests, beyond the floor.
func (c *RateCap) MaxRatio() float64 { return c.cfg.MaxRatio }

// MinPerSec returns the cap's floor in hedges per second; 0 if Off.
func (c *RateCap) MinPerSec() float64 { return c.cfg.MinPerSec }

// Window returns the length of the cap's rolling window.
func (c *RateCap) Window() time.Duration { return c.cfg.Window }

// Request records one request at the clock's current time.
func (c *RateCap) Request() { c.requests.Add(c.ep.Epoch(c.clock.Now())) }

// TryHedge grants and charges one hedge if, counting it, hedges stay within
// MaxRatio × requests + MinPerSec × Window over the window ending now;
// otherwise it charges nothing and returns false. Concurrent calls are
// serialised, so the bound holds exactly.
func (c *RateCap) TryHedge() bool {
	ep := c.ep.Epoch(c.clock.Now())
	c.mu.Lock()
	defer c.mu.Unlock()
	// A caller that read the clock before another one's later reading
	// counts in the later epoch, so the window never moves back.
	ep = max(ep, c.lastEp)
	c.lastEp = ep
	req, hedges := c.sumLocked(ep)
	if (hedges+1)*ratioScale > c.ratio*req+c.reserve {
		return false
	}
	b := &c.hedges[ep%rolling.Buckets]
	if b.epoch != ep {
		*b = hedgeBucket{epoch: ep}
	}
	b.n++
	return true
}

// sumLocked returns the requests and hedges in the window ending in ep.
func (c *RateCap) sumLocked(ep uint64) (requests, hedges uint64) {
	for i := range c.hedges {
		if b := c.hedges[i]; rolling.InWindow(b.epoch, ep) {
			hedges += b.n
		}
	}
	return c.requests.Sum(ep), hedges
}

// Stats returns the requests and hedges counted in the window ending now.
func (c *RateCap) Stats() (requests, hedges float64) {
	ep := c.ep.Epoch(c.clock.Now())
	c.mu.Lock()
	defer c.mu.Unlock()
	r, h := c.sumLocked(max(ep, c.lastEp))
	return float64(r), float64(h)
}
