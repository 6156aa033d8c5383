package caddymodule

import (
	"errors"
	"sync/atomic"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/internal/registry"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// AdmissionConfig is a handler's pool capacity and priority queue: past
// capacity, or while the pool is saturated (with saturation configured:
// every healthy upstream at its queue or KV-cache threshold), sheddable
// tiers are refused at once (429 saturated) and the others wait by
// priority, then arrival, up to their tier's queue_timeout.
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

// sharedGate is a pool's gate, kept across reloads by the pool's identity
// (its upstream set): the requests in flight and queued through the old
// config's handler still count against the new one's capacity. The newest
// started config's capacity and queue apply.
type sharedGate struct {
	g   *admission.Gate
	cap atomic.Pointer[gateCapacity]
}

// gateCapacity is one config's capacity setting for a shared gate.
type gateCapacity struct {
	fixed, perUpstream, queue int
	pool                      *upstream.Pool
}

// capacity is the gate's capacity now; 0 is unlimited.
func (s *sharedGate) capacity() int {
	c := s.cap.Load()
	if c == nil {
		return 0
	}
	healthy := 0
	if c.perUpstream > 0 {
		healthy = c.pool.ClosedUpstreams()
	}
	return admission.PoolCapacity(c.fixed, c.perUpstream, healthy)
}

// saturated is the pool signal of the newest started config's pool
// (false when that pool has no saturation configured): admission treats a
// saturated pool like a full capacity.
func (s *sharedGate) saturated() bool {
	c := s.cap.Load()
	return c != nil && c.pool.Saturated()
}

// apply makes c the gate's capacity (the config starts).
func (s *sharedGate) apply(c *gateCapacity) {
	s.cap.Store(c)
	s.g.SetQueue(c.queue)
}

// gate takes the handler's reference to its pool's shared gate and returns
// it with the capacity this config will apply when it starts: a gate
// whenever capacity or tenants are configured (the gate counts admission
// decisions) or need is set (the degradation ladder reads the pool's
// saturation from it), nil otherwise.
func (ac *AdmissionConfig) gate(claims *registry.Claims, poolKey string, pool *upstream.Pool, ctl *admission.Controller, need bool) (*sharedGate, *gateCapacity, error) {
	hasCapacity := ac != nil && (ac.Capacity > 0 || ac.PerUpstream > 0)
	if !hasCapacity && ctl == nil && !need {
		return nil, nil, nil
	}
	want := &gateCapacity{pool: pool}
	if ac != nil {
		want.fixed, want.perUpstream, want.queue = ac.Capacity, ac.PerUpstream, ac.Queue
	}
	sg, err := shared.gates.Acquire(claims, poolKey, func() (*sharedGate, error) {
		sg := new(sharedGate)
		// A new gate is not live yet: its capacity applies now.
		sg.cap.Store(want)
		sg.g = admission.NewGate(admission.GateConfig{Capacity: sg.capacity, Saturated: sg.saturated, Queue: want.queue, Controller: ctl},
			admission.SystemClock{}, newGateObserver())
		return sg, nil
	}, nil)
	return sg, want, err
}

// capacityChanged re-checks every gate's capacity and pool signal (a
// breaker closed, so a per_upstream capacity grew; a scrape may have
// cleared the saturation signal): waiting requests are admitted now rather
// than at the next release.
func capacityChanged() {
	_, gs := shared.gates.Snapshot()
	for _, g := range gs {
		g.g.Saturated()
	}
}
