package admission

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// t0 is the fake clock's start.
var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// newFakeClock returns a fake clock at t0.
func newFakeClock() *clocktest.Fake { return clocktest.New(t0) }

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
func newCtl(t testing.TB, cfg Config) (*Controller, *clocktest.Fake, *recObserver) {
	t.Helper()
	clk, obs := newFakeClock(), newRec()
	c, err := NewController(cfg, clk, obs)
	if err != nil {
		t.Fatal(err)
	}
	c.rand = func() float64 { return 0 }
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
