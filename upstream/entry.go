package upstream

import (
	"cmp"
	"context"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/prefix"
	"github.com/llmproxy/caddy-llm-proxy/saturation"
)

// Entry is the gateway's state for one upstream server, identified by its
// dial address, shared by every handler and config that targets it (as
// Caddy's own Host is) and kept across reloads: the attempts in flight,
// the upstream's evidence, its prober and scraper, an operator's drain,
// and each handler's verdict on it.
//
// Who decides that an upstream is out for a request: the breaker of the
// request's handler (its pool's claim) on that upstream and model key. Each
// handler has its own breaker — its settings, its state machine — and
// every attempt's outcome on the upstream, whichever handler made it,
// reaches every handler's breaker (Breaker.Hear), so handlers with equal
// settings reach equal verdicts and each judges by its own thresholds.
// A reload builds new breakers for the new config's handlers; an open
// verdict and its cooldown carry over once, when the new config starts
// (activate), to the handler that replaces the old one.
type Entry struct {
	addr string
	reg  *Registry

	// inflight counts this gateway's attempts in progress to the server.
	inflight atomic.Int64
	// recent is the outcomes of every attempt on the server within
	// RecentWindow, whichever handler made it (Recent).
	recent *breaker.Outcomes
	// scraper scrapes the server's /metrics while a started config reads
	// its saturation signals, and holds its snapshot and the attempts
	// started since it (saturation.Scraper); created with the entry,
	// stopped by destroy.
	scraper *saturation.Scraper
	// prefix is the index of the prompt prefixes recently sent to the
	// server (lb_policy prefix_cache), nil until that policy uses it.
	prefix atomic.Pointer[prefix.Index]

	// ctx is cancelled when the entry is destroyed: an active probe in
	// flight ends with it.
	ctx    context.Context
	cancel context.CancelFunc

	// verdicts is every handler's breakers on the server: an immutable
	// slice replaced under mu, so the request path reads it without a
	// lock.
	verdicts atomic.Pointer[[]verdict]
	// drain is an operator's drain of the upstream (Drain), nil when none:
	// a breaker created while it lasts starts forced open, and a handler
	// with breakers off skips the upstream while it lasts (Drained). Written
	// under mu; read lock-free on the pick path.
	drain atomic.Pointer[drain]
	// probes counts the half-open probes of user requests in flight, by
	// model key, across handlers (takeProbe).
	probeMu sync.Mutex
	probes  map[string]int

	mu sync.Mutex // guards everything below
	// claims are the pools holding the entry, oldest first.
	claims    []*claim
	probing   bool // a probe loop runs
	destroyed bool
	// bstore is the store the breakers were built with (Registry.SetBreakerStore).
	bstore breaker.Store
}

// verdict is one handler's breaker on the upstream, for one model key (""
// per upstream, the model's under scope model).
type verdict struct {
	c     *claim
	model string
	b     *breaker.Breaker
}

// drain is an operator's drain of an upstream: every breaker forced open
// until until (forever: until Undrain).
type drain struct {
	until   time.Time
	forever bool
	reason  string
}

// left returns how long d still holds at now: ok false when it is over;
// 0 with ok when it holds until Undrain.
func (d *drain) left(now time.Time) (time.Duration, bool) {
	if d == nil {
		return 0, false
	}
	if d.forever {
		return 0, true
	}
	l := d.until.Sub(now)
	return l, l > 0
}

// claim is one pool's hold on the entries of its upstreams: what the
// entry's shared loops (prober, scraper) and the pool's breakers need of
// its config.
type claim struct {
	gen uint64
	// cgen is the generation of the config the pool belongs to
	// (Config.Generation, else gen): a claim of a newer config replaces
	// the older one of the same handler when it starts (activate).
	cgen   uint64
	active atomic.Bool
	// pool is the pool's key (Config.Key), for the admin API.
	pool string
	// owner is the pool itself.
	owner *Pool
	// handler names the handler the pool serves (Config.Handler, else
	// the pool's key): a reload hands an open verdict to the claim of
	// the same handler.
	handler string
	// settings is nil when the config turns breakers off.
	settings *breaker.Settings
	// fp is the fingerprint of the claim's policy: its breaker settings
	// and whether it reads saturation signals ("" when breakers are off).
	// Breakers of one policy share their fleet key.
	fp string
	// scopeModel: the pool keys breakers by model, so it holds no
	// per-upstream breaker ahead of traffic.
	scopeModel bool
	prober     *Prober
	// sat is the config's saturation settings (defaults applied), nil
	// when it reads no signals.
	sat *saturation.Saturation
}

