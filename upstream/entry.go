package upstream

import (
	"context"
	"fmt"
	"hash/fnv"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/prefix"
	"github.com/llmproxy/caddy-llm-proxy/saturation"
)

// Entry is the gateway's state for one upstream server, identified by its
// dial address: the attempts in flight, the circuit breaker(s), the active
// prober. There is one per address in the process, shared by every handler
// and config that targets it, so in-flight counts and breaker state are
// shared between handlers and survive reloads (as Caddy's own Host is).
//
// Breakers are kept per policy: the handlers (pools) whose breaker
// settings, and whether they read saturation signals, are identical share
// one breaker per model key; a handler with other settings has its own
// (Caddy's reverseproxy keeps per-host counters shared and thresholds per
// handler, hosts.go). The primary policy is, among the handlers with
// breakers on of the newest started config (else of the newest
// provisioned one), the one whose fingerprint sorts last, see
// effectiveLocked; its breakers keep the plain names
// ("addr", "addr|model") and take the new settings when a reload changes
// them, so their state survives the reload. When a reload hands the
// primary policy to another policy while the old one is still some
// handler's (it adds a handler whose policy sorts after it), the two policies'
// breakers swap names, each built again with its open state
// (rekeyLocked), so each handler keeps its own breaker's state. Another
// policy's breakers are named "addr~<policy>" ("addr~<policy>|model"). A
// handler with breakers off uses none and changes nothing for the others.
// A config that is only provisioned (not started, or failed to load)
// never changes what a running one set (DESIGN §6).
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

	// breakers by policy and model key: an immutable map replaced under
	// mu, so the request path reads it without a lock.
	breakers atomic.Pointer[map[bkey]*breaker.Breaker]
	// prim is the primary policy; written under mu.
	prim atomic.Pointer[primary]
	// claimList is claims, replaced under mu, for the request path,
	// which must not take mu (Pool.reserveTrips runs under a breaker's
	// lock).
	claimList atomic.Pointer[[]*claim]

	mu sync.Mutex // guards everything below
	// claims are the configs holding the entry, oldest first.
	claims []*claim
	// eff is the claim whose settings the primary policy's breakers take
	// (nil: no claim has breakers on).
	eff       *claim
	probing   bool // a probe loop runs
	destroyed bool
	// bstore is the store the breakers were built with (Registry.SetBreakerStore).
	bstore breaker.Store
	// drain is an operator's drain of the upstream (Drain), nil when none:
	// a breaker created while it lasts starts forced open, and a handler
	// with breakers off skips the upstream while it lasts (Drained). Written
	// under mu; read lock-free on the pick path.
	drain atomic.Pointer[drain]
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

// primary is an entry's primary policy: its fingerprint ("" when no claim
// has breakers on) and the config generation of the claim it comes from.
type primary struct {
	fp   string
	cgen uint64
}

// bkey identifies one of an entry's breakers: its policy ("" for the
// primary policy, else the policy's fingerprint) and its model key ("" for
// the per-upstream breaker, the model name under scope model).
type bkey struct{ pol, model string }

// claim is one config's (one pool's) wishes for the entries it holds.
type claim struct {
	gen uint64
	// cgen is the generation of the config the pool belongs to
	// (Config.Generation, else gen): a claim of an older config than the
	// primary's uses the primary policy (a reload hands a handler's
	// breakers to its new settings).
	cgen   uint64
	active atomic.Bool
	// pool is the pool's key (Config.Key), for the admin API.
	pool string
	// owner is the pool itself, whose ejection cap a breaker of its
	// policy trips within (Pool.reserveTrips).
	owner *Pool
	// handler names the handler the pool serves (Config.Handler, else
	// the pool's key), for the admin API.
	handler string
	// settings is nil when the config turns breakers off.
	settings *breaker.Settings
	// fp is the fingerprint of the claim's policy: its breaker settings
	// and whether it reads saturation signals ("" when breakers are off).
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
// breaker's trip rules and the queue_threshold its recovery reads (so that
// pools with other trip rules have breakers of their own), and its scope
// (a scope model pool never reads, lists or counts as healthy another
// pool's per-upstream breaker).
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
	e.breakers.Store(&map[bkey]*breaker.Breaker{})
	e.prim.Store(&primary{})
	return e
}

// breakerMap returns the current breakers; do not modify it.
func (e *Entry) breakerMap() map[bkey]*breaker.Breaker { return *e.breakers.Load() }

