package upstream

import (
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/hedge"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// TestHedgerHotPathAllocatesNothing: Delay and Observe run on every hedged
// request. The TTFT tracker is found by a struct key; it used to be found by
// a key formatted with Sprintf, twice per request.
func TestHedgerHotPathAllocatesNothing(t *testing.T) {
	reg := NewRegistry(nil)
	reg.Models.Learn("llama")
	p, err := reg.NewPool(Config{
		Key:    "hotpath",
		Static: []Target{{Addr: "10.77.0.1:8000"}},
		Hedge:  &HedgeConfig{Policy: hedge.DelayPolicy{Percentile: 0.95, Min: time.Millisecond, Max: time.Second}},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Release()
	h := p.Hedging()
	info := proxy.RequestInfo{Model: "llama", Stream: true}
	h.Observe(info, 100*time.Millisecond) // the tracker exists from here on
	if n := testing.AllocsPerRun(1000, func() {
		h.Request()
		_, _ = h.Delay(info)
		h.Observe(info, 120*time.Millisecond)
	}); n != 0 {
		t.Fatalf("Request + Delay + Observe allocate %v times per request, want 0", n)
	}
}

// TestPickAndDoneAllocateLittle bounds the allocations of one pick and its
// release on a static pool with breakers on: the candidate slice and the
// Upstream's two closures.
func TestPickAndDoneAllocateLittle(t *testing.T) {
	reg := NewRegistry(nil)
	s := breaker.Settings{}
	p, err := reg.NewPool(Config{Key: "hotpath-pick", Static: []Target{{Addr: "10.77.0.2:8000"}, {Addr: "10.77.0.3:8000"}}, Breaker: &s})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Release()
	p.Activate()
	req := proxy.PickRequest{Info: proxy.RequestInfo{Model: "m"}}
	n := testing.AllocsPerRun(1000, func() {
		up, err := p.Pick(nil, nil, req)
		if err != nil {
			t.Fatal(err)
		}
		up.Done(&proxy.AttemptReport{Upstream: up.Addr, Outcome: proxy.AttemptSuccess})
	})
	t.Logf("Pick + Done: %v allocations", n)
	if n > 6 {
		t.Fatalf("Pick + Done allocate %v times, want at most 6", n)
	}
}
