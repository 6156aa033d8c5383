package admission

import "time"

// ReserveShare decides q on one gateway's share of a fleet-wide quota, for
// when the fleet's store cannot decide (Redis away, or not connected yet):
// every limit is divided by instances (at least 1 each; instances ≤ 1
// keeps them whole) and counted in local, which the caller starts from
// zero on each switch to local mode (DESIGN §9). A fail_closed tier is
// refused with CodeFleetUnavailable and retry instead. A request that
// fits the fleet's tpm but not this gateway's share of it is refused as
// tenant_tpm with retry (waiting for the fleet helps), not as
// request_exceeds_limit. The decision is marked Local and carries the
// limits applied; when admitted, h.Ref is local, so that the request
// settles there.
func ReserveShare(local *LocalLimits, instances int, retry time.Duration, q *Quota, h *Hold) Decision {
	if q.FailClosed {
		return Decision{Code: CodeFleetUnavailable, RetryAfter: retry, Local: true}
	}
	share := func(v int) int {
		if v <= 0 || instances <= 1 {
			return v
		}
		return max(1, v/instances)
	}
	lq := *q
	lq.MaxConcurrent, lq.RPM, lq.TPM = share(q.MaxConcurrent), share(q.RPM), share(q.TPM)
	d := local.Reserve(&lq, h)
	d.Local = true
	d.MaxConcurrent, d.RPM, d.TPM = lq.MaxConcurrent, lq.RPM, lq.TPM
	if d.Code == CodeRequestExceedsLimit && lq.TPM < q.TPM &&
		((q.Explicit && q.Need <= int64(q.TPM)) || (!q.Explicit && q.Prompt <= int64(q.TPM))) {
		d.Code, d.RetryAfter = CodeTenantTPM, retry
	}
	if d.Code == "" {
		h.Ref = local
	}
	return d
}
