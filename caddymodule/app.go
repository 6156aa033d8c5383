package caddymodule

import (
	"fmt"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"go.uber.org/zap"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/fleet"
	"github.com/llmproxy/caddy-llm-proxy/internal/registry"
	"github.com/llmproxy/caddy-llm-proxy/live"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

func init() {
	caddy.RegisterModule(App{})
}

// App is the llm_proxy app: the settings shared by every llm_proxy handler
// of a config (global option `llm_proxy { … }`: tenants and tiers, the
// fleet connection), and the owner of the background work.
//
// Every handler provisions its upstream pool against the process-wide
// registry and hands it to its config's App. Starting the App applies the
// config's settings to shared upstream entries (breaker thresholds, active
// probing); stopping it hands them back to the newest config still running.
// So a config that fails to load never changes live state, and background
// loops (active probes and /metrics scrapers) run once per upstream however
// many handlers use it, survive reloads handed over to the newest config,
// and stop when their upstream is released. The fleet connection is opened
// when a config starts and kept while running configs want the same one.
type App struct {
	// Tenants maps credentials to tenants. Default: none — requests are not
	// identified and no tenant limits apply.
	Tenants *TenantsConfig `json:"tenants,omitempty"`

	// Tiers are the classes of tenants with their priority and limits.
	// Default: none.
	Tiers []TierConfig `json:"tiers,omitempty"`

	// TenantOverrides set tenants' tiers and per-tenant limits.
	// Default: none (a tenant has the tier named "default").
	TenantOverrides []TenantOverride `json:"tenant_overrides,omitempty"`

	// MetricsTenantLabel adds a tenant label (the tenant id, never a key)
	// to the admission metrics. Default: false (labels by tier only: the
	// number of tenants is the operator's to bound).
	MetricsTenantLabel bool `json:"metrics_tenant_label,omitempty"`

	// Fleet shares state between the gateways of a fleet through Redis.
	// Default: none — every gateway keeps its state to itself.
	Fleet *FleetConfig `json:"fleet,omitempty"`

	// MaxBufferedBodies bounds the memory that request bodies held by
	// every llm_proxy handler and llm_model matcher of the process take at
	// once, in bytes. Each body is charged its buffer (its declared
	// Content-Length, or what arrived so far) before it is read and given
	// back when its request ends; a body that does not fit waits up to 1s
	// for room, then gets 503 with Retry-After: 1 and code
	// body_memory_exhausted, and a body larger than the whole budget gets
	// 413. Configs of the same size share one budget across reloads.
	// Default: 256MiB.
	MaxBufferedBodies int64 `json:"max_buffered_bodies,omitempty"`

	// bodies is the process-wide body budget of MaxBufferedBodies.
	bodies *proxy.BodyBudget

	// tenancy is what the handlers of this config use to identify and
	// admit; nil without tenants.
	tenancy *tenancy

	// fleetCfg is Fleet resolved in Provision; fleet holds its connection
	// from Start on (read by the admin API and metrics while the config
	// runs), referenced through fleetClaims until Stop.
	fleetCfg    fleet.Config
	fleet       *fleetSlot
	fleetClaims *registry.Claims

	// claims are the config's references to shared state that lives from
	// Provision to Cleanup (its body budget, the tenant controller).
	claims *registry.Claims

	pools []*upstream.Pool
	// gen is the config's generation (upstream.Config.Generation), so
	// that two handlers of this config in front of one upstream each obey
	// their own breaker settings.
	gen   uint64
	gates []adoptedGate
	// gateSeq counts the gates of this config by pool identity (gateKey).
	gateSeq map[string]int
	// live is what the config put in force at Start (shared.live).
	live   *live.Config
	logger *zap.Logger
	events *caddyevents.App
	ctx    caddy.Context
}

// CaddyModule returns the Caddy module information.
func (App) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "llm_proxy",
		New: func() caddy.Module { return new(App) },
	}
}

// Provision loads the events app, to which breaker transitions are
// emitted, and checks the tenants and the fleet settings. It connects to
// nothing: a config that fails to load must not touch live state.
func (a *App) Provision(ctx caddy.Context) error {
	a.ctx, a.logger = ctx, ctx.Logger()
	a.claims = new(registry.Claims)
	a.gen = a.registry().NextGeneration()
	if err := registerMetrics(ctx.GetMetricsRegistry()); err != nil {
		return err
	}
	if a.Fleet != nil {
		cfg, err := a.Fleet.config()
		if err != nil {
			return err
		}
		a.fleetCfg, a.fleet = cfg, new(fleetSlot)
	}
	bodies, err := bodyBudgetFor(a.claims, a.MaxBufferedBodies)
	if err != nil {
		return err
	}
	a.bodies = bodies
	ev, err := ctx.App("events")
	if err != nil {
		return fmt.Errorf("loading events app: %w", err)
	}
	a.events = ev.(*caddyevents.App)
	t, err := newTenancy(a)
	if err != nil {
		return err
	}
	a.tenancy = t
	return nil
}

