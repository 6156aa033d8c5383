package upstream

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// Entry is the gateway's state for one upstream server, identified by its
// dial address: the attempts in flight, the circuit breaker(s), the active
// prober. There is one per address in the process, shared by every handler
// and config that targets it, so in-flight counts and breaker state are
// shared between handlers and survive reloads (as Caddy's own Host is).
//
// Settings come from the configs that hold the entry (each a claim, see
// Pool): the newest config that has started wins; a config that is only
// provisioned (not started, or failed to load) never changes what a running
// one set (DESIGN §6).
type Entry struct {
	addr string
	reg  *Registry

	// inflight counts this gateway's attempts in progress to the server.
	inflight atomic.Int64
	// since counts the attempts started since the latest successful
	// scrape that are still in flight: the scrape epoch in the high 32
	// bits, the count in the low 32 (see score.go).
	since atomic.Uint64
	// sat is the latest scrape's snapshot, nil before the first.
	sat atomic.Pointer[satSnapshot]

	// ctx is cancelled when the entry is destroyed: an active probe in
	// flight ends with it.
	ctx    context.Context
	cancel context.CancelFunc

	// breakers by model key ("" for the per-upstream breaker, the model
	// name under scope model): an immutable map replaced under mu, so the
	// request path reads it without a lock.
	breakers atomic.Pointer[map[string]*breaker.Breaker]

	mu sync.Mutex // guards everything below
	// claims are the configs holding the entry, oldest first.
	claims []*claim
	// eff is the claim whose settings apply (nil: none wants breakers).
	eff       *claim
	probing   bool // a probe loop runs
	scraping  bool // a scrape loop runs
	destroyed bool
}

// claim is one config's wishes for the entries it holds.
type claim struct {
	gen    uint64
	active atomic.Bool
	// settings is nil when the config turns breakers off.
	settings *breaker.Settings
	prober   *Prober
	// sat is the config's saturation settings (defaults applied), nil
	// when it reads no signals.
	sat *Saturation
}

func newEntry(reg *Registry, addr string) *Entry {
	ctx, cancel := context.WithCancel(context.Background())
	e := &Entry{addr: addr, reg: reg, ctx: ctx, cancel: cancel}
	e.breakers.Store(&map[string]*breaker.Breaker{})
	return e
}

// breakerMap returns the current breakers; do not modify it.
func (e *Entry) breakerMap() map[string]*breaker.Breaker { return *e.breakers.Load() }

// Addr returns the entry's dial address ("10.0.0.2:8000", or a socket path).
func (e *Entry) Addr() string { return e.addr }

// Inflight returns the number of attempts in progress to the server.
func (e *Entry) Inflight() int64 { return e.inflight.Load() }

