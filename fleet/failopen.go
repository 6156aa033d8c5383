package fleet

import (
	"time"

	"github.com/llmproxy/caddy-llm-proxy/admission"
)

// shareRetry is the Retry-After of a fail_closed tier's refusal while the
// fleet's store is not there yet.
const shareRetry = time.Second

// FailOpenLimits is the tenants' limit store of a config with a fleet: the
// fleet's Limits once the config's connection is open; before then (the
// instant between the tenants' start and the connection's), requests are
// decided as in local mode — on this gateway's share of each limit (the
// limit ÷ expected_instances) counted in a local store of its own, or 503
// for a fail_closed tier (admission.ReserveShare). The fleet's Limits
// itself falls back the same way while Redis is away. Safe for concurrent
// use.
type FailOpenLimits struct {
	fleet func() *Limits
	share int
	local *admission.LocalLimits
}

// NewFailOpenLimits returns the store that uses fleet() (nil until the
// connection is open) and, without it, 1/expectedInstances of each limit
// (expectedInstances < 1 counts as 1).
func NewFailOpenLimits(fleet func() *Limits, expectedInstances int) *FailOpenLimits {
	return &FailOpenLimits{fleet: fleet, share: max(expectedInstances, 1), local: admission.NewLocalLimits(nil)}
}

// Fleet returns the fleet's store in use, nil before the connection is open.
func (f *FailOpenLimits) Fleet() *Limits { return f.fleet() }

// Reserve implements admission.LimitStore.
func (f *FailOpenLimits) Reserve(q *admission.Quota, h *admission.Hold) admission.Decision {
	if l := f.fleet(); l != nil {
		return l.Reserve(q, h)
	}
	return admission.ReserveShare(f.local, f.share, shareRetry, q, h)
}

// Settle implements admission.LimitStore: a hold the fleet's store took
// carries its Ref; one of the local store's does not.
func (f *FailOpenLimits) Settle(h *admission.Hold, used int64) {
	if l := f.fleet(); l != nil && h.Ref != nil {
		l.Settle(h, used)
		return
	}
	f.local.Settle(h, used)
}

// Cancel implements admission.LimitStore.
func (f *FailOpenLimits) Cancel(h *admission.Hold) {
	if l := f.fleet(); l != nil && h.Ref != nil {
		l.Cancel(h)
		return
	}
	f.local.Cancel(h)
}

// Interface guard.
var _ admission.LimitStore = (*FailOpenLimits)(nil)
