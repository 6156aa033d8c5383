package upstream

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/registry"
	"github.com/llmproxy/caddy-llm-proxy/saturation"
)

// Target is one upstream server as the glue hands it to a Pool.
type Target struct {
	// Addr is the dial address without network ("10.0.0.2:8000", or a
	// socket path): the upstream's identity in the registry, metrics and
	// logs, and the URL host of its requests.
	Addr string
	// MaxRequests caps this gateway's attempts in flight to it; 0 is no cap.
	MaxRequests int
	// Dial decorates an attempt's context with what the transport needs
	// to reach the upstream (Caddy's dial info). Optional.
	Dial func(context.Context) context.Context
	// Ref is the glue's own handle on the upstream (Caddy's
	// *reverseproxy.Upstream), for Selector adapters.
	Ref any
}

// Source returns the upstreams for a request (Caddy's dynamic upstream
// sources: a, srv, multi, ...). It is asked on every pick.
type Source func(r *http.Request) ([]Target, error)

// Config describes a Pool.
type Config struct {
	// Generation identifies the config (Caddy config load) the pool
	// belongs to: pools of one config share it, a newer config has a
	// greater one (Registry.NextGeneration). Pools of one generation in
	// front of one upstream each obey their own breaker settings; a pool
	// of an older generation uses those of the newest config (a reload
	// hands the handler's breakers to its new settings). Default 0: a
	// generation of the pool's own, newer than every earlier pool's.
	Generation uint64
	// Key identifies the pool across reloads: its sorted dial addresses,
	// or its dynamic source's configuration. Retry budgets, hedge caps
	// and TTFT trackers are kept per pool (and settings) under it.
	Key string
	// Handler names the handler (site) whose requests the pool serves,
	// as the admin API shows it beside each breaker (BreakerView.Handlers)
	// and pool (PoolStatus.Handler). Default "": Key.
	Handler string
	// Named says Handler was given by the operator (a `name`), so it names
	// the same handler in every config: a reload hands the handler's open
	// verdicts to the pool of the same name whatever its settings. Else
	// (a name derived from a Caddyfile line, which moves with edits, or
	// from the upstreams) the pool of the same upstreams and settings
	// takes them first (Entry.activate). Default false.
	Named bool
	// Static lists the upstreams; exclusive with Source.
	Static []Target
	// Source returns the upstreams per request; exclusive with Static.
	Source Source
	// Selector chooses among the candidates. Default LeastConn.
	Selector Selector
	// Breaker holds the breaker settings; nil turns breakers off.
	Breaker *breaker.Settings
	// Ejection is the pool's ejection cap and panic rule (zero fields take
	// their defaults; see Ejection). Used only with Breaker.
	Ejection Ejection
	// ScopeModel keys breakers by upstream and requested model.
	ScopeModel bool
	// Prober, when set, probes upstreams whose breaker is not closed.
	Prober *Prober
	// Retry configures the retry budget and backoff.
	Retry RetryConfig
	// Hedge configures hedging; nil turns it off.
	Hedge *HedgeConfig
	// Saturation reads the upstreams' load signals; nil turns it off.
	// Defaults are applied by NewPool; Transport is required.
	Saturation *saturation.Saturation
}

// Bounds on the dynamic upstreams a pool remembers: addresses a source
// stopped returning (pods that churn) are forgotten after dynamicTTL, or at
// once when more than maxDynamic are remembered.
const (
	dynamicTTL        = time.Minute
	maxDynamic        = 1024
	dynamicSweepEvery = 10 * time.Second
)

// Pool is one handler's view of the registry: its upstreams' entries, its
// selection policy, and its pool state. It implements proxy.Balancer (and,
// through Retries and Hedging, proxy.Retries and proxy.Hedging). It holds
// references from NewPool until Release; it applies its settings to shared
// entries only once Activate is called (the config has started).
type Pool struct {
	reg    *Registry
	cfg    Config
	claims registry.Claims
	claim  *claim
	sel    Selector

	static []*member
	// dynamic holds the members a Source returned, by address.
	dynamic   sync.Map // string → *member
	nDynamic  atomic.Int64
	lastSweep atomic.Int64
	// mem remembers a dynamic pool's addresses across reloads.
	mem *poolState

	retries *retryGate
	hedger  *hedger
	// sat is cfg.Saturation with defaults; scored says Pick computes
	// Candidate.Score (saturation on, or a selector that reads it).
	sat    *saturation.Saturation
	scored bool

	// ejection is cfg.Ejection with defaults; panic its panic mode.
	ejection Ejection
	panic    panicState
	// det is the pool's outlier detector (outliers.go): statistical
	// ejection, the cap and probation, on an interval.
	det detector
	// fail is the pool-wide rule: the pool's last outcomes and whether it
	// failed as a whole (poolfail.go).
	fail *poolFailure
}

