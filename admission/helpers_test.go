package admission

import (
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// t0 is the fake clock's start.
var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// fakeClock is moved by hand (Advance); AfterFunc timers fire inside
// Advance, in time order, on the caller's goroutine. Nothing sleeps.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer
}

type fakeTimer struct {
	c       *fakeClock
	at      time.Time
	f       func()
	stopped bool
}

func newFakeClock() *fakeClock { return &fakeClock{now: t0} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) AfterFunc(d time.Duration, f func()) interface{ Stop() bool } {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{c: c, at: c.now.Add(d), f: f}
	c.timers = append(c.timers, t)
	return t
}

func (t *fakeTimer) Stop() bool {
	t.c.mu.Lock()
	defer t.c.mu.Unlock()
	was := !t.stopped
	t.stopped = true
	return was
}

// Advance moves the clock by d, firing due timers in order.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	end := c.now.Add(d)
	for {
		sort.SliceStable(c.timers, func(i, j int) bool { return c.timers[i].at.Before(c.timers[j].at) })
		var due *fakeTimer
		for i, t := range c.timers {
			if t.stopped {
				continue
			}
			if !t.at.After(end) {
				due = t
				c.timers = append(c.timers[:i], c.timers[i+1:]...)
			}
			break
		}
		if due == nil {
			c.now = end
			c.mu.Unlock()
			return
		}
		due.stopped = true
		if due.at.After(c.now) {
			c.now = due.at
		}
		c.mu.Unlock()
		due.f()
		c.mu.Lock()
	}
}

// pending returns the number of live timers.
func (c *fakeClock) pending() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, t := range c.timers {
		if !t.stopped {
			n++
		}
	}
	return n
}

// recObserver records what admission reports.
type recObserver struct {
	mu          sync.Mutex
	decisions   []string // "tenant/tier/decision"
	waits       []time.Duration
	depth       map[string]int
	inflight    map[string]int
	tokens      map[string]int // "tenant/kind/source"
	transitions []breaker.Transition
}

func newRec() *recObserver {
	return &recObserver{depth: map[string]int{}, inflight: map[string]int{}, tokens: map[string]int{}}
}

func (o *recObserver) Decision(tenant, tier, d string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.decisions = append(o.decisions, tenant+"/"+tier+"/"+d)
}
func (o *recObserver) QueueWait(_, _ string, d time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.waits = append(o.waits, d)
}
func (o *recObserver) QueueDepth(tier string, n int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.depth[tier] = n
}
func (o *recObserver) Inflight(tier string, n int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.inflight[tier] = n
}
func (o *recObserver) Tokens(tenant, _, _, kind, source string, n int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.tokens[tenant+"/"+kind+"/"+source] += n
}
func (o *recObserver) TenantBreaker(_, _ string, tr breaker.Transition) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.transitions = append(o.transitions, tr)
}

func (o *recObserver) lastDecision() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.decisions) == 0 {
		return ""
	}
	return o.decisions[len(o.decisions)-1]
}

// newCtl builds a controller on a fake clock with no cooldown jitter.
func newCtl(t testing.TB, cfg Config) (*Controller, *fakeClock, *recObserver) {
	t.Helper()
	clk, obs := newFakeClock(), newRec()
	c, err := NewController(cfg, clk, obs)
	if err != nil {
		t.Fatal(err)
	}
	c.rand = func() float64 { return 0.5 }
	return c, clk, obs
}

// oneTier is a config of one tier "t" (for tenant "a" and any other).
func oneTier(t Tier) Config {
	t.Name = "t"
	return Config{Tiers: []Tier{t}, DefaultTier: "t"}
}

// view returns tenant id's admin view.
func view(c *Controller, id string) TenantView {
	for _, v := range c.Tenants() {
		if v.Tenant == id {
			return v
		}
	}
	return TenantView{}
}

// limStr shows a limit in failures.
func limStr(l *Limit) string {
	if l == nil {
		return "none"
	}
	return fmt.Sprintf("%d/%d reset %s", l.Remaining, l.Limit, l.Reset)
}
