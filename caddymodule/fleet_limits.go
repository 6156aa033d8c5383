package caddymodule

import (
	"context"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/fleet"
)

// fleetLimits is the tenant-limit store of a config with a fleet: the
// fleet's store in Redis (fleet.Limits) over the config's connection.
// tenancy.start gives it to the process-wide controller just before
// App.Start opens the connection; a request in that instant is decided as
// in local mode — on this gateway's share of the limits, or 503 for a
// fail_closed tier — by a local store of its own.
type fleetLimits struct {
	slot  *fleetSlot
	share int // expected_instances
	local *admission.LocalLimits
}

func newFleetLimits(slot *fleetSlot, cfg fleet.Config) *fleetLimits {
	return &fleetLimits{slot: slot, share: cfg.Defaults().ExpectedInstances, local: admission.NewLocalLimits(nil)}
}

// limits returns the fleet store of the config's connection, nil before it
// is open.
func (f *fleetLimits) limits() *fleet.Limits { return f.slot.limits.Load() }

// Reserve implements admission.LimitStore.
func (f *fleetLimits) Reserve(q *admission.Quota, h *admission.Hold) admission.Decision {
	if l := f.limits(); l != nil {
		return l.Reserve(q, h)
	}
	return admission.ReserveShare(f.local, f.share, time.Second, q, h)
}

// Settle implements admission.LimitStore: a hold the fleet store took
// carries its Ref; one of the local store's does not.
func (f *fleetLimits) Settle(h *admission.Hold, used int64) {
	if l := f.limits(); l != nil && h.Ref != nil {
		l.Settle(h, used)
		return
	}
	f.local.Settle(h, used)
}

// Cancel implements admission.LimitStore.
func (f *fleetLimits) Cancel(h *admission.Hold) {
	if l := f.limits(); l != nil && h.Ref != nil {
		l.Cancel(h)
		return
	}
	f.local.Cancel(h)
}

// liveLimitStore is the fleet limit store the controller uses now, nil in
// local mode (no fleet, or its connection not open).
func liveLimitStore() *fleet.Limits {
	ctl := liveController()
	if ctl == nil {
		return nil
	}
	if f, ok := ctl.LimitStore().(*fleetLimits); ok {
		return f.limits()
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

// Interface guard.
var _ admission.LimitStore = (*fleetLimits)(nil)
