package proxy

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/api"
)

// Pool is a set of upstreams that a request can be served from, with its
// own balancer (breakers, saturation), retry budget, hedging and capacity:
// a bulkhead, so that a flood to one pool cannot starve another. The
// primary pool is Config's Balancer, Retries and Hedging, its capacity the
// Admitter's; a Fallback carries its own.
type Pool struct {
	// Balancer picks the pool's upstreams. Required.
	Balancer Balancer
	// Retries is the pool's retry budget and backoff; nil retries at once
	// within MaxAttempts.
	Retries Retries
	// Hedging is the pool's hedging; nil disables it.
	Hedging Hedging
	// Gate is the pool's capacity and priority queue; nil is none.
	Gate *admission.Gate
	// Headers is what the pool's attempts change in the request and
	// response headers (header_up, header_down, the client's keys); the
	// zero value changes nothing but removing the keys.
	Headers Headers
}

// FallbackWhen says which failures of the pools above a Fallback send
// requests to it.
type FallbackWhen uint8

const (
	// WhenUnavailable: no upstream of the pools above can take the request
	// (breakers open, every upstream busy, attempts spent on retryable
	// failures, upstream 429), before commit.
	WhenUnavailable FallbackWhen = 1 << iota
	// WhenSaturated: the primary pool has no free capacity now (its
	// capacity, or its saturation signal), so a tier allowed here is sent
	// to the fallback at once instead of queueing for the primary.
	WhenSaturated
)

// Reasons of a degradation: the "reason" label of
// caddy_llm_proxy_degraded_total.
const (
	DegradeUnavailable = "unavailable"
	DegradeSaturated   = "saturated"
)

// HeaderDegraded is the response header of a degraded answer (DESIGN §5):
// "fallback=<name>[; model=<m>][; <limit field>=<n>[; thinking_budget=<n>
// | ; thinking=off]]", where the limit field is the one the API's server
// reads (max_tokens, max_completion_tokens, max_output_tokens) and the
// thinking part says how a Messages request's extended thinking was cut
// to fit the clamped max_tokens.
const HeaderDegraded = "X-LLM-Proxy-Degraded"

// Fallback is one rung of the degradation ladder (DESIGN §10): a pool that
// serves the tiers allowed to degrade when the pools above it cannot,
// possibly with a smaller model and a clamped max_tokens. Fallbacks are
// tried in order, only before commit. A tenant's own limits never send a
// request here: admission refuses it before any pool is tried.
type Fallback struct {
	// Name names the fallback in the degraded header, metrics and errors.
	Name string
	// Pool is where the fallback sends requests. Its Balancer is required.
	Pool
	// Model, when set, replaces the request body's "model".
	Model string
	// ContextWindow, when positive, is the fallback model's context in
	// tokens: a request whose prompt estimate leaves no room in it is not
	// sent here (zero calls), and max_tokens is clamped to what is left.
	ContextWindow int
	// MaxOutputTokens, when positive, caps max_tokens (or
	// max_completion_tokens).
	MaxOutputTokens int
	// When is which failures of the pools above send requests here; 0 is
	// WhenUnavailable.
	When FallbackWhen
	// Tiers lists the tiers that may degrade here; empty is every tier.
	Tiers []string
}

// allows reports whether requests of tier may degrade to f.
func (f *Fallback) allows(tier string) bool {
	return len(f.Tiers) == 0 || slices.Contains(f.Tiers, tier)
}

// rewrites reports whether the request body is edited for f.
func (f *Fallback) rewrites(setMax bool) bool { return f.Model != "" || setMax }

// when returns f.When with its default.
func (f *Fallback) when() FallbackWhen {
	if f.When == 0 {
		return WhenUnavailable
	}
	return f.When
}

