// Package upstream is the gateway's pool of inference servers: one shared
// Entry per upstream server (dial address) holding its in-flight count,
// its evidence, each handler's circuit breakers, its active prober
// and its saturation.Scraper (which breakers a saturation trip reaches:
// those of the pools that configured saturation); the Pool that a handler
// picks from (candidate filtering by breaker, saturation score, capacity
// and what was tried, then the selection policy, then a permit); the
// recording of each attempt's outcome (DESIGN §4); and the per-pool retry
// budget, hedge cap and TTFT trackers. It knows HTTP but nothing of Caddy:
// the Caddy glue adapts Caddy's selection policies, upstream sources and
// transport to it.
//
// Who decides that an upstream is out for a request: the handler's Pool,
// in three steps of Pick.
//
//   - The pool as a whole (poolfail.go): when all of its last
//     PoolFailWindow outcomes, across two or more upstreams, failed, the
//     pool has failed and answers 503 without touching its upstreams but
//     for one probe per upstream per probe interval; the first probe that
//     succeeds re-admits traffic.
//   - The handler's verdict on the upstream: its breaker (closed, open
//     until, half-open), which applies the handler's breaker settings to
//     the upstream's evidence. Hard evidence (a dead or hanging server, a
//     Retry-After, an operator's drain) keeps the upstream out whatever
//     the rest of the pool does.
//   - The pool's outlier detector (outliers.go), run every
//     OutlierInterval on the registry's clock: an upstream failing far
//     more than the rest of its pool, or nearly always, or past the
//     handler's statistical rules, is held on statistical evidence, at
//     most max_ejection of the pool at once; below the panic threshold
//     the pool routes over such upstreams. Where nothing keeps an
//     upstream out (panic, past the cap), its recent failures count
//     against it in what the selection policy sees (Candidate.Load).
//
// Evidence is per upstream and recorded once per attempt, whichever
// handler made it and whether a breaker let it through: in the entry's
// settings-free record (evidence.go, the admin API's upstream_evidence),
// in the pool's window of last outcomes, and in every handler's breaker on
// the upstream (verdicts.go), which judges it by that handler's settings.
// Each handler has its own breakers (per model under scope model); a
// reload builds new ones and carries an open verdict over to the handler
// that replaces the old one.
package upstream

import (
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
	"github.com/llmproxy/caddy-llm-proxy/internal/registry"
	"github.com/llmproxy/caddy-llm-proxy/saturation"
)

// Observer receives the pool's events for metrics and logs. Calls come from
// request goroutines and probe loops; implementations must be safe for
// concurrent use and cheap.
type Observer interface {
	// BreakerCreated is called when an upstream's breaker is created; key
	// is "" for the per-upstream breaker, the model under scope model.
	BreakerCreated(upstream, key string)
	// BreakerTransition reports a state change of a live breaker of
	// handler (Config.Handler, else the pool's key).
	BreakerTransition(upstream, key, handler string, tr breaker.Transition)
	// BreakerGone is called when a breaker is forgotten (its upstream
	// released, or breakers turned off): its gauges should go.
	BreakerGone(upstream, key string)
	// ShortCircuited is called when an upstream is skipped because its
	// breaker refused.
	ShortCircuited(upstream string)
	// HedgeDelay reports the hedge delay computed for a request.
	HedgeDelay(model string, stream bool, d time.Duration)
	// Scraped, SignalUpdated and ScraperGone report each upstream's
	// /metrics scrapes and signals (see saturation.Observer); an Observer
	// that also implements saturation.PrefixHitObserver gets the servers'
	// prefix-cache hit ratios.
	saturation.Observer
}

// NopObserver discards every event.
type NopObserver struct{}

func (NopObserver) BreakerCreated(string, string)                                {}
func (NopObserver) BreakerTransition(string, string, string, breaker.Transition) {}
func (NopObserver) BreakerGone(string, string)                                   {}
func (NopObserver) ShortCircuited(string)                                        {}
func (NopObserver) HedgeDelay(string, bool, time.Duration)                       {}
func (NopObserver) Scraped(string, time.Duration, error)                         {}
func (NopObserver) SignalUpdated(string, saturation.Signal, saturation.Value, saturation.SignalState, saturation.SignalState) {
}
func (NopObserver) ScraperGone(string) {}

