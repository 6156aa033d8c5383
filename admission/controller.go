package admission

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// controllerState is the Controller's fields (the type is declared in
// api.go, the contract).
type controllerState struct {
	snap    atomic.Pointer[snapshot]
	setMu   sync.Mutex // serializes SetConfig
	clock   clock.Clock
	obs     Observer
	rand    func() float64 // breaker cooldown jitter; tests fix it
	base    time.Time      // epoch 0 of every tenant's window
	tenants tenantSet
	store   atomic.Pointer[storeBox] // nil: the tenants' own counts
	// brkStore is the tenant breakers' store (SetBreakerStore).
	brkStore atomic.Pointer[brkStoreBox]
}

func newController(cfg Config, clk clock.Clock, obs Observer) (*Controller, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	clk = clock.Or(clk)
	if obs == nil {
		obs = nopObserver{}
	}
	c := &Controller{}
	c.clock, c.obs, c.rand = clk, obs, rand.Float64
	c.base = clk.Now()
	c.tenants.init()
	c.snap.Store(newSnapshot(cfg))
	return c, nil
}

func (c *Controller) setConfig(cfg Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	c.setMu.Lock()
	defer c.setMu.Unlock()
	snap := newSnapshot(cfg)
	c.snap.Store(snap)
	c.repin(snap)
	return nil
}

func (c *Controller) tier(tenant, tier string) (Tier, bool) {
	ti, lim, ok := c.snap.Load().resolve(tenant, tier)
	if !ok {
		return Tier{}, false
	}
	return ti.effective(lim), true
}