// Clamp returns the max_tokens (per sequence) that a request described by
// info is sent to f with: min(requested, MaxOutputTokens, ContextWindow −
// prompt estimate), each bound applying when set; set is false when f
// leaves max_tokens as the client sent it (no bound applies, or the
// request's own is already within them). fits is false when the prompt
// estimate leaves no room in f's context window: the request is not sent
// to f at all.
func (f *Fallback) Clamp(info RequestInfo) (maxTokens int, set, fits bool) {
	limit := -1
	if f.ContextWindow > 0 {
		room := f.ContextWindow - max(info.PromptTokens, 0)
		if room <= 0 {
			return 0, false, false
		}
		limit = room
	}
	if m := f.MaxOutputTokens; m > 0 && (limit < 0 || m < limit) {
		limit = m
	}
	switch {
	case limit < 0:
		return info.MaxTokens, false, true
	case info.MaxTokensSet && info.MaxTokens <= limit:
		return info.MaxTokens, false, true
	}
	return limit, true, true
}

// rewriteBody returns body, a request of API a parsed as info, as f's
// upstreams get it, and the Request that describes it: "model" replaced
// by model when set, and a's output-limit fields (api.Request.
// SetOutputLimit: Chat's max_completion_tokens and max_tokens, whichever
// the client sent, max_tokens when it sent neither; Responses'
// max_output_tokens; Messages' and Completions' max_tokens) set to
// maxTokens when setMax (an API without one, api.None, is not clamped).
// A Messages request's extended thinking is kept below the new
// max_tokens (api.Request.ClampThinking). Every other byte is as the
// client sent it; an empty body is left empty. The edits go where info's
// parse found the fields, without walking the body again.
//
// note is what the clamp changed, for the X-LLM-Proxy-Degraded header:
// "<field>=<n>" naming the field the server reads (the first of a's
// fields that was set: max_completion_tokens when a Chat client sent it),
// then "; thinking_budget=<n>" or "; thinking=off" when the thinking
// budget was lowered or removed; "" when setMax is false.
func rewriteBody(body []byte, info RequestInfo, a api.API, model string, maxTokens int, setMax bool) (out []byte, rinfo RequestInfo, note string, err error) {
	setMax = setMax && len(a.OutputLimitFields()) > 0
	if (model == "" && !setMax) || len(body) == 0 {
		return body, info, "", nil
	}
	out = body
	if model != "" {
		if out, err = info.SetModel(out, model); err != nil {
			return nil, info, "", err
		}
	}
	if setMax {
		var field string
		if out, field, err = info.SetOutputLimit(out, a, maxTokens); err != nil {
			return nil, info, "", err
		}
		note = field + "=" + strconv.Itoa(maxTokens)
		if a == api.Messages {
			var th string
			if out, th, err = info.ClampThinking(out, maxTokens); err != nil {
				return nil, info, "", err
			}
			if th != "" {
				note += "; " + th
			}
		}
	}
	return out, info, note, nil
}

// degradedHeader is the X-LLM-Proxy-Degraded value of a request sent to f
// with model (when f rewrites it) and rewriteBody's note:
// "fallback=<name>[; model=<m>][; <limit field>=<n>[; thinking_budget=<n>
// | ; thinking=off]]".
func degradedHeader(f *Fallback, note string) string {
	var b strings.Builder
	b.WriteString("fallback=")
	b.WriteString(f.Name)
	if f.Model != "" {
		b.WriteString("; model=")
		b.WriteString(f.Model)
	}
	if note != "" {
		b.WriteString("; ")
		b.WriteString(note)
	}
	return b.String()
}

// PoolAdmitter is an Admitter that can also place admitted requests in the
// ladder's pools. *TenantAdmitter is one.
type PoolAdmitter interface {
	Admitter
	// AdmitNoWait is Admit, except that when the primary pool has no free
	// slot now the request is admitted by its tenant's limits without a
	// slot (saturated true) rather than queued or shed: the ladder offers
	// it to a fallback, or queues it for the primary (PoolAdmission.Queue).
	// The Admission is then a PoolAdmission.
	AdmitNoWait(ctx context.Context, id Identity, info RequestInfo) (adm Admission, saturated bool, err error)
}

// PoolAdmission is an Admission that the ladder moves between pools.
type PoolAdmission interface {
	Admission
	// Queue takes a slot of the primary pool for the request described by
	// info (the client's own: its reservation is recomputed for it), giving
	// back any other slot it holds, waiting in the primary's queue (or shed
	// by priority) as Admit would. A refusal is returned as Admit returns
	// it, with the tenant's reservation cancelled (it consumed nothing).
	Queue(ctx context.Context, info RequestInfo) error
	// MoveTo takes a slot of g (nil: a pool without capacity), at once
	// (wait false: a *GatewayError when none is free) or waiting in g's
	// queue, then recomputes the tenant's reservation for info (the
	// clamped max_tokens), and only then gives back the slot held before.
	// A refusal at either step leaves the admission as it was: the
	// request is not sent to that pool.
	MoveTo(ctx context.Context, g *admission.Gate, info RequestInfo, wait bool) error
}

