package admission

import (
	"hash/maphash"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// LocalLimits is a LimitStore in this process's memory: the same rolling
// minute and in-flight counts, with the same decisions, as a Controller's
// own state, kept apart from it. A fleet store falls back to one while its
// shared store is away (with the fleet's limits divided among the expected
// instances, from zero). Safe for concurrent use.
type LocalLimits struct {
	clock     clock.Clock
	base      time.Time // epoch 0 of every window
	seed      maphash.Seed
	shards    [shardCount]localShard
	entries   atomic.Int64
	lastSweep atomic.Int64 // clock nanoseconds of the last sweep
}

// localSweepAbove is the number of entries above which idle ones are
// swept (at most once per sweepEvery).
const localSweepAbove = 1024

type localShard struct {
	mu sync.Mutex
	m  map[string]*localEntry
	_  [48]byte // to 64 bytes
}

// localEntry is one tenant's counts in a LocalLimits.
type localEntry struct {
	mu      sync.Mutex
	evicted bool // swept from the map; a Reserve that holds it retries
	counts
}

// NewLocalLimits returns an empty store on clk (nil: clock.Real).
func NewLocalLimits(clk clock.Clock) *LocalLimits {
	clk = clock.Or(clk)
	l := &LocalLimits{clock: clk, base: clk.Now(), seed: maphash.MakeSeed()}
	for i := range l.shards {
		l.shards[i].m = make(map[string]*localEntry)
	}
	return l
}

// entry returns tenant's entry, creating it.
func (l *LocalLimits) entry(tenant string) *localEntry {
	sh := &l.shards[maphash.String(l.seed, tenant)%shardCount]
	sh.mu.Lock()
	e := sh.m[tenant]
	if e == nil {
		e = &localEntry{}
		e.win.base = l.base
		sh.m[tenant] = e
		l.entries.Add(1)
	}
	sh.mu.Unlock()
	return e
}

// Reserve implements LimitStore.
func (l *LocalLimits) Reserve(q *Quota, h *Hold) Decision {
	if l.entries.Load() > localSweepAbove {
		l.sweep()
	}
	for {
		e := l.entry(q.Tenant)
		now := l.clock.Now()
		e.mu.Lock()
		if e.evicted {
			e.mu.Unlock()
			continue
		}
		var d Decision
		ep := decideLocked(&e.counts, q, now, &d)
		e.mu.Unlock()
		if d.Code == "" {
			h.Reserved, h.le, h.lep = d.Reserved, e, ep
		}
		return d
	}
}

// Settle implements LimitStore.
func (l *LocalLimits) Settle(h *Hold, used int64) { l.give(h, 0, used) }

// Cancel implements LimitStore.
func (l *LocalLimits) Cancel(h *Hold) { l.give(h, 1, 0) }

// give takes back h's slot, reqs requests and its reservation, and counts
// used tokens now.
func (l *LocalLimits) give(h *Hold, reqs, used int64) {
	e := h.le
	if e == nil {
		return
	}
	h.le = nil
	now := l.clock.Now()
	e.mu.Lock()
	e.win.advance(now)
	e.win.remove(h.lep, reqs, h.Reserved)
	if used > 0 {
		e.win.add(0, used)
	}
	e.inflight--
	e.mu.Unlock()
}

// Counts returns tenant's requests in flight and its rolling minute's
// request and token counts now (zeros for a tenant it has never seen).
func (l *LocalLimits) Counts(tenant string) (inflight int, requests, tokens int64) {
	sh := &l.shards[maphash.String(l.seed, tenant)%shardCount]
	sh.mu.Lock()
	e := sh.m[tenant]
	sh.mu.Unlock()
	if e == nil {
		return 0, 0, 0
	}
	now := l.clock.Now()
	e.mu.Lock()
	defer e.mu.Unlock()
	e.win.advance(now)
	return e.inflight, e.win.reqs, e.win.toks
}

// sweep removes idle entries (nothing in flight, empty window), at most
// once per sweepEvery.
func (l *LocalLimits) sweep() {
	now := l.clock.Now()
	last := l.lastSweep.Load()
	if now.UnixNano()-last < int64(sweepEvery) || !l.lastSweep.CompareAndSwap(last, now.UnixNano()) {
		return
	}
	for i := range l.shards {
		sh := &l.shards[i]
		sh.mu.Lock()
		for id, e := range sh.m {
			e.mu.Lock()
			e.win.advance(now)
			if e.inflight == 0 && e.win.reqs == 0 && e.win.toks == 0 {
				e.evicted = true
				delete(sh.m, id)
				l.entries.Add(-1)
			}
			e.mu.Unlock()
		}
		sh.mu.Unlock()
	}
}

// Interface guard.
var _ LimitStore = (*LocalLimits)(nil)
