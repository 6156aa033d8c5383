package upstream

import (
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/budget"
	"github.com/llmproxy/caddy-llm-proxy/hedge"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// RetryConfig configures a pool's retry budget and backoff. Zero fields take
// the budget package's defaults.
type RetryConfig struct {
	// Ratio is the share of requests that may be retried (budget.RatioConfig.Ratio).
	Ratio float64
	// Window is the ratio budget's rolling window (budget.RatioConfig.Window).
	Window time.Duration
	// MinPerSec is the ratio budget's floor of retries per second
	// (budget.RatioConfig.MinPerSec).
	MinPerSec float64
	// BucketMax and BucketRefill, when BucketMax > 0, replace the ratio
	// budget with a token bucket of that size refilled at that rate per
	// second.
	BucketMax, BucketRefill float64
	// Backoff is the full-jitter backoff between retries.
	Backoff budget.Backoff
}

// HedgeConfig configures a pool's hedging.
type HedgeConfig struct {
	// Policy computes the hedge delay (fixed, or a TTFT percentile).
	Policy hedge.DelayPolicy
	// Cap bounds the share of requests that hedge (with its floor).
	Cap hedge.RateCapConfig
	// MaxHedges is the most backups per request; default 1.
	MaxHedges int
}

// poolState is what a pool keeps across reloads under a key: its retry
// budget, its hedge cap, its TTFT trackers, or the addresses a dynamic
// source returned (one of them per key).
type poolState struct {
	budget budget.Budget
	cap    *hedge.RateCap
	// trackers holds a *hedge.LatencyTracker per trackerKey.
	trackers sync.Map

	mu   sync.Mutex
	seen map[string]struct{}

	// fail is the pool-wide rule's record, under "poolfail|<key>".
	fail poolFailure
}

func newPoolState() (*poolState, error) { return &poolState{}, nil }

func (s *poolState) remember(addr string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.seen == nil {
		s.seen = map[string]struct{}{}
	}
	s.seen[addr] = struct{}{}
}

func (s *poolState) forget(addr string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.seen, addr)
}

func (s *poolState) addrs() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.seen))
	for a := range s.seen {
		out = append(out, a)
	}
	sort.Strings(out)
	return out
}

// retryGate adapts the pool's budget and the backoff to proxy.Retries.
type retryGate struct {
	budget  budget.Budget
	backoff budget.Backoff
}

func (p *Pool) newRetryGate() (*retryGate, error) {
	rc := p.cfg.Retry
	bo := rc.Backoff
	if bo.Base <= 0 {
		bo.Base = DefaultBackoffBase
	}
	if bo.Cap <= 0 {
		bo.Cap = DefaultBackoffCap
	}
	if bo.Cap < bo.Base {
		return nil, fmt.Errorf("retries: backoff cap %v is below its base %v", bo.Cap, bo.Base)
	}
	var key string
	var build func() (budget.Budget, error)
	if rc.BucketMax > 0 {
		key = fmt.Sprintf("budget|%s|bucket|%g|%g", p.cfg.Key, rc.BucketMax, rc.BucketRefill)
		build = func() (budget.Budget, error) {
			return budget.NewBucket(rc.BucketMax, rc.BucketRefill, p.reg.clock)
		}
	} else {
		cfg := budget.RatioConfig{Ratio: rc.Ratio, Window: rc.Window, MinPerSec: rc.MinPerSec}
		key = fmt.Sprintf("budget|%s|ratio|%g|%v|%g", p.cfg.Key, cfg.Ratio, cfg.Window, cfg.MinPerSec)
		build = func() (budget.Budget, error) { return budget.NewRatio(cfg, p.reg.clock) }
	}
	s, err := p.reg.state.Acquire(&p.claims, key, func() (*poolState, error) {
		b, err := build()
		if err != nil {
			return nil, fmt.Errorf("retries: %w", err)
		}
		return &poolState{budget: b}, nil
	}, nil)
	if err != nil {
		return nil, err
	}
	return &retryGate{budget: s.budget, backoff: bo}, nil
}

// Defaults of the backoff.
const (
	DefaultBackoffBase = 100 * time.Millisecond
	DefaultBackoffCap  = 2 * time.Second
)