// member is one upstream of a pool with its shared entry.
type member struct {
	t        Target
	e        *Entry
	lastSeen atomic.Int64 // unix ns, dynamic members
}

// NewPool builds a pool and takes its references: the entries of its static
// upstreams (and, for a dynamic pool, of the upstreams the same source
// returned before a reload), its retry budget and hedge cap. Nothing live
// changes until Activate. On error every reference taken is released.
func (r *Registry) NewPool(cfg Config) (*Pool, error) {
	if (len(cfg.Static) == 0) == (cfg.Source == nil) {
		return nil, errors.New("upstream pool: want static upstreams or a source, not both or neither")
	}
	p := &Pool{reg: r, cfg: cfg, sel: cfg.Selector, ejection: cfg.Ejection.WithDefaults()}
	if err := p.ejection.Validate(); err != nil {
		return nil, fmt.Errorf("breaker: %w", err)
	}
	if p.sel == nil {
		p.sel = LeastConn{}
	}
	p.claim = &claim{gen: r.gen.Add(1), pool: cfg.Key, owner: p, handler: cfg.Handler, named: cfg.Named, settings: cfg.Breaker, prober: cfg.Prober}
	if p.claim.handler == "" {
		p.claim.handler = cfg.Key
	}
	p.claim.cgen = cfg.Generation
	if p.claim.cgen == 0 {
		p.claim.cgen = p.claim.gen
	}
	if cfg.Breaker == nil {
		p.claim.prober = nil
	}
	if cfg.Saturation != nil {
		s := cfg.Saturation.Defaults()
		if err := s.Validate(); err != nil {
			return nil, fmt.Errorf("saturation: %w", err)
		}
		if s.Transport == nil {
			return nil, errors.New("saturation: a transport is required")
		}
		p.sat, p.claim.sat = &s, &s
	}
	p.claim.fp = policyFingerprint(cfg.Breaker, p.sat, cfg.ScopeModel)
	p.claim.scopeModel = cfg.ScopeModel
	_, p.scored = p.sel.(interface{ wantsScores() })
	p.scored = p.scored || p.sat != nil
	if err := p.build(); err != nil {
		p.Release()
		return nil, err
	}
	return p, nil
}

func (p *Pool) build() error {
	for _, t := range p.cfg.Static {
		if slices.ContainsFunc(p.static, func(m *member) bool { return m.t.Addr == t.Addr }) {
			return fmt.Errorf("upstream %s is listed twice", t.Addr)
		}
		e, err := p.hold(t.Addr)
		if err != nil {
			return err
		}
		p.static = append(p.static, &member{t: t, e: e})
	}
	p.holdBreakers()
	if p.cfg.Source != nil {
		mem, err := p.reg.state.Acquire(&p.claims, "dynamic|"+p.cfg.Key, newPoolState, nil)
		if err != nil {
			return err
		}
		p.mem = mem
		// Hold what the same source returned before a reload, so that
		// its breakers survive until the source is asked again.
		for _, addr := range mem.addrs() {
			if _, err := p.hold(addr); err != nil {
				return err
			}
		}
	}
	// The pool-wide rule's record outlives a reload: a pool that failed
	// as a whole stays failed for the new config's pool of the same
	// handler, upstreams and policy, which would otherwise send its whole
	// traffic to them until 40 new failures filled its window. It is the
	// handler's: another site in front of the same upstreams (other
	// requests, other settings) keeps its own.
	fs, err := p.reg.state.Acquire(&p.claims, "poolfail|"+p.cfg.Key+"|"+p.claim.handler+"~"+p.claim.fp, newPoolState, nil)
	if err != nil {
		return err
	}
	p.fail = &fs.fail
	if p.retries, err = p.newRetryGate(); err != nil {
		return err
	}
	if p.cfg.Hedge != nil {
		if p.hedger, err = p.newHedger(); err != nil {
			return err
		}
	}
	return nil
}

// hold takes the pool's reference to the entry for addr.
func (p *Pool) hold(addr string) (*Entry, error) {
	e, err := p.reg.entries.Acquire(&p.claims, addr,
		func() (*Entry, error) { return newEntry(p.reg, addr), nil },
		func(e *Entry) { e.dropClaim(p.claim) })
	if err == nil {
		e.addClaim(p.claim)
	}
	return e, err
}

