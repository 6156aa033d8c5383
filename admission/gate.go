package admission

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// refusalRetry is the Retry-After of the gate's refusals: the pool's
// capacity frees as requests end, typically within seconds.
const refusalRetry = time.Second

// gateState is the Gate's fields (the type is declared in api.go).
type gateState struct {
	capacity func() int
	// poolSaturated is GateConfig.Saturated (nil: never).
	poolSaturated func() bool
	bound         int // the pool queue's bound
	ctl           *Controller
	clock         clock.Clock
	obs           Observer
	// settings are a pool gate's (NewPoolGate), nil for others.
	settings *poolGate

	mu       sync.Mutex
	inflight int
	q        queue
	seq      uint64
	tiers    map[string]*tierCount
}

// tierCount is one tier's requests in a gate.
type tierCount struct{ queued, inflight int }

func newGate(cfg GateConfig, clk clock.Clock, obs Observer) *Gate {
	clk = clock.Or(clk)
	if obs == nil {
		obs = nopObserver{}
	}
	g := &Gate{}
	g.capacity, g.poolSaturated, g.bound, g.ctl = cfg.Capacity, cfg.Saturated, cfg.Queue, cfg.Controller
	if g.bound <= 0 {
		g.bound = DefaultQueue
	}
	g.clock, g.obs = clk, obs
	g.tiers = make(map[string]*tierCount)
	return g
}

// capLocked returns the capacity now; <= 0 is unlimited.
func (g *Gate) capLocked() int {
	if g.capacity == nil {
		return 0
	}
	return g.capacity()
}

// freeLocked reports whether a slot is free under capacity n: below it
// (or unlimited), and the pool signal does not say saturated.
func (g *Gate) freeLocked(n int) bool {
	return (n <= 0 || g.inflight < n) && !g.signalLocked()
}

// signalLocked reports the pool signal (false without one).
func (g *Gate) signalLocked() bool { return g.poolSaturated != nil && g.poolSaturated() }

func (g *Gate) countLocked(tier string) *tierCount {
	tc := g.tiers[tier]
	if tc == nil {
		tc = &tierCount{}
		g.tiers[tier] = tc
	}
	return tc
}

// admitLocked takes a slot for a request of tier. Observer calls under the
// gate's lock keep each gauge's values in order.
func (g *Gate) admitLocked(tier string) {
	g.inflight++
	tc := g.countLocked(tier)
	tc.inflight++
	g.obs.Inflight(tier, tc.inflight)
}

// dequeueLocked takes w out of the queue with its decision (nil: admitted)
// and wakes it.
func (g *Gate) dequeueLocked(w *waiter, r *Refusal) {
	g.q.remove(w)
	w.decided, w.refusal = true, r
	w.timer.Stop()
	tc := g.countLocked(w.tier)
	tc.queued--
	g.obs.QueueDepth(w.tier, tc.queued)
	g.ctl.addQueued(w.tenant, -1)
	if r == nil {
		g.admitLocked(w.tier)
	}
	close(w.done)
}

// pumpLocked admits queued requests, head first, while slots are free; a
// head whose deadline has passed is refused, never admitted. This is what
// keeps capacity from sitting idle while an admissible request waits: it
// runs on every Acquire, release, timeout and Saturated call.
func (g *Gate) pumpLocked() {
	for len(g.q) > 0 {
		w := g.q[0]
		if !g.clock.Now().Before(w.deadline) {
			g.dequeueLocked(w, timeoutRefusal(w))
			continue
		}
		if !g.freeLocked(g.capLocked()) {
			return
		}
		g.dequeueLocked(w, nil)
	}
}

func timeoutRefusal(w *waiter) *Refusal {
	return &Refusal{Status: 429, Code: CodeQueueTimeout, RetryAfter: refusalRetry,
		Message: fmt.Sprintf("tier %s: queued longer than its queue_timeout of %s; retry in %s", w.tier, w.timeout, retryIn(refusalRetry))}
}

// Slot is one admitted request's place in a gate, for AcquireSlot: the
// caller keeps it in its own per-request state, so that taking a place
// allocates nothing. The zero Slot is ready; a Slot is used for one
// request at a time (Release before the next AcquireSlot).
type Slot struct{ s slotRelease }

