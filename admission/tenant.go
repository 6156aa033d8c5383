package admission

import (
	"hash/maphash"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// MaxTenantStates bounds the states of tenants that are not in
// Config.Tenants (tenants named by a key or a trusted header only, and
// UnknownTenant aside). Keys are finite, so this bound is reached only by
// trusted proxies naming many tenants. At the bound, idle states (nothing
// in flight or queued, empty windows, breaker closed) are evicted, at most
// one sweep a second; when none is idle, a new tenant is refused with 429
// CodeSaturated until one is. Configured tenants are not counted: the
// configuration bounds them.
const MaxTenantStates = 10000

// sweepEvery spaces sweeps for idle tenant states at the bound.
const sweepEvery = time.Second

// tenant is one tenant's counters and breaker, shared by all its keys and
// every handler, and kept across reloads.
type tenant struct {
	id string

	mu sync.Mutex
	// counts are the tenant's limits in the Controller's own memory (its
	// in-flight count is kept with any LimitStore too).
	counts
	evicted bool // removed from the map; a Reserve that holds it retries
	pinned  bool // configured (or UnknownTenant): never evicted nor counted

	queued atomic.Int64
	// tier is the effective tier of the tenant's last admission, for the
	// breaker's listener and the admin API.
	tier atomic.Pointer[tierInfo]

	bmu     sync.Mutex                      // creating and re-configuring brk
	brk     atomic.Pointer[breaker.Breaker] // nil until a tier with one is used
	brkTier atomic.Pointer[tierInfo]        // the tier whose settings brk has
	brkIn   atomic.Pointer[brkStoreBox]     // the store brk was built with
}

// tierName returns the name of the tenant's last effective tier.
func (t *tenant) tierName() string {
	if ti := t.tier.Load(); ti != nil {
		return ti.Name
	}
	return ""
}

// idleLocked reports whether the state may be evicted: nothing in flight or
// queued, nothing counted in the window, breaker closed.
func (t *tenant) idleLocked(now time.Time) bool {
	t.win.advance(now)
	if t.inflight != 0 || t.queued.Load() != 0 || t.win.reqs != 0 || t.win.toks != 0 {
		return false
	}
	b := t.brk.Load()
	return b == nil || b.State() == breaker.Closed
}

// breakerFor returns the tenant's breaker configured for ti, nil when ti has
// none. The breaker is created on first use and re-configured when the
// tenant's requests come under another tier (or a reload); its state is
// kept.
func (c *Controller) breakerFor(t *tenant, ti *tierInfo) *breaker.Breaker {
	if ti.brk == nil {
		return nil
	}
	store := c.brkStore.Load()
	if t.brkTier.Load() == ti && t.brkIn.Load() == store {
		return t.brk.Load()
	}
	t.bmu.Lock()
	defer t.bmu.Unlock()
	b := t.brk.Load()
	switch {
	case t.brkTier.Load() == ti && t.brkIn.Load() == store:
	case b == nil || t.brkIn.Load() != store:
		opts := []breaker.Option{
			breaker.WithClock(c.clock),
			breaker.WithRand(c.rand),
			breaker.WithListener(func(tr breaker.Transition) { c.obs.TenantBreaker(t.id, t.tierName(), tr) }),
		}
		key := t.id
		if store != nil && store.s != nil {
			// Shared with the upstream breakers: a key of its own kind.
			key = TenantBreakerKey(t.id)
			opts = append(opts, breaker.WithStore(store.s))
		}
		closeBreaker(b)
		b = breaker.New(key, *ti.brk, opts...)
		t.brk.Store(b)
		t.brkIn.Store(store)
	default:
		b.SetSettings(*ti.brk)
	}
	t.brkTier.Store(ti)
	return b
}

// shardCount spreads tenant states over maps with their own locks, so that
// lookups of different tenants share no cache line.
const shardCount = 64

type shard struct {
	mu sync.RWMutex
	m  map[string]*tenant
	_  [32]byte // to 64 bytes: a cache line of its own
}

// tenantSet holds every tenant's state.
type tenantSet struct {
	seed      maphash.Seed
	shards    [shardCount]shard
	dynamic   atomic.Int64 // unpinned states
	lastSweep atomic.Int64 // clock nanoseconds (UnixNano) of the last sweep
}

func (s *tenantSet) init() {
	s.seed = maphash.MakeSeed()
	for i := range s.shards {
		s.shards[i].m = make(map[string]*tenant)
	}
}

func (s *tenantSet) shard(id string) *shard {
	return &s.shards[maphash.String(s.seed, id)%shardCount]
}

// get returns tenant id's state, nil if it has none.
func (s *tenantSet) get(id string) *tenant {
	sh := s.shard(id)
	sh.mu.RLock()
	t := sh.m[id]
	sh.mu.RUnlock()
	return t
}

// state returns tenant id's state, creating it if the bound allows; nil
// when it does not.
func (c *Controller) state(id string, snap *snapshot) *tenant {
	if t := c.tenants.get(id); t != nil {
		return t
	}
	pinned := snap.pinned(id)
	if !pinned && c.tenants.dynamic.Load() >= MaxTenantStates {
		c.sweep()
		if c.tenants.dynamic.Load() >= MaxTenantStates {
			return nil
		}
	}
	sh := c.tenants.shard(id)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if t := sh.m[id]; t != nil {
		return t
	}
	t := &tenant{id: id, pinned: pinned}
	t.win.base = c.base
	sh.m[id] = t
	if !pinned {
		c.tenants.dynamic.Add(1)
	}
	return t
}

// sweep evicts every idle unpinned state, at most once per sweepEvery.
func (c *Controller) sweep() {
	now := c.clock.Now()
	last := c.tenants.lastSweep.Load()
	if now.UnixNano()-last < int64(sweepEvery) || !c.tenants.lastSweep.CompareAndSwap(last, now.UnixNano()) {
		return
	}
	var dropped []*breaker.Breaker
	for i := range c.tenants.shards {
		sh := &c.tenants.shards[i]
		sh.mu.Lock()
		for id, t := range sh.m {
			t.mu.Lock()
			if !t.pinned && t.idleLocked(now) {
				t.evicted = true
				delete(sh.m, id)
				c.tenants.dynamic.Add(-1)
				if b := t.brk.Load(); b != nil {
					dropped = append(dropped, b)
				}
			}
			t.mu.Unlock()
		}
		sh.mu.Unlock()
	}
	// Outside the locks: a fleet store forgets them.
	for _, b := range dropped {
		closeBreaker(b)
	}
}

// repin marks the states of snap's configured tenants pinned and the others
// not, keeping the count of unpinned states right across reloads.
func (c *Controller) repin(snap *snapshot) {
	for i := range c.tenants.shards {
		sh := &c.tenants.shards[i]
		sh.mu.Lock()
		for id, t := range sh.m {
			p := snap.pinned(id)
			t.mu.Lock()
			if p != t.pinned {
				t.pinned = p
				if p {
					c.tenants.dynamic.Add(-1)
				} else {
					c.tenants.dynamic.Add(1)
				}
			}
			t.mu.Unlock()
		}
		sh.mu.Unlock()
	}
}

// addQueued counts a queued request of tenant (d = +1 or -1), for
// TenantView.Queued; a tenant with no state is not counted.
func (c *Controller) addQueued(tenant string, d int64) {
	if c == nil {
		return
	}
	if t := c.tenants.get(tenant); t != nil {
		t.queued.Add(d)
	}
}

// each calls f for every tenant state.
func (s *tenantSet) each(f func(*tenant)) {
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.RLock()
		ts := make([]*tenant, 0, len(sh.m))
		for _, t := range sh.m {
			ts = append(ts, t)
		}
		sh.mu.RUnlock()
		for _, t := range ts {
			f(t)
		}
	}
}
