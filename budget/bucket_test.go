package budget_test

import (
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/budget"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

func newBucket(t testing.TB, maxTokens, perSec float64) (*budget.Bucket, *clocktest.Fake) {
	t.Helper()
	clk := clocktest.New(t0)
	b, err := budget.NewBucket(maxTokens, perSec, clk)
	if err != nil {
		t.Fatal(err)
	}
	return b, clk
}

func TestNewBucketRefusesInvalidConfig(t *testing.T) {
	cases := []struct {
		max, rate float64
		want      string
	}{
		{0, 1, "max_tokens 0"},
		{0.5, 1, "max_tokens 0.5"},
		{math.NaN(), 1, "max_tokens NaN"},
		{math.Inf(1), 1, "max_tokens +Inf"},
		{1e12, 0.5, "max_tokens 1e+12"},
		{10, 0, "refill_per_sec 0"},
		{10, -1, "refill_per_sec -1"},
		{10, math.NaN(), "refill_per_sec NaN"},
		{10, 2e9, "refill_per_sec 2e+09"},
	}
	for _, tc := range cases {
		_, err := budget.NewBucket(tc.max, tc.rate, clocktest.New(t0))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewBucket(%v, %v) error = %v, want one containing %q", tc.max, tc.rate, err, tc.want)
		}
	}
	if _, err := budget.NewBucket(10, 0.5, nil); err == nil {
		t.Error("NewBucket with a nil clock: no error")
	}
}

// A full bucket grants a burst of max tokens at once; requests earn nothing.
func TestBucketBurstsUpToMax(t *testing.T) {
	b, _ := newBucket(t, 10, 0.5)
	for range 1000 {
		b.Request()
	}
	if n := drain(b); n != 10 {
		t.Fatalf("burst of %d, want 10", n)
	}
}

// The bucket refills at its rate: 0.5/s is one token every 2s.
func TestBucketRefillsAtRate(t *testing.T) {
	b, clk := newBucket(t, 10, 0.5)
	drain(b)
	clk.Advance(2*time.Second - time.Nanosecond)
	if b.TryRetry() {
		t.Fatal("token granted before 2s at 0.5/s")
	}
	clk.Advance(time.Nanosecond)
	if !b.TryRetry() {
		t.Fatal("no token after 2s at 0.5/s")
	}
	if b.TryRetry() {
		t.Fatal("two tokens after 2s at 0.5/s")
	}
	clk.Advance(7 * time.Second) // 3.5 tokens
	if n := drain(b); n != 3 {
		t.Fatalf("after 7s: %d tokens, want 3", n)
	}
	clk.Advance(time.Second) // the half token kept, plus half
	if n := drain(b); n != 1 {
		t.Fatalf("after 8s: %d tokens, want 1", n)
	}
}

// However long it stays idle, the bucket never holds more than max.
func TestBucketNeverAboveMax(t *testing.T) {
	b, clk := newBucket(t, 10, 0.5)
	drain(b)
	clk.Advance(24 * time.Hour)
	if s := b.Stats(); s.Available != 10 {
		t.Fatalf("Stats().Available = %d after a day, want 10", s.Available)
	}
	if n := drain(b); n != 10 {
		t.Fatalf("after a day: burst of %d, want 10", n)
	}
	// Fractional capacity: 2.5 tokens grant 2 at once.
	f, _ := newBucket(t, 2.5, 1)
	if n := drain(f); n != 2 {
		t.Fatalf("max 2.5: burst of %d, want 2", n)
	}
}

// Over any run, grants ≤ max + rate × elapsed, and nearly that at saturation.
func TestBucketBoundHolds(t *testing.T) {
	rnd := rand.New(rand.NewPCG(3, 4))
	for _, tc := range []struct{ max, rate float64 }{{10, 0.5}, {1, 3}, {100, 7.3}, {2.5, 1000}} {
		b, clk := newBucket(t, tc.max, tc.rate)
		grants := 0
		for range 20000 {
			grants += drain(b)
			// Gaps average a tenth of the time to fill the bucket, so
			// it seldom overflows and the grants come near the bound (a bucket of
			// one token still loses the part of each gap past its one token).
			fill := time.Duration(float64(time.Second) * tc.max / tc.rate)
			clk.Advance(time.Duration(rnd.ExpFloat64() * float64(fill/10)))
		}
		bound := tc.max + tc.rate*clk.Elapsed().Seconds()
		if float64(grants) > bound || float64(grants) < 0.9*bound-tc.max {
			t.Errorf("bucket(%v, %v): %d grants over %v, want ≤ %.1f and near it",
				tc.max, tc.rate, grants, clk.Elapsed(), bound)
		}
	}
}

// Concurrent TryRetry never grants more tokens than there are.
func TestBucketConcurrentNeverOverGrants(t *testing.T) {
	// Time frozen: exactly max grants among all goroutines.
	b, clk := newBucket(t, 10, 0.5)
	var grants atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 1000 {
				if b.TryRetry() {
					grants.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if grants.Load() != 10 {
		t.Fatalf("%d grants from a bucket of 10 with time frozen", grants.Load())
	}

	// Time moving: within max + rate × elapsed.
	b, clk = newBucket(t, 10, 50)
	grants.Store(0)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 20000 {
				if b.TryRetry() {
					grants.Add(1)
				}
				if i%10 == g {
					clk.Advance(time.Millisecond)
				}
			}
		}()
	}
	wg.Wait()
	bound := 10 + 50*clk.Elapsed().Seconds()
	if float64(grants.Load()) > bound {
		t.Fatalf("%d grants over %v exceed %.0f", grants.Load(), clk.Elapsed(), bound)
	}
}

func TestBucketStats(t *testing.T) {
	b, clk := newBucket(t, 10, 0.5)
	for range 5 {
		b.Request()
	}
	b.TryRetry()
	b.TryRetry()
	want := budget.Stats{Window: budget.DefaultWindow, Requests: 5, Retries: 2, Available: 8}
	if s := b.Stats(); s != want {
		t.Fatalf("Stats() = %+v, want %+v", s, want)
	}
	clk.Advance(budget.DefaultWindow)
	want = budget.Stats{Window: budget.DefaultWindow, Available: 10}
	if s := b.Stats(); s != want {
		t.Fatalf("after the window: Stats() = %+v, want %+v", s, want)
	}
	if b.MaxTokens() != 10 || b.RefillPerSec() != 0.5 {
		t.Fatalf("MaxTokens, RefillPerSec = %v, %v", b.MaxTokens(), b.RefillPerSec())
	}
}
