package caddymodule

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// tenancy is one config's tenants and tiers, built in Provision: its key
// directory and trusted proxies are its own (they change nothing live);
// its limits apply to the process-wide controller when the config starts.
type tenancy struct {
	cfg     admission.Config
	dir     *admission.Directory
	header  string
	trusted []netip.Prefix
	unknown string
	// ctl is the process-wide controller (tenants' windows and breakers
	// survive reloads).
	ctl *admission.Controller
	// limits is where the tenants' rate limits and concurrency slots are
	// counted while this config is the newest started: the fleet's Redis
	// when the config has a fleet, nil (the controller's own memory)
	// without.
	limits admission.LimitStore
}

// newTenancy builds the config's tenancy; nil when it configures none.
func newTenancy(a *App) (*tenancy, error) {
	if a.Tenants == nil && len(a.Tiers) == 0 && len(a.TenantOverrides) == 0 {
		return nil, nil
	}
	if a.Tenants == nil {
		return nil, errors.New("llm_proxy: tiers without tenants: add a tenants block (keys) so requests can be identified")
	}
	cfg, err := a.admissionConfig()
	if err != nil {
		return nil, fmt.Errorf("llm_proxy: %w", err)
	}
	keys, dir, err := a.Tenants.directory()
	if err != nil {
		return nil, err
	}
	// Every key must lead to a tier, or its requests would all be 401s.
	check, err := admission.NewController(cfg, clock.Real, nil)
	if err != nil {
		return nil, fmt.Errorf("llm_proxy: %w", err)
	}
	for _, k := range keys {
		if _, ok := check.Tier(k.Tenant, k.Tier); !ok {
			if k.Tier != "" {
				return nil, fmt.Errorf("llm_proxy: tenants: a key of tenant %s names tier %q, which no tier block defines", k.Tenant, k.Tier)
			}
			return nil, fmt.Errorf("llm_proxy: tenants: tenant %s has no tier: give it one (key … tier <name>, or a tenant block), or define a tier named default", k.Tenant)
		}
	}
	trusted, err := a.Tenants.trustedPrefixes()
	if err != nil {
		return nil, err
	}
	t := &tenancy{cfg: cfg, dir: dir, header: a.Tenants.Header, trusted: trusted, unknown: cfg.UnknownTier}
	if a.fleet != nil {
		t.limits = newFleetLimits(a.fleet, a.fleetCfg)
	}
	// The one controller, shared by the configs with tenants; the first
	// builds it with its limits (nothing is live yet).
	ctl, err := shared.tenants.Acquire(a.claims, "", func() (*admission.Controller, error) {
		return admission.NewController(cfg, clock.Real, admissionObserver{})
	}, nil)
	if err != nil {
		return nil, fmt.Errorf("llm_proxy: %w", err)
	}
	t.ctl = ctl
	return t, nil
}
