package budget_test

import (
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/budget"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// The hot paths, from b.RunParallel goroutines sharing one budget, with the
// real clock. Run with:
//
//	go test -run '^$' -bench . -benchmem -cpu 1,2 ./budget/

// BenchmarkRatioRequestTryRetry is the 100%-failure path: every request is
// recorded and asks for a retry (most are refused once the budget is spent).
func BenchmarkRatioRequestTryRetry(b *testing.B) {
	for _, bc := range []struct {
		name  string
		clock clock.Reader
	}{{"system_clock", clock.Real}, {"frozen_clock", clocktest.Frozen(t0)}} {
		b.Run(bc.name, func(b *testing.B) {
			r, err := budget.NewRatio(budget.RatioConfig{}, bc.clock)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					r.Request()
					r.TryRetry()
				}
			})
		})
	}
}

// BenchmarkRatioRequest is the healthy path: a request is recorded, no retry.
func BenchmarkRatioRequest(b *testing.B) {
	r, err := budget.NewRatio(budget.RatioConfig{}, clock.Real)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			r.Request()
		}
	})
}

// BenchmarkBucketRequestTryRetry is the token bucket's 100%-failure path.
func BenchmarkBucketRequestTryRetry(b *testing.B) {
	k, err := budget.NewBucket(10, 0.5, clock.Real)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			k.Request()
			k.TryRetry()
		}
	})
}

// BenchmarkBackoffDelay draws a delay with a Retry-After and a deadline.
func BenchmarkBackoffDelay(b *testing.B) {
	var bo budget.Backoff
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		n := 0
		for pb.Next() {
			bo.Delay(n&7, 150*time.Millisecond, 5*time.Second)
			n++
		}
	})
}

// BenchmarkSystemClockNow is one clock.Real.Now, the floor under every
// budget call (two per Request+TryRetry).
func BenchmarkSystemClockNow(b *testing.B) {
	var c clock.Reader = clock.Real
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		var t time.Time
		for pb.Next() {
			t = c.Now()
		}
		_ = t
	})
}
