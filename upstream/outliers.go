package upstream

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// OutlierInterval is how often a pool's outlier detector runs: it is the
// longest an upstream that became a statistical outlier keeps serving
// before its pool ejects it. Envoy's default interval is 10 s because its
// detector also carries the consecutive-5xx rules' periodic un-ejection
// and reads counters swapped per interval; here hard evidence trips a
// breaker at once on the request path, and the detector reads the
// breakers' rolling windows, so an interval costs only one pass over the
// pool's breakers (atomics, no lock held across them). Half a second keeps
// statistical discovery within the second that DESIGN §4 promises for
// fast discovery, and well below the 3 s buckets of the default 30 s ratio
// window, so no bucket's counts are judged late.
const OutlierInterval = 500 * time.Millisecond

// detector is a pool's outlier detector (DESIGN §4, who decides): one per
// pool, run every OutlierInterval on the registry's clock while the pool is
// active. It owns statistical ejection, the ejection cap, probation and
// the peer ratios its breakers judge their probes by; the request path
// only reads the view it publishes.
type detector struct {
	// mu serializes runs with start and stop; it is never held by the
	// request path.
	mu    sync.Mutex
	on    bool
	timer clock.Timer
	// runs counts the runs, for tests that check the detector stopped.
	runs atomic.Int64
	// view is the last run's outcome.
	view atomic.Pointer[outlierView]
}

// outlierView is what a detector run found: what the request path and the
// admin API read, replaced whole at each run.
type outlierView struct {
	at time.Time
	// maxEjected is the cap for the pool's upstreams at the run.
	maxEjected int
	// ejected lists the upstreams held on statistical evidence (per
	// upstream, or under scope model of no model); probation counts those
	// back from an ejection still on probation.
	ejected   []string
	probation int
	// overCap holds the upstreams that were outliers for some model key
	// but found no place under the cap, with until when (RecentWindow
	// after the last run that found so) their recent failures count
	// against them in selection (Candidate.Load). The mark outlasts the
	// run: an upstream that fails fast would otherwise draw the traffic
	// between the runs that see it as an outlier, or as soon as a
	// pardon empties its windows.
	overCap map[*Entry]time.Time
	// seen is each upstream's counts, by address and model key, as the
	// run judged them.
	seen map[outlierKey]outlierCounts
}

// outlierKey names one breaker of a pool: an upstream and a model key.
type outlierKey struct{ addr, model string }

// outlierCounts is one breaker's ratio window and its peers' ratio at a
// run.
type outlierCounts struct {
	breaker.RatioCounts
	// Peer is the failure ratio of the rest of the pool, as told to the
	// breaker (SetPeerRatio); -1 when it had no peers to compare with.
	Peer float64
}

// startDetector starts the pool's outlier detector (idempotent): a first
// run now, so the pool's view is current from its start, then one every
// OutlierInterval. Pools without breakers have none.
func (p *Pool) startDetector() {
	if p.cfg.Breaker == nil {
		return
	}
	d := &p.det
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.on {
		return
	}
	d.on = true
	p.detect()
	d.timer = p.reg.clock.AfterFunc(OutlierInterval, p.detectorTick)
}

// stopDetector stops the detector: no run starts after it returns.
func (p *Pool) stopDetector() {
	d := &p.det
	d.mu.Lock()
	defer d.mu.Unlock()
	d.on = false
	if d.timer != nil {
		d.timer.Stop()
		d.timer = nil
	}
}

// detectorTick is one run on the timer, which it re-arms.
func (p *Pool) detectorTick() {
	d := &p.det
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.on {
		return
	}
	p.detect()
	d.timer = p.reg.clock.AfterFunc(OutlierInterval, p.detectorTick)
}

// outliers returns the detector's last view, or, before its first run (a
// pool built and not started), a view of the pool as it is, found without
// acting on it.
func (p *Pool) outliers() *outlierView {
	if v := p.det.view.Load(); v != nil {
		return v
	}
	return p.survey()
}

// overCap reports whether the detector found e an outlier with no place
// under the ejection cap within RecentWindow before now.
func (p *Pool) overCap(e *Entry, now time.Time) bool {
	v := p.det.view.Load()
	return v != nil && now.Before(v.overCap[e])
}

// judgedBreaker is one breaker as a run reads it.
type judgedBreaker struct {
	m         *member
	b         *breaker.Breaker
	rc        breaker.RatioCounts
	ratio     float64 // rc.Failures / rc.Requests; 0 with no requests
	peer      float64
	havePeers bool
	held      bool // on statistical evidence, or on probation
	reason    string
}