// rung is the pool a request is being served from: the primary (fb nil,
// index -1) or a fallback.
type rung struct {
	index  int
	fb     *Fallback
	pool   *Pool
	reason string
}

// degradable reports whether the request's failure may descend the ladder:
// no upstream of the pool could take it (no upstream at all, or attempts
// spent on retryable failures), and neither the client nor stream_timeout
// ended it.
func (x *exchange) degradable(f *failure) bool {
	if f == nil || f.ctxErr != nil || x.clientGone() || x.ctx.Err() != nil {
		return false
	}
	if f.last == nil {
		return errors.Is(f.pickErr, ErrNoUpstream)
	}
	return f.last.outcome.Retryable() && f.last.outcome != AttemptInternalError
}

// degrade is the ladder's step for a request whose pool failed it (why is
// DegradeUnavailable) or is saturated (DegradeSaturated, before any
// attempt): it moves the request to the next fallback below the current
// rung that takes such requests, allows the tier, fits the prompt and has
// room, and reports whether it did. Each fallback passed over for a reason
// of its own leaves a note for the client's error message.
func (x *exchange) degrade(why string) bool {
	fbs := x.p.cfg.Fallbacks
	want := WhenUnavailable
	if why == DegradeSaturated {
		want = WhenSaturated
	}
	if x.client == nil {
		x.client = &clientRequest{body: x.body, info: x.result.Info}
	}
	if f := x.failure; f != nil && f.last == nil && f.pickErr != nil {
		x.noteUnavailable(f.pickErr)
	}
	for i := x.rung.index + 1; i < len(fbs); i++ {
		f := &fbs[i]
		if f.when()&want == 0 || (i < 64 && x.tried&(1<<i) != 0) {
			continue
		}
		if tier := x.result.Identity.Tier; !f.allows(tier) {
			x.refuseFallback(f, fmt.Sprintf("tier %q may not degrade to it", tier))
			continue
		}
		maxTokens, setMax, fits := f.Clamp(x.client.info)
		// An API without an output limit (api.None) is sent unclamped.
		setMax = setMax && len(x.api.OutputLimitFields()) > 0
		if !fits {
			x.refuseFallback(f, fmt.Sprintf("the prompt estimate of %d tokens does not fit its context_window of %d",
				x.client.info.PromptTokens, f.ContextWindow))
			continue
		}
		body, info, note, err := rewriteBody(x.client.body, x.client.info, x.api, f.Model, maxTokens, setMax)
		if err != nil {
			x.refuseFallback(f, "the request body cannot be rewritten: "+err.Error())
			continue
		}
		// The rewritten copy is memory too: charged to the body budget
		// until commit or the request's end, as the client's body is.
		// Counted in fbCharged at once, so that finish gives it back
		// whatever happens (a panic in movePool).
		var charged int64
		if b := x.p.cfg.BodyBudget; b != nil && f.rewrites(setMax) {
			charged = int64(cap(body))
			if err := b.acquire(x.ctx, x.p.clock, charged); err != nil {
				x.refuseFallback(f, "no body memory for its rewritten request (max_buffered_bodies)")
				continue
			}
			x.fbCharged += charged
		}
		// A fallback is taken only with room now: the request has waited
		// for the pools above already.
		if !x.movePool(f, info) {
			if charged > 0 {
				x.fbCharged -= charged
				x.p.cfg.BodyBudget.release(charged)
			}
			continue
		}
		if i < 64 {
			x.tried |= 1 << i
		}
		x.body, x.result.Info = body, info
		x.rung = rung{index: i, fb: f, pool: &f.Pool, reason: why}
		x.result.Degraded, x.result.Fallback, x.result.DegradeReason = degradedHeader(f, note), f.Name, why
		x.failure = nil
		return true
	}
	return false
}