// satAdd and satMul keep token arithmetic on client-supplied values
// (prompt size, n, max_tokens) from overflowing: they saturate at
// math.MaxInt64, which exceeds every limit.
func satAdd(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

func satMul(a, b int64) int64 {
	if a != 0 && b > math.MaxInt64/a {
		return math.MaxInt64
	}
	return a * b
}

// refusalBox holds a Refusal with the storage its Limits point to: one
// allocation per refusal.
type refusalBox struct {
	r        Refusal
	req, tok Limit
}

// limitsOf fills req and tok with the tenant's limits as d leaves them
// and returns the Limits pointing to them, nil for a limit the tenant does
// not have.
func limitsOf(d *Decision, lim limits, req, tok *Limit) Limits {
	var l Limits
	if lim.rpm > 0 {
		*req = Limit{Limit: lim.rpm, Remaining: int(max(0, int64(lim.rpm)-d.Requests)), Reset: d.ResetRequests}
		l.Requests = req
	}
	if lim.tpm > 0 {
		*tok = Limit{Limit: lim.tpm, Remaining: int(max(0, int64(lim.tpm)-d.Tokens)), Reset: d.ResetTokens}
		l.Tokens = tok
	}
	return l
}

// applied returns lim with the limits a store applied in its place (a
// fleet store's local fallback divides them).
func (d *Decision) applied(lim limits) limits {
	if d.MaxConcurrent > 0 {
		lim.maxConc = d.MaxConcurrent
	}
	if d.RPM > 0 {
		lim.rpm = d.RPM
	}
	if d.TPM > 0 {
		lim.tpm = d.TPM
	}
	return lim
}

// retryIn formats d for messages, rounded up to the second ("12s", "1m0s").
func retryIn(d time.Duration) string {
	if d <= 0 {
		return "0s"
	}
	return ((d + time.Second - 1) / time.Second * time.Second).String()
}

// quotaOf fills q with what req asks of limits lim.
func quotaOf(q *Quota, tenant string, ti *tierInfo, lim limits, req *Request) {
	est := int64(max(req.PromptTokens, 0))
	n := int64(max(req.N, 1))
	per := int64(req.MaxTokens)
	explicit := per > 0
	if !explicit {
		per = int64(ti.DefaultMaxTokens)
	}
	*q = Quota{Tenant: tenant, Tier: ti.Name, MaxConcurrent: lim.maxConc, RPM: lim.rpm, TPM: lim.tpm,
		Prompt: est, Need: satAdd(est, satMul(n, per)), Explicit: explicit, FailClosed: ti.FailClosed}
}

// counts are one tenant's local limit state: its requests in flight and
// its rolling minute. The owner's lock guards them.
type counts struct {
	inflight int
	win      minuteWindow
}

// decideLocked applies q's limits in order (max_concurrent, rpm, tpm) at
// now and, if they all pass, counts the request and its reservation. It
// fills the zero d with the decision and the window's counts for the
// x-ratelimit-* headers, and returns the epoch the request is counted in.
// It allocates nothing.
func decideLocked(c *counts, q *Quota, now time.Time, d *Decision) (ep int64) {
	ep = c.win.advance(now)
	switch {
	case q.MaxConcurrent > 0 && c.inflight >= q.MaxConcurrent:
		d.Code, d.RetryAfter = CodeTenantConcurrency, time.Second
	case q.RPM > 0 && c.win.reqs+1 > int64(q.RPM):
		d.Code, d.RetryAfter = CodeTenantRPM, c.win.until(now, fieldReqs, int64(q.RPM)-1)
	case q.TPM > 0:
		tpm := int64(q.TPM)
		d.Left = tpm - c.win.toks
		switch {
		case q.Explicit && q.Need > tpm, !q.Explicit && q.Prompt > tpm:
			// Waiting cannot help: it never fits the whole limit.
			d.Code = CodeRequestExceedsLimit
		case q.Explicit && q.Need > d.Left:
			d.Code, d.RetryAfter = CodeTenantTPM, c.win.until(now, fieldToks, tpm-q.Need)
		case !q.Explicit && d.Left < max(q.Prompt, 1):
			// Capped at what is left, it must still hold the prompt.
			d.Code, d.RetryAfter = CodeTenantTPM, c.win.until(now, fieldToks, tpm-max(q.Prompt, 1))
		default:
			d.Reserved = min(q.Need, d.Left)
		}
	}
	if d.Code == "" {
		c.inflight++
		c.win.add(1, d.Reserved)
	}
	d.Requests, d.Tokens = c.win.reqs, c.win.toks
	if q.RPM > 0 {
		d.ResetRequests = c.win.reset(now, fieldReqs)
	}
	if q.TPM > 0 {
		d.ResetTokens = c.win.reset(now, fieldToks)
	}
	return ep
}

// refusal builds the Refusal of a refused decision d for tenant id, whose
// limits are lim (as the store applied them).
func (d *Decision) refusal(id string, lim limits, q *Quota, req *Request) *Refusal {
	b := &refusalBox{}
	b.r = Refusal{Status: 429, Code: d.Code, RetryAfter: d.RetryAfter}
	b.r.Limits = limitsOf(d, lim, &b.req, &b.tok)
	local := ""
	if d.Local {
		local = " (this gateway's share: the fleet's store is unreachable)"
	}
	switch d.Code {
	case CodeTenantConcurrency:
		b.r.Message = fmt.Sprintf("tenant %s: %d concurrent requests (max_concurrent) in flight%s; retry in %s", id, lim.maxConc, local, retryIn(d.RetryAfter))
	case CodeTenantRPM:
		b.r.Message = fmt.Sprintf("tenant %s: %d requests per minute (rpm) exceeded%s; retry in %s", id, lim.rpm, local, retryIn(d.RetryAfter))
	case CodeTenantTPM:
		what, need := "reservation of %d tokens", q.Need
		if !q.Explicit {
			what, need = "prompt of %d tokens", max(q.Prompt, 1)
		}
		b.r.Message = fmt.Sprintf("tenant %s: %d tokens per minute (tpm) exceeded%s: "+what+", %d left; retry in %s",
			id, lim.tpm, local, need, max(d.Left, 0), retryIn(d.RetryAfter))
	case CodeRequestExceedsLimit:
		if q.Explicit {
			b.r.Message = fmt.Sprintf("tenant %s: request needs %d tokens (prompt %d + %d × max_tokens %d), more than the whole limit of %d tokens per minute (tpm)",
				id, q.Need, max(req.PromptTokens, 0), max(req.N, 1), req.MaxTokens, lim.tpm)
		} else {
			b.r.Message = fmt.Sprintf("tenant %s: prompt of %d tokens exceeds the whole limit of %d tokens per minute (tpm)",
				id, max(req.PromptTokens, 0), lim.tpm)
		}
	case CodeFleetUnavailable:
		b.r.Status = 503
		b.r.Message = fmt.Sprintf("tenant %s: tier %s is fail_closed and the fleet's limits cannot be checked (redis unavailable); retry in %s",
			id, q.Tier, retryIn(d.RetryAfter))
	default:
		b.r.Message = fmt.Sprintf("tenant %s: refused by the limit store (%s); retry in %s", id, d.Code, retryIn(d.RetryAfter))
	}
	return &b.r
}

// reserve is Reserve into tk (see ReserveInto).
func (c *Controller) reserve(tk *Ticket, req *Request) *Refusal {
	snap := c.snap.Load()
	ti, lim, ok := snap.resolve(req.Tenant, req.Tier)
	if !ok {
		r := &Refusal{Status: 401, Code: CodeUnknownKey,
			Message: fmt.Sprintf("tenant %s: no tier (tier %q not configured, or tenant not listed and no default tier)", req.Tenant, req.Tier)}
		c.obs.Decision(req.Tenant, req.Tier, r.Code)
		return r
	}
	tk.hold.store = nil
	for {
		t := c.state(req.Tenant, snap)
		if t == nil {
			r := &Refusal{Status: 429, Code: CodeSaturated, RetryAfter: time.Second,
				Message: fmt.Sprintf("tenant %s: too many tenants active (%d not configured); retry in 1s", req.Tenant, MaxTenantStates)}
			c.obs.Decision(req.Tenant, ti.Name, r.Code)
			return r
		}
		if t.tier.Load() != ti {
			t.tier.Store(ti)
		}
		var p breaker.Permit
		b := c.breakerFor(t, ti)
		if b != nil {
			var allowed bool
			if p, allowed = b.Allow(); !allowed {
				r := c.circuitOpen(t, lim, b)
				c.obs.Decision(t.id, ti.Name, r.Code)
				return r
			}
		}
		var d Decision
		var ep int64
		if sb := c.store.Load(); sb != nil && (lim.maxConc > 0 || lim.rpm > 0 || lim.tpm > 0) {
			q := &tk.quota
			quotaOf(q, t.id, ti, lim, req)
			var retry bool
			if d, retry = c.reserveIn(sb.s, t, q, &tk.hold); retry {
				p.Done(breaker.Neutral, 0, "")
				continue
			}
			if d.Code != "" {
				return c.refuse(t, ti, d.applied(lim), &d, q, req, p)
			}
			tk.limits = limitsOf(&d, d.applied(lim), &tk.reqLim, &tk.tokLim)
		} else {
			var q Quota
			quotaOf(&q, t.id, ti, lim, req)
			now := c.clock.Now()
			t.mu.Lock()
			if t.evicted {
				t.mu.Unlock()
				p.Done(breaker.Neutral, 0, "")
				continue
			}
			ep = decideLocked(&t.counts, &q, now, &d)
			t.mu.Unlock()
			if d.Code != "" {
				return c.refuse(t, ti, lim, &d, &q, req, p)
			}
			tk.limits = limitsOf(&d, lim, &tk.reqLim, &tk.tokLim)
		}

		tk.c, tk.t, tk.ti, tk.lim = c, t, ti, lim
		tk.est = max(req.PromptTokens, 0)
		tk.reserved, tk.ep = d.Reserved, ep
		tk.permit = p
		tk.settled.Store(false)
		return nil
	}
}

// refuse answers a refused decision: the tenant breaker's probe slot is
// freed, the decision observed.
func (c *Controller) refuse(t *tenant, ti *tierInfo, lim limits, d *Decision, q *Quota, req *Request, p breaker.Permit) *Refusal {
	r := d.refusal(t.id, lim, q, req)
	p.Done(breaker.Neutral, 0, "") // a refused probe frees its slot
	c.obs.Decision(t.id, ti.Name, r.Code)
	return r
}

// reserveIn is reserve's step with a LimitStore: the tenant's state counts
// the request in flight first (so it is not evicted while the store holds
// it), then the store decides. retry is set when the state was evicted
// before it could count.
func (c *Controller) reserveIn(s LimitStore, t *tenant, q *Quota, h *Hold) (d Decision, retry bool) {
	t.mu.Lock()
	if t.evicted {
		t.mu.Unlock()
		return d, true
	}
	t.inflight++
	t.mu.Unlock()
	*h = Hold{}
	d = s.Reserve(q, h)
	if d.Code != "" {
		t.mu.Lock()
		t.inflight--
		t.mu.Unlock()
		*h = Hold{}
		return d, false
	}
	h.store = s
	return d, false
}

// circuitOpen is the refusal of an open (or fully probing half-open) tenant
// breaker: Retry-After is the remaining open time, at least a second.
func (c *Controller) circuitOpen(t *tenant, lim limits, b *breaker.Breaker) *Refusal {
	now := c.clock.Now()
	retry := time.Second
	if at := b.RetryAt(); at.Sub(now) > retry {
		retry = at.Sub(now)
	}
	bx := &refusalBox{}
	bx.r = Refusal{Status: 429, Code: CodeTenantCircuitOpen, RetryAfter: retry, CircuitOpen: true,
		Message: fmt.Sprintf("tenant %s: circuit breaker open (too many slow or failed requests); retry in %s", t.id, retryIn(retry))}
	t.mu.Lock()
	t.win.advance(now)
	d := Decision{Requests: t.win.reqs, Tokens: t.win.toks}
	if lim.rpm > 0 {
		d.ResetRequests = t.win.reset(now, fieldReqs)
	}
	if lim.tpm > 0 {
		d.ResetTokens = t.win.reset(now, fieldToks)
	}
	t.mu.Unlock()
	bx.r.Limits = limitsOf(&d, lim, &bx.req, &bx.tok)
	return &bx.r
}

func (c *Controller) tenantViews() []TenantView {
	snap := c.snap.Load()
	now := c.clock.Now()
	var vs []TenantView
	c.tenants.each(func(t *tenant) {
		v := TenantView{Tenant: t.id, Queued: int(t.queued.Load())}
		var lim limits
		if ti, l, ok := snap.resolve(t.id, ""); ok {
			v.Tier, lim = ti.Name, l
		} else if ti := t.tier.Load(); ti != nil {
			// Named with a key's tier only: show that tier's limits, as
			// the current config has them (a reload may have changed them).
			if cur, l, ok := snap.resolve(t.id, ti.Name); ok {
				v.Tier, lim = cur.Name, l
			} else {
				v.Tier, lim = ti.Name, ti.lim
			}
		}
		v.MaxConcurrent, v.RPM, v.TPM = lim.maxConc, lim.rpm, lim.tpm
		t.mu.Lock()
		t.win.advance(now)
		// A queued request holds its tenant's slot but is not running.
		v.Inflight = max(t.inflight-v.Queued, 0)
		v.RequestsInWindow, v.TokensInWindow = int(t.win.reqs), int(t.win.toks)
		t.mu.Unlock()
		if b := t.brk.Load(); b != nil {
			s := b.Snapshot()
			v.Breaker = &s
		}
		vs = append(vs, v)
	})
	sort.Slice(vs, func(i, j int) bool { return vs[i].Tenant < vs[j].Tenant })
	return vs
}

func (c *Controller) tenantBreaker(id string) *breaker.Breaker {
	if t := c.tenants.get(id); t != nil {
		if b := t.brk.Load(); b != nil {
			return b
		}
	}
	// A configured tenant that has sent nothing yet can still be forced
	// open: create its state and breaker.
	snap := c.snap.Load()
	ti, _, ok := snap.resolve(id, "")
	if !ok || ti.brk == nil || snap.tenants[id] == nil {
		return nil
	}
	t := c.state(id, snap)
	if t == nil {
		return nil
	}
	if t.tier.Load() == nil {
		t.tier.Store(ti)
	}
	return c.breakerFor(t, ti)
}

// nopObserver is the Observer of a nil one.
type nopObserver struct{}

func (nopObserver) Decision(string, string, string)                    {}
func (nopObserver) QueueWait(string, string, time.Duration)            {}
func (nopObserver) QueueDepth(string, int)                             {}
func (nopObserver) Inflight(string, int)                               {}
func (nopObserver) Tokens(string, string, string, string, string, int) {}
func (nopObserver) TenantBreaker(string, string, breaker.Transition)   {}
