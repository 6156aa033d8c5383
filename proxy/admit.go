package proxy

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/api"
)

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
	// Admission with a nil error admits with nothing to release. A refusal
	// error that implements QueueWaiter (directly or wrapped) reports the
	// time the request waited before it was refused.
	Admit(ctx context.Context, id Identity, info RequestInfo) (Admission, error)
}

// Admission is an admitted request's hold on its tenant's limits. It may
// also implement HeaderAdmission and QueueWaiter.
type Admission interface {
	// Release settles the reservation with what the request really used
	// and gives back its slot. finish calls it exactly once, on every path
	// (client gone and panics included), after the outcome is classified
	// and before Observer.RequestDone: res carries Usage, Committed,
	// ContentEvents (Result.Settlement turns them into what to charge),
	// Outcome, TenantFault, Status and AttemptTTFT for the tenant breaker.
	// Nothing uses the Admission after Release.
	Release(res *Result)
}

// HeaderAdmission is implemented by an Admission whose responses carry
// headers of their own: OpenAI's x-ratelimit-* for a tenant with limits.
// SetHeader is called on every response the gateway sends for the admitted
// request before its status is written: the committed response, an upstream
// error passed through and the gateway's own errors. It must not allocate
// more than the headers it sets.
type HeaderAdmission interface {
	// SetHeader sets the admission's headers on h, replacing any there.
	SetHeader(h http.Header)
}

// QueueWaiter reports the time a request waited to be admitted (in a
// pool's priority queue), for Result.QueueWait and {http.llm_proxy.queue_ms}.
type QueueWaiter interface {
	// QueueWait returns the time waited.
	QueueWait() time.Duration
}

// nopAdmitter admits everything.
type nopAdmitter struct{}

func (nopAdmitter) Admit(context.Context, Identity, RequestInfo) (Admission, error) { return nil, nil }

// admit is step 3: the request's admission, or its refusal. When a
// fallback takes the primary's saturated overflow, a request that finds the
// primary without a free slot descends the ladder here, before any attempt:
// to the first such fallback that allows its tier and has room now, else
// back to the primary's queue, where the lowest tiers are shed first.
func (x *exchange) admit() bool {
	pa, ladder := x.p.cfg.Admitter.(PoolAdmitter)
	if !ladder || !x.p.saturatedRungs {
		adm, err := x.p.cfg.Admitter.Admit(x.ctx, x.result.Identity, x.result.Info)
		if err != nil {
			return x.refuse(err)
		}
		x.admitted(adm)
		return true
	}
	adm, saturated, err := pa.AdmitNoWait(x.ctx, x.result.Identity, x.result.Info)
	if err != nil {
		return x.refuse(err)
	}
	x.admitted(adm)
	if !saturated || x.degrade(DegradeSaturated) {
		return true
	}
	if err := adm.(PoolAdmission).Queue(x.ctx, x.result.Info); err != nil {
		return x.refuse(err) // the notes say why no fallback took it
	}
	x.admitted(adm)
	x.notes = nil // served by the primary after all
	return true
}

// admitted records adm, the request's admission.
func (x *exchange) admitted(adm Admission) {
	x.admission = adm
	if adm != nil {
		if qw, ok := adm.(QueueWaiter); ok {
			x.result.QueueWait = qw.QueueWait()
		}
	}
}

// refuse records an admission refusal; it returns false.
func (x *exchange) refuse(err error) bool {
	var qw QueueWaiter
	if errors.As(err, &qw) {
		x.result.QueueWait = qw.QueueWait()
	}
	x.refusal = err
	return false
}

// setAdmissionHeader sets the admission's own response headers on h (the
// client's response header, before its status is written).
//
// With tenants, the upstream's own x-ratelimit-* and
// anthropic-ratelimit-* headers (the shared account's figures) never reach
// a tenant: only the tenant's own, and none for a limit it does not have.
func (x *exchange) setAdmissionHeader(h http.Header) {
	if _, nop := x.p.cfg.Admitter.(nopAdmitter); !nop {
		for k := range h {
			if len(k) > 12 && strings.EqualFold(k[:12], "X-Ratelimit-") ||
				len(k) > 20 && strings.EqualFold(k[:20], "Anthropic-Ratelimit-") {
				delete(h, k)
			}
		}
	}
	if ha, ok := x.admission.(HeaderAdmission); ok {
		ha.SetHeader(h)
		if api.AnthropicShaped(x.api) {
			setAnthropicRateLimitHeaders(h, time.Now())
		}
	}
	if d := x.result.Degraded; d != "" {
		h.Set(HeaderDegraded, d)
	}
}
