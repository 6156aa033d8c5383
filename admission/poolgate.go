package admission

import (
	"sync/atomic"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// PoolView is what a pool gate reads of its upstream pool
// (upstream.Pool implements it). Both methods must be cheap, safe for
// concurrent use and allocation-free: they are read on every admission.
type PoolView interface {
	// ClosedUpstreams returns how many of the pool's upstreams are
	// healthy (their circuit breaker closed).
	ClosedUpstreams() int
	// Saturated is the pool signal (GateConfig.Saturated).
	Saturated() bool
	// Holds reports whether the upstream at dial address addr is one of
	// the pool's now (GateSet.Wake pumps the gates of the pools that
	// hold an upstream whose state changed).
	Holds(addr string) bool
}

// GateSettings are one config's capacity and queue for a pool gate, which
// may be kept across reloads (the requests in flight and queued through
// the old config's handler count against the new one's capacity).
type GateSettings struct {
	// Capacity is the most requests in flight; 0 is unlimited. Exclusive
	// with PerUpstream.
	Capacity int
	// PerUpstream, when > 0, makes the capacity PerUpstream × the pool's
	// upstreams whose breaker is closed (at least one upstream's worth),
	// so it shrinks as upstreams fail and grows as they recover.
	PerUpstream int
	// Queue bounds the requests waiting; <= 0 is DefaultQueue.
	Queue int
	// Pool is where the healthy upstreams and the pool signal are read;
	// nil: no per-upstream capacity and never saturated.
	Pool PoolView
}

// capacity is the capacity under s now; 0 is unlimited.
func (s *GateSettings) capacity() int {
	healthy := 0
	if s.PerUpstream > 0 && s.Pool != nil {
		healthy = s.Pool.ClosedUpstreams()
	}
	return PoolCapacity(s.Capacity, s.PerUpstream, healthy)
}

// poolGate holds a pool gate's settings.
type poolGate struct{ s atomic.Pointer[GateSettings] }

func (p *poolGate) capacity() int { return p.s.Load().capacity() }

func (p *poolGate) saturated() bool {
	s := p.s.Load()
	return s.Pool != nil && s.Pool.Saturated()
}

// NewPoolGate returns a gate whose capacity and pool signal come from its
// settings (s now, SetSettings later): a fixed capacity, or per_upstream ×
// the pool's closed upstreams, re-read on every decision; the pool's
// Saturated as the pool signal. ctl, when set, is told of each tenant's
// queued requests (GateConfig.Controller). Observer calls are NewGate's.
func NewPoolGate(s GateSettings, ctl *Controller, clk clock.Clock, obs Observer) *Gate {
	p := new(poolGate)
	p.s.Store(&s)
	g := newGate(GateConfig{Capacity: p.capacity, Saturated: p.saturated, Queue: s.Queue, Controller: ctl}, clk, obs)
	g.settings = p
	return g
}

// SetSettings makes s the settings of a gate made by NewPoolGate (a
// reloaded config's, for a gate kept across the reload): its capacity and
// pool apply at once and the queue's bound changes as SetQueue does;
// requests queued stay, and those that fit now are admitted. On other
// gates it only sets the queue bound.
func (g *Gate) SetSettings(s GateSettings) {
	if g.settings != nil {
		g.settings.s.Store(&s)
	}
	g.SetQueue(s.Queue)
}