// Activate applies the pool's settings to its entries: its config has
// started, so it is the newest running one. Entries the pool takes later
// (dynamic upstreams) get them at once.
func (p *Pool) Activate() { p.setActive(true) }

// Deactivate hands the entries back to the newest other running config
// (this config stopped, or another app of it failed to start).
func (p *Pool) Deactivate() { p.setActive(false) }

func (p *Pool) setActive(on bool) {
	p.claim.active.Store(on)
	for _, e := range p.entries() {
		if on {
			e.activate(p.claim)
		} else {
			e.deactivate()
		}
	}
	if on {
		p.holdBreakers()
		p.startDetector()
	} else {
		p.stopDetector()
	}
}

// holdBreakers creates the per-upstream breakers of the static upstreams,
// so that they are listed and their gauges read 0 before any traffic.
// Under scope model breakers come with requests. It creates nothing where
// the effective config has breakers off (a config not started yet never
// decides that for a running one).
func (p *Pool) holdBreakers() {
	if p.cfg.Breaker == nil || p.cfg.ScopeModel {
		return
	}
	for _, m := range p.static {
		m.e.breakerFor(p.claim, "")
	}
}

// Release drops every reference the pool holds (Cleanup) and stops its
// outlier detector. Requests still running on it keep working; it takes
// no new references.
func (p *Pool) Release() {
	p.stopDetector()
	p.claims.Release()
}

// entries returns the entries the pool holds now.
func (p *Pool) entries() []*Entry {
	var out []*Entry
	for _, m := range p.static {
		out = append(out, m.e)
	}
	p.dynamic.Range(func(_, v any) bool {
		out = append(out, v.(*member).e)
		return true
	})
	if p.mem != nil {
		for _, addr := range p.mem.addrs() {
			if e, ok := p.reg.Entry(addr); ok && !slices.Contains(out, e) {
				out = append(out, e)
			}
		}
	}
	return out
}

// members returns the pool's upstreams for r.
func (p *Pool) members(r *http.Request) ([]*member, error) {
	if p.cfg.Source == nil {
		return p.static, nil
	}
	ts, err := p.cfg.Source(r)
	if err != nil {
		return nil, fmt.Errorf("dynamic upstreams: %w", err)
	}
	now := p.reg.now().UnixNano()
	out := make([]*member, 0, len(ts))
	for _, t := range ts {
		m, err := p.dynamicMember(t)
		if err != nil {
			return nil, err
		}
		m.lastSeen.Store(now)
		out = append(out, m)
	}
	p.sweep(now, out)
	return out, nil
}

// dynamicMember returns the member for a dynamic upstream, taking the
// pool's reference to its entry on first sight.
func (p *Pool) dynamicMember(t Target) (*member, error) {
	if v, ok := p.dynamic.Load(t.Addr); ok {
		m := v.(*member)
		if m.t.MaxRequests == t.MaxRequests {
			return m, nil
		}
	}
	e, err := p.hold(t.Addr)
	if errors.Is(err, registry.ErrReleased) {
		// A request on a replaced config: use the live entry if any,
		// without a reference; else a detached one (no breakers).
		if e == nil {
			e = newEntry(p.reg, t.Addr)
		}
	} else if err != nil {
		return nil, err
	} else if p.mem != nil {
		p.mem.remember(t.Addr)
	}
	m := &member{t: t, e: e}
	if v, loaded := p.dynamic.LoadOrStore(t.Addr, m); loaded {
		old := v.(*member)
		if old.t.MaxRequests == t.MaxRequests {
			return old, nil
		}
		p.dynamic.Store(t.Addr, m)
		return m, nil
	}
	p.nDynamic.Add(1)
	return m, nil
}

// sweep forgets dynamic upstreams that the source no longer returns, and
// releases their entries.
func (p *Pool) sweep(now int64, current []*member) {
	last := p.lastSweep.Load()
	over := p.nDynamic.Load() > maxDynamic
	if !over && now-last < int64(dynamicSweepEvery) {
		return
	}
	if !p.lastSweep.CompareAndSwap(last, now) {
		return // another request sweeps
	}
	p.dynamic.Range(func(k, v any) bool {
		m := v.(*member)
		if now-m.lastSeen.Load() > int64(dynamicTTL) || (over && !slices.Contains(current, m)) {
			p.forget(m)
		}
		return true
	})
}