// polOf returns the policy key of c's breakers: "" when c shares the
// primary policy or belongs to an older config than the primary's, else
// its fingerprint.
func (e *Entry) polOf(c *claim) string {
	if p := e.prim.Load(); c.fp == p.fp || c.cgen < p.cgen {
		return ""
	}
	return c.fp
}

// satPolicy reports whether the saturation rules trip the breakers of
// policy key pol.
func (e *Entry) satPolicy(pol string) bool {
	if pol == "" {
		pol = e.prim.Load().fp
	}
	return strings.HasPrefix(pol, "s")
}

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

// addClaim records a config's wishes; the caller releases it with dropClaim.
// Adding a claim twice adds it once.
func (e *Entry) addClaim(c *claim) {
	e.mu.Lock()
	if slices.Contains(e.claims, c) {
		e.mu.Unlock()
		return
	}
	e.claims = append(e.claims, c)
	cl := slices.Clone(e.claims)
	e.claimList.Store(&cl)
	e.mu.Unlock()
	e.reconcile()
}

func (e *Entry) dropClaim(c *claim) {
	e.mu.Lock()
	e.claims = slices.DeleteFunc(e.claims, func(x *claim) bool { return x == c })
	cl := slices.Clone(e.claims)
	e.claimList.Store(&cl)
	e.mu.Unlock()
	e.reconcile()
}

// effectiveLocked picks the claim whose settings the primary policy's
// breakers take: among the claims with breakers on of one config — the
// newest config with a started pool, else (nothing started yet, e.g. the
// first config while it starts) the newest config — the one whose policy
// fingerprint sorts last (of those, the newest claim). The choice is per
// config, not per pool: a config starts its pools one by one, and its
// first started pool alone must not make its policy the primary one for a
// moment (that dropped the other policies' breakers, and their state, on
// every reload). It depends on the config alone, not on the order in
// which its handlers were provisioned (Caddy provisions its HTTP servers
// in map order, at random), so every load of a config, and every gateway
// of a fleet running it, names the breakers alike. A claim with breakers
// off never decides anything for another handler.
func (e *Entry) effectiveLocked() *claim {
	var cgen uint64
	started := false
	for _, c := range e.claims {
		if c.settings == nil {
			continue
		}
		if a := c.active.Load(); (a && !started) || (a == started && c.cgen > cgen) {
			cgen, started = c.cgen, a
		}
	}
	var best *claim
	for _, c := range e.claims {
		if c.settings != nil && c.cgen == cgen && (best == nil || c.fp > best.fp || c.fp == best.fp && c.gen > best.gen) {
			best = c
		}
	}
	return best
}

// liveLocked reports whether some claim uses policy key pol.
func (e *Entry) liveLocked(pol string) bool {
	for _, c := range e.claims {
		if c.settings != nil && e.polOf(c) == pol {
			return true
		}
	}
	return false
}

// scopeModelLocked reports whether every claim that uses policy key pol
// keys its breakers by model, so that none reads a per-upstream breaker of
// that policy (a claim of an older config that uses the primary policy may
// still read one).
func (e *Entry) scopeModelLocked(pol string) bool {
	n := 0
	for _, c := range e.claims {
		if c.settings != nil && e.polOf(c) == pol {
			if !c.scopeModel {
				return false
			}
			n++
		}
	}
	return n > 0
}

// settingsLocked returns the settings of policy key pol.
func (e *Entry) settingsLocked(pol string) (breaker.Settings, bool) {
	if pol == "" {
		if e.eff == nil {
			return breaker.Settings{}, false
		}
		return *e.eff.settings, true
	}
	for _, c := range e.claims {
		if c.settings != nil && c.fp == pol {
			return *c.settings, true
		}
	}
	return breaker.Settings{}, false
}

