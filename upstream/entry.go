package upstream

import (
	"context"
	"maps"
	"slices"
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
	// ev is the server's evidence, whichever handler made the attempts
	// (Evidence, Recent).
	ev evidence
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
	// inherit holds, for a claim that keys by model where the handler it
	// replaces did not, that handler's open per-upstream breaker: each of
	// its model breakers starts with that verdict (activate).
	inherit map[*claim]*breaker.Breaker
	// succ maps a claim of an older config to the claim that replaced it
	// at activation (predecessorLocked), so that a request still running
	// on the released config uses its own handler's successor
	// (successorFor); an entry goes with the claim it names as successor.
	succ map[*claim]*claim
	// bstore is the store the breakers were built with (Registry.SetBreakerStore).
	bstore breaker.Store
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
	// named: handler was given by the operator (Config.Named).
	named bool
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

func newEntry(reg *Registry, addr string) *Entry {
	ctx, cancel := context.WithCancel(context.Background())
	e := &Entry{addr: addr, reg: reg, ctx: ctx, cancel: cancel}
	e.ev.recent = breaker.NewOutcomes(RecentWindow, reg.clock)
	e.scraper = reg.scrapers.New(addr, scrapeHost{e})
	e.verdicts.Store(&[]verdict{})
	return e
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
func (e *Entry) Recent() breaker.OutcomeCounts { return e.ev.recent.Counts() }

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
	delete(e.inherit, c)
	maps.DeleteFunc(e.succ, func(_, to *claim) bool { return to == c })
	e.configureScraperLocked()
	gone := e.removeLocked(func(v verdict) bool { return v.c == c })
	e.mu.Unlock()
	for _, v := range gone {
		v.b.Close()
	}
	e.maybeProbe()
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
	var downFrom *verdict
	if c.settings != nil && !e.destroyed {
		pred := e.predecessorLocked(c)
		if pred != nil {
			if e.succ == nil {
				e.succ = map[*claim]*claim{}
			}
			e.succ[pred] = c
		}
		for _, v := range e.verdictList() {
			if pred == nil || v.c != pred || v.b.State() == breaker.Closed {
				continue
			}
			switch {
			case pred.scopeModel == c.scopeModel:
				from = append(from, v)
			case !c.scopeModel:
				// The handler no longer keys by model: a model's
				// verdict says nothing of the others, but one held
				// open by refused connections or timeouts still
				// running says the server is down; the latest of
				// them carries over.
				if v.b.Evidence() == breaker.Hard && !v.b.Snapshot().Forced && e.ev.downRun.Load() > 0 &&
					(downFrom == nil || v.b.Snapshot().OpenUntil.After(downFrom.b.Snapshot().OpenUntil)) {
					vv := v
					downFrom = &vv
				}
			case c.scopeModel && !v.b.Snapshot().Forced:
				// The handler now keys by model: its per-upstream
				// verdict covers every model, each model's breaker
				// starts with it when the model is first asked for.
				// (A drain of the upstream is the entry's and reaches
				// them anyway; an operator's open of the old breaker
				// alone stays with it.)
				if e.inherit == nil {
					e.inherit = map[*claim]*breaker.Breaker{}
				}
				e.inherit[c] = v.b
			}
		}
	}
	inherited := e.inherit[c]
	e.mu.Unlock()
	if downFrom != nil {
		from = append(from, verdict{c: downFrom.c, model: "", b: downFrom.b})
	}
	for _, v := range from {
		if nb := e.breakerFor(c, v.model); nb != nil {
			nb.CarryOver(v.b, "open before the reload")
		}
	}
	if inherited != nil {
		for _, v := range e.verdictList() {
			if v.c == c {
				v.b.CarryOver(inherited, "open for the upstream before the reload")
			}
		}
	}
	e.maybeProbe()
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
	// The per-upstream verdicts a scope model handler's new model
	// breakers would start with (activate) held before this: the
	// operator's word replaces them.
	e.inherit = nil
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
