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
)

// controllerState is the Controller's fields (the type is declared in
// api.go, the contract).
type controllerState struct {
	snap    atomic.Pointer[snapshot]
	setMu   sync.Mutex // serializes SetConfig
	clock   Clock
	obs     Observer
	rand    func() float64 // breaker cooldown jitter; tests fix it
	base    time.Time      // epoch 0 of every tenant's window
	tenants tenantSet
}

func newController(cfg Config, clock Clock, obs Observer) (*Controller, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if clock == nil {
		clock = SystemClock{}
	}
	if obs == nil {
		obs = nopObserver{}
	}
	c := &Controller{}
	c.clock, c.obs, c.rand = clock, obs, rand.Float64
	c.base = clock.Now()
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

// limitsLocked fills req and tok with the tenant's limits now (the window
// advanced to now) and returns the Limits pointing to them, nil for a limit
// the tenant does not have.
func limitsLocked(t *tenant, lim limits, now time.Time, req, tok *Limit) Limits {
	var l Limits
	if lim.rpm > 0 {
		*req = Limit{Limit: lim.rpm, Remaining: int(max(0, int64(lim.rpm)-t.win.reqs)), Reset: t.win.reset(now, fieldReqs)}
		l.Requests = req
	}
	if lim.tpm > 0 {
		*tok = Limit{Limit: lim.tpm, Remaining: int(max(0, int64(lim.tpm)-t.win.toks)), Reset: t.win.reset(now, fieldToks)}
		l.Tokens = tok
	}
	return l
}

// retryIn formats d for messages, rounded up to the second ("12s", "1m0s").
func retryIn(d time.Duration) string {
	if d <= 0 {
		return "0s"
	}
	return ((d + time.Second - 1) / time.Second * time.Second).String()
}

// check is the decision of Reserve's limit checks, made under the tenant's
// lock without allocating; a refusal is built from it afterwards.
type check struct {
	code     string
	retry    time.Duration
	res      int64 // tokens to reserve
	need     int64 // the request's tokens (estimate + n × max_tokens)
	left     int64 // tpm left before this request
	explicit bool
}

// checkLocked applies the tenant's limits in order (max_concurrent, rpm,
// tpm) and, if they all pass, counts the request and its reservation.
func checkLocked(t *tenant, lim limits, req *Request, defMax int, now time.Time) check {
	var k check
	if lim.maxConc > 0 && t.inflight >= lim.maxConc {
		k.code, k.retry = CodeTenantConcurrency, time.Second
		return k
	}
	if lim.rpm > 0 && t.win.reqs+1 > int64(lim.rpm) {
		k.code, k.retry = CodeTenantRPM, t.win.until(now, fieldReqs, int64(lim.rpm)-1)
		return k
	}
	if lim.tpm > 0 {
		tpm := int64(lim.tpm)
		est := int64(max(req.PromptTokens, 0))
		n := int64(max(req.N, 1))
		per := int64(req.MaxTokens)
		k.explicit = per > 0
		if !k.explicit {
			per = int64(defMax)
		}
		k.need = satAdd(est, satMul(n, per))
		k.left = tpm - t.win.toks
		switch {
		case k.explicit && k.need > tpm, !k.explicit && est > tpm:
			// Waiting cannot help: it never fits the whole limit.
			k.code = CodeRequestExceedsLimit
			return k
		case k.explicit && k.need > k.left:
			k.code, k.retry = CodeTenantTPM, t.win.until(now, fieldToks, tpm-k.need)
			return k
		case !k.explicit && k.left < max(est, 1):
			// Capped at what is left, it must still hold the prompt.
			k.code, k.retry = CodeTenantTPM, t.win.until(now, fieldToks, tpm-max(est, 1))
			return k
		}
		k.res = min(k.need, k.left)
	}
	t.inflight++
	t.win.add(1, k.res)
	return k
}

// refusal builds the Refusal of a failed check.
func (k *check) refusal(t *tenant, lim limits, req *Request, now time.Time) *Refusal {
	b := &refusalBox{}
	b.r = Refusal{Status: 429, Code: k.code, RetryAfter: k.retry}
	b.r.Limits = limitsLocked(t, lim, now, &b.req, &b.tok)
	id := t.id
	switch k.code {
	case CodeTenantConcurrency:
		b.r.Message = fmt.Sprintf("tenant %s: %d concurrent requests (max_concurrent) in flight; retry in %s", id, lim.maxConc, retryIn(k.retry))
	case CodeTenantRPM:
		b.r.Message = fmt.Sprintf("tenant %s: %d requests per minute (rpm) exceeded; retry in %s", id, lim.rpm, retryIn(k.retry))
	case CodeTenantTPM:
		what := "reservation of %d tokens"
		if !k.explicit {
			what = "prompt of %d tokens"
			k.need = int64(max(req.PromptTokens, 1))
		}
		b.r.Message = fmt.Sprintf("tenant %s: %d tokens per minute (tpm) exceeded: "+what+", %d left; retry in %s",
			id, lim.tpm, k.need, max(k.left, 0), retryIn(k.retry))
	case CodeRequestExceedsLimit:
		if k.explicit {
			b.r.Message = fmt.Sprintf("tenant %s: request needs %d tokens (prompt %d + %d × max_tokens %d), more than the whole limit of %d tokens per minute (tpm)",
				id, k.need, max(req.PromptTokens, 0), max(req.N, 1), req.MaxTokens, lim.tpm)
		} else {
			b.r.Message = fmt.Sprintf("tenant %s: prompt of %d tokens exceeds the whole limit of %d tokens per minute (tpm)",
				id, max(req.PromptTokens, 0), lim.tpm)
		}
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
		now := c.clock.Now()
		t.mu.Lock()
		if t.evicted {
			t.mu.Unlock()
			p.Done(breaker.Neutral, 0, "")
			continue
		}
		ep := t.win.advance(now)
		k := checkLocked(t, lim, req, ti.DefaultMaxTokens, now)
		if k.code != "" {
			r := k.refusal(t, lim, req, now)
			t.mu.Unlock()
			p.Done(breaker.Neutral, 0, "") // a refused probe frees its slot
			c.obs.Decision(t.id, ti.Name, r.Code)
			return r
		}
		tk.limits = limitsLocked(t, lim, now, &tk.reqLim, &tk.tokLim)
		t.mu.Unlock()

		tk.c, tk.t, tk.ti, tk.lim = c, t, ti, lim
		tk.est = max(req.PromptTokens, 0)
		tk.reserved, tk.ep = k.res, ep
		tk.permit = p
		tk.settled.Store(false)
		return nil
	}
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
	bx.r.Limits = limitsLocked(t, lim, now, &bx.req, &bx.tok)
	t.mu.Unlock()
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

func (nopObserver) Decision(string, string, string)                  {}
func (nopObserver) QueueWait(string, string, time.Duration)          {}
func (nopObserver) QueueDepth(string, int)                           {}
func (nopObserver) Inflight(string, int)                             {}
func (nopObserver) Tokens(string, string, string, string, int)       {}
func (nopObserver) TenantBreaker(string, string, breaker.Transition) {}