// newerThan orders claims for the settings one loop of the entry runs with
// (the scraper's, the prober's): the claim of the newer config, and among
// the claims of one config — which Caddy provisions in no fixed order, one
// HTTP server after another — the one whose policy fingerprint, then
// handler name, sorts last (then the later started), so that the choice is
// a function of the config.
func (c *claim) newerThan(o *claim) bool {
	if c.cgen != o.cgen {
		return c.cgen > o.cgen
	}
	if c.fp != o.fp {
		return c.fp > o.fp
	}
	if c.handler != o.handler {
		return c.handler > o.handler
	}
	return c.gen > o.gen
}

// policyFingerprint identifies a breaker policy: "s" (saturation signals
// trip its breakers) or "b" (they do not), then 8 hex digits of the FNV-1a
// hash of the breaker settings and, with saturation, of the saturation
// breaker's trip rules and the queue_threshold its recovery reads, and its
// scope. Breakers of one policy on one upstream have one key in a fleet
// store ("addr~policy", see breakerKey), so gateways running one config
// share their verdicts, and handlers with other settings never do.
func policyFingerprint(s *breaker.Settings, sat *saturation.Saturation, scopeModel bool) string {
	if s == nil {
		return ""
	}
	h := fnv.New32a()
	fmt.Fprintf(h, "%+v", *s)
	if scopeModel {
		fmt.Fprint(h, "|scope model")
	}
	kind := "b"
	if sat != nil {
		kind = "s"
		if sat.Trip != nil {
			fmt.Fprintf(h, "|trip %+v", *sat.Trip)
		} else {
			fmt.Fprint(h, "|trip off")
		}
		fmt.Fprintf(h, "|queue %v", sat.QueueThreshold)
	}
	return fmt.Sprintf("%s%08x", kind, h.Sum32())
}

func newEntry(reg *Registry, addr string) *Entry {
	ctx, cancel := context.WithCancel(context.Background())
	e := &Entry{addr: addr, reg: reg, ctx: ctx, cancel: cancel, recent: breaker.NewOutcomes(RecentWindow, reg.clock)}
	e.scraper = reg.scrapers.New(addr, scrapeHost{e})
	e.verdicts.Store(&[]verdict{})
	return e
}

// verdictList returns the current verdicts; do not modify it.
func (e *Entry) verdictList() []verdict { return *e.verdicts.Load() }

// Addr returns the entry's dial address ("10.0.0.2:8000", or a socket path).
func (e *Entry) Addr() string { return e.addr }

// Inflight returns the number of attempts in progress to the server.
func (e *Entry) Inflight() int64 { return e.inflight.Load() }

// RecentWindow is the window of an upstream's shared record of outcomes
// (Entry.Recent).
const RecentWindow = 10 * time.Second

// Recent returns the outcomes of every attempt on the server within
// RecentWindow, of every handler, recorded once each: picks made in panic
// or past the ejection cap, which take no breaker permit, included.
func (e *Entry) Recent() breaker.OutcomeCounts { return e.recent.Counts() }

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

// takeProbe admits a half-open probe of a user request for model key
// while fewer than limit (the asking breaker's half_open_probes) are in
// flight across every handler, so that however many handlers' breakers
// are half-open at once the upstream gets one handler's probes; the
// caller gives it back with giveProbe.
func (e *Entry) takeProbe(model string, limit int) bool {
	e.probeMu.Lock()
	defer e.probeMu.Unlock()
	if e.probes[model] >= max(limit, 1) {
		return false
	}
	if e.probes == nil {
		e.probes = map[string]int{}
	}
	e.probes[model]++
	return true
}

