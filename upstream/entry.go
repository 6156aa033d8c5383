package upstream

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/prefix"
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
	// prefix is the index of the prompt prefixes recently sent to the
	// server (lb_policy prefix_cache), nil until that policy uses it.
	prefix atomic.Pointer[prefix.Index]

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
	// bstore is the store the breakers were built with (Registry.SetBreakerStore).
	bstore breaker.Store
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
// it with the effective settings and the registry's breaker store; nil when
// breakers are off or the entry is gone (a request still running on a
// config that released it).
func (e *Entry) breakerFor(key string) *breaker.Breaker {
	if b, ok := e.breakerMap()[key]; ok {
		return b
	}
	e.mu.Lock()
	if e.destroyed || e.eff == nil || e.eff.settings == nil {
		e.mu.Unlock()
		return nil
	}
	old := e.breakerMap()
	if b, ok := old[key]; ok {
		e.mu.Unlock()
		return b
	}
	st := e.reg.BreakerStore()
	if len(old) == 0 {
		e.bstore = st
	} // else a SetBreakerStore is on its way to this entry and builds them all again
	b, l := e.newBreakerLocked(key, *e.eff.settings, st)
	m := make(map[string]*breaker.Breaker, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	m[key] = b
	e.breakers.Store(&m)
	e.reg.obs.BreakerCreated(e.addr, key)
	e.mu.Unlock()
	l.register(b)
	return b
}

// newBreakerLocked builds the breaker for key with store st (nil: none).
// Its transitions wait in the returned listener until register, which the
// caller calls once the breaker is in the map and e.mu is released: a
// store that knows the key is open opens the breaker within New, and the
// entry's listener takes e.mu.
func (e *Entry) newBreakerLocked(key string, s breaker.Settings, st breaker.Store) (*breaker.Breaker, *heldListener) {
	name := e.addr
	if key != "" {
		name += "|" + key
	}
	l := &heldListener{e: e, key: key}
	opts := []breaker.Option{breaker.WithListener(l.listen)}
	if st != nil {
		opts = append(opts, breaker.WithStore(st))
	}
	return breaker.New(name, s, append(opts, e.reg.breakerOpts...)...), l
}

// heldListener is a breaker's listener that holds its transitions until
// the breaker is registered, then hands them, in order, to the entry.
type heldListener struct {
	e   *Entry
	key string

	mu   sync.Mutex
	b    *breaker.Breaker // nil until register
	held []breaker.Transition
}

func (l *heldListener) listen(tr breaker.Transition) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.b == nil {
		l.held = append(l.held, tr)
		return
	}
	l.e.transition(l.key, l.b, tr)
}

// register delivers the held transitions; later ones go straight through.
// Call it without e.mu.
func (l *heldListener) register(b *breaker.Breaker) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b = b
	for _, tr := range l.held {
		l.e.transition(l.key, b, tr)
	}
	l.held = nil
}

// useStore builds the entry's breakers again with store st (see
// Registry.SetBreakerStore): an open breaker's cooldown end travels, as a
// verdict the new breaker adopts; the old ones leave their store.
func (e *Entry) useStore(st breaker.Store) {
	e.mu.Lock()
	if e.destroyed || e.bstore == st {
		e.mu.Unlock()
		return
	}
	e.bstore = st
	old := e.breakerMap()
	if len(old) == 0 || e.eff == nil || e.eff.settings == nil {
		e.mu.Unlock()
		return
	}
	m := make(map[string]*breaker.Breaker, len(old))
	ls := make(map[string]*heldListener, len(old))
	for k := range old {
		m[k], ls[k] = e.newBreakerLocked(k, *e.eff.settings, st)
		e.reg.obs.BreakerCreated(e.addr, k) // the new one's state, from closed
	}
	e.breakers.Store(&m)
	e.mu.Unlock()
	for k, ob := range old {
		nb := m[k]
		if snap := ob.Snapshot(); snap.State == breaker.Open && nb.State() == breaker.Closed {
			// OpenUntil is zero when forced open until closed: so is Adopt's.
			nb.Adopt(snap.OpenUntil, "open before the breaker store changed")
		}
		ls[k].register(nb)
		ob.Close()
	}
	e.maybeProbe()
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