// acquire takes an in-flight slot, refusing when max > 0 slots are taken.
// The check and the increment are one compare-and-swap, so max holds
// exactly under any load.
func (e *Entry) acquire(max int) bool {
	for {
		n := e.inflight.Load()
		if max > 0 && n >= int64(max) {
			return false
		}
		if e.inflight.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

func (e *Entry) releaseSlot() { e.inflight.Add(-1) }

// full reports whether max > 0 slots are taken.
func (e *Entry) full(max int) bool { return max > 0 && e.inflight.Load() >= int64(max) }

// addClaim records a config's wishes; the caller releases it with dropClaim.
// Adding a claim twice adds it once.
func (e *Entry) addClaim(c *claim) {
	e.mu.Lock()
	if slices.Contains(e.claims, c) {
		e.mu.Unlock()
		return
	}
	e.claims = append(e.claims, c)
	e.mu.Unlock()
	e.reconcile()
}

func (e *Entry) dropClaim(c *claim) {
	e.mu.Lock()
	e.claims = slices.DeleteFunc(e.claims, func(x *claim) bool { return x == c })
	e.mu.Unlock()
	e.reconcile()
}

// effectiveLocked picks the claim whose settings apply: the newest active
// one, else (nothing started yet, e.g. the first config while it starts)
// the newest. Claims without breakers count too: the newest config turning
// breakers off forgets their state.
func (e *Entry) effectiveLocked() *claim {
	var best *claim
	for _, c := range e.claims {
		ca, ba := c.active.Load(), best != nil && best.active.Load()
		if best == nil || (ca && !ba) || (ca == ba && c.gen > best.gen) {
			best = c
		}
	}
	return best
}

// reconcile applies the effective claim: new thresholds to existing
// breakers, breakers dropped when the effective config has them off, and
// active probing started when it is on and a breaker is not closed.
func (e *Entry) reconcile() {
	e.mu.Lock()
	if e.destroyed {
		e.mu.Unlock()
		return
	}
	prev := e.eff
	eff := e.effectiveLocked()
	e.eff = eff
	var drop []string
	var apply []*breaker.Breaker
	switch {
	case eff == nil || eff.settings == nil:
		for k := range e.breakerMap() {
			drop = append(drop, k)
		}
		defer closeBreakers(e.breakerMap()) // after e.mu is released
		e.breakers.Store(&map[string]*breaker.Breaker{})
	case prev != eff:
		for _, b := range e.breakerMap() {
			apply = append(apply, b)
		}
	}
	for _, k := range drop {
		e.reg.obs.BreakerGone(e.addr, k)
	}
	e.mu.Unlock()
	for _, b := range apply {
		b.SetSettings(*eff.settings)
	}
	e.maybeProbe()
	e.maybeScrape()
}

// breakerFor returns the breaker for a model key ("" per upstream), creating
// it with the effective settings; nil when breakers are off or the entry is
// gone (a request still running on a config that released it).
func (e *Entry) breakerFor(key string) *breaker.Breaker {
	if b, ok := e.breakerMap()[key]; ok {
		return b
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.destroyed || e.eff == nil || e.eff.settings == nil {
		return nil
	}
	old := e.breakerMap()
	if b, ok := old[key]; ok {
		return b
	}
	name := e.addr
	if key != "" {
		name += "|" + key
	}
	var b *breaker.Breaker
	opts := append([]breaker.Option{breaker.WithListener(func(tr breaker.Transition) { e.transition(key, b, tr) })}, e.reg.breakerOpts...)
	b = breaker.New(name, *e.eff.settings, opts...)
	m := make(map[string]*breaker.Breaker, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	m[key] = b
	e.breakers.Store(&m)
	e.reg.obs.BreakerCreated(e.addr, key)
	return b
}

// lookupBreaker returns an existing breaker without creating one.
func (e *Entry) lookupBreaker(key string) *breaker.Breaker { return e.breakerMap()[key] }

// Breakers returns the entry's breakers by model key ("" per upstream); do
// not modify the map.
func (e *Entry) Breakers() map[string]*breaker.Breaker { return e.breakerMap() }

// transition is every breaker's listener. A breaker that is no longer the
// entry's (dropped, or the entry destroyed) reports nothing: its gauges are
// gone and must not come back.
func (e *Entry) transition(key string, b *breaker.Breaker, tr breaker.Transition) {
	e.mu.Lock()
	// Reported under the lock, so that a destroy or a drop cannot slip in
	// between the check and the report and have its gauge re-created.
	live := !e.destroyed && e.breakerMap()[key] == b
	if live {
		e.reg.obs.BreakerTransition(e.addr, key, tr)
	}
	e.mu.Unlock()
	if !live {
		return
	}
	if tr.To == breaker.Open {
		e.maybeProbe()
	}
}

// destroy ends the entry when no config holds it: its probe stops, in-flight
// probes are cancelled, and its breakers' gauges go.
func (e *Entry) destroy() {
	e.mu.Lock()
	e.destroyed = true
	var keys []string
	for k := range e.breakerMap() {
		keys = append(keys, k)
	}
	defer closeBreakers(e.breakerMap()) // after e.mu is released
	e.breakers.Store(&map[string]*breaker.Breaker{})
	for _, k := range keys {
		e.reg.obs.BreakerGone(e.addr, k)
	}
	if e.sat.Load() != nil {
		e.reg.obs.ScraperGone(e.addr)
	}
	e.mu.Unlock()
	e.cancel()
}