func (e *Entry) giveProbe(model string) {
	e.probeMu.Lock()
	if e.probes[model]--; e.probes[model] <= 0 {
		delete(e.probes, model)
	}
	e.probeMu.Unlock()
}

// addClaim records a pool's hold; the caller releases it with dropClaim.
// Adding a claim twice adds it once.
func (e *Entry) addClaim(c *claim) {
	e.mu.Lock()
	if !slices.Contains(e.claims, c) {
		e.claims = append(e.claims, c)
		e.configureScraperLocked()
	}
	e.mu.Unlock()
}

// dropClaim forgets a pool's hold and its breakers.
func (e *Entry) dropClaim(c *claim) {
	e.mu.Lock()
	e.claims = slices.DeleteFunc(e.claims, func(x *claim) bool { return x == c })
	e.configureScraperLocked()
	gone := e.removeLocked(func(v verdict) bool { return v.c == c })
	e.mu.Unlock()
	for _, v := range gone {
		v.b.Close()
	}
	e.maybeProbe()
}

// removeLocked drops the verdicts for which drop is true and reports them
// gone; the caller closes them once e.mu is released.
func (e *Entry) removeLocked(drop func(verdict) bool) []verdict {
	var keep, gone []verdict
	for _, v := range e.verdictList() {
		if drop(v) {
			gone = append(gone, v)
		} else {
			keep = append(keep, v)
		}
	}
	if len(gone) == 0 {
		return nil
	}
	e.verdicts.Store(&keep)
	for _, v := range gone {
		e.reg.obs.BreakerGone(e.addr, v.model)
	}
	return gone
}

// activate applies a started pool's claim: the entry's loops take its
// settings where it is the newest, and the open verdicts of the handler it
// replaces — the same handler in an older config, else a pool of an older
// config in front of the same upstreams with the same settings — carry
// over to its breakers, once, with their cooldown's end: a reload never
// sends traffic to an upstream a handler held out, nor forgets a drain.
func (e *Entry) activate(c *claim) {
	e.mu.Lock()
	e.configureScraperLocked()
	var from []verdict
	if c.settings != nil && !e.destroyed {
		pred := e.predecessorLocked(c)
		for _, v := range e.verdictList() {
			if pred != nil && v.c == pred && v.b.State() != breaker.Closed {
				from = append(from, v)
			}
		}
	}
	e.mu.Unlock()
	for _, v := range from {
		if nb := e.breakerFor(c, v.model); nb != nil {
			carryOpen(v.b, nb, e.reg.now(), "open before the reload")
		}
	}
	e.maybeProbe()
}

// predecessorLocked returns the claim c replaces, of the claims of older
// configs: the newest of the same handler and policy; else the one of the
// same handler in the newest older config that has it, when only one
// there has that name (a handler whose settings changed; unnamed handlers
// of one upstream list share a name); else the newest of the same pool and
// policy (a handler whose name changed with its line in the Caddyfile).
// nil when none.
func (e *Entry) predecessorLocked(c *claim) *claim {
	var same, byPool *claim
	named := map[uint64][]*claim{}
	var newest uint64
	for _, o := range e.claims {
		if o.cgen >= c.cgen || o.settings == nil {
			continue
		}
		if o.handler == c.handler {
			if o.fp == c.fp && (same == nil || o.newerThan(same)) {
				same = o
			}
			named[o.cgen] = append(named[o.cgen], o)
			newest = max(newest, o.cgen)
		}
		if o.pool == c.pool && o.fp == c.fp && (byPool == nil || o.newerThan(byPool)) {
			byPool = o
		}
	}
	switch {
	case same != nil:
		return same
	case len(named[newest]) == 1:
		return named[newest][0]
	}
	return byPool
}

// carryOpen hands old's open verdict to nb, a closed breaker that replaces
// it: an open breaker stays open until the end of its cooldown, or until
// closed if forced so; an operator's timed open is forced again for what
// is left of it (the admin API and status still say forced).
func carryOpen(old, nb *breaker.Breaker, now time.Time, reason string) {
	snap := old.Snapshot()
	if snap.State == breaker.Closed || nb.State() != breaker.Closed {
		return
	}
	if d := snap.OpenUntil.Sub(now); snap.Forced && !snap.OpenUntil.IsZero() && d > 0 {
		nb.ForceOpen(d, reason)
		return
	}
	nb.Adopt(snap.OpenUntil, reason)
}

