package budget_test

import (
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/budget"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

func TestNewRatioAppliesDefaults(t *testing.T) {
	r, _ := newRatio(t, budget.RatioConfig{})
	want := budget.RatioConfig{Ratio: 0.1, Window: 10 * time.Second, MinPerSec: 3}
	if got := r.Config(); got != want {
		t.Fatalf("Config() = %+v, want %+v", got, want)
	}
	r, _ = newRatio(t, budget.RatioConfig{Ratio: budget.Off, MinPerSec: budget.Off, Window: time.Second})
	want = budget.RatioConfig{Ratio: 0, Window: time.Second, MinPerSec: 0}
	if got := r.Config(); got != want {
		t.Fatalf("Config() = %+v, want %+v", got, want)
	}
}

func TestNewRatioRefusesInvalidConfig(t *testing.T) {
	nan := func() float64 { var z float64; return z / z }()
	cases := []struct {
		name string
		c    budget.RatioConfig
		want string
	}{
		{"ratio above 1 (a percentage)", budget.RatioConfig{Ratio: 10}, "ratio 10"},
		{"negative ratio", budget.RatioConfig{Ratio: -0.5}, "ratio -0.5"},
		{"NaN ratio", budget.RatioConfig{Ratio: nan}, "ratio NaN"},
		{"negative window", budget.RatioConfig{Window: -time.Second}, "window -1s"},
		{"tiny window", budget.RatioConfig{Window: time.Millisecond}, "window 1ms"},
		{"negative floor", budget.RatioConfig{MinPerSec: -3}, "min_per_sec -3"},
		{"NaN floor", budget.RatioConfig{MinPerSec: nan}, "min_per_sec NaN"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := budget.NewRatio(tc.c, clocktest.New(t0))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("NewRatio(%+v) error = %v, want one containing %q", tc.c, err, tc.want)
			}
		})
	}
	if _, err := budget.NewRatio(budget.RatioConfig{}, nil); err == nil {
		t.Fatal("NewRatio with a nil clock: no error")
	}
	if _, err := budget.NewRatio(budget.RatioConfig{Ratio: 1}, clocktest.New(t0)); err != nil {
		t.Fatalf("ratio 1: %v", err)
	}
}

// At a 100% failure rate, with every request retrying until refused, the
// retries stay within the documented bound and use nearly all of it.
func TestRatioBoundsRetriesAtTotalFailure(t *testing.T) {
	cases := []struct {
		name     string
		c        budget.RatioConfig
		perSec   int
		duration time.Duration
	}{
		{"defaults, 100 req/s for 100s", budget.RatioConfig{}, 100, 100 * time.Second},
		{"ratio 0.2, window 5s, floor 1", budget.RatioConfig{Ratio: 0.2, Window: 5 * time.Second, MinPerSec: 1}, 100, 100 * time.Second},
		{"no floor", budget.RatioConfig{MinPerSec: budget.Off}, 100, 100 * time.Second},
		{"floor only", budget.RatioConfig{Ratio: budget.Off}, 100, 100 * time.Second},
		{"ratio 1", budget.RatioConfig{Ratio: 1}, 50, 200 * time.Second},
		{"window 1s, 1000 req/s", budget.RatioConfig{Window: time.Second}, 1000, 10 * time.Second},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r, clk := newRatio(t, tc.c)
			step := time.Second / time.Duration(tc.perSec)
			requests, retries := 0, 0
			for clk.Elapsed() < tc.duration {
				r.Request()
				requests++
				retries += drain(r)
				clk.Advance(step)
			}
			last := clk.Elapsed() - step
			bound := ratioBound(r.Config(), requests, last)
			t.Logf("%d requests over %v: %d retries, bound %d (%.1f%%)",
				requests, tc.duration, retries, bound, 100*float64(retries)/float64(bound))
			if retries > bound {
				t.Fatalf("%d retries exceed the bound %d", retries, bound)
			}
			if retries < bound*9/10 {
				t.Fatalf("%d retries: under 90%% of the bound %d, the budget is not usable", retries, bound)
			}
		})
	}
}

// The issue's figures: 10,000 requests at 100 req/s over 100s, every one
// failing: at most 0.1 × 10,000 + 3 + 3 × 100 = 1,303 retries.
func TestRatioIssueFigures(t *testing.T) {
	r, clk := newRatio(t, budget.RatioConfig{})
	retries := 0
	for range 10000 {
		r.Request()
		retries += drain(r)
		clk.Advance(10 * time.Millisecond)
	}
	if retries > 1303 || retries < 1170 {
		t.Fatalf("%d retries, want 1170..1303", retries)
	}
}