func (g *retryGate) Request()       { g.budget.Request() }
func (g *retryGate) TryRetry() bool { return g.budget.TryRetry() }

// RetryAvailable implements proxy.RetryPeeker: whether the budget would
// grant a retry now, charging nothing.
func (g *retryGate) RetryAvailable() bool { return g.budget.Stats().Available > 0 }

// Backoff never waits past the backoff cap: a longer Retry-After is the
// client's to honour, and it gets the 429/503 with it at once.
func (g *retryGate) Backoff(n int, retryAfter, remaining time.Duration) (time.Duration, bool) {
	if remaining <= 0 || remaining > g.backoff.Cap {
		remaining = g.backoff.Cap
	}
	return g.backoff.Delay(n, retryAfter, remaining)
}

// Retries returns the pool's retry gate, for proxy.Config.Retries.
func (p *Pool) Retries() proxy.Retries { return p.retries }

// Budget returns the pool's retry budget.
func (p *Pool) Budget() budget.Budget { return p.retries.budget }

// hedger implements proxy.Hedging for a pool: the delay policy, the pool's
// hedge-rate cap and its TTFT trackers (both kept across reloads).
type hedger struct {
	p         *Pool
	policy    hedge.DelayPolicy
	cap       *hedge.RateCap
	maxHedges int
	// trackers is the pool state holding the TTFT trackers.
	trackers *poolState
}

// trackerKey names a TTFT tracker: per model and mode (a streamed TTFT and
// a whole JSON body are different quantities). A struct, not a formatted
// string: it is built on every request.
type trackerKey struct {
	model  string
	stream bool
}

func (p *Pool) newHedger() (*hedger, error) {
	hc := p.cfg.Hedge
	if err := hc.Policy.Validate(); err != nil {
		return nil, fmt.Errorf("hedge: %w", err)
	}
	capKey := fmt.Sprintf("cap|%s|%g|%g|%v", p.cfg.Key, hc.Cap.MaxRatio, hc.Cap.MinPerSec, hc.Cap.Window)
	c, err := p.reg.state.Acquire(&p.claims, capKey, func() (*poolState, error) {
		c, err := hedge.NewRateCap(hc.Cap, nil)
		if err != nil {
			return nil, fmt.Errorf("hedge: %w", err)
		}
		return &poolState{cap: c}, nil
	}, nil)
	if err != nil {
		return nil, err
	}
	tr, err := p.reg.state.Acquire(&p.claims, "ttft|"+p.cfg.Key, newPoolState, nil)
	if err != nil {
		return nil, err
	}
	return &hedger{p: p, policy: hc.Policy, cap: c.cap, maxHedges: max(hc.MaxHedges, 1), trackers: tr}, nil
}

// Hedging returns the pool's hedging, nil when off (for proxy.Config.Hedging:
// a nil *hedger must stay a nil interface).
func (p *Pool) Hedging() proxy.Hedging {
	if p.hedger == nil {
		return nil
	}
	return p.hedger
}

func (g *hedger) tracker(info proxy.RequestInfo) *hedge.LatencyTracker {
	k := trackerKey{model: g.p.reg.Models.Label(info.Model), stream: info.Stream}
	if v, ok := g.trackers.trackers.Load(k); ok {
		return v.(*hedge.LatencyTracker)
	}
	v, _ := g.trackers.trackers.LoadOrStore(k, hedge.NewLatencyTracker(0, nil))
	return v.(*hedge.LatencyTracker)
}

func (g *hedger) Delay(info proxy.RequestInfo) (time.Duration, bool) {
	d := g.policy.Delay(g.tracker(info))
	g.p.reg.obs.HedgeDelay(g.p.reg.Models.Label(info.Model), info.Stream, d)
	return d, true
}
func (g *hedger) Request()       { g.cap.Request() }
func (g *hedger) TryHedge() bool { return g.cap.TryHedge() }
func (g *hedger) MaxHedges() int { return g.maxHedges }
func (g *hedger) Observe(info proxy.RequestInfo, ttft time.Duration) {
	g.tracker(info).Observe(ttft)
}

var (
	_ proxy.Retries     = (*retryGate)(nil)
	_ proxy.RetryPeeker = (*retryGate)(nil)
	_ proxy.Hedging     = (*hedger)(nil)
)
