package hedge

import (
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of the hedge-rate cap (`max_ratio` in the hedge block; the window
// is not configurable in the Caddyfile).
const (
	// DefaultMaxRatio: at most 1 hedge per 10 requests.
	DefaultMaxRatio = 0.1
	// DefaultWindow: the rolling window over which hedges and requests
	// are counted.
	DefaultWindow = 10 * time.Second
)

// capBuckets is the number of buckets in a RateCap's window: a 10s window
// forgets requests and hedges one second at a time.
const capBuckets = 10

// ratioScale is the fixed-point scale of the ratio: the cap compares
// (hedges+1)·10⁶ with round(ratio·10⁶)·requests in integers, so that it is
// exact (0.29 × 100 allows 29 hedges, which float64 arithmetic would not).
const ratioScale = 1_000_000

// A request counter word holds a bucket epoch in its high bits and a count in
// its low bits, so that Request moves a bucket to a new epoch and counts in
// one compare-and-swap.
const (
	countBits = 24
	countMask = 1<<countBits - 1
	// countMax leaves headroom below the mask so that adders racing past
	// the saturation check never carry into the epoch bits.
	countMax = countMask - 1<<16
)

// RateCap caps the share of requests that may hedge over a rolling window:
// a hedge is granted only if, counting it, hedges ≤ MaxRatio × requests
// among those recorded in the window. So hedging adds at most MaxRatio to
// the upstream load whatever the latencies do, and a fleet that has become
// slow everywhere (every request crossing the delay) is not asked for twice
// the work. The form is that of the retry budgets of Finagle and gRPC.
//
// The window is capBuckets (10) buckets of window/10 each, aligned to the
// cap's creation and advanced lazily by the times read from the clock (no
// timer): at any time it covers the current bucket and the 9 before, that is
// between 0.9 and 1 window of history. A hedge stays charged in the bucket of
// the moment it was granted.
//
// Request takes no lock and allocates nothing (one atomic add, a
// compare-and-swap when its bucket moves on); TryHedge and Stats take a
// mutex so that concurrent TryHedge calls can never exceed the cap, and
// allocate nothing. The gateway calls Request for every request and
// TryHedge only when a hedge delay expires. The zero value is not usable:
// use NewRateCap.
type RateCap struct {
	maxRatio float64
	ratio    uint64 // round(maxRatio · ratioScale)
	window   time.Duration
	width    time.Duration // bucket width
	clock    Clock
	base     time.Time // epoch 1 starts here

	// requests are written by every Request, apart from the rest.
	_        [64]byte
	requests [capBuckets]atomic.Uint64 // epoch<<countBits | count
	_        [64]byte

	mu     sync.Mutex
	lastEp uint64                  // latest epoch TryHedge saw; guarded by mu
	hedges [capBuckets]hedgeBucket // guarded by mu
}

type hedgeBucket struct{ epoch, n uint64 }

// NewRateCap returns a cap allowing hedges up to maxRatio × requests over a
// rolling window (DefaultMaxRatio and DefaultWindow when 0), reading time
// from clock (SystemClock if nil). maxRatio must be in (0, 1] and window at
// least 10ms (buckets of 1ms).
func NewRateCap(maxRatio float64, window time.Duration, clock Clock) (*RateCap, error) {
	if maxRatio == 0 {
		maxRatio = DefaultMaxRatio
	}
	if window == 0 {
		window = DefaultWindow
	}
	if !(maxRatio > 0 && maxRatio <= 1) {
		return nil, fmt.Errorf("hedge rate cap: max_ratio %v must be above 0 and at most 1", maxRatio)
	}
	if window < capBuckets*time.Millisecond {
		return nil, fmt.Errorf("hedge rate cap: window %v must be at least %v", window, capBuckets*time.Millisecond)
	}
	if clock == nil {
		clock = SystemClock{}
	}
	return &RateCap{
		maxRatio: maxRatio,
		ratio:    uint64(math.Round(maxRatio * ratioScale)),
		window:   window,
		width:    window / capBuckets,
		clock:    clock,
		base:     clock.Now(),
	}, nil
}

// MaxRatio returns the cap's ratio of hedges to requests.
func (c *RateCap) MaxRatio() float64 { return c.maxRatio }

// Window returns the length of the cap's rolling window.
func (c *RateCap) Window() time.Duration { return c.window }

// epoch returns the bucket epoch of t, starting at 1 (0 marks an unused
// word). Times before the cap's creation fall into epoch 1.
func (c *RateCap) epoch(t time.Time) uint64 {
	d := t.Sub(c.base)
	if d < 0 {
		return 1
	}
	return uint64(d/c.width) + 1
}

// inWindow reports whether a bucket of epoch e counts in the window ending
// in epoch ep.
func inWindow(e, ep uint64) bool { return e <= ep && e+capBuckets > ep }

// Request records one request at the clock's current time.
func (c *RateCap) Request() {
	ep := c.epoch(c.clock.Now())
	a := &c.requests[ep%capBuckets]
	for {
		old := a.Load()
		switch oe := old >> countBits; {
		case oe < ep:
			if a.CompareAndSwap(old, ep<<countBits|1) {
				return
			}
		default:
			// oe == ep, or oe > ep: the bucket moved on after this
			// caller read the clock; count the request in the newer one.
			if old&countMask < countMax {
				a.Add(1)
			}
			return
		}
	}
}

// TryHedge grants and charges one hedge if, counting it, hedges stay within
// MaxRatio × requests over the window ending now; otherwise it charges
// nothing and returns false. Concurrent calls are serialised, so the bound
// holds exactly.
func (c *RateCap) TryHedge() bool {
	ep := c.epoch(c.clock.Now())
	c.mu.Lock()
	defer c.mu.Unlock()
	// A caller that read the clock before another one's later reading
	// counts in the later epoch, so the window never moves back.
	ep = max(ep, c.lastEp)
	c.lastEp = ep
	req, hedges := c.sumLocked(ep)
	if (hedges+1)*ratioScale > c.ratio*req {
		return false
	}
	b := &c.hedges[ep%capBuckets]
	if b.epoch != ep {
		*b = hedgeBucket{epoch: ep}
	}
	b.n++
	return true
}

// sumLocked returns the requests and hedges in the window ending in ep.
func (c *RateCap) sumLocked(ep uint64) (requests, hedges uint64) {
	for i := range c.requests {
		if w := c.requests[i].Load(); inWindow(w>>countBits, ep) {
			requests += w & countMask
		}
		if b := c.hedges[i]; inWindow(b.epoch, ep) {
			hedges += b.n
		}
	}
	return requests, hedges
}

// Stats returns the requests and hedges counted in the window ending now.
func (c *RateCap) Stats() (requests, hedges float64) {
	ep := c.epoch(c.clock.Now())
	c.mu.Lock()
	defer c.mu.Unlock()
	r, h := c.sumLocked(max(ep, c.lastEp))
	return float64(r), float64(h)
}