// breakerFor returns c's breaker for a model key ("" per upstream),
// creating it with c's settings and the registry's breaker store; nil when
// c has breakers off or does not hold the entry (a request still running
// on a config that released it), or the entry is gone. A new breaker
// starts as the entry's drain says; a new handler's (one no older config
// had) as another handler's with the same settings open on hard evidence
// (equal settings, equal verdict).
func (e *Entry) breakerFor(c *claim, model string) *breaker.Breaker {
	if c == nil || c.settings == nil {
		return nil
	}
	if b := e.lookupFor(c, model); b != nil {
		return b
	}
	e.mu.Lock()
	if e.destroyed || !slices.Contains(e.claims, c) {
		e.mu.Unlock()
		return nil
	}
	old := e.verdictList()
	var twin *breaker.Breaker
	newHandler := e.predecessorLocked(c) == nil // else activate carries its state over
	for _, v := range old {
		if v.c == c && v.model == model {
			e.mu.Unlock()
			return v.b
		}
		if newHandler && v.model == model && v.c.fp == c.fp && twin == nil && v.b.Evidence() == breaker.Hard {
			twin = v.b
		}
	}
	st := e.reg.BreakerStore()
	if len(old) == 0 {
		e.bstore = st
	} // else a SetBreakerStore is on its way to this entry and builds them all again
	b, l := e.newBreakerLocked(c, model, *c.settings, st)
	next := append(slices.Clip(old), verdict{c: c, model: model, b: b})
	e.verdicts.Store(&next)
	e.reg.obs.BreakerCreated(e.addr, model)
	dr := e.drain.Load()
	e.mu.Unlock()
	l.register(b)
	now := e.reg.now()
	if d, ok := dr.left(now); ok {
		// The upstream is drained: a breaker of a handler or model that
		// had none when the drain began refuses as the others do.
		b.ForceOpen(d, dr.reason)
	} else if twin != nil {
		carryOpen(twin, b, now, "open for the handlers with the same settings")
	}
	return b
}

// lookupFor returns c's breaker for a model key without creating one.
func (e *Entry) lookupFor(c *claim, model string) *breaker.Breaker {
	if c == nil || c.settings == nil {
		return nil
	}
	for _, v := range e.verdictList() {
		if v.c == c && v.model == model {
			return v.b
		}
	}
	return nil
}

// breakerKey is a breaker's key in a fleet store (breaker.WithStoreKey):
// "addr~policy", then "|model" under scope model. Breakers of one policy
// share it, so a fleet's gateways, and handlers with equal settings, share
// one verdict, and handlers with other settings never do.
func (e *Entry) breakerKey(c *claim, model string) string {
	name := e.addr + "~" + c.fp
	if model != "" {
		name += "|" + model
	}
	return name
}

// displayKey is the breaker's key (breaker.Key) in the admin API and
// logs: "addr", then "|model" under scope model.
func (e *Entry) displayKey(model string) string {
	if model == "" {
		return e.addr
	}
	return e.addr + "|" + model
}

// newBreakerLocked builds c's breaker for model with store st (nil: none).
// Its transitions wait in the returned listener until register, which the
// caller calls once the breaker is in the list and e.mu is released: a
// store that knows the key is open opens the breaker within New, and the
// entry's listener takes e.mu.
func (e *Entry) newBreakerLocked(c *claim, model string, s breaker.Settings, st breaker.Store) (*breaker.Breaker, *heldListener) {
	l := &heldListener{e: e, model: model}
	opts := []breaker.Option{breaker.WithListener(l.listen)}
	if st != nil {
		opts = append(opts, breaker.WithStore(st))
	}
	opts = append(opts, breaker.WithStoreKey(e.breakerKey(c, model)))
	return breaker.New(e.displayKey(model), s, append(opts, e.reg.breakerOpts...)...), l
}

