package caddymodule

import (
	"errors"
	"sync"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// AdmissionConfig is a handler's pool capacity and priority queue: past
// capacity, sheddable tiers are refused at once (429 saturated) and the
// others wait by priority, then arrival, up to their tier's queue_timeout.
type AdmissionConfig struct {
	// Capacity is the most requests in flight through this handler.
	// Exclusive with PerUpstream. Default: 0 (no pool capacity: only the
	// tenants' own limits apply).
	Capacity int `json:"capacity,omitempty"`

	// PerUpstream sets the capacity to this many requests per upstream
	// whose circuit breaker is closed, so capacity shrinks as upstreams
	// fail and grows as they recover. Exclusive with Capacity. Default: 0.
	PerUpstream int `json:"per_upstream,omitempty"`

	// Queue bounds the requests waiting for capacity (a tier's queue
	// setting caps its share). Default: 100.
	Queue int `json:"queue,omitempty"`
}

func (ac *AdmissionConfig) validate() error {
	if ac == nil {
		return nil
	}
	if ac.Capacity < 0 || ac.PerUpstream < 0 || ac.Queue < 0 {
		return errors.New("admission: capacity, per_upstream and queue must not be negative")
	}
	if ac.Capacity > 0 && ac.PerUpstream > 0 {
		return errors.New("admission: use capacity or per_upstream, not both")
	}
	return nil
}

// gate builds the handler's gate: capacity and queue when configured, and
// always when tenants are (the gate counts admission decisions); nil when
// neither.
func (ac *AdmissionConfig) gate(pool *upstream.Pool, ctl *admission.Controller) *admission.Gate {
	hasCapacity := ac != nil && (ac.Capacity > 0 || ac.PerUpstream > 0)
	if !hasCapacity && ctl == nil {
		return nil
	}
	capacity := func() int { return 0 } // unlimited
	queue := 0
	if ac != nil {
		queue = ac.Queue
		if ac.Capacity > 0 {
			capacity = func() int { return ac.Capacity }
		}
		if n := ac.PerUpstream; n > 0 {
			// At least one upstream's worth: 0 would mean unlimited.
			capacity = func() int { return n * max(pool.ClosedUpstreams(), 1) }
		}
	}
	return admission.NewGate(admission.GateConfig{Capacity: capacity, Queue: queue, Controller: ctl},
		admission.SystemClock{}, admissionObserver{})
}

// perUpstreamGates holds the gates whose capacity follows their pools'
// closed breakers: when a breaker closes, capacity grows, and the gate must
// admit waiting requests now rather than at the next release.
var perUpstreamGates sync.Map // *admission.Gate → struct{}

// capacityChanged re-checks the per_upstream gates (a breaker closed or opened).
func capacityChanged() {
	perUpstreamGates.Range(func(k, _ any) bool {
		k.(*admission.Gate).Saturated()
		return true
	})
}