// detect is one run of the detector; the caller holds p.det.mu. For each
// model key the pool has breakers for, it reads every member's breaker
// (atomics only, no breaker's lock), tells each the failure ratio of the
// rest of the pool, finds the outliers (the pool's rules, near-total
// failure and outlier against its peers, and the breaker settings'
// statistical rules: Failures, FailureRatio, SlowRatio), and ejects them
// within the cap, worst first; a worse outlier displaces a milder hold;
// holds over the cap (a lowered max_ejection, a probe's outlier re-open)
// are pardoned, mildest first. Then it publishes the view.
func (p *Pool) detect() {
	p.det.runs.Add(1)
	v := p.judgeAll(true)
	p.det.view.Store(v)
}

// survey is detect without acting: the view as the pool is now.
func (p *Pool) survey() *outlierView { return p.judgeAll(false) }

func (p *Pool) judgeAll(act bool) *outlierView {
	var members []*member
	p.eachMember(func(m *member) { members = append(members, m) })
	now := p.reg.now()
	v := &outlierView{at: now, maxEjected: p.ejection.maxEjected(len(members)),
		overCap: map[*Entry]time.Time{}, seen: map[outlierKey]outlierCounts{}}
	if last := p.det.view.Load(); last != nil {
		for _, m := range members {
			if until, ok := last.overCap[m.e]; ok && now.Before(until) {
				v.overCap[m.e] = until
			}
		}
	}
	keys := []string{""}
	if p.cfg.ScopeModel {
		keys = keys[:0]
		for _, m := range members {
			for k := range p.Breakers(m.e) {
				if !slices.Contains(keys, k) {
					keys = append(keys, k)
				}
			}
		}
		slices.Sort(keys)
	}
	for _, key := range keys {
		// An ejection changes the peers of the rest: judge them again
		// against the pool without it, so that an outlier now over the
		// cap is marked at this run, not the next.
		for range 2 {
			if !p.judgeKey(key, members, v, act) {
				break
			}
		}
	}
	// The view's ejected set: the upstreams held on statistical evidence,
	// by their per-upstream breaker or, under scope model, by any of their
	// model breakers.
	for _, m := range members {
		held, probation := false, false
		for _, key := range keys {
			b := m.e.lookupFor(p.claim, key)
			switch {
			case b == nil:
			case b.Evidence() == breaker.Statistical:
				held = true
			case b.OnProbation():
				probation = true
			}
		}
		switch {
		case held:
			v.ejected = append(v.ejected, m.t.Addr)
		case probation:
			v.probation++
		}
	}
	return v
}

