package caddymodule

import (
	"context"
	"sync"
	"sync/atomic"
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

	// l is the fleet store of the slot's connection once it is open (a
	// config opens one connection, once).
	l  atomic.Pointer[fleet.Limits]
	mu sync.Mutex
}

func newFleetLimits(slot *fleetSlot, cfg fleet.Config) *fleetLimits {
	return &fleetLimits{slot: slot, share: cfg.Defaults().ExpectedInstances, local: admission.NewLocalLimits(nil)}
}

// limits returns the fleet store of the config's connection, nil before it
// is open.
func (f *fleetLimits) limits() *fleet.Limits {
	if l := f.l.Load(); l != nil {
		return l
	}
	c := f.slot.Load()
	if c == nil {
		return nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if l := f.l.Load(); l != nil {
		return l
	}
	l := limitsFor(c)
	f.l.Store(l)
	return l
}

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
	if l := f.l.Load(); l != nil && h.Ref != nil {
		l.Settle(h, used)
		return
	}
	f.local.Settle(h, used)
}

// Cancel implements admission.LimitStore.
func (f *fleetLimits) Cancel(h *admission.Hold) {
	if l := f.l.Load(); l != nil && h.Ref != nil {
		l.Cancel(h)
		return
	}
	f.local.Cancel(h)
}

// fleetLimitStores holds one fleet.Limits per open connection, dropped
// when its connection closes (the store stops with it).
var fleetLimitStores struct {
	sync.Mutex
	m map[*fleet.Client]*fleet.Limits
}

// limitsFor returns the fleet limit store of connection c, creating it.
func limitsFor(c *fleet.Client) *fleet.Limits {
	fleetLimitStores.Lock()
	defer fleetLimitStores.Unlock()
	if l := fleetLimitStores.m[c]; l != nil {
		return l
	}
	l, err := fleet.NewLimits(c, fleet.LimitsConfig{})
	if err != nil {
		panic(err) // the defaults are valid
	}
	if fleetLimitStores.m == nil {
		fleetLimitStores.m = make(map[*fleet.Client]*fleet.Limits)
	}
	fleetLimitStores.m[c] = l
	go func() {
		<-l.Done()
		fleetLimitStores.Lock()
		if fleetLimitStores.m[c] == l {
			delete(fleetLimitStores.m, c)
		}
		fleetLimitStores.Unlock()
	}()
	return l
}

// liveLimitStore is the fleet limit store the controller uses now, nil in
// local mode (no fleet, or its connection not open).
func liveLimitStore() *fleet.Limits {
	ctl := liveController()
	if ctl == nil {
		return nil
	}
	if f, ok := ctl.LimitStore().(*fleetLimits); ok {
		return f.l.Load()
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
