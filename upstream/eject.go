package upstream

import (
	"fmt"
	"math"
	"slices"
	"sync/atomic"
	"time"
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
	// evidence at the outlier detector's last run (every OutlierInterval);
	// MaxEjected the most allowed at once; EjectedUpstreams their
	// addresses.
	Ejected          int      `json:"ejected"`
	MaxEjected       int      `json:"max_ejected"`
	EjectedUpstreams []string `json:"ejected_upstreams,omitempty"`
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

// Status returns the pool's ejection state as its outlier detector last
// found it (breakers of the per-upstream key; under scope model, of no
// model).
func (p *Pool) Status() PoolStatus {
	e := p.ejection
	v := p.outliers()
	st := PoolStatus{Key: p.cfg.Key, Handler: p.claim.handler, MaxEjection: e.MaxEjection, PanicThreshold: e.PanicThreshold,
		Panic: p.panic.on.Load(), PanicRequests: p.panic.requests.Load(),
		Ejected: len(v.ejected), MaxEjected: v.maxEjected, EjectedUpstreams: slices.Clone(v.ejected), Probation: v.probation}
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