// heldListener is a breaker's listener that holds its transitions until
// the breaker is registered, then hands them, in order, to the entry.
type heldListener struct {
	e     *Entry
	model string

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
	l.e.transition(l.model, l.b, tr)
}

// register delivers the held transitions; later ones go straight through.
// Call it without e.mu.
func (l *heldListener) register(b *breaker.Breaker) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b = b
	for _, tr := range l.held {
		l.e.transition(l.model, b, tr)
	}
	l.held = nil
}

// hear gives the outcome of an attempt that own let through (nil: a pick
// without a permit, in panic or past the cap) to every other handler's
// breaker for model key: each judges it by its own rules. Each fleet key
// reports it once (Breaker.Hear).
func (e *Entry) hear(own *breaker.Breaker, model string, o breaker.Outcome, issued time.Time, ttft time.Duration, reason string) {
	if o == breaker.Neutral {
		return
	}
	vs := e.verdictList()
	for i, v := range vs {
		if v.model != model || v.b == own {
			continue
		}
		report := own == nil || own.StoreKey() != v.b.StoreKey()
		for _, w := range vs[:i] {
			if w.model == model && w.b != own && w.b.StoreKey() == v.b.StoreKey() {
				report = false // an earlier one with this key reported it
			}
		}
		v.b.Hear(o, issued, ttft, reason, report)
	}
}

// live tells every handler's breaker for model key of a sign of life (a
// first token): see Breaker.Live.
func (e *Entry) live(model string) {
	for _, v := range e.verdictList() {
		if v.model == model {
			v.b.Live()
		}
	}
}

// retryAfter keeps every handler's breaker for model key open for what
// the upstream asked (a 429 or 503 with Retry-After is the upstream's word
// to every client, not to one handler).
func (e *Entry) retryAfter(model string, d time.Duration, reason string) {
	for _, v := range e.verdictList() {
		if v.model == model {
			v.b.ExtendOpen(d, reason)
		}
	}
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
	old := e.verdictList()
	if len(old) == 0 {
		e.mu.Unlock()
		return
	}
	next := make([]verdict, len(old))
	ls := make([]*heldListener, len(old))
	for i, v := range old {
		var nb *breaker.Breaker
		nb, ls[i] = e.newBreakerLocked(v.c, v.model, *v.c.settings, st)
		next[i] = verdict{c: v.c, model: v.model, b: nb}
		e.reg.obs.BreakerCreated(e.addr, v.model) // the new one's state, from closed
	}
	e.verdicts.Store(&next)
	e.mu.Unlock()
	for i, v := range old {
		nb := next[i].b
		if snap := v.b.Snapshot(); snap.State == breaker.Open && nb.State() == breaker.Closed {
			// OpenUntil is zero when forced open until closed: so is Adopt's.
			nb.Adopt(snap.OpenUntil, "open before the breaker store changed")
		}
		ls[i].register(nb)
		v.b.Close()
	}
	e.maybeProbe()
}

// AllBreakers returns every handler's breaker on the upstream, of every
// model key, sorted by key.
func (e *Entry) AllBreakers() []*breaker.Breaker {
	vs := e.verdictList()
	out := make([]*breaker.Breaker, 0, len(vs))
	for _, v := range vs {
		out = append(out, v.b)
	}
	slices.SortStableFunc(out, func(a, b *breaker.Breaker) int { return strings.Compare(a.Key(), b.Key()) })
	return out
}

// Drain is an operator's drain of the upstream (admin API: POST
// /llm_proxy/breakers/<addr>/open): every handler's breaker on the
// upstream, of every model key, is forced open for d (d ≤ 0: until
// Undrain; see breaker.ForceOpen), and a breaker created while the drain
// lasts (a model first requested under scope model, a handler of a config
// loaded meanwhile) starts forced open for what is left of it, so that no
// handler sends here. It returns the breakers it opened, sorted by key; ok
// is false, and nothing changes, when no handler holding the upstream has
// breakers on.
func (e *Entry) Drain(d time.Duration, reason string) (opened []*breaker.Breaker, ok bool) {
	e.mu.Lock()
	if e.destroyed || !slices.ContainsFunc(e.claims, func(c *claim) bool { return c.settings != nil }) {
		e.mu.Unlock()
		return nil, false
	}
	dr := &drain{forever: d <= 0, reason: reason}
	if d > 0 {
		dr.until = e.reg.now().Add(d)
	}
	e.drain.Store(dr)
	e.mu.Unlock()
	// Outside e.mu: each transition reaches the entry's listener.
	bs := e.AllBreakers()
	for _, b := range bs {
		b.ForceOpen(d, reason)
	}
	return bs, true
}

