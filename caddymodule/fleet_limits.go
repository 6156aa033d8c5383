package caddymodule

import (
	"context"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/fleet"
)

// newFleetLimits is the tenants' limit store of a config with a fleet:
// the fleet's store of the slot's connection once Start has opened it, this
// gateway's share of the limits before (fleet.FailOpenLimits).
func newFleetLimits(slot *fleetSlot, cfg fleet.Config) *fleet.FailOpenLimits {
	return fleet.NewFailOpenLimits(slot.limits.Load, cfg.Defaults().ExpectedInstances)
}

// liveLimitStore is the fleet limit store the controller uses now, nil in
// local mode (no fleet, or its connection not open).
func liveLimitStore() *fleet.Limits {
	ctl := liveController()
	if ctl == nil {
		return nil
	}
	if f, ok := ctl.LimitStore().(*fleet.FailOpenLimits); ok {
		return f.Fleet()
	}
	return nil
}

// fleetTenantViews gives the admin API the fleet's in-flight count: in
// fleet mode, each tenant with max_concurrent shows its unexpired leases
// in Redis (every gateway's requests), not this gateway's alone. Without a
// fleet, in local mode, or when Redis does not answer within op_timeout,
// the views are returned as they are (this gateway's count).
func fleetTenantViews(views []admission.TenantView) []admission.TenantView {
	l := liveLimitStore()
	if l == nil || len(views) == 0 {
		return views
	}
	var ids []string
	for _, v := range views {
		if v.MaxConcurrent > 0 {
			ids = append(ids, v.Tenant)
		}
	}
	n, err := l.InFlight(context.Background(), ids)
	if err != nil {
		return views
	}
	for i, v := range views {
		if c, ok := n[v.Tenant]; ok {
			views[i].Inflight = c
		}
	}
	return views
}