// judgeKey judges the pool's breakers of one model key; it reports whether
// it ejected any.
func (p *Pool) judgeKey(key string, members []*member, v *outlierView, act bool) (ejected bool) {
	rows := make([]*judgedBreaker, 0, len(members))
	for _, m := range members {
		b := m.e.lookupFor(p.claim, key)
		if b == nil {
			continue
		}
		r := &judgedBreaker{m: m, b: b, rc: b.RatioCounts()}
		if r.rc.Requests > 0 {
			r.ratio = float64(r.rc.Failures) / float64(r.rc.Requests)
		}
		r.held = b.Evidence() == breaker.Statistical || b.OnProbation()
		rows = append(rows, r)
	}
	if len(rows) == 0 {
		return false
	}
	// The rest of the pool's ratio is the mean of its upstreams' ratios,
	// each weighing its requests up to MinRequests: a peer with a full
	// window counts as one upstream, however busy. Pooling the requests
	// let the busiest peer stand for the pool: of 10%, 30% and 60%
	// failing replicas the least-loaded pick sends most to the 10% one,
	// and the 30% one, judged against it almost alone, was ejected as an
	// outlier and held the cap's place while the 60% one served. One
	// held on evidence or on probation is no peer.
	minReq := rows[0].b.Settings().MinRequests
	weight := func(r *judgedBreaker) float64 {
		if r.held || r.b.Evidence() != breaker.EvidenceNone || r.rc.Requests == 0 {
			return 0
		}
		return float64(min(r.rc.Requests, minReq))
	}
	var totW, totF float64
	for _, r := range rows {
		w := weight(r)
		totW += w
		totF += w * r.ratio
	}
	var cands, holds []*judgedBreaker
	for _, r := range rows {
		w := weight(r)
		peerW, peerF := totW-w, totF-w*r.ratio
		r.peer, r.havePeers = r.ratio, peerW >= float64(minReq)-1e-9
		if r.havePeers {
			r.peer = max(0, peerF/peerW)
		}
		if act && (r.havePeers || r.rc.Requests > 0) {
			r.b.SetPeerRatio(r.peer)
		}
		c := outlierCounts{RatioCounts: r.rc, Peer: -1}
		if r.havePeers {
			c.Peer = r.peer
		}
		v.seen[outlierKey{r.m.t.Addr, key}] = c
		if r.held {
			holds = append(holds, r)
		} else if r.reason = outlierReason(r); r.reason != "" {
			cands = append(cands, r)
		}
	}
	// Worst first: the cap's places go to the upstreams that fail most.
	slices.SortStableFunc(cands, func(a, b *judgedBreaker) int {
		return cmp.Or(cmp.Compare(b.ratio, a.ratio), cmp.Compare(b.rc.Failures, a.rc.Failures))
	})
	for _, r := range cands {
		if !act {
			if len(holds) >= v.maxEjected {
				v.overCap[r.m.e] = v.at.Add(RecentWindow)
			}
			continue
		}
		if len(holds) >= v.maxEjected {
			// The cap: enough of the pool is out on statistics. The
			// place goes to the worse outlier, by as much as an
			// outlier is worse than its pool; holds never pass back
			// and forth, as the pardoned one is the less failing by
			// the margin.
			i := mildest(holds)
			if i < 0 || r.ratio-holds[i].b.HeldRatio() < OutlierMargin ||
				!holds[i].b.Pardon(fmt.Sprintf("a worse outlier (failure ratio %.2f against its %.2f) takes its place under max_ejection", r.ratio, holds[i].b.HeldRatio())) {
				v.overCap[r.m.e] = v.at.Add(RecentWindow)
				continue
			}
			// Pardoned for want of a place, it serves again with empty
			// windows: its recent failures still count against it.
			v.overCap[holds[i].m.e] = v.at.Add(RecentWindow)
			holds = slices.Delete(holds, i, i+1)
		}
		if r.b.Eject(r.reason+fmt.Sprintf(" within %s", r.b.Settings().RatioWindow), r.peer) {
			holds = append(holds, r)
			delete(v.overCap, r.m.e)
			ejected = true
		}
	}
	// Holds over the cap (max_ejection lowered by a reload, a half-open
	// upstream that re-opened as an outlier): the mildest go first. One
	// not this pool's to pardon (an operator's or a fleet's open) keeps
	// its place, and the next mildest goes.
	if over := len(holds) - v.maxEjected; act && over > 0 {
		slices.SortStableFunc(holds, func(a, b *judgedBreaker) int { return cmp.Compare(a.b.HeldRatio(), b.b.HeldRatio()) })
		for _, h := range holds {
			if over == 0 {
				break
			}
			if h.b.Pardon(fmt.Sprintf("over max_ejection (%d held on statistics, at most %d)", len(holds), v.maxEjected)) {
				v.overCap[h.m.e] = v.at.Add(RecentWindow)
				over--
			}
		}
	}
	return ejected
}

// mildest returns the index of the hold resting on the lowest failure
// ratio, -1 when there is none.
func mildest(holds []*judgedBreaker) int {
	i := -1
	for j, h := range holds {
		if i < 0 || h.b.HeldRatio() < holds[i].b.HeldRatio() {
			i = j
		}
	}
	return i
}

// outlierReason is why r's closed breaker should be ejected, "" when it
// should not: it fails nearly everything (NearTotalRatio), or it is an
// outlier against its peers by OutlierMargin and three standard deviations
// of their ratio at its volume, or one of the breaker settings'
// statistical rules fires. Failures amid a pool that fails as much are
// never an ejection: under uniform failure no upstream is worse than
// another, and ejecting them would only turn partial success into none.
func outlierReason(r *judgedBreaker) string {
	if r.b.State() != breaker.Closed {
		return ""
	}
	s, rc := r.b.Settings(), r.rc
	enough := rc.Requests >= s.MinRequests
	switch {
	case enough && r.ratio >= NearTotalRatio:
		return fmt.Sprintf("failure ratio %d/%d ≥ %g", rc.Failures, rc.Requests, NearTotalRatio)
	case enough && r.havePeers && r.ratio-r.peer >= max(OutlierMargin, 3*math.Sqrt(r.peer*(1-r.peer)/float64(rc.Requests))):
		return fmt.Sprintf("outlier: failure ratio %d/%d against %.2f for the rest of the pool", rc.Failures, rc.Requests, r.peer)
	case s.Failures > 0:
		if n := r.b.FailureCount(); n >= s.Failures {
			return fmt.Sprintf("%d failures within %s", n, s.FailuresWindow)
		}
	}
	switch {
	case s.FailureRatio > 0 && enough && float64(rc.Failures) >= s.FailureRatio*float64(rc.Requests):
		return fmt.Sprintf("failure ratio %d/%d ≥ %g", rc.Failures, rc.Requests, s.FailureRatio)
	case s.SlowRatio > 0 && enough && float64(rc.Slow) >= s.SlowRatio*float64(rc.Requests):
		return fmt.Sprintf("slow call ratio %d/%d ≥ %g", rc.Slow, rc.Requests, s.SlowRatio)
	}
	return ""
}