// Release gives the place back; later calls do nothing.
func (s *Slot) Release() { s.s.release() }

// AcquireSlot is Acquire with the place kept in slot instead of a release
// func: on success, slot.Release must be called exactly once.
func (g *Gate) AcquireSlot(ctx context.Context, tenant string, tier Tier, slot *Slot) (waited time.Duration, err error) {
	slot.s = slotRelease{}
	_, waited, err = g.acquireInto(ctx, tenant, tier, &slot.s, true)
	return waited, err
}

// AcquireMovedSlot is AcquireSlot for a request that was admitted by
// another pool first and moves here (the degradation ladder): the same
// queue and refusals, but no admission decision is counted (the request's
// decision was counted where it arrived) — only its queue wait.
func (g *Gate) AcquireMovedSlot(ctx context.Context, tenant string, tier Tier, slot *Slot) (waited time.Duration, err error) {
	slot.s = slotRelease{}
	_, waited, err = g.acquireInto(ctx, tenant, tier, &slot.s, false)
	return waited, err
}

// slotRelease is the release of one admitted request.
type slotRelease struct {
	g    *Gate
	tier string
	done atomic.Bool
}

func (s *slotRelease) release() {
	if s.g == nil || !s.done.CompareAndSwap(false, true) {
		return
	}
	g := s.g
	g.mu.Lock()
	g.inflight--
	tc := g.countLocked(s.tier)
	tc.inflight--
	g.obs.Inflight(s.tier, tc.inflight)
	g.pumpLocked()
	g.mu.Unlock()
}

// releaseFunc arms slot (a new one when nil) for tier and returns its
// release.
func (g *Gate) releaseFunc(tier string, slot *slotRelease) func() {
	if slot == nil {
		slot = new(slotRelease)
		slot.g, slot.tier = g, tier
		return slot.release
	}
	slot.g, slot.tier = g, tier
	return nil // the caller releases through its Slot
}

func (g *Gate) acquire(ctx context.Context, tenant string, tier Tier) (func(), time.Duration, error) {
	return g.acquireInto(ctx, tenant, tier, nil, true)
}

