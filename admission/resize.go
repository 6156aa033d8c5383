package admission

import (
	"fmt"
	"time"
)

// Resizer is implemented by a LimitStore that can change an admitted
// request's token reservation in place (the degradation ladder moved the
// request to a model with a smaller max_tokens). A store without it keeps
// the original reservation until Settle, which replaces it with the tokens
// used: the window is right after settlement either way.
type Resizer interface {
	// Resize changes h's reservation to reserved tokens. Growing it checks
	// the tenant's TPM (q.TPM; 0 none) and returns false, changing nothing,
	// when it does not fit; shrinking always succeeds.
	Resize(q *Quota, h *Hold, reserved int64) bool
}

// Resize recomputes the ticket's token reservation for a request now
// asking maxTokens per sequence (prompt estimate + n × maxTokens, as at
// admission): the degradation ladder clamped max_tokens for a fallback
// model. Shrinking always succeeds; growing is checked against the
// tenant's TPM and refused (nil change) with a *Refusal when it does not
// fit. A settled or unreserved ticket, or a tenant without a token limit,
// has nothing to resize.
func (t *Ticket) Resize(maxTokens, n int) *Refusal { return t.resize(maxTokens, n) }

func (tk *Ticket) resize(maxTokens, n int) *Refusal {
	if tk.t == nil || tk.settled.Load() || tk.lim.tpm <= 0 {
		return nil
	}
	n = max(n, 1)
	need := satAdd(int64(tk.est), satMul(int64(n), int64(max(maxTokens, 0))))
	delta := need - tk.reserved
	if delta == 0 {
		return nil
	}
	t := tk.t
	if s := tk.hold.store; s != nil {
		rs, ok := s.(Resizer)
		if !ok {
			return nil // settled later against the original reservation
		}
		if !rs.Resize(&tk.quota, &tk.hold, need) {
			return tk.resizeRefusal(need)
		}
		tk.reserved = need
		return nil
	}
	now := tk.c.clock.Now()
	t.mu.Lock()
	ok := t.win.resize(now, &tk.ep, tk.reserved, need, int64(tk.lim.tpm))
	t.mu.Unlock()
	if !ok {
		return tk.resizeRefusal(need)
	}
	tk.reserved = need
	if tk.limits.Tokens != nil {
		tk.tokLim.Remaining -= int(delta)
	}
	return nil
}

func (tk *Ticket) resizeRefusal(need int64) *Refusal {
	return &Refusal{Status: 429, Code: CodeTenantTPM, RetryAfter: time.Second,
		Message: fmt.Sprintf("tenant %s: %d tokens do not fit what is left of its tpm limit of %d", tk.t.id, need, tk.lim.tpm)}
}

// TryAcquireSlot takes a slot of the pool only if one is free now (below
// capacity, the pool signal clear, nobody queued before it), without
// queueing or refusing: the degradation ladder asks before it offers a
// saturated pool's request to a fallback. It reports whether slot holds a
// place, which slot.Release gives back.
func (g *Gate) TryAcquireSlot(tenant string, tier Tier, slot *Slot) bool {
	return g.tryAcquire(tenant, tier, slot, true)
}

// TryAcquireMovedSlot is TryAcquireSlot for a request admitted by another
// pool first (the degradation ladder moves it here): no admission decision
// is counted, the request's was counted where it arrived.
func (g *Gate) TryAcquireMovedSlot(tenant string, tier Tier, slot *Slot) bool {
	return g.tryAcquire(tenant, tier, slot, false)
}

func (g *Gate) tryAcquire(tenant string, tier Tier, slot *Slot, decide bool) bool {
	slot.s = slotRelease{}
	g.mu.Lock()
	g.pumpLocked()
	if len(g.q) > 0 || !g.freeLocked(g.capLocked()) {
		g.mu.Unlock()
		return false
	}
	g.admitLocked(tier.Name)
	g.mu.Unlock()
	if decide {
		g.obs.QueueWait(tenant, tier.Name, 0)
		g.obs.Decision(tenant, tier.Name, DecisionAdmitted)
	}
	g.releaseFunc(tier.Name, &slot.s)
	return true
}

// resize replaces a reservation of old tokens counted in epoch *ep by need
// tokens; growing past tpm (0: no limit) fails and changes nothing. A
// reservation whose slot left the window is counted anew in the current
// one (*ep moves there).
func (w *minuteWindow) resize(now time.Time, ep *int64, old, need, tpm int64) bool {
	w.advance(now)
	if d := need - old; d > 0 && tpm > 0 && w.toks+d > tpm {
		return false
	}
	if w.inWindow(*ep) {
		w.remove(*ep, 0, old)
		s := &w.s[*ep%slots]
		s.toks += need
		w.toks += need
		return true
	}
	*ep = w.cur
	w.add(0, need)
	return true
}

// Resize implements Resizer.
func (l *LocalLimits) Resize(q *Quota, h *Hold, reserved int64) bool {
	e := h.le
	if e == nil {
		return false
	}
	now := l.clock.Now()
	e.mu.Lock()
	ok := e.win.resize(now, &h.lep, h.Reserved, reserved, int64(q.TPM))
	e.mu.Unlock()
	if ok {
		h.Reserved = reserved
	}
	return ok
}
