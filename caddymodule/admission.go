package caddymodule

import (
	"errors"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
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

// gate takes the handler's reference to its pool's gate (shared.gates, by
// pool identity and the handler's place among the config's handlers of
// that identity, see App.gateKey: kept across reloads, so the requests in
// flight and queued through the old config's handler count against the new
// one's capacity, while two handlers of one config in front of the same
// upstreams each have a gate, a capacity and a pool signal of their own)
// and returns it with the settings this config will apply when it starts:
// a gate whenever capacity or tenants are configured (the gate counts
// admission decisions) or need is set (the degradation ladder reads the
// pool's saturation from it), nil otherwise.
func (ac *AdmissionConfig) gate(app *App, claims *registry.Claims, poolKey string, pool *upstream.Pool, ctl *admission.Controller, need bool) (*admission.Gate, *admission.GateSettings, error) {
	hasCapacity := ac != nil && (ac.Capacity > 0 || ac.PerUpstream > 0)
	if !hasCapacity && ctl == nil && !need {
		return nil, nil, nil
	}
	want := &admission.GateSettings{Pool: pool}
	if ac != nil {
		want.Capacity, want.PerUpstream, want.Queue = ac.Capacity, ac.PerUpstream, ac.Queue
	}
	g, err := shared.gates.Acquire(claims, app.gateKey(poolKey), func() (*admission.Gate, error) {
		// A new gate is not live yet: its settings apply now.
		return admission.NewPoolGate(*want, ctl, clock.Real, newGateObserver()), nil
	}, nil)
	return g, want, err
}

// gatePump is the upstream registry's observer: the metrics and logs of
// upstreamObserver, and the news of an upstream whose state may have
// changed a gate's capacity or pool signal (a breaker closed, a scrape),
// forwarded to the gates (admission.GateSet.Wake decides which to pump).
type gatePump struct{ upstreamObserver }

// BreakerTransition wakes the gates when a breaker closes, asynchronously:
// it runs under the upstream entry's lock.
func (p gatePump) BreakerTransition(addr, key, handler string, tr breaker.Transition) {
	p.upstreamObserver.BreakerTransition(addr, key, handler, tr)
	if tr.To == breaker.Closed {
		go shared.gates.Wake(addr)
	}
}

// Scraped wakes the gates after each scrape (on the upstream's scrape
// loop, under the scraper's lock, outside the entry's).
func (p gatePump) Scraped(addr string, took time.Duration, err error) {
	p.upstreamObserver.Scraped(addr, took, err)
	shared.gates.Wake(addr)
}
