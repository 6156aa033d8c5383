package caddymodule

import (
	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/fleet"
	"github.com/llmproxy/caddy-llm-proxy/internal/registry"
	"github.com/llmproxy/caddy-llm-proxy/live"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// shared is the llm_proxy app's registry: every piece of state that
// outlives one config (DESIGN §6), and the only package-level mutable
// value of caddymodule besides the metric collectors. A config's app and
// handlers take their references in Provision (the fleet's at Start) through
// registry.Claims and release them in Cleanup (the fleet's at Stop); a
// reload's new config takes its references before the old one releases
// its own, so a value that both use survives, and the last release
// destroys it.
var shared = newSharedState()

// sharedState is what shared holds; each field names its owner and when
// it dies.
type sharedState struct {
	// upstreams holds the upstream entries by dial address and the pool
	// state by pool identity; each handler's pools claim them
	// (upstream.Pool) and release them in the handler's Cleanup.
	upstreams *upstream.Registry
	// gates are the pools' admission gates by pool identity, claimed by
	// the handlers (their claims), released in their Cleanup; the
	// upstream observer (gatePump) wakes them.
	gates *admission.GateSet
	// bodies are the body budgets by max_buffered_bodies, claimed by the
	// app in Provision and released in its Cleanup: a reload that keeps
	// the size keeps the budget with the charges of the requests still
	// running; the last config of a size drops it.
	bodies *registry.Table[*proxy.BodyBudget]
	// tenants holds the one tenant controller (tenants' windows, slots
	// and breakers), under the key "", claimed by each app with tenants in
	// Provision and released in its Cleanup.
	tenants *registry.Table[*admission.Controller]
	// fleets are the open fleet connections by their settings, with
	// their breaker and limit stores under the same keys, claimed by each
	// app with a fleet at Start and released at Stop: the last closes
	// the connection (and the stores stop with it).
	fleets        *registry.Table[*fleet.Client]
	fleetBreakers *registry.Table[*fleet.Breakers]
	fleetLimits   *registry.Table[*fleet.Limits]
	// live is what the newest started config puts in force (gate
	// settings, tenants, breaker store, body budget, logger, pools) and
	// the handlers' model lists: Start and Stop hand it over.
	live *live.Owner
	// series decides when per-upstream series go (series.go).
	series seriesLife
}

func newSharedState() *sharedState {
	s := &sharedState{
		upstreams:     upstream.NewRegistry(gatePump{}),
		gates:         admission.NewGateSet(),
		bodies:        registry.NewTable[*proxy.BodyBudget](nil),
		tenants:       registry.NewTable[*admission.Controller](nil),
		fleets:        registry.NewTable(func(_ string, c *fleet.Client) { _ = c.Close() }),
		fleetBreakers: registry.NewTable(func(_ string, bs *fleet.Breakers) { bs.Close() }),
		fleetLimits:   registry.NewTable[*fleet.Limits](nil), // they stop with their connection
	}
	s.live = live.New(s.upstreams, liveChanged)
	s.series.entries = s.upstreams.Entries
	return s
}