// Registry is the process-wide home of upstream entries and pool state,
// keyed by identities that do not change across reloads: entries by dial
// address, pool state by the pool's identity and settings. A Pool takes its
// references at construction (Provision) and drops them in Release
// (Cleanup), through one registry.Claims.
type Registry struct {
	obs     Observer
	entries *registry.Table[*Entry]
	state   *registry.Table[*poolState]
	// Models bounds the model names used as metric labels and breaker keys.
	Models *ModelNames
	// gen numbers pools, newest highest.
	gen atomic.Uint64
	// loops counts the probe loops running.
	loops atomic.Int64
	// scrapers are the entries' /metrics scrapers (on the registry's
	// clock) and the count of their loops.
	scrapers *saturation.Scrapers
	// breakerOpts are added to every breaker's options: the statistical
	// rules go to the pools' outlier detectors (WithOutlierDetector), and
	// tests inject a clock. Tests append to it, never replace it.
	breakerOpts []breaker.Option
	// clock is the time of picks, retry budgets, the probe and scrape
	// loops and, through breakerOpts, breakers (UseClock); clock.Real by
	// default.
	clock clock.Clock
	// store is the breaker store of the breakers created now (nil: none);
	// storeMu serializes SetBreakerStore.
	store   atomic.Pointer[storeBox]
	storeMu sync.Mutex
}

// storeBox holds a breaker.Store, which may be nil, in an atomic pointer.
type storeBox struct{ s breaker.Store }

// SetBreakerStore makes s the store of every upstream breaker (nil: none,
// each breaker keeps its state to itself): a fleet's breaker store
// (fleet.Breakers) shares their counts and open state with the other
// gateways. The breakers that exist are built again with s, each with the
// state that can travel: an open breaker stays open until the end of its
// cooldown (until closed, if forced so), as a verdict of the new store
// (its recovery is published); a half-open one starts closed, and the
// rolling windows start empty. Setting the store in effect does nothing,
// so a reload that keeps the fleet keeps the breakers.
func (r *Registry) SetBreakerStore(s breaker.Store) {
	r.storeMu.Lock()
	defer r.storeMu.Unlock()
	if r.BreakerStore() == s {
		return
	}
	r.store.Store(&storeBox{s})
	for _, e := range r.Entries() {
		e.useStore(s)
	}
}

// BreakerStore is the store set by SetBreakerStore, nil for none.
func (r *Registry) BreakerStore() breaker.Store {
	if b := r.store.Load(); b != nil {
		return b.s
	}
	return nil
}

// NewRegistry returns an empty registry reporting to obs (nil: NopObserver).
func NewRegistry(obs Observer) *Registry {
	if obs == nil {
		obs = NopObserver{}
	}
	r := &Registry{obs: obs, Models: NewModelNames(DefaultMaxModels, DefaultMaxUnservedModels), clock: clock.Real,
		breakerOpts: []breaker.Option{breaker.WithOutlierDetector()}}
	r.scrapers = saturation.NewScrapers(r.clock, obs)
	r.entries = registry.NewTable(func(_ string, e *Entry) { e.destroy() })
	r.state = registry.NewTable[*poolState](nil)
	return r
}

// UseClock makes c the clock of picks, of the retry budgets of pools built
// from now on, of the breakers created from now on and of the background
// loops (the active prober's interval, the /metrics scrape interval and
// each scrape's timeout and stamp), so that tests and simulations run on a
// fake clock. Call it before building pools; it is not safe for concurrent
// use with them.
func (r *Registry) UseClock(c clock.Clock) {
	r.clock = c
	r.breakerOpts = append(r.breakerOpts, breaker.WithClock(c))
	r.scrapers = saturation.NewScrapers(c, r.obs)
}

// now is the registry clock's time.
func (r *Registry) now() time.Time { return r.clock.Now() }

// Entry returns the entry for a dial address without taking a reference.
func (r *Registry) Entry(addr string) (*Entry, bool) { return r.entries.Peek(addr) }

// Entries returns every entry, sorted by address.
func (r *Registry) Entries() []*Entry {
	_, es := r.entries.Snapshot()
	return es
}

// EntryRefs returns how many configs hold the entry for addr.
func (r *Registry) EntryRefs(addr string) int { return r.entries.Refs(addr) }

// ProbeLoops returns the number of active-probe loops running.
func (r *Registry) ProbeLoops() int { return int(r.loops.Load()) }