// Arrivals at random times and retries asked for at random times (as when
// they come out of different backoffs) stay within the bound too.
func TestRatioBoundHoldsForRandomTraffic(t *testing.T) {
	rnd := rand.New(rand.NewPCG(1, 2))
	for i := range 50 {
		c := budget.RatioConfig{
			Ratio:     []float64{budget.Off, 0.05, 0.1, 0.3, 1}[rnd.IntN(5)],
			Window:    time.Duration(1+rnd.IntN(20)) * 500 * time.Millisecond,
			MinPerSec: []float64{budget.Off, 0.5, 3, 10}[rnd.IntN(4)],
		}
		r, clk := newRatio(t, c)
		requests, retries := 0, 0
		for range 5000 {
			if rnd.IntN(3) > 0 {
				r.Request()
				requests++
			}
			for range rnd.IntN(4) {
				if r.TryRetry() {
					retries++
				}
			}
			clk.Advance(time.Duration(rnd.ExpFloat64() * float64(20*time.Millisecond)))
		}
		if bound := ratioBound(r.Config(), requests, clk.Elapsed()); retries > bound {
			t.Fatalf("case %d %+v: %d retries over %v with %d requests exceed the bound %d",
				i, r.Config(), retries, clk.Elapsed(), requests, bound)
		}
	}
}

// A retry is charged when it is granted: retries still waiting out their
// backoff (or that never run) use up the budget.
func TestRatioChargesRetriesWhenScheduled(t *testing.T) {
	r, clk := newRatio(t, budget.RatioConfig{MinPerSec: budget.Off})
	for range 100 {
		r.Request()
	}
	// Ten failures each schedule a retry; none has run yet.
	for i := range 10 {
		if !r.TryRetry() {
			t.Fatalf("retry %d refused with 100 requests at ratio 0.1", i+1)
		}
	}
	clk.Advance(500 * time.Millisecond) // the retries sleep in backoff
	if r.TryRetry() {
		t.Fatal("11th retry granted: the scheduled ones were not charged")
	}
	if s := r.Stats(); s.Retries != 10 || s.Available != 0 {
		t.Fatalf("Stats() = %+v, want 10 retries, 0 available", s)
	}
}

// With little traffic the floor still grants about MinPerSec retries per
// second; with none at all it grants the floor alone.
func TestRatioFloorServesLowTraffic(t *testing.T) {
	for _, perSec := range []int{0, 1} {
		r, clk := newRatio(t, budget.RatioConfig{})
		requests, retries := 0, 0
		const seconds = 100
		for range seconds * 10 {
			if perSec > 0 && clk.Elapsed()%time.Second == 0 {
				r.Request()
				requests++
			}
			retries += drain(r)
			clk.Advance(100 * time.Millisecond)
		}
		rate := float64(retries) / seconds
		t.Logf("%d req/s: %d retries in %ds (%.2f/s)", perSec, retries, seconds, rate)
		if rate < 2.9 || retries > ratioBound(r.Config(), requests, clk.Elapsed()) {
			t.Fatalf("%d req/s: %.2f retries/s, want about 3 and within the bound", perSec, rate)
		}
	}
	// With no traffic yet, one second of the floor is there at once, not
	// a window's worth.
	r, _ := newRatio(t, budget.RatioConfig{})
	if n := drain(r); n != 3 {
		t.Fatalf("a fresh budget grants %d retries, want 3 (one second of min_per_sec)", n)
	}
}

// The issue's burst: 100 requests arrive at once and every attempt fails.
// Each asks for retries until refused: at most 1 + ratio per request plus
// one second of the floor, not the 30 of a window-sized reservoir.
func TestRatioBurstGetsOneSecondOfFloor(t *testing.T) {
	r, clk := newRatio(t, budget.RatioConfig{})
	for range 100 {
		r.Request()
	}
	n := drain(r)
	if n != 10+3 {
		t.Fatalf("a burst of 100 failing requests got %d retries, want 0.1 × 100 + 3 = 13", n)
	}
	clk.Advance(time.Second/3 + time.Millisecond)
	if got := drain(r); got != 1 {
		t.Fatalf("after 1/3 s the floor granted %d more, want 1", got)
	}
}

