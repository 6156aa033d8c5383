package caddymodule

import (
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/llmproxy/caddy-llm-proxy/budget"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

func TestRetryGateNeverWaitsPastTheBackoffCap(t *testing.T) {
	g := &retryGate{budget: nil, backoff: budget.Backoff{Base: 100 * time.Millisecond, Cap: 2 * time.Second, Rand: func() float64 { return 0.5 }}}
	if _, ok := g.Backoff(0, 30*time.Second, 0); ok {
		t.Fatal("a 30s Retry-After without a deadline must not be waited for")
	}
	if d, ok := g.Backoff(0, 1500*time.Millisecond, 0); !ok || d < 1500*time.Millisecond || d > 2*time.Second {
		t.Fatalf("a 1.5s Retry-After within the cap: %v %v", d, ok)
	}
	if _, ok := g.Backoff(0, 1500*time.Millisecond, time.Second); ok {
		t.Fatal("a Retry-After past stream_timeout's remaining time must not be waited for")
	}
	if d, ok := g.Backoff(3, 0, 0); !ok || d > 800*time.Millisecond {
		t.Fatalf("retry 3: %v %v, want ≤ base·2³", d, ok)
	}
}

func TestRetryBudgetSurvivesReloadOfSamePool(t *testing.T) {
	mk := func() *Handler {
		h := &Handler{poolKey: "test-pool-10.2.0.1:8000", Retries: &RetryConfig{Ratio: 0.5, MinPerSec: budget.Off}}
		if err := h.provisionRetries(); err != nil {
			t.Fatal(err)
		}
		return h
	}
	old := mk()
	for range 4 {
		old.retryGate.Request()
	}
	next := mk()
	_, _ = budgetPool.Delete(old.budgetKey)
	defer budgetPool.Delete(next.budgetKey)
	granted := 0
	for next.retryGate.TryRetry() {
		granted++
	}
	if granted != 2 {
		t.Fatalf("after a reload the budget granted %d retries, want 2 (0.5 × 4 requests made before it)", granted)
	}
}

func TestHedgerDelayFallsBackThenFollowsTTFT(t *testing.T) {
	initMetrics()
	h := &Handler{poolKey: "test-pool-hedge", trackers: new(sync.Map), stateMu: new(sync.Mutex),
		Hedge: &HedgeConfig{Percentile: 0.95, Min: caddyDur(50 * time.Millisecond), Max: caddyDur(2 * time.Second), Fallback: caddyDur(700 * time.Millisecond)}}
	if err := h.provisionHedging(); err != nil {
		t.Fatal(err)
	}
	defer h.Cleanup()
	learnModel("hedge-test-model")
	info := proxy.RequestInfo{Model: "hedge-test-model", Stream: true}
	if d, ok := h.hedger.Delay(info); !ok || d != 700*time.Millisecond {
		t.Fatalf("without samples: %v, want the 700ms fallback", d)
	}
	for range 100 {
		h.hedger.Observe(info, 300*time.Millisecond)
	}
	d, _ := h.hedger.Delay(info)
	if d < 280*time.Millisecond || d > 320*time.Millisecond {
		t.Fatalf("p95 of 300ms TTFTs gave %v", d)
	}
	if g := testutil.ToFloat64(metrics.hedgeDelay.WithLabelValues("hedge-test-model", "stream")); g != d.Seconds() {
		t.Fatalf("hedge_delay_seconds %v, want %v", g, d.Seconds())
	}
}

func caddyDur(d time.Duration) caddy.Duration { return caddy.Duration(d) }