// BreakerView is one handler's breaker on an upstream, with the
// upstream's shared evidence, for the admin API.
type BreakerView struct {
	breaker.Snapshot
	// FleetKey is the breaker's key in a fleet store: "addr~policy", then
	// "|model" (Snapshot.Key is "addr", then "|model").
	FleetKey string `json:"fleet_key"`
	// Upstream is the upstream's dial address.
	Upstream string `json:"upstream"`
	// Model is the model under scope model, "" for a per-upstream breaker.
	Model string `json:"model,omitempty"`
	// Inflight is the attempts in progress to the upstream.
	Inflight int64 `json:"inflight"`
	// Recent is the outcomes of every handler's attempts on the upstream
	// within RecentWindow (Entry.Recent; also in UpstreamEvidence).
	Recent breaker.OutcomeCounts `json:"recent"`
	// UpstreamEvidence is the upstream's shared evidence, the same for
	// every handler's breaker on it (Entry.Evidence).
	UpstreamEvidence UpstreamEvidence `json:"upstream_evidence"`
	// Policy is the fingerprint of the handler's breaker settings ("b",
	// or "s" when saturation trips them, then 8 hex digits): handlers
	// with one policy reach one verdict.
	Policy string `json:"policy,omitempty"`
	// Handler names the handler (site) whose verdict this is
	// (Config.Handler); Pool is its pool's key (a label in the admin API).
	Handler string `json:"handler"`
	Pool    string `json:"pool"`
	// Pools and Handlers are Pool and Handler as one-element lists, as
	// earlier versions showed them.
	Pools    []string `json:"pools"`
	Handlers []string `json:"handlers"`
	// Scope is "fleet" when the breaker's counts and state are shared with
	// the fleet (its store is the fleet's, in fleet mode, and it is not
	// open by its own rules alone, see Snapshot.Local), else "local".
	// Filled by the admin API.
	Scope string `json:"scope,omitempty"`
	// OpenedBy is the instance that opened the key fleet-wide, while the
	// fleet says it is open. Filled by the admin API.
	OpenedBy string `json:"opened_by,omitempty"`
}

// View returns v, a verdict of e, as the admin API shows it.
func (e *Entry) View(v Verdict) BreakerView {
	return BreakerView{Snapshot: v.Breaker.Snapshot(), FleetKey: v.Breaker.StoreKey(), Upstream: e.addr, Model: v.Model, Inflight: e.Inflight(), Recent: e.Recent(), UpstreamEvidence: e.Evidence(),
		Policy: v.Policy, Handler: v.Handler, Pool: v.Pool, Pools: []string{v.Pool}, Handlers: []string{v.Handler}}
}

// shown returns the verdicts of e the admin API lists: those of the
// newest started config of each handler (a config that is loading, or an
// old one still finishing its requests after a reload, has breakers of
// its own that govern nothing new), or all of them when no config holding
// e has started.
func (e *Entry) shown() []Verdict {
	all := e.Verdicts()
	newer := func(v Verdict) bool {
		return slices.ContainsFunc(all, func(o Verdict) bool {
			return o.Active && o.Handler == v.Handler && o.Model == v.Model && o.cgen > v.cgen
		})
	}
	active := slices.DeleteFunc(slices.Clone(all), func(v Verdict) bool { return !v.Active || newer(v) })
	if len(active) == 0 {
		return all
	}
	return active
}

// Breakers returns every handler's live breaker on every upstream, sorted
// by key (then model, handler).
func (r *Registry) Breakers() []BreakerView {
	var out []BreakerView
	for _, e := range r.Entries() {
		for _, v := range e.shown() {
			out = append(out, e.View(v))
		}
	}
	sortViews(out)
	return out
}

// Find returns the entry and the verdicts a key names: "addr" or
// "addr|model" (every started handler's breaker for it), or a fleet key
// "addr~policy[|model]" (the breakers of that policy). ok is false when
// none.
func (r *Registry) Find(key string) (*Entry, []Verdict, bool) {
	for _, e := range r.Entries() {
		rest, found := strings.CutPrefix(key, e.addr)
		if !found || rest != "" && rest[0] != '|' && rest[0] != '~' {
			continue
		}
		var out []Verdict
		for _, v := range e.shown() {
			if key == v.Breaker.Key() || key == v.Breaker.StoreKey() {
				out = append(out, v)
			}
		}
		if len(out) > 0 {
			return e, out, true
		}
	}
	return nil, nil, false
}

// NextGeneration returns a new config generation for Config.Generation,
// greater than every generation and pool numbered before it.
func (r *Registry) NextGeneration() uint64 { return r.gen.Add(1) }