// ForgetUnseen forgets the dynamic upstreams that the pool's source has not
// returned since t, and releases their entries, as the sweep does for those
// unseen for dynamicTTL (1 minute); for tests that cannot wait that long.
func (p *Pool) ForgetUnseen(t time.Time) {
	p.dynamic.Range(func(_, v any) bool {
		if m := v.(*member); m.lastSeen.Load() < t.UnixNano() {
			p.forget(m)
		}
		return true
	})
}

// forget drops a dynamic member and the pool's reference to its entry.
func (p *Pool) forget(m *member) {
	if !p.dynamic.CompareAndDelete(m.t.Addr, m) {
		return
	}
	p.nDynamic.Add(-1)
	if p.mem != nil {
		p.mem.forget(m.t.Addr)
	}
	registry.Drop(&p.claims, p.reg.entries, m.t.Addr)
}

// breakerKey is the model part of a breaker's key for a request's model.
func (p *Pool) breakerKey(model string) string {
	if !p.cfg.ScopeModel {
		return ""
	}
	return p.reg.Models.BreakerKey(model)
}

// BreakerState returns the state of the breaker of addr for model ("" when
// breakers are off or the upstream is not in the registry any more).
func (p *Pool) BreakerState(addr, model string) string {
	if p.cfg.Breaker == nil || addr == "" {
		return ""
	}
	e, ok := p.reg.Entry(addr)
	if !ok {
		return ""
	}
	b := e.lookupFor(p.claim, p.breakerKey(model))
	if b == nil {
		return ""
	}
	return b.State().String()
}

// Breakers returns the breakers of e that govern the pool's requests, by
// model key ("" per upstream): empty when the pool has breakers off. Do
// not modify the map.
func (p *Pool) Breakers(e *Entry) map[string]*breaker.Breaker {
	out := map[string]*breaker.Breaker{}
	if p.claim.settings == nil {
		return out
	}
	for _, v := range e.verdictList() {
		if v.c == p.claim {
			out[v.model] = v.b
		}
	}
	return out
}

// Policy returns the fingerprint of the pool's breaker policy ("b" or "s"
// then 8 hex digits, see BreakerView.Policy), "" with breakers off. Pools
// with one policy in front of one upstream share their breakers' fleet key.
func (p *Pool) Policy() string { return p.claim.fp }

// Registry returns the registry the pool belongs to.
func (p *Pool) Registry() *Registry { return p.reg }

// Key returns the pool's identity, Config.Key.
func (p *Pool) Key() string { return p.cfg.Key }

// Handler returns the name of the handler the pool serves (Config.Handler,
// else its Key).
func (p *Pool) Handler() string { return p.claim.handler }

// Entries returns the entries of the upstreams the pool holds now: its
// static upstreams, or the dynamic ones its source returned (and those it
// remembers from before a reload). Do not modify them.
func (p *Pool) Entries() []*Entry { return p.entries() }

// Holds reports whether the upstream at dial address addr is one of the
// pool's now: a static upstream, or a dynamic one its source returned and
// the pool has not forgotten (admission.PoolView: the gates of the pools
// holding an upstream are pumped when its state changes).
func (p *Pool) Holds(addr string) bool {
	for _, m := range p.static {
		if m.t.Addr == addr {
			return true
		}
	}
	_, ok := p.dynamic.Load(addr)
	return ok
}

// ClosedUpstreams returns how many of the pool's known upstreams are
// healthy: their per-upstream breaker closed, or under scope model at least
// one of their model breakers closed (all of them when breakers are off),
// for a capacity of per_upstream × healthy upstreams.
func (p *Pool) ClosedUpstreams() int {
	n := 0
	for _, m := range p.static {
		if p.healthy(m) {
			n++
		}
	}
	p.dynamic.Range(func(_, v any) bool {
		if p.healthy(v.(*member)) {
			n++
		}
		return true
	})
	return n
}

// healthy reports whether m counts as a healthy upstream: its per-upstream
// breaker closed (or none), or under scope model at least one of its model
// breakers closed (or none yet); with breakers off, not drained by an
// operator (Entry.Drained).
func (p *Pool) healthy(m *member) bool {
	if p.claim.settings == nil {
		_, drained := m.e.Drained(p.reg.now())
		return !drained
	}
	if p.cfg.ScopeModel {
		// Per-model breakers: the server is unhealthy only when none of
		// its breakers is closed.
		if p.claim.settings == nil {
			return true
		}
		n := 0
		for _, v := range m.e.verdictList() {
			if v.c != p.claim {
				continue
			}
			n++
			if v.b.State() == breaker.Closed {
				return true
			}
		}
		return n == 0
	}
	b := m.e.lookupFor(p.claim, "")
	return b == nil || b.State() == breaker.Closed
}
