package hedge_test

import (
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/hedge"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// Run with:
//
//	go test -run '^$' -bench . -benchmem -cpu 1,2 ./hedge/
//
// The "system" cases read the real clock (clock.Real) on every call, as the
// gateway does; the "frozen" cases use a clock that returns a fixed time, to
// show the cost of the structure alone.

func clocks() []struct {
	name  string
	clock clock.Reader
} {
	return []struct {
		name  string
		clock clock.Reader
	}{{"system", clock.Real}, {"frozen", clocktest.Frozen(t0)}}
}

// ttfts is a spread of TTFTs over 40 histogram buckets, so that parallel
// observers contend as they would in production rather than on one word.
var ttfts = func() []time.Duration {
	d := make([]time.Duration, 64)
	for i := range d {
		d[i] = 80*time.Millisecond + time.Duration(i)*30*time.Millisecond
	}
	return d
}()

// BenchmarkObserve: one TTFT observation, from b.RunParallel goroutines
// sharing one tracker.
func BenchmarkObserve(b *testing.B) {
	for _, c := range clocks() {
		b.Run(c.name, func(b *testing.B) {
			tr := hedge.NewLatencyTracker(time.Minute, c.clock)
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				i := 0
				for pb.Next() {
					tr.Observe(ttfts[i&63])
					i++
				}
			})
		})
	}
}

// BenchmarkQuantile: one p95 query on a full tracker, in parallel.
func BenchmarkQuantile(b *testing.B) {
	for _, c := range clocks() {
		b.Run(c.name, func(b *testing.B) {
			tr := hedge.NewLatencyTracker(time.Minute, c.clock)
			for i := range 10000 {
				tr.Observe(ttfts[i&63])
			}
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, ok := tr.Quantile(0.95); !ok {
						b.Fatal("no p95")
					}
				}
			})
		})
	}
}

// BenchmarkObserveAndDelay: what a request costs the tracker in the gateway,
// a Delay (p95 clamped) at its start and an Observe at its commit, in
// parallel.
func BenchmarkObserveAndDelay(b *testing.B) {
	tr := hedge.NewLatencyTracker(time.Minute, clock.Real)
	for i := range 10000 {
		tr.Observe(ttfts[i&63])
	}
	p := hedge.DelayPolicy{Percentile: 0.95, Min: 100 * time.Millisecond, Max: 2 * time.Second}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			if p.Delay(tr) <= 0 {
				b.Fatal("no delay")
			}
			tr.Observe(ttfts[i&63])
			i++
		}
	})
}

// BenchmarkRateCapRequest: Request, called for every request, in parallel
// on one cap with the real clock.
func BenchmarkRateCapRequest(b *testing.B) {
	c, err := hedge.NewRateCap(hedge.RateCapConfig{MaxRatio: 0.1, Window: 10 * time.Second}, clock.Real)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			c.Request()
		}
	})
}

// BenchmarkRateCapTryHedge: Request plus TryHedge for every request (the
// worst case: every request crosses its hedge delay), in parallel on one cap
// with the real clock; about one call in ten is granted.
func BenchmarkRateCapTryHedge(b *testing.B) {
	c, err := hedge.NewRateCap(hedge.RateCapConfig{MaxRatio: 0.1, Window: 10 * time.Second}, clock.Real)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			c.Request()
			c.TryHedge()
		}
	})
}
