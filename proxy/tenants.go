package proxy

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/admission"
)

// TenantAdmitter is the Admitter of DESIGN §3 step 3 over package
// admission: the tenant's own limits and breaker (a Controller's
// reservation), then the pool's capacity and priority queue (a Gate). A
// refusal at either consumes nothing. Every response to an admitted tenant
// with rate limits carries OpenAI's x-ratelimit-* headers, and so does a
// refusal. Admitting and settling a request allocates nothing of its own.
//
// Either part may be absent: without a Controller requests are not charged
// to a tenant (the Gate queues them by Identity.Tier alone); the zero
// value admits everything.
type TenantAdmitter struct {
	c    *admission.Controller
	g    *admission.Gate
	pool sync.Pool // *tenantAdmission
}

// NewTenantAdmitter returns an admitter over c and g, either of which may
// be nil.
func NewTenantAdmitter(c *admission.Controller, g *admission.Gate) *TenantAdmitter {
	return &TenantAdmitter{c: c, g: g}
}

// Admit reserves the request's share of its tenant's limits, then takes a
// slot of the pool, waiting in its queue while the pool is saturated. A
// refusal is a *GatewayError (429, 503 or 401, from the admission.Refusal);
// when ctx ends while the request waits, ctx's error is returned (the
// client-gone or stream_timeout answer).
func (a *TenantAdmitter) Admit(ctx context.Context, id Identity, info RequestInfo) (Admission, error) {
	adm, _, err := a.admit(ctx, id, info, true)
	return adm, err
}

// AdmitNoWait implements PoolAdmitter: Admit, but a request that finds the
// pool without a free slot is admitted by its tenant's limits alone, with
// saturated true, for the degradation ladder to place.
func (a *TenantAdmitter) AdmitNoWait(ctx context.Context, id Identity, info RequestInfo) (Admission, bool, error) {
	return a.admit(ctx, id, info, false)
}

func (a *TenantAdmitter) admit(ctx context.Context, id Identity, info RequestInfo, wait bool) (Admission, bool, error) {
	if a.c == nil && a.g == nil {
		return nil, false, nil
	}
	ad, _ := a.pool.Get().(*tenantAdmission)
	if ad == nil {
		ad = new(tenantAdmission)
	}
	ad.owner, ad.reserved, ad.slotted, ad.decided, ad.waited, ad.tenant = a, false, false, false, 0, id.Tenant
	admitted := false
	defer func() {
		if !admitted && ad.reserved {
			ad.ticket.Cancel() // a panic in the gate: nothing stays taken
		}
	}()

	tier := admission.Tier{Name: id.Tier}
	if a.c != nil {
		req := admission.Request{Tenant: id.Tenant, Tier: id.Tier, PromptTokens: info.PromptTokens, N: info.N}
		if info.MaxTokensSet {
			req.MaxTokens = info.MaxTokens
		}
		if r := a.c.ReserveInto(&ad.ticket, req); r != nil {
			err := refusalError(r, r.Limits, 0)
			a.pool.Put(ad)
			admitted = true // nothing to cancel
			return nil, false, err
		}
		ad.reserved = true
		tier = ad.ticket.Tier()
	}
	ad.tier = tier
	if a.g != nil {
		if !wait {
			if !a.g.TryAcquireSlot(id.Tenant, tier, ad.spare()) {
				admitted = true
				return ad, true, nil
			}
			ad.swap()
			ad.decided = true
		} else if err := ad.queue(ctx, a.g); err != nil {
			admitted = true // cancelled by queue
			a.pool.Put(ad)
			return nil, false, err
		}
	}
	admitted = true
	return ad, false, nil
}

// queue takes a slot of g, waiting in its queue, and gives back the slot
// held before, if any; a refusal cancels the tenant's reservation (a
// refused request consumes nothing) and is returned as the gateway's
// error.
func (ad *tenantAdmission) queue(ctx context.Context, g *admission.Gate) error {
	acquire := g.AcquireSlot
	if ad.decided {
		acquire = g.AcquireMovedSlot
	}
	waited, err := acquire(ctx, ad.tenant, ad.tier, ad.spare())
	ad.waited += waited
	if err == nil {
		ad.swap()
		ad.decided = true
		return nil
	}
	var lim admission.Limits
	if ad.reserved {
		ad.ticket.Cancel()
		ad.reserved = false
		lim = unreserved(ad.ticket.Limits(), ad.ticket.Reserved())
	}
	if r, ok := errors.AsType[*admission.Refusal](err); ok {
		if r.Limits.Requests != nil || r.Limits.Tokens != nil {
			lim = r.Limits
		}
		return refusalError(r, lim, ad.waited)
	}
	return &waitError{err: err, waited: ad.waited}
}