// reconcile applies the claims: the effective claim's thresholds to the
// primary policy's breakers, breakers of policies no claim uses any more
// dropped, and active probing started when wanted and a breaker is not
// closed.
func (e *Entry) reconcile() {
	e.mu.Lock()
	if e.destroyed {
		e.mu.Unlock()
		return
	}
	prev := e.eff
	eff := e.effectiveLocked()
	e.eff = eff
	prim := &primary{}
	if eff != nil {
		prim = &primary{fp: eff.fp, cgen: eff.cgen}
	}
	prevPrim := e.prim.Load()
	e.prim.Store(prim)
	e.configureScraperLocked()
	moved, retired := e.rekeyLocked(prevPrim, prim)
	var drop []bkey
	var apply []*breaker.Breaker
	old := e.breakerMap()
	for k, b := range old {
		switch {
		case !e.liveLocked(k.pol), k.model == "" && e.scopeModelLocked(k.pol):
			// No claim uses the policy any more, or it became a scope
			// model policy (a reload made a scope model handler the
			// newest one): its per-upstream breaker governs nothing.
			drop = append(drop, k)
		case k.pol == "" && prev != eff:
			apply = append(apply, b)
		}
	}
	if len(drop) > 0 {
		m := make(map[bkey]*breaker.Breaker, len(old))
		gone := make(map[bkey]*breaker.Breaker, len(drop))
		for k, b := range old {
			if slices.Contains(drop, k) {
				gone[k] = b
			} else {
				m[k] = b
			}
		}
		e.breakers.Store(&m)
		defer closeBreakers(gone) // after e.mu is released
	}
	for _, k := range drop {
		e.reg.obs.BreakerGone(e.addr, k.model)
	}
	// Every other policy in use where the primary one has breakers holds
	// its per-upstream breaker too, so that a policy that stopped being the
	// primary one (a newer handler started) is listed, and tripped by
	// saturation, before its next request.
	var hold []*claim
	_, primHeld := e.breakerMap()[bkey{"", ""}]
	for _, c := range e.claims {
		if pol := e.polOf(c); primHeld && c.settings != nil && !c.scopeModel && pol != "" {
			if _, ok := e.breakerMap()[bkey{pol, ""}]; !ok {
				hold = append(hold, c)
			}
		}
	}
	e.mu.Unlock()
	for nb, r := range moved {
		r.finish(nb)
	}
	for _, b := range retired {
		b.Close()
	}
	for _, b := range apply {
		b.SetSettings(*eff.settings)
	}
	for _, c := range hold {
		e.breakerFor(c, "")
	}
	e.maybeProbe()
}

// rekeyed is a breaker built again under another key (rekeyLocked): the
// breaker it replaces, and its listener to register.
type rekeyed struct {
	old *breaker.Breaker
	l   *heldListener
}

// finish carries the replaced breaker's open state over to nb (as a
// verdict it adopts, as useStore does: an open breaker stays open until
// the end of its cooldown, or until closed if forced so; an operator's
// timed open is forced again for what is left of it), delivers nb's
// transitions and retires the old one. Call it without e.mu.
func (r rekeyed) finish(nb *breaker.Breaker) {
	if snap := r.old.Snapshot(); snap.State == breaker.Open && nb.State() == breaker.Closed {
		const reason = "open before its policy's key changed"
		if d := snap.OpenUntil.Sub(r.l.e.reg.now()); snap.Forced && !snap.OpenUntil.IsZero() && d > 0 {
			// An operator's timed open (a drain) stays one, for what is
			// left of it: the admin API and status still say forced.
			// (Adopt of a forced open until closed already keeps it forced.)
			nb.ForceOpen(d, reason)
		} else {
			nb.Adopt(snap.OpenUntil, reason)
		}
	}
	r.l.register(nb)
	r.old.Close()
}

