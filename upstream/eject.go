package upstream

import (
	"fmt"
	"math"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// Defaults and constants of a pool's statistical ejection (DESIGN §4, hard
// and statistical evidence).
const (
	// DefaultMaxEjection is the share of a pool's upstreams that may be
	// held open on statistical evidence at once: 0.3, at least one
	// (max(1, ⌊N × 0.3⌋): 1 of 3, 3 of 10). Envoy's max_ejection_percent
	// defaults to 10%; ours is higher because only outliers against the
	// pool are ejected here (a uniformly failing pool ejects nobody), and a
	// bad rack of three in ten should go; with the panic threshold at 50%
	// statistics alone never take a pool below half its upstreams.
	DefaultMaxEjection = 0.3
	// DefaultPanicThreshold: when fewer than half of a pool's upstreams
	// are available and some are held open on statistical evidence, the
	// pool routes over every upstream not held by hard evidence (Envoy's
	// healthy_panic_threshold, also 50%).
	DefaultPanicThreshold = 0.5
	// NearTotalRatio is the failure ratio at which an upstream is ejected
	// on its own statistics, peers or not (over at least MinRequests
	// requests of the breaker's RatioWindow): it fails nearly everything.
	NearTotalRatio = 0.95
	// OutlierMargin is the least distance between an upstream's failure
	// ratio and the rest of its pool's for it to be an outlier; with few
	// requests the distance must also be three standard deviations of the
	// pool's ratio at the upstream's volume (in the spirit of Envoy's
	// success-rate ejection, stdev factor 1.9, over a fixed interval).
	OutlierMargin = 0.2
)

// Ejection holds a pool's ejection cap and panic rule, the `max_ejection`
// and `panic_threshold` of the breaker block.
type Ejection struct {
	// MaxEjection is the share of the pool's upstreams that may be held
	// open on statistical evidence at once, at least one; 0 takes
	// DefaultMaxEjection.
	MaxEjection float64
	// PanicThreshold is the share of available upstreams below which the
	// pool routes over every upstream not held by hard evidence; 0 takes
	// DefaultPanicThreshold, a negative value turns the rule off.
	PanicThreshold float64
}

// WithDefaults returns e with its zero fields set to their defaults.
func (e Ejection) WithDefaults() Ejection {
	if e.MaxEjection == 0 {
		e.MaxEjection = DefaultMaxEjection
	}
	if e.PanicThreshold == 0 {
		e.PanicThreshold = DefaultPanicThreshold
	}
	return e
}

// Validate reports a ratio out of range (after defaults).
func (e Ejection) Validate() error {
	e = e.WithDefaults()
	if !(e.MaxEjection > 0 && e.MaxEjection <= 1) {
		return fmt.Errorf("max_ejection %v: want a ratio in (0, 1]", e.MaxEjection)
	}
	if !(e.PanicThreshold < 0 || e.PanicThreshold <= 1) || math.IsNaN(e.PanicThreshold) {
		return fmt.Errorf("panic_threshold %v: want a ratio in (0, 1], or off", e.PanicThreshold)
	}
	return nil
}

// maxEjected is the most upstreams of n held open on statistical evidence.
func (e Ejection) maxEjected(n int) int {
	return max(1, int(math.Floor(float64(n)*e.MaxEjection+1e-9)))
}

// panicState is a pool's panic mode, for the gauge and the admin API.
type panicState struct {
	on       atomic.Bool
	requests atomic.Int64
}

// PanicObserver is implemented by an Observer that counts the panic rule:
// PoolPanic when a pool enters (on) or leaves panic mode, PanicRequest for
// each pick that routed over upstreams held open on statistical evidence.
// pool is the pool's Config.Key.
type PanicObserver interface {
	PoolPanic(pool string, on bool)
	PanicRequest(pool string)
}

// setPanic records the pool's panic mode after a pick.
func (p *Pool) setPanic(on bool) {
	if p.panic.on.Load() == on || p.panic.on.Swap(on) == on {
		return
	}
	if o, ok := p.reg.obs.(PanicObserver); ok {
		o.PoolPanic(p.cfg.Key, on)
	}
}

// panicRequest counts one pick made in panic mode.
func (p *Pool) panicRequest() {
	p.panic.requests.Add(1)
	if o, ok := p.reg.obs.(PanicObserver); ok {
		o.PanicRequest(p.cfg.Key)
	}
}

// PoolStatus is a pool's ejection state for the admin API.
type PoolStatus struct {
	// Key identifies the pool (its upstreams, or its dynamic source).
	Key string `json:"key"`
	// Handler names the handler (site) the pool serves (Config.Handler).
	Handler string `json:"handler"`
	// MaxEjection and PanicThreshold are the effective settings
	// (PanicThreshold negative: off).
	MaxEjection    float64 `json:"max_ejection"`
	PanicThreshold float64 `json:"panic_threshold"`
	// Ejected is the number of upstreams held open on statistical
	// evidence now; MaxEjected the most allowed at once.
	Ejected    int `json:"ejected"`
	MaxEjected int `json:"max_ejected"`
	// Probation is the number of upstreams back from an ejection that
	// still count against MaxEjected (breaker.OnProbation).
	Probation int `json:"probation"`
	// Panic is true while the pool routes over upstreams held open on
	// statistical evidence; PanicRequests counts the picks made so.
	Panic         bool  `json:"panic"`
	PanicRequests int64 `json:"panic_requests"`
	// Failed is true while the pool has failed as a whole (every one of
	// its last PoolFailWindow attempts, across at least two upstreams,
	// failed): it answers 503 at once but for one probe per upstream per
	// probe interval. FailedSince and FailedReason say when and why;
	// Failures counts the times it failed so.
	Failed       bool      `json:"failed"`
	FailedSince  time.Time `json:"failed_since,omitzero"`
	FailedReason string    `json:"failed_reason,omitempty"`
	Failures     int64     `json:"failures"`
}

// Status returns the pool's ejection state (breakers of the per-upstream
// key; under scope model, of no model).
func (p *Pool) Status() PoolStatus {
	e := p.ejection
	st := PoolStatus{Key: p.cfg.Key, Handler: p.claim.handler, MaxEjection: e.MaxEjection, PanicThreshold: e.PanicThreshold,
		Panic: p.panic.on.Load(), PanicRequests: p.panic.requests.Load()}
	n := 0
	p.eachMember(func(m *member) {
		n++
		b := m.e.lookupFor(p.claim, "")
		switch {
		case b == nil:
		case b.Evidence() == breaker.Statistical:
			st.Ejected++
		case b.OnProbation():
			st.Probation++
		}
	})
	st.MaxEjected = e.maxEjected(n)
	st.Failed, st.FailedSince, st.FailedReason, st.Failures = p.fail.status()
	return st
}

// eachMember calls f for the pool's static upstreams and the dynamic ones
// it knows now.
func (p *Pool) eachMember(f func(*member)) {
	for _, m := range p.static {
		f(m)
	}
	p.dynamic.Range(func(_, v any) bool {
		f(v.(*member))
		return true
	})
}

// reserveTrip reports whether self's breaker for model key may open on
// statistical evidence: the pool's upstreams other than self held open on
// it or on probation, with the trips under way, leave a place under the
// ejection cap. true takes the place until releaseTrip, which the caller
// calls once the breaker opened (its Evidence shows it): two upstreams
// failing at once must not both take the last place. It reads only
// atomics of the breakers and takes only the pool's tripMu, so a breaker
// may ask it under its own lock (breaker.Permit.DoneCapped).
func (p *Pool) reserveTrip(key string, self *Entry) bool {
	p.tripMu.Lock()
	defer p.tripMu.Unlock()
	held, n := 0, 0
	p.eachMember(func(m *member) {
		n++
		if m.e == self {
			return
		}
		if pb := m.e.lookupFor(p.claim, key); pb != nil && (pb.Evidence() == breaker.Statistical || pb.OnProbation()) {
			held++
		}
	})
	// trips counts every model key's: a trip of another model holds a
	// place for the moment it takes to open, which errs on the side of
	// the cap.
	if held+p.trips >= p.ejection.maxEjected(n) {
		return false
	}
	p.trips++
	return true
}

// releaseTrip gives back the place reserveTrip took.
func (p *Pool) releaseTrip() {
	p.tripMu.Lock()
	p.trips--
	p.tripMu.Unlock()
}

// reserveTrips is reserveTrip for p's own breaker of self: breakers are
// per handler, so a trip counts against its own pool's cap alone. It
// returns the places it took, for releaseTrips, or ok false with none.
func (p *Pool) reserveTrips(key string, self *Entry) (taken []*Pool, ok bool) {
	if !p.reserveTrip(key, self) {
		return nil, false
	}
	return []*Pool{p}, true
}

// releaseTrips gives back the places reserveTrips took.
func releaseTrips(taken []*Pool) {
	for _, q := range taken {
		q.releaseTrip()
	}
}

// judge applies the pool's statistical rules after b, the breaker of self
// for model key, recorded a failure: it tells b the failure ratio of the
// rest of the pool (for a fair recovery), and ejects b, within the cap,
// when b is failing nearly everything or is an outlier against its pool.
// Failures amid a pool that fails as much are never an ejection: under
// uniform failure no upstream is worse than another, and ejecting them
// would only turn partial success into none.
func (p *Pool) judge(key string, self *Entry, b *breaker.Breaker) {
	s := b.Settings()
	own := b.RatioCounts()
	// The rest of the pool's ratio is the mean of its upstreams' ratios,
	// each weighing its requests up to MinRequests: a peer with a full
	// window counts as one upstream, however busy. Pooling the requests
	// let the busiest peer stand for the pool: of 10%, 30% and 60%
	// failing replicas the least-loaded pick sends most to the 10% one,
	// and the 30% one, judged against it almost alone, was ejected as an
	// outlier and held the cap's place while the 60% one served.
	var peerWeight, peerFail float64
	p.eachMember(func(m *member) {
		if m.e == self {
			return
		}
		pb := m.e.lookupFor(p.claim, key)
		// One back from an ejection and not judged again yet is no peer.
		if pb == nil || pb.Evidence() != breaker.EvidenceNone || pb.OnProbation() {
			return
		}
		rc := pb.RatioCounts()
		if rc.Requests == 0 {
			return
		}
		w := float64(min(rc.Requests, s.MinRequests))
		peerWeight += w
		peerFail += w * float64(rc.Failures) / float64(rc.Requests)
	})
	if own.Requests == 0 {
		return
	}
	fi := float64(own.Failures) / float64(own.Requests)
	peer := fi // no peers to compare with: the upstream is its own pool
	havePeers := peerWeight >= float64(s.MinRequests)-1e-9
	if havePeers {
		peer = peerFail / peerWeight
	}
	b.SetPeerRatio(peer)
	if b.State() != breaker.Closed || own.Requests < s.MinRequests {
		return
	}
	var reason string
	switch {
	case fi >= NearTotalRatio:
		reason = fmt.Sprintf("failure ratio %d/%d ≥ %g", own.Failures, own.Requests, NearTotalRatio)
	case havePeers && fi-peer >= max(OutlierMargin, 3*math.Sqrt(peer*(1-peer)/float64(own.Requests))):
		reason = fmt.Sprintf("outlier: failure ratio %d/%d against %.2f for the rest of the pool", own.Failures, own.Requests, peer)
	default:
		return
	}
	taken, ok := p.reserveTrips(key, self)
	if !ok {
		// The cap: enough of the pool is out on statistics. The place
		// goes to the worse outlier, by as much as an outlier is worse
		// than its pool.
		if !p.displace(key, self, fi) {
			p.markOverCap(self)
			return
		}
		if taken, ok = p.reserveTrips(key, self); !ok {
			return
		}
	}
	b.Eject(reason+fmt.Sprintf(" within %s", s.RatioWindow), peer)
	releaseTrips(taken)
}

// displace frees a place under the ejection cap for self's breaker of
// model key, failing at ratio fi: the upstream held on statistics (or on
// probation) whose hold rests on the lowest failure ratio, when fi is at
// least OutlierMargin above it, is pardoned (breaker.Pardon) and serves
// again, judged at its next failure like any other. It reports whether a
// place was freed. Holds never pass back and forth: the pardoned one is
// the less failing by the margin, so it cannot displace its displacer.
func (p *Pool) displace(key string, self *Entry, fi float64) bool {
	var mild *breaker.Breaker
	p.eachMember(func(m *member) {
		if m.e == self {
			return
		}
		pb := m.e.lookupFor(p.claim, key)
		if pb == nil || (pb.Evidence() != breaker.Statistical && !pb.OnProbation()) {
			return
		}
		if mild == nil || pb.HeldRatio() < mild.HeldRatio() {
			mild = pb
		}
	})
	if mild == nil || fi-mild.HeldRatio() < OutlierMargin {
		return false
	}
	return mild.Pardon(fmt.Sprintf("a worse outlier (failure ratio %.2f against its %.2f) takes its place under max_ejection", fi, mild.HeldRatio()))
}