// Capacity earned by requests expires with the window, and so do charged
// retries.
func TestRatioWindowRollover(t *testing.T) {
	r, clk := newRatio(t, budget.RatioConfig{MinPerSec: budget.Off})
	for range 1000 {
		r.Request()
	}
	clk.Set(10*time.Second - time.Nanosecond) // last instant of the first window
	if s := r.Stats(); s.Requests != 1000 || s.Available != 100 {
		t.Fatalf("at 9.999s: Stats() = %+v, want 1000 requests, 100 available", s)
	}
	clk.Set(10 * time.Second)
	if r.TryRetry() {
		t.Fatal("retry granted from requests that left the window")
	}
	if s := r.Stats(); s.Requests != 0 || s.Available != 0 {
		t.Fatalf("at 10s: Stats() = %+v, want nothing", s)
	}
	// Long idle: still nothing, and no stale bucket comes back.
	clk.Advance(time.Hour + 3*time.Second)
	if r.TryRetry() {
		t.Fatal("retry granted after an hour without requests")
	}

	// The floor refills with time, one second's worth at most: 3 at once
	// at 2.5s, none a moment later, 3 again a second later, and never
	// more than 3 however long it stayed unused.
	f, clk := newRatio(t, budget.RatioConfig{Ratio: budget.Off})
	clk.Set(2500 * time.Millisecond)
	if n := drain(f); n != 3 {
		t.Fatalf("floor grants %d, want 3", n)
	}
	clk.Set(2800 * time.Millisecond)
	if f.TryRetry() {
		t.Fatal("floor refilled before a third of a second passed")
	}
	clk.Set(3600 * time.Millisecond)
	if n := drain(f); n != 3 {
		t.Fatalf("a second later the floor grants %d, want 3", n)
	}
	clk.Set(time.Hour)
	if n := drain(f); n != 3 {
		t.Fatalf("after an hour idle the floor grants %d, want 3", n)
	}
}

// A clock that steps back never grants more than the window allows.
func TestRatioClockSteppingBack(t *testing.T) {
	r, clk := newRatio(t, budget.RatioConfig{Ratio: budget.Off})
	clk.Set(5 * time.Second)
	drain(r)
	clk.Set(-time.Hour)
	if r.TryRetry() {
		t.Fatal("a clock stepped back refilled the budget")
	}
}

func TestRatioStats(t *testing.T) {
	r, clk := newRatio(t, budget.RatioConfig{Ratio: 0.5, Window: 2 * time.Second, MinPerSec: 1})
	want := budget.Stats{Window: 2 * time.Second, Available: 1}
	if s := r.Stats(); s != want {
		t.Fatalf("fresh: Stats() = %+v, want %+v", s, want)
	}
	for range 7 {
		r.Request()
	}
	r.TryRetry()
	clk.Advance(time.Second)
	want = budget.Stats{Window: 2 * time.Second, Requests: 7, Retries: 1, Available: 3} // ⌊3.5 − 1⌋ + 1 floor token
	if s := r.Stats(); s != want {
		t.Fatalf("Stats() = %+v, want %+v", s, want)
	}
}

// Concurrent requests and retries, with the clock moving underneath them
// (each worker advances it now and then), never over-grant.
func TestRatioConcurrentNeverOverGrants(t *testing.T) {
	for _, c := range []budget.RatioConfig{
		{Window: time.Second},
		{Window: time.Second, MinPerSec: budget.Off},
		{Window: 200 * time.Millisecond, Ratio: 0.5, MinPerSec: 20},
	} {
		r, clk := newRatio(t, c)
		var requests, retries atomic.Int64
		var wg sync.WaitGroup
		for g := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range 20000 {
					if (i+g)%3 == 0 {
						r.Request()
						requests.Add(1)
					}
					if r.TryRetry() {
						retries.Add(1)
					}
					if i%50 == g {
						clk.Advance(time.Millisecond)
					}
				}
			}()
		}
		wg.Wait()
		bound := ratioBound(r.Config(), int(requests.Load()), clk.Elapsed())
		t.Logf("%+v: %d requests, %d retries over %v; bound %d",
			r.Config(), requests.Load(), retries.Load(), clk.Elapsed(), bound)
		if int(retries.Load()) > bound {
			t.Fatalf("%d retries exceed the bound %d", retries.Load(), bound)
		}
		if int(retries.Load()) < bound*8/10 {
			t.Fatalf("%d retries: well under the bound %d", retries.Load(), bound)
		}
	}
}
