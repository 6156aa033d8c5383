package upstream

import (
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/hedge"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/saturation"
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

// saturatedPool is a started three-upstream pool with saturation on and a
// fresh scrape on each upstream (one of them saturated).
func saturatedPool(tb testing.TB) (*Pool, []Candidate) {
	reg := NewRegistry(nil)
	clk := newLoopClock()
	reg.UseClock(clk)
	addrs := []string{"10.78.0.1:8000", "10.78.0.2:8000", "10.78.0.3:8000"}
	p, err := reg.NewPool(Config{Key: "hotpath-sat", Static: targets(addrs...), Selector: LeastQueue{},
		Saturation: &saturation.Saturation{Transport: refusingTransport{}, Interval: time.Hour, StaleAfter: 3 * time.Hour, Window: 2 * time.Hour}})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(p.Release)
	p.Activate()
	awaitTickers(tb, clk, len(addrs)) // each loop's first, failing, scrape is done
	now := clk.Now()
	var cs []Candidate
	for i, a := range addrs {
		e, _ := reg.Entry(a)
		if published, _ := e.scraper.Scraped(); !published {
			tb.Fatalf("no snapshot of %s after its first scrape", a)
		}
		r := saturation.Readings{Waiting: saturation.Known(float64(2 * i * i)), Running: saturation.Known(4), KVUsage: saturation.Known(0.3)}
		e.scraper.Apply(p.sat, saturation.Scrape{Server: saturation.NewSample(now, r)}, nil, now, 0)
		cs = append(cs, Candidate{Target: &p.static[i].t, Entry: e})
	}
	return p, cs
}

// TestSelectionWithSaturationAllocatesNothing: scoring, removing the
// saturated and choosing (issue 9: 0 allocations per pick).
func TestSelectionWithSaturationAllocatesNothing(t *testing.T) {
	p, cs := saturatedPool(t)
	buf := make([]Candidate, len(cs))
	now := time.Now()
	n := testing.AllocsPerRun(1000, func() {
		copy(buf, cs)
		if i := p.sel.Select(p.rank(buf, now, "m"), nil, nil); i < 0 {
			t.Fatal("no choice")
		}
	})
	if n != 0 {
		t.Fatalf("selection with saturation allocates %v times per pick, want 0", n)
	}
}

// BenchmarkSelectionWithSaturation measures one pick's selection with
// saturation on (score three upstreams, drop the saturated, least_queue);
// run with -cpu 8 for the figure (target ≤ 300 ns, 0 allocs).
func BenchmarkSelectionWithSaturation(b *testing.B) {
	p, cs := saturatedPool(b)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		buf := make([]Candidate, len(cs))
		for pb.Next() {
			copy(buf, cs)
			if i := p.sel.Select(p.rank(buf, time.Now(), "m"), nil, nil); i < 0 {
				b.Fatal("no choice")
			}
		}
	})
}