// Queue implements PoolAdmission: a slot of the admitter's own pool, and
// the reservation recomputed for info where it fits (the request was
// admitted with it: settlement corrects one that did not fit back).
func (ad *tenantAdmission) Queue(ctx context.Context, info RequestInfo) error {
	if ad.owner.g == nil {
		ad.release()
		ad.resize(info)
		return nil
	}
	if err := ad.queue(ctx, ad.owner.g); err != nil {
		return err
	}
	ad.resize(info)
	return nil
}

// MoveTo implements PoolAdmission.
func (ad *tenantAdmission) MoveTo(ctx context.Context, g *admission.Gate, info RequestInfo, wait bool) error {
	if g != nil {
		if !wait {
			// A request whose admission was counted at its first pool is
			// not counted again here.
			try := g.TryAcquireSlot
			if ad.decided {
				try = g.TryAcquireMovedSlot
			}
			if !try(ad.tenant, ad.tier, ad.spare()) {
				return &GatewayError{Status: 429, Type: TypeRateLimit, Code: admission.CodeSaturated,
					Message: "its capacity is full"}
			}
		} else {
			waited, err := g.AcquireMovedSlot(ctx, ad.tenant, ad.tier, ad.spare())
			ad.waited += waited
			if err != nil {
				if r, ok := errors.AsType[*admission.Refusal](err); ok {
					return &GatewayError{Status: r.Status, Type: TypeRateLimit, Code: r.Code, Message: r.Message}
				}
				return err
			}
		}
	}
	if r := ad.resize(info); r != nil {
		if g != nil {
			ad.spare().Release()
		}
		return refusalError(r, ad.ticket.Limits(), 0)
	}
	if g != nil {
		ad.swap()
		ad.decided = true
	} else {
		ad.release()
	}
	return nil
}

// resize recomputes the reservation for info's max_tokens.
func (ad *tenantAdmission) resize(info RequestInfo) *admission.Refusal {
	if !ad.reserved || !info.MaxTokensSet {
		return nil
	}
	return ad.ticket.Resize(info.MaxTokens, info.N)
}

// spare is the slot not held, where the next pool's place is taken.
func (ad *tenantAdmission) spare() *admission.Slot { return &ad.slots[1-ad.cur] }

// swap makes the spare slot, just taken, the held one, giving back the one
// held before.
func (ad *tenantAdmission) swap() {
	ad.release()
	ad.cur = 1 - ad.cur
	ad.slotted = true
}

// release gives back the slot held, if any.
func (ad *tenantAdmission) release() {
	if ad.slotted {
		ad.slots[ad.cur].Release()
		ad.slotted = false
	}
}

// tenantAdmission is an admitted request's ticket and pool slot. It is
// pooled: finish calls Release exactly once and nothing uses it after.
type tenantAdmission struct {
	owner    *TenantAdmitter
	ticket   admission.Ticket
	reserved bool // ticket holds a reservation
	// slots[cur] is the pool gate's place, held while slotted; the other
	// takes the next pool's place before this one is given back (the
	// degradation ladder moves a request only where it fits).
	slots   [2]admission.Slot
	cur     int
	slotted bool
	// decided: the request's admission decision was counted (at the first
	// pool that took it); a move does not count another.
	decided bool
	waited  time.Duration
	// tenant and tier are whom the slot is taken for (the ladder moves it).
	tenant string
	tier   admission.Tier
}

// Release settles the ticket with what the request used (Result.Settlement),
// the verdict its outcome says about the tenant, the committed attempt's
// TTFT and the queue wait, then gives back the pool slot.
func (ad *tenantAdmission) Release(res *Result) {
	if ad.reserved {
		prompt, completion, estimated := res.Settlement()
		u := admission.Usage{PromptTokens: prompt, CompletionTokens: completion, Estimated: estimated,
			Verdict: verdict(res), API: res.API}
		if res.Committed {
			u.TTFT = res.AttemptTTFT
		}
		ad.ticket.Settle(u, ad.waited)
	}
	ad.release()
	owner := ad.owner
	ad.owner, ad.slotted, ad.reserved = nil, false, false
	owner.pool.Put(ad)
}

