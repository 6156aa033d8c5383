// Package live owns what a started config puts in force for the whole
// process (DESIGN §6): the gates' capacities, the tenants' tiers and limit
// store, the breaker store of the upstream and tenant breakers, the body
// budget the gauges report, whether admissions are labelled by tenant, and
// the logger, events and pools that the process-wide observers and the
// admin API use. The newest started config's settings are in force; when
// it stops (a reload's old config stops after the new one started, so only
// a failed start or an unload stops the newest), the newest config still
// running puts its own back, and after the last nothing points at any
// config. It also holds the model lists of the handlers, kept across
// reloads by the pools they list.
//
// It imports no Caddy, so reloads can be tested without one.
package live

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/fleet"
	"github.com/llmproxy/caddy-llm-proxy/internal/registry"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// Config is what one config puts in force while it is the newest started.
// It is built before Start and not changed after.
type Config struct {
	// Logger logs what shared state does (breaker transitions, saturation
	// signals, the fleet connection) while this config is the newest.
	// Required.
	Logger *zap.Logger
	// Emit sends an event (a breaker transition) through the config's
	// events; nil sends none.
	Emit func(name string, data map[string]any)
	// Pools are the config's upstream pools, activated at Start and
	// deactivated at Stop.
	Pools []*upstream.Pool
	// Gates are the config's admission gates with their settings.
	Gates []Gate
	// Tenants are the config's tenants and tiers; nil without.
	Tenants *Tenants
	// BreakerStore is where upstream and tenant breakers share their state
	// (the fleet's); nil keeps them to this process.
	BreakerStore breaker.Store
	// Fleet is the config's open fleet connection; nil without a fleet.
	Fleet *fleet.Client
	// Bodies is the config's body budget (max_buffered_bodies).
	Bodies *proxy.BodyBudget
	// TenantLabels is metrics_tenant_label: admissions are counted by
	// tenant id too.
	TenantLabels bool
}

// Gate is a shared admission gate with the settings a config gives it.
type Gate struct {
	Gate     *admission.Gate
	Settings admission.GateSettings
}

// Tenants is a config's tenant configuration for the process-wide tenant
// controller.
type Tenants struct {
	// Controller is the process-wide tenant controller.
	Controller *admission.Controller
	// Config holds the tiers and tenants to apply.
	Config admission.Config
	// Limits is where tenants' limits are counted (the fleet's Redis); nil
	// counts them in the controller's memory.
	Limits admission.LimitStore
}

// Owner holds the started configs, newest last, and keeps the newest one's
// settings in force. Safe for concurrent use; readers never wait on a
// Start or Stop. The zero value is not usable: use New.
type Owner struct {
	upstreams *upstream.Registry
	onChange  func(*Config)

	mu      sync.Mutex // serialises Start and Stop
	running []*Config
	newest  atomic.Pointer[Config]

	// Models holds the handlers' model lists by the pools they list (see
	// ModelsKey), claimed by each handler that serves GET /v1/models in
	// Provision and released in its Cleanup: a reload that keeps a
	// handler's pools keeps its cached list and each pool's last answer.
	Models *registry.Table[*proxy.ModelCache]
}

// New returns an Owner that sets the breaker store of upstreams, and calls
// onChange (when not nil) with the config whose settings are in force
// after each change, nil after the last stopped.
func New(upstreams *upstream.Registry, onChange func(*Config)) *Owner {
	return &Owner{upstreams: upstreams, onChange: onChange, Models: registry.NewTable[*proxy.ModelCache](nil)}
}

// Start makes c the newest started config and puts its settings in force,
// then activates its pools. It fails, changing nothing, when the tenant
// controller refuses c's tiers.
func (o *Owner) Start(c *Config) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if err := o.apply(c, o.newest.Load()); err != nil {
		return err
	}
	o.running = append(o.running, c)
	for _, p := range c.Pools {
		p.Activate()
	}
	return nil
}

// Stop deactivates c's pools and takes c out of the started configs; when
// c was the newest, the settings of the newest one still running are put
// back in force (none after the last). It returns the tenant controller's
// error if it refused those tiers.
func (o *Owner) Stop(c *Config) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	i := slices.Index(o.running, c)
	if i < 0 {
		return nil
	}
	for _, p := range c.Pools {
		p.Deactivate()
	}
	o.running = slices.Delete(o.running, i, i+1)
	if o.newest.Load() != c {
		return nil
	}
	var next *Config
	if n := len(o.running); n > 0 {
		next = o.running[n-1]
	}
	return o.apply(next, c)
}

// apply puts c's settings in force in place of prev's (either may be nil).
func (o *Owner) apply(c, prev *Config) error {
	var store breaker.Store
	if c != nil {
		store = c.BreakerStore
	}
	switch {
	case c != nil && c.Tenants != nil:
		t := c.Tenants
		if err := t.Controller.SetConfig(t.Config); err != nil {
			return fmt.Errorf("llm_proxy: applying tenants: %w", err)
		}
		t.Controller.SetLimitStore(t.Limits)
		t.Controller.SetBreakerStore(store)
	case prev != nil && prev.Tenants != nil:
		// The controller outlives configs with tenants only to finish
		// their requests: it lets go of a fleet connection that may close.
		prev.Tenants.Controller.SetLimitStore(nil)
		prev.Tenants.Controller.SetBreakerStore(nil)
	}
	o.upstreams.SetBreakerStore(store)
	if c != nil {
		for _, g := range c.Gates {
			g.Gate.SetSettings(g.Settings)
		}
	}
	o.newest.Store(c)
	if o.onChange != nil {
		o.onChange(c)
	}
	return nil
}

// Newest returns the config whose settings are in force, nil when none is
// started.
func (o *Owner) Newest() *Config { return o.newest.Load() }

// Pools returns the pools of every started config, newest config first.
func (o *Owner) Pools() []*upstream.Pool {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []*upstream.Pool
	for i := len(o.running) - 1; i >= 0; i-- {
		out = append(out, o.running[i].Pools...)
	}
	return out
}

// Bodies returns the body budget in force, nil when no config is started.
func (o *Owner) Bodies() *proxy.BodyBudget {
	if c := o.newest.Load(); c != nil {
		return c.Bodies
	}
	return nil
}

// TenantLabels reports whether admissions are counted by tenant id now.
func (o *Owner) TenantLabels() bool {
	c := o.newest.Load()
	return c != nil && c.TenantLabels
}

// Logger returns the logger in force; nil when no config is started.
func (o *Owner) Logger() *zap.Logger {
	if c := o.newest.Load(); c != nil {
		return c.Logger
	}
	return nil
}
