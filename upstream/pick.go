package upstream

import (
	"fmt"
	"net/http"
	"slices"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// Candidate is an upstream that may take the next attempt, as a Selector
// sees it.
type Candidate struct {
	// Target is the upstream as the glue described it.
	Target *Target
	// Entry is its shared state (Inflight for count-aware policies).
	Entry *Entry
	// Score is its saturation score (see Entry.Score; 1 is saturated)
	// when the pool reads saturation signals or the selector is
	// LeastQueue, else 0.
	Score float64

	br *breaker.Breaker // nil when breakers are off
	// key is the breaker's model key ("" per upstream); model the
	// request's model, as every handler's breakers judge the attempt by
	// it (Entry.judges).
	key, model string
	// failing is the upstream's failures within RecentWindow, which count
	// against it as attempts in flight would (see Load).
	failing int64
	// bypass marks an upstream whose breaker the saturation rules opened,
	// picked because no other upstream could take the request: it goes
	// without a permit (saturation alone never refuses a request).
	bypass bool
}

// Pick implements proxy.Balancer (DESIGN §3 step 4): candidates are the
// pool's upstreams minus those whose breaker refuses, minus those at their
// max_requests, preferring those the request has not tried; the selection
// policy chooses; an in-flight slot and the breaker's permit are taken, and
// given back by the returned Upstream's Done.
//
// When none qualifies it returns a *proxy.UnavailableError: Busy when some
// upstream was only full (it frees as soon as an attempt ends),
// CircuitOpen when open breakers alone are the cause, with RetryAfter the
// earliest time a breaker may let a request in.
//
// Upstreams held open on statistical evidence (breaker.Statistical) are
// skipped only within the pool's ejection cap, and only while at least
// panic_threshold of the pool remains available: below it (panic mode) the
// pick routes over every upstream not held by hard evidence, without a
// permit, since under uniform failure a skipped upstream serves as well as
// any other (see Ejection).
func (p *Pool) Pick(w http.ResponseWriter, r *http.Request, req proxy.PickRequest) (proxy.Upstream, error) {
	members, err := p.members(r)
	if err != nil {
		return proxy.Upstream{}, fmt.Errorf("%w: %v", proxy.ErrNoUpstream, err)
	}
	if len(members) == 0 {
		return proxy.Upstream{}, fmt.Errorf("%w: the pool is empty", proxy.ErrNoUpstream)
	}
	now := p.reg.now()
	probing := false
	if p.cfg.Breaker != nil && p.fail.failed.Load() {
		if members, probing, err = p.failedPoolMembers(members, now, req.Hedge); err != nil {
			return proxy.Upstream{}, err
		}
	}
	var earliest time.Time
	open, busy := 0, 0
	noteOpen := func(addr string, b *breaker.Breaker) {
		open++
		p.reg.obs.ShortCircuited(addr)
		if at := b.RetryAt(); !at.IsZero() && (earliest.IsZero() || at.Before(earliest)) {
			earliest = at
		}
	}
	key := p.breakerKey(req.Info.Model)
	fresh := make([]Candidate, 0, len(members))
	var retried, saturated, ejected []Candidate
	for _, m := range members {
		if m.e.full(m.t.MaxRequests) {
			busy++
			continue
		}
		c := Candidate{Target: &m.t, Entry: m.e, key: key, model: req.Info.Model}
		if p.cfg.Breaker != nil {
			if c.br = m.e.breakerFor(p.claim, key); c.br == nil {
				// A request still running on a config a reload
				// released: its handler's breaker is now the new
				// config's.
				c.br = m.e.successorFor(p.claim, key)
			}
		}
		if c.br == nil {
			// Breakers off (or none left for a released config): an
			// operator's drain of the upstream still keeps this handler
			// from sending there.
			if until, drained := m.e.Drained(now); drained {
				open++
				p.reg.obs.ShortCircuited(m.t.Addr)
				if !until.IsZero() && (earliest.IsZero() || until.Before(earliest)) {
					earliest = until
				}
				continue
			}
		} else {
			if req.Hedge && c.br.State() != breaker.Closed {
				continue // never hedge onto a recovering upstream
			}
			if p.sat != nil && c.br.Observed() {
				// Opened by the saturation rules: skipped while another
				// upstream can take the request.
				c.bypass = true
				saturated = append(saturated, c)
				continue
			}
			if at := c.br.RetryAt(); !at.IsZero() && at.After(now) {
				if c.br.Evidence() == breaker.Statistical {
					c.bypass = true
					ejected = append(ejected, c)
					continue
				}
				noteOpen(m.t.Addr, c.br)
				continue
			}
		}
		if slices.Contains(req.Tried, m.t.Addr) {
			retried = append(retried, c)
		} else {
			fresh = append(fresh, c)
		}
	}
	panicking := false
	if p.cfg.Breaker != nil {
		// The cap and the panic rule, for upstreams open on statistics.
		n, route := len(members), 0
		if capN := p.ejection.maxEjected(n); len(ejected) > capN {
			route = len(ejected) - capN // beyond the cap: not held
		}
		thr := p.ejection.PanicThreshold
		panicking = len(ejected) > 0 && thr > 0 && float64(n-open-len(ejected)+route) < thr*float64(n)
		if panicking {
			route = len(ejected)
			p.panicRequest()
		}
		if !req.Hedge {
			// A hedge's pick skipped every breaker that is not closed:
			// it knows nothing of the pool's panic mode.
			p.setPanic(panicking)
		}
		for _, c := range ejected[len(ejected)-route:] {
			if slices.Contains(req.Tried, c.Target.Addr) {
				retried = append(retried, c)
			} else {
				fresh = append(fresh, c)
			}
		}
		for _, c := range ejected[:len(ejected)-route] {
			noteOpen(c.Target.Addr, c.br)
		}
	}
	if len(fresh) == 0 && !req.Hedge {
		// Every upstream that accepts was tried: allow them again. A
		// hedge only ever goes to another upstream.
		fresh = retried
	}
	if len(fresh) == 0 && !req.Hedge {
		// Only saturation-tripped upstreams are left: the request still
		// goes to the least saturated (shedding is admission's decision,
		// on the pool signal), and risks nothing the breaker protects.
		fresh = saturated
	}
	p.countFailures(fresh, panicking, now)
	fresh = p.rank(fresh, now, req.Info.Model)
	for len(fresh) > 0 {
		i := p.choose(fresh, r, w, &req) // prefixcache.go
		if i < 0 || i >= len(fresh) {
			return proxy.Upstream{}, fmt.Errorf("%w: none of %d upstream(s) is available", proxy.ErrNoUpstream, len(fresh))
		}
		c := fresh[i]
		fresh = slices.Delete(fresh, i, i+1)
		if !c.Entry.acquire(c.Target.MaxRequests) {
			busy++ // filled up since the scan
			continue
		}
		if probing && !p.fail.takeProbe(c.Entry, now, p.poolProbeInterval()) {
			c.Entry.releaseSlot() // another pick took its probe
			continue
		}
		if c.br == nil || c.bypass {
			return p.upstream(c, nil), nil
		}
		if permit, ok := c.br.Allow(); ok {
			if !permit.Probe() || c.Entry.takeProbe(c.key, c.br.Settings().HalfOpenProbes) {
				return p.upstream(c, &permit), nil
			}
			// Another handler's probe of the upstream is out: one
			// handler's probes at a time reach it.
			permit.Done(breaker.Neutral, 0, "")
		}
		// Lost the race for a half-open probe slot: try the others.
		c.Entry.releaseSlot()
		noteOpen(c.Target.Addr, c.br)
	}
	ue := &proxy.UnavailableError{RetryAfter: max(earliest.Sub(now), 0)}
	switch {
	case busy > 0:
		// No RetryAfter: a slot frees whenever an attempt ends, so a retry
		// must not sleep on it (the client's 503 says Retry-After: 1).
		ue.Busy, ue.RetryAfter = true, 0
		ue.Reason = fmt.Sprintf("%d of %d upstream(s) are at max_requests and the rest are unavailable", busy, len(members))
	case open > 0:
		ue.CircuitOpen = true
		ue.Reason = fmt.Sprintf("the circuit breakers of all %d upstream(s) are open", len(members))
	default:
		ue.Reason = fmt.Sprintf("none of %d upstream(s) can take the attempt", len(members))
	}
	return proxy.Upstream{}, ue
}

// Load is what count-aware selection policies (LeastConn, RandomChoose)
// compare: the attempts in flight to the upstream, plus, where its breaker
// does not keep it out (the pool in panic, the upstream routed over past
// the ejection cap or refused a place under it), its failures within
// RecentWindow. An upstream that fails at once has nothing in flight;
// without its failures it would look the least loaded and draw the
// traffic just where nothing else keeps it out.
func (c Candidate) Load() int64 { return c.Entry.Inflight() + c.failing }

// countFailures sets each candidate's recent failures where they count
// against it (see Candidate.Load): every candidate in panic, else those
// routed over past the cap and those the pool's outlier detector found
// outliers with no place under the cap at its last run.
func (p *Pool) countFailures(cs []Candidate, panicking bool, now time.Time) {
	if p.cfg.Breaker == nil {
		return
	}
	for i := range cs {
		if c := &cs[i]; panicking || c.bypass || p.overCap(c.Entry, now) {
			c.failing = int64(c.Entry.Recent().Failures)
		}
	}
}

// upstream hands c to the proxy for one attempt: its slot and permit are
// given back exactly once, by Done.
func (p *Pool) upstream(c Candidate, permit *breaker.Permit) proxy.Upstream {
	// The closures capture what they use, not the Candidate: a held
	// stream keeps them.
	e, br, t, key, model := c.Entry, c.br, c.Target, c.key, c.model
	epoch := e.startAttempt()
	started := p.reg.now()
	issued := started
	var probe *atomic.Bool // the entry's probe place, held until settled
	if permit != nil {
		issued = permit.IssuedAt()
		if permit.Probe() {
			probe = new(atomic.Bool)
			probe.Store(true)
		}
	}
	giveProbe := func() {
		if probe != nil && probe.Swap(false) {
			e.giveProbe(key)
		}
	}
	return proxy.Upstream{
		Addr:       t.Addr,
		Closed:     br == nil || br.State() == breaker.Closed,
		Context:    t.Dial,
		Saturation: c.Score,
		// A half-open probe is settled by its first token: a healthy
		// stream longer than the probe timeout must not count as a hung
		// probe. Later, Done on a settled permit does nothing.
		Committed: func(ttft time.Duration) {
			e.live(model) // a first token: the server is up, for every handler
			if permit != nil && permit.Probe() {
				record(br, permit, &proxy.AttemptReport{Upstream: t.Addr, Outcome: proxy.AttemptSuccess, TTFT: ttft})
				giveProbe()
			}
		},
		Done: func(rep *proxy.AttemptReport) {
			e.endAttempt(epoch)
			e.releaseSlot()
			defer giveProbe()
			// Every attempt's outcome is the upstream's evidence, once,
			// whether or not a breaker let it through: in its shared
			// record, and in every handler's breaker on it.
			o := outcomeOf(rep)
			e.ev.record(o, issued, p.reg.now())
			if o != breaker.Neutral || answered(rep) {
				p.recordOutcome(e, started, o == breaker.Failure || o == breaker.Down)
			}
			if rep != nil && o != breaker.Neutral {
				own := br // its permit records it (record)
				if permit == nil {
					own = nil
				}
				e.hear(own, model, o, issued, rep.TTFT, reasonOf(rep))
				if rep.RetryAfter > 0 {
					e.retryAfter(model, rep.RetryAfter, fmt.Sprintf("upstream answered %d with Retry-After %v", rep.Status, rep.RetryAfter))
				}
			}
			if permit != nil {
				record(br, permit, rep)
			}
		},
	}
}

// failedPoolMembers returns, for a pool that failed as a whole, the members
// whose probe is due (probing true), or the 503 that answers the request
// at once: a hedge never probes, and between probes nothing reaches the
// upstreams.
func (p *Pool) failedPoolMembers(members []*member, now time.Time, hedge bool) ([]*member, bool, error) {
	every := p.poolProbeInterval()
	var due []*member
	var next time.Time
	for _, m := range members {
		at, ok := p.fail.probeDue(m.e, now, every)
		if ok {
			due = append(due, m)
		} else if next.IsZero() || at.Before(next) {
			next = at
		}
	}
	if !p.fail.failed.Load() {
		return members, false, nil // re-admitted meanwhile
	}
	if len(due) > 0 && !hedge {
		return due, true, nil
	}
	_, _, reason, _ := p.fail.status()
	ue := &proxy.UnavailableError{CircuitOpen: true, RetryAfter: max(next.Sub(now), 0),
		Reason: fmt.Sprintf("the pool failed as a whole (%s); only probes reach its upstreams until one succeeds", reason)}
	if next.IsZero() {
		ue.RetryAfter = every
	}
	return nil, false, ue
}

var _ proxy.Balancer = (*Pool)(nil)