// rekeyLocked keeps each policy's breakers when the primary policy passes
// from prev's to cur's (a reload that adds a policy sorting after prev's):
// the plain key's breakers, prev's policy's, move to "addr~<prev>" while a
// handler of cur's config still has that policy, and cur's policy's own
// breakers ("addr~<cur>") move to the plain key, each built again under
// its new name with the old one's open state (finish it after e.mu is
// released). When no handler of cur's config has prev's policy, a plain
// breaker stays and takes the new primary settings (a reload that changed
// the primary handlers' settings, or the newest config stopped and handed
// the entry back: cur's breakers are then those the new config held
// ahead of its start, and the drop that follows forgets them), unless
// cur's policy was one of prev's config too (its breakers have that
// handler's state): then cur's breaker wins and the plain one is retired
// (close it after e.mu is released). It returns the new breakers; nothing
// changes when the primary policy stays or either has breakers off.
func (e *Entry) rekeyLocked(prev, cur *primary) (built map[*breaker.Breaker]rekeyed, retired []*breaker.Breaker) {
	prevFP, fp := prev.fp, cur.fp
	if prevFP == "" || fp == "" || prevFP == fp {
		return nil, nil
	}
	old := e.breakerMap()
	has := func(fp string, cgen uint64) bool {
		return slices.ContainsFunc(e.claims, func(c *claim) bool { return c.settings != nil && c.fp == fp && c.cgen == cgen })
	}
	keepPrev := has(prevFP, cur.cgen)
	// served: cur's policy governed requests of prev's config (its
	// breakers hold state), not only those of a config not started yet.
	served := keepPrev || has(fp, prev.cgen)
	next := make(map[bkey]*breaker.Breaker, len(old))
	moves := map[bkey]*breaker.Breaker{} // new key → old breaker
	for k, b := range old {
		switch {
		case k.pol == "" && keepPrev:
			moves[bkey{prevFP, k.model}] = b
		case k.pol == "":
			if _, mine := old[bkey{fp, k.model}]; mine && served {
				retired = append(retired, b)
			} else {
				next[k] = b // stays, takes the new settings
			}
		case k.pol == fp && served:
			moves[bkey{"", k.model}] = b
		default:
			next[k] = b
		}
	}
	if len(moves) == 0 {
		return nil, nil
	}
	out := make(map[*breaker.Breaker]rekeyed, len(moves))
	for k, ob := range moves {
		s, ok := e.settingsLocked(k.pol)
		if !ok {
			s = ob.Settings()
		}
		nb, l := e.newBreakerLocked(k, s, e.bstore)
		next[k] = nb
		out[nb] = rekeyed{old: ob, l: l}
		e.reg.obs.BreakerCreated(e.addr, k.model) // the new one's state, from closed
	}
	e.breakers.Store(&next)
	return out, retired
}

