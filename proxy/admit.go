package proxy

import "context"

// Admitter admits a request before any upstream is picked (DESIGN §3 step
// 3): tenant breaker, tenant limits, pool capacity, a token reservation
// (prompt estimate + max_tokens), shedding by priority or a bounded wait in
// a priority queue. Implementations must be safe for concurrent use.
type Admitter interface {
	// Admit admits the request or refuses it. ctx ends with the request
	// (client gone, stream_timeout): a queued request waits no longer. A
	// refusal reserves nothing; a *GatewayError is written as it is (429
	// with Retry-After and x-ratelimit-* headers, 503 when shed), any other
	// error is answered with 500 and the outcome internal_error. A nil
	// Admission with a nil error admits with nothing to release.
	Admit(ctx context.Context, id Identity, info RequestInfo) (Admission, error)
}

// Admission is an admitted request's hold on its tenant's limits.
type Admission interface {
	// Release settles the reservation with what the request really used
	// and gives back its slot. finish calls it exactly once, on every path
	// (client gone and panics included), after the outcome is classified:
	// res carries Usage (Reported false: settle with an estimate, e.g. from
	// ContentEvents), Outcome, Status and TTFT for the tenant breaker.
	Release(res *Result)
}

// nopAdmitter admits everything.
type nopAdmitter struct{}

func (nopAdmitter) Admit(context.Context, Identity, RequestInfo) (Admission, error) { return nil, nil }

// admit is step 3: the request's admission, or its refusal.
func (x *exchange) admit() bool {
	adm, err := x.p.cfg.Admitter.Admit(x.ctx, x.res.Identity, x.res.Info)
	if err != nil {
		x.refusal = err
		return false
	}
	x.admission = adm
	return true
}