// QueueWait is the time the request waited in the pool's queue.
func (ad *tenantAdmission) QueueWait() time.Duration { return ad.waited }

// SetHeader sets the tenant's x-ratelimit-* headers, this request counted.
func (ad *tenantAdmission) SetHeader(h http.Header) {
	if ad.reserved {
		setRateLimitHeaders(h, ad.ticket.Limits())
	}
}

// verdict is what a finished request says of its tenant (DESIGN §4, tenant
// column): its own 4xx is a failure, a complete response a success, and
// everything else — upstream faults, the client leaving, stream_timeout,
// a gateway panic — nothing.
func verdict(res *Result) admission.Verdict {
	switch {
	case res.TenantFault:
		return admission.VerdictFailure
	case res.Outcome == OutcomeSuccess:
		return admission.VerdictSuccess
	}
	return admission.VerdictNeutral
}

// unreserved returns lim as it is without a cancelled request: one request
// and reserved tokens more remaining (never above the limit).
func unreserved(lim admission.Limits, reserved int) admission.Limits {
	if l := lim.Requests; l != nil {
		c := *l
		c.Remaining = min(c.Remaining+1, c.Limit)
		lim.Requests = &c
	}
	if l := lim.Tokens; l != nil {
		c := *l
		c.Remaining = min(c.Remaining+reserved, c.Limit)
		lim.Tokens = &c
	}
	return lim
}

// refusalError turns admission's no into the gateway's error response:
// its status, code and message; Retry-After in whole seconds rounded up
// when waiting helps; X-Circuit-Breaker: open for an open tenant breaker;
// the x-ratelimit-* headers of lim.
func refusalError(r *admission.Refusal, lim admission.Limits, waited time.Duration) error {
	ge := &GatewayError{Status: r.Status, Code: r.Code, Message: r.Message, Header: http.Header{}}
	if ge.Status == 0 {
		ge.Status = http.StatusTooManyRequests
	}
	switch {
	case ge.Status == http.StatusTooManyRequests:
		ge.Type = TypeRateLimit
	case ge.Status >= 500:
		ge.Type = TypeServer
	default:
		ge.Type = TypeInvalidRequest
	}
	if r.RetryAfter > 0 {
		ge.RetryAfter = int(ceilSeconds(r.RetryAfter) / time.Second)
	}
	if r.CircuitOpen {
		ge.Header.Set("X-Circuit-Breaker", "open")
	}
	setRateLimitHeaders(ge.Header, lim)
	if waited > 0 {
		return &waitError{err: ge, waited: waited}
	}
	return ge
}

// waitError is a refusal that came after a wait in the queue.
type waitError struct {
	err    error
	waited time.Duration
}

func (e *waitError) Error() string            { return e.err.Error() }
func (e *waitError) Unwrap() error            { return e.err }
func (e *waitError) QueueWait() time.Duration { return e.waited }

// The x-ratelimit-* header keys, canonical.
var (
	hdrLimitRequests     = http.CanonicalHeaderKey("x-ratelimit-limit-requests")
	hdrRemainingRequests = http.CanonicalHeaderKey("x-ratelimit-remaining-requests")
	hdrResetRequests     = http.CanonicalHeaderKey("x-ratelimit-reset-requests")
	hdrLimitTokens       = http.CanonicalHeaderKey("x-ratelimit-limit-tokens")
	hdrRemainingTokens   = http.CanonicalHeaderKey("x-ratelimit-remaining-tokens")
	hdrResetTokens       = http.CanonicalHeaderKey("x-ratelimit-reset-tokens")
)