func (a *App) registry() *upstream.Registry { return shared.upstreams }

// bodyBudgetFor takes claims' reference to the shared body budget of size
// bytes (0: proxy.DefaultMaxBufferedBodies): a reload that keeps
// max_buffered_bodies keeps the budget, with the charges of the requests
// still running; a new size starts a new budget while the old one's
// requests finish, and the old one goes with the last config of its size.
func bodyBudgetFor(claims *registry.Claims, size int64) (*proxy.BodyBudget, error) {
	if size < 0 {
		return nil, fmt.Errorf("llm_proxy: negative max_buffered_bodies %d", size)
	}
	if size == 0 {
		size = proxy.DefaultMaxBufferedBodies
	}
	return shared.bodies.Acquire(claims, strconv.FormatInt(size, 10), func() (*proxy.BodyBudget, error) {
		return proxy.NewBodyBudget(size, proxy.DefaultBodyBudgetWait)
	}, nil)
}

// Cleanup releases the config's references taken in Provision (its body
// budget, the tenant controller); requests still running keep what they
// hold.
func (a *App) Cleanup() error {
	if a.claims != nil {
		a.claims.Release()
	}
	return nil
}

// adoptedGate is a shared gate with the settings this config gives it.
type adoptedGate struct {
	g    *admission.Gate
	want *admission.GateSettings
}

// gateKey returns the registry key of the next gate of pool identity
// poolKey in this config: the identity, then "#n" for the n-th handler (or
// fallback) of the config with that identity, in provisioning order. A
// reload of the same config finds each handler's gate again; two handlers
// in front of the same upstreams get one each (before, they shared one
// with the last one's capacity). Caddy provisions a config from one
// goroutine, so gateSeq needs no lock.
func (a *App) gateKey(poolKey string) string {
	if a.gateSeq == nil {
		a.gateSeq = map[string]int{}
	}
	n := a.gateSeq[poolKey]
	a.gateSeq[poolKey] = n + 1
	return poolKey + "#" + strconv.Itoa(n)
}

// adoptGate records a gate whose capacity this config sets when it starts.
func (a *App) adoptGate(g *admission.Gate, want *admission.GateSettings) {
	a.gates = append(a.gates, adoptedGate{g, want})
}

// adopt records a pool provisioned in this config, to be activated when the
// config starts. Caddy provisions, starts and stops a config from one
// goroutine, so pools needs no lock.
func (a *App) adopt(p *upstream.Pool) { a.pools = append(a.pools, p) }

// Start makes this config's settings the live ones (shared.live): its
// pools' breaker settings and probers apply to the shared entries, its
// gates' capacities and its tenants' tiers apply, and breaker transitions
// are logged and emitted through this config's logger and events app. With
// a fleet, it takes the connection first (opening it, in local mode if
// Redis is away: that never fails the config).
func (a *App) Start() error {
	if err := a.startFleet(); err != nil {
		a.stopFleet()
		return err
	}
	a.live = a.liveConfig()
	if err := shared.live.Start(a.live); err != nil {
		a.stopFleet() // Caddy does not stop an app whose Start failed
		return err
	}
	return nil
}

// Stop hands the live settings back to the newest config still running
// (a reload's new config has started already; after a failed start, the
// old one). The pools' references are released by the handlers' Cleanup.
// It drops the config's fleet connection, which closes when no running
// config wants it.
func (a *App) Stop() error {
	var err error
	if a.live != nil {
		// Before the connection may close: the breakers go back to the
		// newest running config's store first.
		err = shared.live.Stop(a.live)
	}
	a.stopFleet()
	return err
}

// liveConfig is what this config puts in force while it is the newest
// started, once its fleet connection is open.
func (a *App) liveConfig() *live.Config {
	c := &live.Config{
		Logger:       a.logger,
		Pools:        a.pools,
		BreakerStore: a.breakerStore(),
		Bodies:       a.bodies,
		TenantLabels: a.MetricsTenantLabel,
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	if a.events != nil {
		ev, ctx := a.events, a.ctx
		c.Emit = func(name string, data map[string]any) { ev.Emit(ctx, name, data) }
	}
	if a.fleet != nil {
		c.Fleet = a.fleet.Load()
	}
	for _, g := range a.gates {
		c.Gates = append(c.Gates, live.Gate{Gate: g.g, Settings: *g.want})
	}
	if t := a.tenancy; t != nil {
		c.Tenants = &live.Tenants{Controller: t.ctl, Config: t.cfg, Limits: t.limits}
	}
	return c
}

// liveChanged exports the objectives of the tiers in force (none when no
// config with tenants is the newest).
func liveChanged(c *live.Config) {
	var tiers []admission.Tier
	if c != nil && c.Tenants != nil {
		tiers = c.Tenants.Config.Tiers
	}
	setObjectives(tiers)
}

// Interface guards
var (
	_ caddy.App          = (*App)(nil)
	_ caddy.Provisioner  = (*App)(nil)
	_ caddy.CleanerUpper = (*App)(nil)
)