// acquireInto takes a slot, queueing; decide counts the admission decision.
func (g *Gate) acquireInto(ctx context.Context, tenant string, tier Tier, slot *slotRelease, decide bool) (func(), time.Duration, error) {
	if tier.Queue <= 0 {
		tier.Queue = DefaultQueue
	}
	if tier.QueueTimeout <= 0 {
		tier.QueueTimeout = DefaultQueueTimeout
	}
	name := tier.Name
	refuse := func(r *Refusal, waited time.Duration) (func(), time.Duration, error) {
		g.obs.QueueWait(tenant, name, waited)
		if decide {
			g.obs.Decision(tenant, name, r.Code)
		}
		return nil, waited, r
	}
	if err := ctx.Err(); err != nil {
		return nil, 0, err
	}

	g.mu.Lock()
	g.pumpLocked()
	n := g.capLocked()
	if g.freeLocked(n) {
		// pumpLocked left the queue empty: nobody waits before this one.
		g.admitLocked(name)
		g.mu.Unlock()
		g.obs.QueueWait(tenant, name, 0)
		if decide {
			g.obs.Decision(tenant, name, DecisionAdmitted)
		}
		return g.releaseFunc(name, slot), 0, nil
	}
	if tier.Priority < 0 {
		why := fmt.Sprintf("%d of %d requests in flight", g.inflight, n)
		if n <= 0 || g.inflight < n {
			why = "every upstream at its queue or KV-cache threshold"
		}
		g.mu.Unlock()
		return refuse(&Refusal{Status: 429, Code: CodeSaturated, RetryAfter: refusalRetry,
			Message: fmt.Sprintf("pool saturated (%s); tier %s (priority %d) is not queued; retry in %s",
				why, name, tier.Priority, retryIn(refusalRetry))}, 0)
	}
	tc := g.countLocked(name)
	if tc.queued >= tier.Queue {
		g.mu.Unlock()
		return refuse(&Refusal{Status: 429, Code: CodeQueueFull, RetryAfter: refusalRetry,
			Message: fmt.Sprintf("tier %s: its share of the pool queue is full (%d waiting, tier queue %d); retry in %s",
				name, tc.queued, tier.Queue, retryIn(refusalRetry))}, 0)
	}
	if len(g.q) >= g.bound {
		v := g.q.victim(tier.Priority)
		if v == nil {
			g.mu.Unlock()
			return refuse(&Refusal{Status: 429, Code: CodeQueueFull, RetryAfter: refusalRetry,
				Message: fmt.Sprintf("pool queue full (%d waiting, queue %d); retry in %s", len(g.q), g.bound, retryIn(refusalRetry))}, 0)
		}
		g.dequeueLocked(v, &Refusal{Status: 429, Code: CodeDisplaced, RetryAfter: refusalRetry,
			Message: fmt.Sprintf("tier %s: displaced from the full pool queue by a request of higher priority (tier %s); retry in %s",
				v.tier, name, retryIn(refusalRetry))})
	}
	now := g.clock.Now()
	g.seq++
	w := &waiter{tenant: tenant, tier: name, prio: tier.Priority, seq: g.seq, enq: now,
		deadline: now.Add(tier.QueueTimeout), timeout: tier.QueueTimeout, done: make(chan struct{})}
	w.timer = g.clock.AfterFunc(tier.QueueTimeout, func() { g.expire(w) })
	g.q.insert(w)
	tc.queued++
	// The tenant's count first: an observer that sees the depth may read
	// the tenant's view at once.
	g.ctl.addQueued(tenant, 1)
	g.obs.QueueDepth(name, tc.queued)
	g.mu.Unlock()

	select {
	case <-w.done:
	case <-ctx.Done():
		g.mu.Lock()
		if !w.decided {
			g.dequeueLocked(w, &Refusal{}) // gone: not admitted, nobody reads it
			g.mu.Unlock()
			waited := g.clock.Now().Sub(w.enq)
			g.obs.QueueWait(tenant, name, waited)
			return nil, waited, ctx.Err()
		}
		g.mu.Unlock()
		if w.refusal == nil {
			// Admitted as the client left: give the slot to the next.
			waited := g.clock.Now().Sub(w.enq)
			if rel := g.releaseFunc(name, slot); rel != nil {
				rel()
			} else {
				slot.release()
			}
			g.obs.QueueWait(tenant, name, waited)
			return nil, waited, ctx.Err()
		}
	}
	waited := g.clock.Now().Sub(w.enq)
	if w.refusal != nil {
		return refuse(w.refusal, waited)
	}
	g.obs.QueueWait(tenant, name, waited)
	if decide {
		g.obs.Decision(tenant, name, DecisionQueuedAdmitted)
	}
	return g.releaseFunc(name, slot), waited, nil
}

// expire refuses w when its queue timeout fires, if it still waits.
func (g *Gate) expire(w *waiter) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !w.decided {
		g.dequeueLocked(w, timeoutRefusal(w))
	}
	g.pumpLocked()
}

func (g *Gate) saturated() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.pumpLocked()
	return !g.freeLocked(g.capLocked())
}

// SetQueue changes the bound of the pool queue (default DefaultQueue when
// n <= 0): a reloaded config's setting for a gate kept across the reload.
// Requests already queued stay; a lower bound only refuses new arrivals.
// It then re-checks capacity, which may have changed too.
func (g *Gate) SetQueue(n int) {
	if n <= 0 {
		n = DefaultQueue
	}
	g.mu.Lock()
	g.bound = n
	g.pumpLocked()
	g.mu.Unlock()
}

// PoolCapacity is a pool's in-flight capacity for a GateConfig.Capacity
// func: fixed, or perUpstream × healthy upstreams (those whose breaker is
// closed) when perUpstream > 0 — at least one upstream's worth, since 0
// would mean unlimited; 0 (unlimited) when neither is set.
func PoolCapacity(fixed, perUpstream, healthy int) int {
	if perUpstream > 0 {
		return perUpstream * max(healthy, 1)
	}
	return max(fixed, 0)
}