// setRateLimitHeaders sets OpenAI's x-ratelimit-* headers for the limits
// the tenant has (rpm: -requests, tpm: -tokens), none for one it has not:
// the limit, what remains (never below 0) and the time until it is fully
// available again as a Go duration rounded up to whole seconds ("1s",
// "6m0s").
//
// Two allocations whatever the limits: the values are formatted into one
// string and sliced from it, in one backing array of slices.
func setRateLimitHeaders(h http.Header, lim admission.Limits) {
	var (
		buf  [128]byte
		keys [6]string
		ends [6]int
		n    int
	)
	b := buf[:0]
	end := func(key string) {
		keys[n], ends[n] = key, len(b)
		n++
	}
	if l := lim.Requests; l != nil {
		b = strconv.AppendInt(b, int64(l.Limit), 10)
		end(hdrLimitRequests)
		b = strconv.AppendInt(b, int64(max(l.Remaining, 0)), 10)
		end(hdrRemainingRequests)
		b = appendSeconds(b, ceilSeconds(l.Reset))
		end(hdrResetRequests)
	}
	if l := lim.Tokens; l != nil {
		b = strconv.AppendInt(b, int64(l.Limit), 10)
		end(hdrLimitTokens)
		b = strconv.AppendInt(b, int64(max(l.Remaining, 0)), 10)
		end(hdrRemainingTokens)
		b = appendSeconds(b, ceilSeconds(l.Reset))
		end(hdrResetTokens)
	}
	if n == 0 {
		return
	}
	s := string(b)
	vals := make([]string, n)
	from := 0
	for i := range n {
		vals[i] = s[from:ends[i]]
		h[keys[i]] = vals[i : i+1 : i+1]
		from = ends[i]
	}
}

// appendSeconds appends d as time.Duration.String formats it ("0s", "59s",
// "6m0s", "1h0m0s"), without allocating when d is whole seconds.
func appendSeconds(b []byte, d time.Duration) []byte {
	if d < 0 || d%time.Second != 0 {
		return append(b, d.String()...)
	}
	s := int64(d / time.Second)
	if s >= 3600 {
		b = strconv.AppendInt(b, s/3600, 10)
		b = append(b, 'h')
	}
	if s >= 60 {
		b = strconv.AppendInt(b, s%3600/60, 10)
		b = append(b, 'm')
	}
	b = strconv.AppendInt(b, s%60, 10)
	return append(b, 's')
}

// The anthropic-ratelimit-* header keys, canonical, each beside the
// x-ratelimit-* key it is derived from.
var anthropicRateLimit = [...]struct{ from, limit, remaining, reset string }{
	{
		from:      hdrLimitRequests,
		limit:     http.CanonicalHeaderKey("anthropic-ratelimit-requests-limit"),
		remaining: http.CanonicalHeaderKey("anthropic-ratelimit-requests-remaining"),
		reset:     http.CanonicalHeaderKey("anthropic-ratelimit-requests-reset"),
	},
	{
		from:      hdrLimitTokens,
		limit:     http.CanonicalHeaderKey("anthropic-ratelimit-tokens-limit"),
		remaining: http.CanonicalHeaderKey("anthropic-ratelimit-tokens-remaining"),
		reset:     http.CanonicalHeaderKey("anthropic-ratelimit-tokens-reset"),
	},
}

// setAnthropicRateLimitHeaders adds to h, for each x-ratelimit-*-requests
// and -tokens set it holds, Anthropic's forms
// (docs.anthropic.com/en/api/rate-limits):
// anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}, the
// reset as an RFC 3339 time (now plus the x-ratelimit reset duration,
// UTC, rounded up to whole seconds). A tenant without a limit gets none.
func setAnthropicRateLimitHeaders(h http.Header, now time.Time) {
	for i, k := range anthropicRateLimit {
		lim := h.Get(k.from)
		if lim == "" {
			continue
		}
		rem, reset := hdrRemainingRequests, hdrResetRequests
		if i == 1 {
			rem, reset = hdrRemainingTokens, hdrResetTokens
		}
		d, _ := time.ParseDuration(h.Get(reset))
		h.Set(k.limit, lim)
		h.Set(k.remaining, h.Get(rem))
		h.Set(k.reset, now.Add(d+time.Second-1).UTC().Truncate(time.Second).Format(time.RFC3339))
	}
}

// ceilSeconds rounds d up to whole seconds; 0 and below are 0.
func ceilSeconds(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return (d + time.Second - 1) / time.Second * time.Second
}

// Interface guards.
var (
	_ Admitter        = (*TenantAdmitter)(nil)
	_ HeaderAdmission = (*tenantAdmission)(nil)
	_ QueueWaiter     = (*tenantAdmission)(nil)
	_ PoolAdmitter    = (*TenantAdmitter)(nil)
	_ PoolAdmission   = (*tenantAdmission)(nil)
)
