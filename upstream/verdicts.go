package upstream

// Each handler's verdicts on an upstream: its breakers, built per claim
// and model key, the outcomes every one of them hears, and how a reload
// hands an open verdict to the handler that replaces it.

import (
	"cmp"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/saturation"
)

// verdict is one handler's breaker on the upstream, for one model key (""
// per upstream, the model's under scope model).
type verdict struct {
	c     *claim
	model string
	b     *breaker.Breaker
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

// verdictList returns the current verdicts; do not modify it.
func (e *Entry) verdictList() []verdict { return *e.verdicts.Load() }

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

// predecessorLocked returns the claim c replaces, of the claims of the
// newest older config holding the entry: the pools of c's config and of
// that one are matched one to one, in passes, each old claim taken once:
// the same name given by the operator (whatever its settings: two named
// sites that swap settings keep their own states); where no unnamed
// handler's line moved, the same line and pool (whatever its settings,
// likewise); the same handler name,
// pool and policy; the same pool (upstreams) and policy (an unnamed
// handler whose Caddyfile line moved, "Caddyfile:<line>" being a line, not
// an identity: a pool's detector holds are its own, so a line that another
// pool's site moved onto must not win); the same handler name and policy;
// the same handler name (an unnamed handler whose settings changed in
// place). nil when none is left for c.
func (e *Entry) predecessorLocked(c *claim) *claim {
	var oldGen uint64
	for _, o := range e.claims {
		if o.settings != nil && o.cgen < c.cgen {
			oldGen = max(oldGen, o.cgen)
		}
	}
	if oldGen == 0 {
		return nil
	}
	var news, olds []*claim
	for _, o := range e.claims {
		switch {
		case o.settings == nil:
		case o.cgen == c.cgen:
			news = append(news, o)
		case o.cgen == oldGen:
			olds = append(olds, o)
		}
	}
	order := func(a, b *claim) int {
		return cmp.Or(strings.Compare(a.handler, b.handler), strings.Compare(a.pool, b.pool), strings.Compare(a.fp, b.fp), cmp.Compare(a.gen, b.gen))
	}
	slices.SortFunc(news, order)
	slices.SortFunc(olds, order)
	// No unnamed handler's line moved (the same default names before and
	// after): each line is still the site it was, whatever its settings
	// now (two sites that swapped settings in place).
	lines := func(cs []*claim) []string {
		var out []string
		for _, c := range cs {
			if !c.named {
				out = append(out, c.handler)
			}
		}
		slices.Sort(out)
		return out
	}
	stayed := slices.Equal(lines(news), lines(olds))
	match := map[*claim]*claim{}
	taken := map[*claim]bool{}
	for _, same := range []func(n, o *claim) bool{
		func(n, o *claim) bool { return n.named && o.named && n.handler == o.handler },
		func(n, o *claim) bool {
			return stayed && !n.named && !o.named && n.handler == o.handler && n.pool == o.pool
		},
		func(n, o *claim) bool { return n.handler == o.handler && n.pool == o.pool && n.fp == o.fp },
		func(n, o *claim) bool { return n.pool == o.pool && n.fp == o.fp },
		func(n, o *claim) bool { return n.handler == o.handler && n.fp == o.fp },
		func(n, o *claim) bool { return !n.named && n.handler == o.handler },
	} {
		for _, n := range news {
			if match[n] != nil {
				continue
			}
			for _, o := range olds {
				if !taken[o] && same(n, o) {
					match[n], taken[o] = o, true
					break
				}
			}
		}
	}
	return match[c]
}

// breakerFor returns c's breaker for a model key ("" per upstream),
// creating it with c's settings and the registry's breaker store; nil when
// c has breakers off or does not hold the entry (a request still running
// on a config that released it), or the entry is gone. A new breaker
// starts as the entry's drain says; a new handler's (one no older config
// had) as another handler's with the same settings open on hard evidence
// (equal settings, equal verdict), but not forced open: an operator's
// open of some breakers is theirs, and a drain of the upstream comes
// from the entry's drain.
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
		if newHandler && v.model == model && v.c.fp == c.fp && twin == nil && v.b.Evidence() == breaker.Hard && !v.b.Snapshot().Forced {
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
	inherited := e.inherit[c]
	e.mu.Unlock()
	if snap := inheritedSnap(inherited); snap.State == breaker.Open && (snap.Forced || snap.OpenUntil.After(e.reg.now())) {
		// Still within the cooldown of the handler's per-upstream
		// verdict from before the reload (once it is over, the model
		// breakers judge for themselves).
		b.CarryOver(inherited, "open for the upstream before the reload")
	}
	if d, ok := dr.left(e.reg.now()); ok {
		// The upstream is drained: a breaker of a handler or model that
		// had none when the drain began refuses as the others do.
		b.ForceOpen(d, dr.reason)
	} else if twin != nil {
		b.CarryOver(twin, "open for the handlers with the same settings")
	}
	// A reload's breaker for a handler that had one starts as that one
	// was (a drain, the fleet's open key, or, at activation, its carried
	// verdict): no news for the transition count, the log or the events.
	// A new handler's breaker that starts open is news.
	l.register(b, !newHandler)
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

// register delivers the held transitions (none when quiet: the breaker
// started as the one it replaces was); later ones go straight through.
// Call it without e.mu.
func (l *heldListener) register(b *breaker.Breaker, quiet bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b = b
	for _, tr := range l.held {
		if !quiet {
			l.e.transition(l.model, b, tr)
		}
	}
	l.held = nil
}

// hear gives the outcome of an attempt that own let through (nil: a pick
// without a permit, in panic or past the cap) to every other handler's
// breaker for model key: each judges it by its own rules. Each fleet key
// reports it once (Breaker.Hear): through the first of its breakers that
// is closed, as one that is not only tallies it.
func (e *Entry) hear(own *breaker.Breaker, model string, o breaker.Outcome, issued time.Time, ttft time.Duration, reason string) {
	if o == breaker.Neutral {
		return
	}
	var buf [4]string
	reported := buf[:0] // the keys reported so far
	var mk modelKey
	for _, v := range e.verdictList() {
		if !e.judges(v, model, &mk) || v.b == own {
			continue
		}
		k := v.b.StoreKey()
		report := (own == nil || own.StoreKey() != k) && !slices.Contains(reported, k)
		if report && v.b.State() == breaker.Closed {
			reported = append(reported, k)
		} // else it only tallies (Breaker.Hear): the next closed one of k reports
		v.b.Hear(o, issued, ttft, reason, report)
	}
}

// live tells every handler's breaker for model key of a sign of life (a
// first token): see Breaker.Live.
func (e *Entry) live(model string) {
	e.ev.lastLife.Store(e.reg.now().UnixNano())
	var mk modelKey
	for _, v := range e.verdictList() {
		if e.judges(v, model, &mk) {
			v.b.Live()
		}
	}
}

// retryAfter keeps every handler's breaker for model key open for what
// the upstream asked (a 429 or 503 with Retry-After is the upstream's word
// to every client, not to one handler).
func (e *Entry) retryAfter(model string, d time.Duration, reason string) {
	if d > 0 && d <= breaker.MaxRetryAfter {
		e.ev.retryUntil.Store(e.reg.now().Add(d).UnixNano())
	}
	var mk modelKey
	for _, v := range e.verdictList() {
		if e.judges(v, model, &mk) {
			v.b.ExtendOpen(d, reason)
		}
	}
}

// useStore builds the entry's breakers again with store st (see
// Registry.SetBreakerStore): an open breaker's verdict travels whole
// (breaker.CarryOver: its end, evidence, forced mark), with no transition;
// the old ones leave their store.
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
		wasOpen := v.b.State() == breaker.Open
		if wasOpen {
			// The whole verdict travels (evidence, forced, held ratio),
			// as across a reload: an outlier stays a statistical hold
			// and a timed drain stays forced.
			nb.CarryOver(v.b, "open before the breaker store changed")
		}
		// The new store's open key is news only for a breaker that was
		// closed.
		ls[i].register(nb, wasOpen)
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
	i := slices.IndexFunc(e.verdictList(), func(v verdict) bool { return v.b == b })
	live := !e.destroyed && i >= 0
	// While a reload's new config is provisioned, its breakers hear the
	// same outcomes as those of the handlers they replace, and each
	// transition would count twice: only a started config's breakers,
	// and new handlers', report.
	if live && (e.verdictList()[i].c.active.Load() || e.predecessorLocked(e.verdictList()[i].c) == nil) && !e.twinReportedLocked(i, tr) {
		e.reg.obs.BreakerTransition(e.addr, model, e.verdictList()[i].c.handler, tr)
	}
	e.mu.Unlock()
	if !live {
		return
	}
	if tr.To == breaker.Open {
		e.maybeProbe()
	}
}

// modelKey is a request's scope model breaker key, worked out once
// (ModelNames.BreakerKey) for the first scope model breaker that needs it.
type modelKey struct {
	key  string
	done bool
}

// judges reports whether v judges an attempt for the request's model (the
// model name as requested): a per-upstream breaker every attempt on its
// upstream, a scope model breaker those of its model key, whichever
// handler made them and whatever that handler's scope.
func (e *Entry) judges(v verdict, model string, mk *modelKey) bool {
	if !v.c.scopeModel {
		return v.model == ""
	}
	if !mk.done {
		mk.key, mk.done = e.reg.Models.BreakerKey(model), true
	}
	return v.model == mk.key
}

// successorFor returns, for a claim that no longer holds the entry (its
// config was released by a reload while one of its requests still runs),
// the breaker for model key of the started claim that replaced it: the
// one activate matched to it (predecessorLocked), else of the same
// handler name, else of the same pool and policy; nil when none.
func (e *Entry) successorFor(c *claim, model string) *breaker.Breaker {
	// The claim that replaced c at activation, first: a handler's name
	// is a Caddyfile line that another site may have taken.
	e.mu.Lock()
	s := e.succ[c]
	for i := 0; s != nil && !s.active.Load() && i < 8; i++ {
		s = e.succ[s]
	}
	e.mu.Unlock()
	if s != nil && s.active.Load() {
		if b := e.lookupFor(s, model); b != nil {
			return b
		}
	}
	var best *verdict
	rank := func(v verdict) int {
		switch {
		case v.c.handler == c.handler:
			return 2
		case v.c.pool == c.pool && v.c.fp == c.fp:
			return 1
		}
		return 0
	}
	for _, v := range e.verdictList() {
		if v.model != model || !v.c.active.Load() || rank(v) == 0 {
			continue
		}
		if best == nil || rank(v) > rank(*best) || rank(v) == rank(*best) && v.c.newerThan(best.c) {
			best = &v
		}
	}
	if best == nil {
		return nil
	}
	return best.b
}

// inheritedSnap is b's snapshot, the zero one for nil.
func inheritedSnap(b *breaker.Breaker) breaker.Snapshot {
	if b == nil {
		return breaker.Snapshot{}
	}
	return b.Snapshot()
}

// twinReportedLocked reports whether another started handler's breaker of
// the same policy (fleet key) and model as verdict i is already in the
// state transition tr goes to: handlers with equal settings hear the same
// outcomes and move together, and their common transition is reported
// once, by the first to make it, not once per site.
func (e *Entry) twinReportedLocked(i int, tr breaker.Transition) bool {
	vs := e.verdictList()
	v := vs[i]
	for j, w := range vs {
		if j != i && w.model == v.model && w.c.active.Load() && w.b.StoreKey() == v.b.StoreKey() && w.b.State() == tr.To {
			return true
		}
	}
	return false
}
