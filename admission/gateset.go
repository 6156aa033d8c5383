package admission

import "github.com/llmproxy/caddy-llm-proxy/internal/registry"

// GateSet is the pool gates of the running configs by the key their owner
// gives them (the Caddy glue: a handler's pool identity and its place
// among the config's handlers with that identity), reference counted
// through internal/registry: each handler's claims hold its gate, and the
// last release drops it, so a reload that keeps a key keeps its gate with
// the requests in flight and queued.
//
// It is also the gates' queue pump: Wake is told which upstream changed
// (a breaker of it closed, so a per_upstream capacity may have grown; its
// /metrics were scraped, so a pool signal may have cleared) and admits the
// requests that fit now at the gates whose pool holds that upstream,
// rather than at their next release.
type GateSet struct {
	*registry.Table[*Gate]
}

// NewGateSet returns an empty set.
func NewGateSet() *GateSet { return &GateSet{registry.NewTable[*Gate](nil)} }

// Wake pumps the gates whose pool (GateSettings.Pool, made by NewPoolGate)
// holds the upstream at dial address addr (PoolView.Holds); a gate of
// another pool, or without a pool, has nothing that changed and is left
// alone. Safe for concurrent use; it takes each gate's lock in turn, so
// call it without holding one.
func (s *GateSet) Wake(addr string) {
	_, gs := s.Snapshot()
	for _, g := range gs {
		if g.holds(addr) {
			g.Pump()
		}
	}
}

// holds reports whether g is a pool gate whose pool holds the upstream addr.
func (g *Gate) holds(addr string) bool {
	if g.settings == nil {
		return false
	}
	p := g.settings.s.Load().Pool
	return p != nil && p.Holds(addr)
}