// movePool moves the request's admission to f's pool: a slot of f's
// capacity if one is free now, and its tenant's reservation recomputed for
// info. It reports false, with a note, when the request does not fit
// there; its admission is then as it was.
func (x *exchange) movePool(f *Fallback, info RequestInfo) bool {
	pa, ok := x.admission.(PoolAdmission)
	if !ok {
		if f.Gate != nil {
			// Admitted without a PoolAdmitter: f's capacity cannot be
			// charged, so f is not used.
			x.refuseFallback(f, "its capacity cannot be checked")
			return false
		}
		return true
	}
	if err := pa.MoveTo(x.ctx, f.Gate, info, false); err != nil {
		msg := err.Error()
		if ge, ok := errors.AsType[*GatewayError](err); ok {
			msg = ge.Message
		}
		x.refuseFallback(f, msg)
		return false
	}
	if qw, ok := x.admission.(QueueWaiter); ok {
		x.result.QueueWait = qw.QueueWait()
	}
	return true
}

// clientRequest is the request as the client sent it, and what the ladder's
// rungs said of it on the way down.
type clientRequest struct {
	body []byte
	info RequestInfo
	// openRetry is the earliest Retry-After of a rung passed because its
	// breakers were open (0: none): the 503 at the ladder's foot says
	// when the first pool may take requests again, not the last.
	openRetry time.Duration
}

// noteUnavailable keeps what the current rung's pool said when none of its
// upstreams could take the request: a note for the client's message, and
// its Retry-After when its breakers were open.
func (x *exchange) noteUnavailable(err error) {
	name := "the primary pool"
	if x.rung.fb != nil {
		name = "fallback " + x.rung.fb.Name
	}
	if len(x.p.cfg.Fallbacks) > 0 {
		// Without fallbacks the client's message is this pool's own:
		// a note would say it twice, and name a "primary" of nothing.
		x.notes = append(x.notes, name+": "+err.Error())
	}
	if ue, ok := errors.AsType[*UnavailableError](err); ok && ue.CircuitOpen && ue.RetryAfter > 0 &&
		(x.client.openRetry == 0 || ue.RetryAfter < x.client.openRetry) {
		x.client.openRetry = ue.RetryAfter
	}
}

// backToPrimary is the ladder's last step for a request that a fallback
// took from a saturated primary and then failed before commit, with no
// fallback below to take it: the request goes back to the primary, as the
// client sent it, and waits in its queue (or is shed) as it would have
// without the ladder. It reports whether the request may be attempted
// again; a refusal is recorded as the request's answer.
func (x *exchange) backToPrimary() bool {
	if x.rung.reason != DegradeSaturated || x.client == nil {
		return false
	}
	pa, ok := x.admission.(PoolAdmission)
	if !ok {
		return false
	}
	if err := pa.Queue(x.ctx, x.client.info); err != nil {
		x.refusal = err
		x.failure = nil
		return false
	}
	if qw, ok := x.admission.(QueueWaiter); ok {
		x.result.QueueWait = qw.QueueWait()
	}
	x.notes = append(x.notes, fmt.Sprintf("fallback %s failed: %s", x.rung.fb.Name, x.failureReason()))
	x.body, x.result.Info = x.client.body, x.client.info
	x.rung = rung{index: -1, pool: &x.p.primary}
	x.result.Degraded, x.result.Fallback, x.result.DegradeReason = "", "", ""
	x.failure = nil
	return true
}

// failureReason says in a few words why the last pool failed.
func (x *exchange) failureReason() string {
	f := x.failure
	switch {
	case f == nil:
		return "no answer"
	case f.last != nil:
		return f.last.outcome.String()
	case f.pickErr != nil:
		return f.pickErr.Error()
	}
	return "no answer"
}

// refuseFallback notes why fallback f was not used.
func (x *exchange) refuseFallback(f *Fallback, why string) {
	x.notes = append(x.notes, fmt.Sprintf("fallback %s refused: %s", f.Name, why))
}

// withNotes returns msg with the ladder's notes appended.
func (x *exchange) withNotes(msg string) string {
	if len(x.notes) == 0 {
		return msg
	}
	return msg + "; " + strings.Join(x.notes, "; ")
}
