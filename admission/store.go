package admission

import "time"

// LimitStore is where a tenant's rate limits and concurrency slots are
// counted: this process's memory (the Controller's own state, the default,
// and LocalLimits), or a store shared by a fleet of gateways (fleet.Limits,
// in Redis).
//
// The seam is three calls, not four: taking a concurrency slot and counting
// the request and its tokens is one step (Reserve), so that a shared store
// decides it in one round trip, and a refusal at any limit takes nothing at
// all (a slot taken before an rpm refusal would have to be given back in a
// second one). Settle and Cancel give the slot back with the same call that
// settles the tokens.
//
// The Controller calls Reserve when a request's tenant breaker has let it
// through, and exactly one of Settle or Cancel for each admitted Hold. A
// store that replays its own calls (after a timeout whose effect it cannot
// know) must make the replay a no-op. Implementations are safe for
// concurrent use; they may block, but never longer than their own bound
// (fleet.Limits: one operation timeout).
type LimitStore interface {
	// Reserve applies q's limits in order — MaxConcurrent, RPM, TPM — and
	// when all pass, takes a concurrency slot, counts one request and
	// reserves tokens (q.Need, or when !q.Explicit q.Need capped at what is
	// left of TPM) in one step, recording in h what Settle or Cancel needs.
	// A refusal (Decision.Code set) takes nothing.
	Reserve(q *Quota, h *Hold) Decision
	// Settle replaces h's reservation with used tokens and frees its slot.
	Settle(h *Hold, used int64)
	// Cancel gives back everything h took (slot, request, tokens), as if
	// the request had never been admitted.
	Cancel(h *Hold)
}

// Quota is what one request asks of its tenant's limits: the tenant's
// effective limits (0: not enforced) and the request's tokens. The
// Controller builds it; stores read it.
type Quota struct {
	Tenant string
	// Tier is the request's effective tier name (for a store's logs).
	Tier string
	// MaxConcurrent, RPM and TPM are the tenant's limits; 0 is none.
	MaxConcurrent, RPM, TPM int
	// Prompt is the prompt estimate (never negative).
	Prompt int64
	// Need is Prompt + n × (max_tokens, or the tier's default), saturating.
	Need int64
	// Explicit is set when the request named max_tokens: Need is reserved
	// in full, or refused. Otherwise the reservation is capped at what is
	// left (and must hold at least the prompt).
	Explicit bool
	// FailClosed is the tier's fail_closed: a shared store that cannot
	// reach its fleet refuses the request (503) instead of deciding on
	// local limits.
	FailClosed bool
}

// Decision is a store's answer to Reserve.
type Decision struct {
	// Code is "" when the request is admitted, else CodeTenantConcurrency,
	// CodeTenantRPM, CodeTenantTPM, CodeRequestExceedsLimit, or
	// CodeFleetUnavailable (a fail_closed tier while the fleet's store is
	// away: status 503).
	Code string
	// RetryAfter is when waiting may help (refusals other than
	// CodeRequestExceedsLimit).
	RetryAfter time.Duration
	// Reserved is the tokens reserved (admitted only).
	Reserved int64
	// Left is what was left of TPM before this request (for messages).
	Left int64
	// Requests and Tokens are the window's counts after the decision
	// (this request included when admitted), ResetRequests and
	// ResetTokens the time until they are 0 again: for the x-ratelimit-*
	// headers.
	Requests, Tokens           int64
	ResetRequests, ResetTokens time.Duration
	// MaxConcurrent, RPM and TPM are the limits the store applied, when
	// they differ from the Quota's (a fleet store's local fallback applies
	// the fleet-wide limits ÷ the expected instances); 0 means the
	// Quota's own.
	MaxConcurrent, RPM, TPM int
	// Local is set when a fleet store decided on local limits because the
	// fleet was unreachable.
	Local bool
}

// Hold is an admitted request's share of a LimitStore, filled by Reserve
// and read by Settle or Cancel. It lives in the request's Ticket.
type Hold struct {
	// Reserved is the tokens reserved.
	Reserved int64
	// ID and Ref are for the store that took the hold (a lease id, the
	// local fallback that decided); the Controller does not read them.
	ID  string
	Ref any

	// store is the store that took the hold (set by the Controller); nil
	// when the Controller's own state did.
	store LimitStore
	// le and lep are LocalLimits': the tenant's entry and the epoch the
	// reservation was counted in.
	le  *localEntry
	lep int64
}

// SetLimitStore makes s the store of every tenant's rate limits and
// concurrency slots from now on; nil makes it the Controller's own memory
// again (the default). Requests admitted before the switch settle with the
// store that admitted them. A tenant with no limit at all is never sent to
// s.
func (c *Controller) SetLimitStore(s LimitStore) {
	if s == nil {
		c.store.Store(nil)
		return
	}
	c.store.Store(&storeBox{s})
}

// LimitStore returns the store set by SetLimitStore, nil for the default.
func (c *Controller) LimitStore() LimitStore {
	if b := c.store.Load(); b != nil {
		return b.s
	}
	return nil
}

// storeBox lets an atomic.Pointer hold an interface.
type storeBox struct{ s LimitStore }