// breakerFor returns c's breaker for a model key ("" per upstream),
// creating it with c's policy and the registry's breaker store; nil when c
// has breakers off or no claim uses c's policy any more (a request still
// running on a config that released the entry), or the entry is gone.
func (e *Entry) breakerFor(c *claim, model string) *breaker.Breaker {
	if c == nil || c.settings == nil {
		return nil
	}
	if b, ok := e.breakerMap()[bkey{e.polOf(c), model}]; ok {
		return b
	}
	e.mu.Lock()
	k := bkey{e.polOf(c), model}
	if e.destroyed || !e.liveLocked(k.pol) {
		e.mu.Unlock()
		return nil
	}
	old := e.breakerMap()
	if b, ok := old[k]; ok {
		e.mu.Unlock()
		return b
	}
	s, _ := e.settingsLocked(k.pol)
	st := e.reg.BreakerStore()
	if len(old) == 0 {
		e.bstore = st
	} // else a SetBreakerStore is on its way to this entry and builds them all again
	b, l := e.newBreakerLocked(k, s, st)
	m := make(map[bkey]*breaker.Breaker, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	m[k] = b
	e.breakers.Store(&m)
	e.reg.obs.BreakerCreated(e.addr, model)
	dr := e.drain.Load()
	e.mu.Unlock()
	l.register(b)
	if d, ok := dr.left(e.reg.now()); ok {
		// The upstream is drained: a breaker of a policy or model that
		// had none when the drain began refuses as the others do.
		b.ForceOpen(d, dr.reason)
	}
	return b
}

// lookupFor returns c's breaker for a model key without creating one.
func (e *Entry) lookupFor(c *claim, model string) *breaker.Breaker {
	if c == nil || c.settings == nil {
		return nil
	}
	return e.breakerMap()[bkey{e.polOf(c), model}]
}

// breakerName is the breaker's key in logs, the admin API and a fleet
// store: "addr", "addr~policy", then "|model" under scope model.
func (e *Entry) breakerName(k bkey) string {
	name := e.addr
	if k.pol != "" {
		name += "~" + k.pol
	}
	if k.model != "" {
		name += "|" + k.model
	}
	return name
}

// newBreakerLocked builds the breaker for k with store st (nil: none).
// Its transitions wait in the returned listener until register, which the
// caller calls once the breaker is in the map and e.mu is released: a
// store that knows the key is open opens the breaker within New, and the
// entry's listener takes e.mu.
func (e *Entry) newBreakerLocked(k bkey, s breaker.Settings, st breaker.Store) (*breaker.Breaker, *heldListener) {
	l := &heldListener{e: e, key: k}
	opts := []breaker.Option{breaker.WithListener(l.listen)}
	if st != nil {
		opts = append(opts, breaker.WithStore(st))
	}
	return breaker.New(e.breakerName(k), s, append(opts, e.reg.breakerOpts...)...), l
}

// heldListener is a breaker's listener that holds its transitions until
// the breaker is registered, then hands them, in order, to the entry.
type heldListener struct {
	e   *Entry
	key bkey

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
	if len(old) == 0 {
		e.mu.Unlock()
		return
	}
	m := make(map[bkey]*breaker.Breaker, len(old))
	ls := make(map[bkey]*heldListener, len(old))
	for k, ob := range old {
		s, ok := e.settingsLocked(k.pol)
		if !ok {
			s = ob.Settings()
		}
		m[k], ls[k] = e.newBreakerLocked(k, s, st)
		e.reg.obs.BreakerCreated(e.addr, k.model) // the new one's state, from closed
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

// AllBreakers returns every breaker of the upstream, of every policy and
// model key, sorted by key.
func (e *Entry) AllBreakers() []*breaker.Breaker {
	m := e.breakerMap()
	out := make([]*breaker.Breaker, 0, len(m))
	for _, b := range m {
		out = append(out, b)
	}
	slices.SortFunc(out, func(a, b *breaker.Breaker) int { return strings.Compare(a.Key(), b.Key()) })
	return out
}

// Drain is an operator's drain of the upstream (admin API: POST
// /llm_proxy/breakers/<addr>/open): every breaker of the upstream — of
// every handler's policy and every model key — is forced open for d (d ≤
// 0: until Undrain; see breaker.ForceOpen), and a breaker created while
// the drain lasts (a model first requested under scope model, a policy
// whose handler had not used the upstream yet) starts forced open for what
// is left of it, so that no handler sends here. It returns the breakers it
// opened, sorted by key; ok is false, and nothing changes, when no handler
// holding the upstream has breakers on.
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

// lookupBreaker returns an existing breaker of the primary policy without
// creating one.
func (e *Entry) lookupBreaker(model string) *breaker.Breaker {
	return e.breakerMap()[bkey{"", model}]
}

// Breakers returns the primary policy's breakers by model key ("" per
// upstream): those of the newest started handler with breakers on, and of
// every handler with the same settings. See Pool.Breakers for a given
// handler's.
func (e *Entry) Breakers() map[string]*breaker.Breaker { return e.policyBreakers("") }

func (e *Entry) policyBreakers(pol string) map[string]*breaker.Breaker {
	out := map[string]*breaker.Breaker{}
	for k, b := range e.breakerMap() {
		if k.pol == pol {
			out[k.model] = b
		}
	}
	return out
}

// PolicyPools returns the sorted keys (Config.Key) of the pools whose
// requests the breakers of policy key pol (BreakerView.Policy, "" for the
// primary policy) govern.
func (e *Entry) PolicyPools(pol string) []string { return e.poolsOf(pol) }

// poolsOf returns the sorted keys of the pools that use policy key pol.
func (e *Entry) poolsOf(pol string) []string {
	return e.claimsOf(pol, func(c *claim) string { return c.pool })
}

// PolicyHandlers returns the sorted names (Config.Handler) of the handlers
// whose requests the breakers of policy key pol (BreakerView.Policy, ""
// for the primary policy) govern.
func (e *Entry) PolicyHandlers(pol string) []string {
	return e.claimsOf(pol, func(c *claim) string { return c.handler })
}

// claimsOf returns the sorted distinct names of the claims that use policy
// key pol.
func (e *Entry) claimsOf(pol string, name func(*claim) string) []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := []string{}
	for _, c := range e.claims {
		if n := name(c); c.settings != nil && e.polOf(c) == pol && !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	sort.Strings(out)
	return out
}

// transition is every breaker's listener. A breaker that is no longer the
// entry's (dropped, or the entry destroyed) reports nothing: its gauges are
// gone and must not come back.
func (e *Entry) transition(k bkey, b *breaker.Breaker, tr breaker.Transition) {
	e.mu.Lock()
	// Reported under the lock, so that a destroy or a drop cannot slip in
	// between the check and the report and have its gauge re-created.
	live := !e.destroyed && e.breakerMap()[k] == b
	if live {
		e.reg.obs.BreakerTransition(e.addr, k.model, tr)
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
	old := e.breakerMap()
	defer closeBreakers(old) // after e.mu is released
	e.breakers.Store(&map[bkey]*breaker.Breaker{})
	for k := range old {
		e.reg.obs.BreakerGone(e.addr, k.model)
	}
	e.scraper.Stop() // reports ScraperGone under e.mu, as BreakerGone
	e.mu.Unlock()
	e.cancel()
}
