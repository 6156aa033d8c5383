package upstream

import (
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/budget"
	"github.com/llmproxy/caddy-llm-proxy/hedge"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

func TestRetryGateNeverWaitsPastTheBackoffCap(t *testing.T) {
	p := startPool(t, NewRegistry(nil), Config{Static: targets("10.4.0.1:8000"),
		Retry: RetryConfig{Backoff: budget.Backoff{Base: 100 * time.Millisecond, Cap: 2 * time.Second, Rand: func() float64 { return 0.5 }}}})
	g := p.Retries()
	for _, tc := range []struct {
		name                  string
		n                     int
		retryAfter, remaining time.Duration
		ok                    bool
		atLeast, atMost       time.Duration
	}{
		{name: "30s Retry-After, no deadline", retryAfter: 30 * time.Second, ok: false},
		{name: "1.5s Retry-After within the cap", retryAfter: 1500 * time.Millisecond, ok: true, atLeast: 1500 * time.Millisecond, atMost: 2 * time.Second},
		{name: "Retry-After past stream_timeout's remaining time", retryAfter: 1500 * time.Millisecond, remaining: time.Second, ok: false},
		{name: "Retry-After past the cap, long deadline", retryAfter: 5 * time.Second, remaining: time.Minute, ok: false},
		{name: "retry 3 without Retry-After", n: 3, ok: true, atMost: 800 * time.Millisecond},
		{name: "retry 30 without Retry-After", n: 30, ok: true, atMost: 2 * time.Second},
	} {
		d, ok := g.Backoff(tc.n, tc.retryAfter, tc.remaining)
		if ok != tc.ok || (ok && (d < tc.atLeast || d > tc.atMost)) {
			t.Errorf("%s: %v %t, want ok %t within [%v, %v]", tc.name, d, ok, tc.ok, tc.atLeast, tc.atMost)
		}
	}
}

func TestBackoffCapBelowBaseIsRefused(t *testing.T) {
	_, err := NewRegistry(nil).NewPool(Config{Static: targets("10.4.0.2:8000"),
		Retry: RetryConfig{Backoff: budget.Backoff{Base: time.Second, Cap: 100 * time.Millisecond}}})
	if err == nil {
		t.Fatal("a backoff cap below its base was accepted")
	}
}

func TestRetryBudgetSurvivesReloadOfSamePool(t *testing.T) {
	reg := NewRegistry(nil)
	cfg := Config{Key: "test-pool-10.2.0.1:8000", Static: targets("10.2.0.1:8000"), Retry: RetryConfig{Ratio: 0.5, MinPerSec: budget.Off}}
	old := startPool(t, reg, cfg)
	for range 4 {
		old.Retries().Request()
	}
	next := reload(t, old, cfg)
	granted := 0
	for next.Retries().TryRetry() {
		granted++
	}
	if granted != 2 {
		t.Fatalf("after a reload the budget granted %d retries, want 2 (0.5 × 4 requests made before it)", granted)
	}
}

// A reload that changes the budget's settings starts a budget of its own.
func TestRetryBudgetChangesWithItsSettings(t *testing.T) {
	reg := NewRegistry(nil)
	old := startPool(t, reg, Config{Key: "test-pool-10.2.0.2:8000", Static: targets("10.2.0.2:8000"), Retry: RetryConfig{Ratio: 0.5, MinPerSec: budget.Off}})
	for range 4 {
		old.Retries().Request()
	}
	next := reload(t, old, Config{Key: "test-pool-10.2.0.2:8000", Static: targets("10.2.0.2:8000"), Retry: RetryConfig{Ratio: 0.25, MinPerSec: budget.Off}})
	if next.Budget() == old.Budget() {
		t.Fatal("a budget with new settings is the old one")
	}
	if next.Retries().TryRetry() {
		t.Fatal("the new budget granted a retry it never earned")
	}
}

func TestHedgerDelayFallsBackThenFollowsTTFT(t *testing.T) {
	obs := newFakeObserver()
	reg := NewRegistry(obs)
	reg.Models.Learn("hedge-test-model")
	p := startPool(t, reg, Config{Key: "test-pool-hedge", Static: targets("10.4.1.1:8000"), Hedge: &HedgeConfig{
		Policy: hedge.DelayPolicy{Percentile: 0.95, Min: 50 * time.Millisecond, Max: 2 * time.Second, Fallback: 700 * time.Millisecond}}})
	h := p.Hedging()
	info := proxy.RequestInfo{Model: "hedge-test-model", Stream: true}
	if d, ok := h.Delay(info); !ok || d != 700*time.Millisecond {
		t.Fatalf("without samples: %v, want the 700ms fallback", d)
	}
	for range 100 {
		h.Observe(info, 300*time.Millisecond)
	}
	d, _ := h.Delay(info)
	if d < 280*time.Millisecond || d > 320*time.Millisecond {
		t.Fatalf("p95 of 300ms TTFTs gave %v", d)
	}
	obs.mu.Lock()
	got := obs.hedge["hedge-test-model|true"]
	obs.mu.Unlock()
	if got != d {
		t.Fatalf("hedge delay reported %v, want %v", got, d)
	}
	// The JSON (non-streamed) mode has its own tracker.
	if d, _ := h.Delay(proxy.RequestInfo{Model: "hedge-test-model"}); d != 700*time.Millisecond {
		t.Fatalf("non-streamed delay %v, want the fallback: TTFT trackers are per mode", d)
	}
}

func TestHedgeTrackersSurviveReloadOfSamePool(t *testing.T) {
	reg := NewRegistry(nil)
	reg.Models.Learn("m")
	cfg := Config{Key: "test-pool-hedge-reload", Static: targets("10.4.2.1:8000"), Hedge: &HedgeConfig{
		Policy: hedge.DelayPolicy{Percentile: 0.95, Fallback: 700 * time.Millisecond, Max: 2 * time.Second}}}
	old := startPool(t, reg, cfg)
	info := proxy.RequestInfo{Model: "m", Stream: true}
	for range 100 {
		old.Hedging().Observe(info, 300*time.Millisecond)
	}
	next := reload(t, old, cfg)
	if d, _ := next.Hedging().Delay(info); d < 280*time.Millisecond || d > 320*time.Millisecond {
		t.Fatalf("after a reload the delay is %v: the TTFT history was lost", d)
	}
}

func TestHedgingOffIsANilInterface(t *testing.T) {
	p := startPool(t, NewRegistry(nil), Config{Static: targets("10.4.3.1:8000")})
	if h := p.Hedging(); h != nil {
		t.Fatalf("hedging off gave %#v, want a nil interface", h)
	}
}