// Drained reports whether an operator's drain (Drain) holds the upstream
// at now, and until when (zero: until Undrain). A handler with breakers
// off has no breaker to force open, so its pick skips a drained upstream
// by this.
func (e *Entry) Drained(now time.Time) (until time.Time, ok bool) {
	dr := e.drain.Load()
	d, ok := dr.left(now)
	if ok && d > 0 {
		until = now.Add(d)
	}
	return until, ok
}

// Undrain ends a drain (admin API: POST /llm_proxy/breakers/<addr>/close
// or /reset): every breaker of the upstream is forced closed, or reset to
// a fresh closed state, and breakers created from now on start closed. It
// returns the breakers it changed, sorted by key; ok is false when no
// handler holding the upstream has breakers on.
func (e *Entry) Undrain(reset bool, reason string) (changed []*breaker.Breaker, ok bool) {
	e.mu.Lock()
	e.drain.Store(nil)
	on := !e.destroyed && slices.ContainsFunc(e.claims, func(c *claim) bool { return c.settings != nil })
	e.mu.Unlock()
	if !on {
		return nil, false
	}
	bs := e.AllBreakers()
	for _, b := range bs {
		if reset {
			b.Reset()
		} else {
			b.ForceClose(reason)
		}
	}
	return bs, true
}

// Verdict is one handler's breaker on an upstream, for the admin API.
type Verdict struct {
	// Breaker is the handler's breaker.
	Breaker *breaker.Breaker
	// Model is the model key under scope model, "" per upstream.
	Model string
	// Pool is the key of the handler's pool (Config.Key); Handler its
	// name (Config.Handler); Policy the fingerprint of its settings.
	Pool, Handler, Policy string
	// Active is false for a pool of a config not started yet, or stopped.
	Active bool

	cgen uint64 // the config's generation
}

// Verdicts returns every handler's breaker on the upstream, sorted by
// model key, then handler.
func (e *Entry) Verdicts() []Verdict {
	vs := e.verdictList()
	out := make([]Verdict, 0, len(vs))
	for _, v := range vs {
		out = append(out, Verdict{Breaker: v.b, Model: v.model, Pool: v.c.pool, Handler: v.c.handler, Policy: v.c.fp, Active: v.c.active.Load(), cgen: v.c.cgen})
	}
	slices.SortStableFunc(out, func(a, b Verdict) int {
		return cmp.Or(strings.Compare(a.Model, b.Model), strings.Compare(a.Handler, b.Handler), strings.Compare(a.Pool, b.Pool))
	})
	return out
}

// transition is every breaker's listener. A breaker that is no longer the
// entry's (dropped, or the entry destroyed) reports nothing: its gauges are
// gone and must not come back.
func (e *Entry) transition(model string, b *breaker.Breaker, tr breaker.Transition) {
	e.mu.Lock()
	// Reported under the lock, so that a destroy or a drop cannot slip in
	// between the check and the report and have its gauge re-created.
	live := !e.destroyed && slices.ContainsFunc(e.verdictList(), func(v verdict) bool { return v.b == b })
	if live {
		e.reg.obs.BreakerTransition(e.addr, model, tr)
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
	gone := e.removeLocked(func(verdict) bool { return true })
	e.scraper.Stop() // reports ScraperGone under e.mu, as BreakerGone
	e.mu.Unlock()
	for _, v := range gone {
		v.b.Close()
	}
	e.cancel()
}

// deactivate hands the entry's loops back to the newest other started
// config (this config stopped, or another app of it failed to start).
func (e *Entry) deactivate() {
	e.mu.Lock()
	e.configureScraperLocked()
	e.mu.Unlock()
	e.maybeProbe()
}
