package upstream

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// A pool that fails as a whole (DESIGN §4): when all of its last
// PoolFailWindow attempt outcomes, across at least two of its upstreams,
// are failures (a bad deploy, an engine crash on every replica), that is
// hard evidence for the pool. It then answers 503 at once, without touching its upstreams,
// but for one probe per upstream per probe interval; the first probe that
// succeeds re-admits traffic. Without this the per-upstream rules held no
// upstream on hard evidence while the window still held the successes of
// before the failure (30 s), and statistics opened at most the ejection
// cap: the pool took ~1.2× its traffic in failures for up to 30 s.
const (
	// PoolFailWindow is the number of a pool's last attempt outcomes that
	// the pool-wide rule reads: at 20 requests/s, with the default retry
	// budget, under a second of a total failure.
	PoolFailWindow = 40
	// PoolFailRatio is the share of failures among the last PoolFailWindow
	// outcomes at which the pool has failed as a whole: all of them. A
	// pool failing 90% of attempts uniformly has 19 of 20 failures in a
	// row 39% of the time, 40 of 40 in 1.5%: at 95% of 20 it was shed
	// most of the time and served 3.8% where a direct connection serves
	// 10%; at 40 of 40 it serves 11% (TestPartialOutageSimulation).
	PoolFailRatio = 1.0
	// PoolFailUpstreams is the least number of distinct upstreams whose
	// failures are among them: one failing upstream is its own breaker's
	// business, not the pool's.
	PoolFailUpstreams = 2
	// DefaultPoolProbeInterval is the time between a failed pool's probes
	// of one upstream when the pool has no active prober (Config.Prober);
	// with one, its Interval.
	DefaultPoolProbeInterval = time.Second
)

// poolFailure is a pool's record of its last attempt outcomes and, once
// they say the pool failed as a whole, its failed state. The pick path
// reads only failed without the lock.
type poolFailure struct {
	failed atomic.Bool

	mu sync.Mutex // guards everything below
	// ring holds the last PoolFailWindow outcomes, next the slot to write,
	// n how many are held.
	ring    [PoolFailWindow]poolOutcome
	next, n int
	// since is when the pool failed; reason says why.
	since  time.Time
	reason string
	// probed is when each upstream was last probed while the pool failed.
	probed map[*Entry]time.Time
	// failures counts the times the pool failed as a whole.
	failures int64
}

type poolOutcome struct {
	e      *Entry
	failed bool
}

// recordPool records one attempt outcome on e that started at started:
// a failure (failed) or an answer. It reports whether the pool changed
// state: on true the pool just failed (failed is then true) or just
// recovered.
func (f *poolFailure) record(e *Entry, started, now time.Time, failed bool) (changed bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failed.Load() {
		// Only an attempt sent since the pool failed (a probe) says
		// anything about it now: an older stream ending well is no sign
		// that new requests are answered.
		if failed || started.Before(f.since) {
			return false
		}
		f.failed.Store(false)
		f.n, f.next = 0, 0
		f.probed = nil
		return true
	}
	f.ring[f.next] = poolOutcome{e: e, failed: failed}
	f.next = (f.next + 1) % PoolFailWindow
	f.n = min(f.n+1, PoolFailWindow)
	if !failed || f.n < PoolFailWindow {
		return false
	}
	fails := 0
	var ups [PoolFailWindow]*Entry
	distinct := 0
	for _, o := range f.ring {
		if !o.failed {
			continue
		}
		fails++
		seen := false
		for _, u := range ups[:distinct] {
			if u == o.e {
				seen = true
				break
			}
		}
		if !seen {
			ups[distinct] = o.e
			distinct++
		}
	}
	if float64(fails) < PoolFailRatio*PoolFailWindow-1e-9 || distinct < PoolFailUpstreams {
		return false
	}
	f.failed.Store(true)
	f.since = now
	f.reason = fmt.Sprintf("%d of its last %d attempts, across %d upstreams, failed", fails, PoolFailWindow, distinct)
	f.probed = map[*Entry]time.Time{}
	f.failures++
	return true
}

// probeDue reports whether a failed pool may probe e at now, and when the
// next probe of e is due otherwise.
func (f *poolFailure) probeDue(e *Entry, now time.Time, every time.Duration) (next time.Time, ok bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.failed.Load() {
		return time.Time{}, true
	}
	last, probed := f.probed[e]
	if !probed {
		// The first probe of each upstream waits an interval from the
		// failure: the pool failed on fresh evidence.
		last = f.since
	}
	next = last.Add(every)
	return next, !now.Before(next)
}

// takeProbe claims e's probe at now; false when another pick took it
// since probeDue, or the pool recovered meanwhile (the pick then goes on
// as usual).
func (f *poolFailure) takeProbe(e *Entry, now time.Time, every time.Duration) bool {
	if _, ok := f.probeDue(e, now, every); !ok {
		return false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failed.Load() {
		f.probed[e] = now
	}
	return true
}

// status returns whether the pool failed, since when and why.
func (f *poolFailure) status() (failed bool, since time.Time, reason string, failures int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failed.Load() {
		return true, f.since, f.reason, f.failures
	}
	return false, time.Time{}, "", f.failures
}

// poolProbeInterval is the time between a failed pool's probes of one
// upstream: its Prober's interval, else DefaultPoolProbeInterval.
func (p *Pool) poolProbeInterval() time.Duration {
	if p.cfg.Prober != nil {
		return p.cfg.Prober.interval()
	}
	return DefaultPoolProbeInterval
}

// PoolFailObserver is implemented by an Observer that follows the
// pool-wide rule: PoolFailed when a pool fails as a whole (on) or is
// re-admitted by a probe's success. pool is the pool's Config.Key.
type PoolFailObserver interface {
	PoolFailed(pool string, on bool, reason string)
}

// recordOutcome feeds the pool-wide rule one attempt outcome and reports a
// change of state to the observer.
func (p *Pool) recordOutcome(e *Entry, started time.Time, failed bool) {
	if p.cfg.Breaker == nil {
		return
	}
	if !p.fail.record(e, started, p.reg.now(), failed) {
		return
	}
	if o, ok := p.reg.obs.(PoolFailObserver); ok {
		on, _, reason, _ := p.fail.status()
		o.PoolFailed(p.cfg.Key, on, reason)
	}
}
