package hedge_test

import (
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/hedge"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// newCap returns a cap without the floor (MinPerSec Off), so that the ratio
// alone decides, on a fake clock.
func newCap(t *testing.T, ratio float64, window time.Duration) (*hedge.RateCap, *clocktest.Fake) {
	t.Helper()
	return newCapConfig(t, hedge.RateCapConfig{MaxRatio: ratio, MinPerSec: hedge.Off, Window: window})
}

// newCapConfig returns a cap configured by c on a fake clock.
func newCapConfig(t *testing.T, c hedge.RateCapConfig) (*hedge.RateCap, *clocktest.Fake) {
	t.Helper()
	clk := newClock()
	rc, err := hedge.NewRateCap(c, clk)
	if err != nil {
		t.Fatal(err)
	}
	return rc, clk
}

func requests(c *hedge.RateCap, n int) {
	for range n {
		c.Request()
	}
}

// tryHedges calls TryHedge n times and returns how many were granted.
func tryHedges(c *hedge.RateCap, n int) int {
	granted := 0
	for range n {
		if c.TryHedge() {
			granted++
		}
	}
	return granted
}

func wantStats(t *testing.T, c *hedge.RateCap, req, hedges float64) {
	t.Helper()
	if r, h := c.Stats(); r != req || h != hedges {
		t.Fatalf("Stats() = %v requests, %v hedges; want %v, %v", r, h, req, hedges)
	}
}

func TestNewRateCapValidatesAndDefaults(t *testing.T) {
	for _, c := range []struct {
		cfg hedge.RateCapConfig
		err string
	}{
		{hedge.RateCapConfig{MaxRatio: -0.1}, "max_ratio -0.1 must be above 0"},
		{hedge.RateCapConfig{MaxRatio: 1.5}, "max_ratio 1.5 must be above 0 and at most 1"},
		{hedge.RateCapConfig{MaxRatio: math.NaN()}, "max_ratio NaN"},
		{hedge.RateCapConfig{MaxRatio: math.Inf(1)}, "max_ratio +Inf"},
		{hedge.RateCapConfig{MaxRatio: hedge.Off}, "max_ratio -1 must be above 0"},
		{hedge.RateCapConfig{MinPerSec: -0.5}, "min_per_sec -0.5 must be above 0 and at most 1e+06, or Off (-1)"},
		{hedge.RateCapConfig{MinPerSec: 2e6}, "min_per_sec 2e+06"},
		{hedge.RateCapConfig{MinPerSec: math.NaN()}, "min_per_sec NaN"},
		{hedge.RateCapConfig{MinPerSec: math.Inf(1)}, "min_per_sec +Inf"},
		{hedge.RateCapConfig{Window: -time.Second}, "window -1s must be at least 10ms"},
		{hedge.RateCapConfig{Window: 5 * time.Millisecond}, "window 5ms must be at least 10ms"},
	} {
		if _, err := hedge.NewRateCap(c.cfg, nil); err == nil || !strings.Contains(err.Error(), c.err) {
			t.Errorf("NewRateCap(%+v) error = %v, want %q", c.cfg, err, c.err)
		}
	}
	c, err := hedge.NewRateCap(hedge.RateCapConfig{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := hedge.RateCapConfig{MaxRatio: hedge.DefaultMaxRatio, MinPerSec: hedge.DefaultMinPerSec, Window: hedge.DefaultWindow}
	if c.Config() != want || c.MaxRatio() != want.MaxRatio || c.MinPerSec() != want.MinPerSec || c.Window() != want.Window {
		t.Errorf("defaults: %+v", c.Config())
	}
	// The default cap (system clock): 0.1 × 10 requests + 1/s × 10s.
	requests(c, 10)
	if got := tryHedges(c, 20); got != 11 {
		t.Errorf("the default cap granted %d hedges for 10 requests, want 11", got)
	}
	if c, err := hedge.NewRateCap(hedge.RateCapConfig{MaxRatio: 1, MinPerSec: hedge.Off, Window: 10 * time.Millisecond}, nil); err != nil || c.MaxRatio() != 1 || c.MinPerSec() != 0 {
		t.Errorf("NewRateCap(1, Off, 10ms) = %v, %v", c, err)
	}
	// The window is kept as ten buckets: rounded down to 10ns.
	if c, err := hedge.NewRateCap(hedge.RateCapConfig{Window: time.Second + 19}, nil); err != nil || c.Window() != time.Second+10 {
		t.Errorf("window 1s+19ns: %v, %v", c, err)
	}
}

func TestRateCapIsExactAtTheRatio(t *testing.T) {
	for _, c := range []struct {
		ratio    float64
		requests int
		want     int
	}{
		{0.1, 0, 0},
		{0.1, 9, 0},
		{0.1, 10, 1},
		{0.1, 19, 1},
		{0.1, 20, 2},
		{0.1, 10000, 1000},
		// float64 gives 0.29·100 = 28.999999999999996; the cap must
		// still allow 29.
		{0.29, 100, 29},
		{0.07, 100, 7},
		{1, 5, 5},
		{0.333333, 3, 0},
		{0.333334, 3, 1},
	} {
		rc, _ := newCap(t, c.ratio, 10*time.Second)
		requests(rc, c.requests)
		if got := tryHedges(rc, c.requests+5); got != c.want {
			t.Errorf("ratio %v, %d requests: %d hedges granted, want %d", c.ratio, c.requests, got, c.want)
		}
		wantStats(t, rc, float64(c.requests), float64(c.want))
	}
}

func TestRateCapHedgeNeedsAnotherRequestOnceFull(t *testing.T) {
	rc, _ := newCap(t, 0.1, 10*time.Second)
	requests(rc, 10)
	if !rc.TryHedge() {
		t.Fatal("refused the first hedge of 10 requests")
	}
	for i := 11; i <= 40; i++ {
		rc.Request()
		// The (i/10)th hedge becomes available at the 10·kth request.
		if got, want := rc.TryHedge(), i%10 == 0; got != want {
			t.Fatalf("request %d: TryHedge() = %v, want %v", i, got, want)
		}
	}
	wantStats(t, rc, 40, 4)
}

func TestRateCapWindowRollsOver(t *testing.T) {
	// A 10s window of ten 1s buckets aligned to the cap's creation.
	rc, clk := newCap(t, 0.1, 10*time.Second)
	requests(rc, 10)
	if !rc.TryHedge() {
		t.Fatal("refused the first hedge")
	}
	clk.Advance(5 * time.Second)
	requests(rc, 10) // bucket of t=5s
	if !rc.TryHedge() || rc.TryHedge() {
		t.Fatal("want exactly one more hedge at 20 requests")
	}
	wantStats(t, rc, 20, 2)

	// Last instant of the first bucket's window: still counted.
	clk.Advance(5*time.Second - 1)
	wantStats(t, rc, 20, 2)
	if rc.TryHedge() {
		t.Fatal("granted a third hedge at 20 requests")
	}
	// t = 10s: the t=0 bucket (10 requests, 1 hedge) leaves the window.
	clk.Advance(1)
	wantStats(t, rc, 10, 1)
	if rc.TryHedge() {
		t.Fatal("granted a second hedge at 10 requests")
	}
	// t = 15s: the t=5s bucket leaves too; nothing is left.
	clk.Advance(5 * time.Second)
	wantStats(t, rc, 0, 0)
	if rc.TryHedge() {
		t.Fatal("granted a hedge without requests")
	}
	requests(rc, 10)
	if !rc.TryHedge() {
		t.Fatal("refused a hedge after 10 new requests")
	}
	// A long idle forgets everything, without wrapping around.
	clk.Advance(1000 * time.Hour)
	wantStats(t, rc, 0, 0)
}

func TestRateCapBoundsHedgesOverTime(t *testing.T) {
	// 10,000 requests at random times over ~200s, each of which wants to
	// hedge with probability 0.3 (a slow fleet). At every grant, hedges ≤
	// ratio × requests over the window; overall hedging is held to ~10%.
	rc, clk := newCap(t, 0.1, 10*time.Second)
	r := rand.New(rand.NewPCG(11, 12))
	granted := 0
	for i := range 10000 {
		clk.Advance(time.Duration(r.Int64N(int64(40 * time.Millisecond))))
		rc.Request()
		if r.Float64() >= 0.3 {
			continue
		}
		if rc.TryHedge() {
			granted++
			req, h := rc.Stats()
			if h*10 > req {
				t.Fatalf("request %d: %v hedges for %v requests in the window", i, h, req)
			}
		}
	}
	if granted > 1000+100 || granted < 900 {
		t.Errorf("%d hedges granted for 10,000 requests, want about 1,000", granted)
	}
}

func TestRateCapConcurrentTryHedgeNeverExceedsCap(t *testing.T) {
	rc, _ := newCap(t, 0.1, 10*time.Second)
	requests(rc, 1000)
	var granted atomic.Int64
	var wg sync.WaitGroup
	for range 64 {
		wg.Go(func() { granted.Add(int64(tryHedges(rc, 50))) })
	}
	wg.Wait()
	if g := granted.Load(); g != 100 {
		t.Fatalf("%d hedges granted for 1,000 requests, want exactly 100", g)
	}
	wantStats(t, rc, 1000, 100)
}

func TestRateCapConcurrentRequestsAndHedges(t *testing.T) {
	// Requests and hedges interleave on many goroutines while the clock
	// moves across buckets; a hedge is granted only within the cap.
	rc, clk := newCap(t, 0.1, 10*time.Second)
	var granted, reqs atomic.Int64
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Go(func() {
			for i := range 2000 {
				rc.Request()
				reqs.Add(1)
				if (g+i)%3 == 0 && rc.TryHedge() {
					granted.Add(1)
				}
				if g == 0 && i%200 == 0 {
					clk.Advance(100 * time.Millisecond)
				}
			}
		})
	}
	wg.Wait()
	// Less than one window passed: nothing has expired.
	if g, n := granted.Load(), reqs.Load(); g*10 > n {
		t.Fatalf("%d hedges for %d requests", g, n)
	}
	req, h := rc.Stats()
	if req != float64(reqs.Load()) || h != float64(granted.Load()) {
		t.Fatalf("Stats() = %v, %v; want %d, %d", req, h, reqs.Load(), granted.Load())
	}
}

func TestRateCapAllocatesNothing(t *testing.T) {
	rc, _ := newCap(t, 0.1, 10*time.Second)
	if a := testing.AllocsPerRun(1000, rc.Request); a != 0 {
		t.Errorf("Request: %v allocs", a)
	}
	if a := testing.AllocsPerRun(1000, func() { rc.TryHedge() }); a != 0 {
		t.Errorf("TryHedge: %v allocs", a)
	}
}

// TestRateCapFloorHedgesAtLowTraffic is the regression test for hedging
// that never fired at low traffic: one request a second, every one stalled
// past its hedge delay. Without the floor, 0.1 × (fewer than 10 requests in
// the window) allowed no hedge, so the first requests, on a fresh gateway,
// all waited for the stalled upstream.
func TestRateCapFloorHedgesAtLowTraffic(t *testing.T) {
	rc, clk := newCapConfig(t, hedge.RateCapConfig{}) // defaults: 0.1, 1/s, 10s
	for i := range 20 {
		rc.Request()
		if !rc.TryHedge() {
			t.Fatalf("second %d: the stalled request could not hedge", i)
		}
		clk.Advance(time.Second)
	}
	// At t = 20s the window holds the 9 requests of t = 11…19s and their
	// hedges.
	wantStats(t, rc, 9, 9)
}

func TestRateCapFloorIsExact(t *testing.T) {
	for _, c := range []struct {
		name      string
		ratio     float64
		minPerSec float64
		window    time.Duration
		requests  int
		want      int
	}{
		{"no traffic: the reservoir", 0.1, 1, 10 * time.Second, 0, 10},
		{"ratio and reservoir add up", 0.1, 1, 10 * time.Second, 10, 11},
		{"below one hedge from the ratio", 0.1, 1, 10 * time.Second, 19, 11},
		{"default floor", 0.1, 0, 10 * time.Second, 25, 12},
		{"fractional reservoir rounds down", 0.1, 0.25, 10 * time.Second, 0, 2},
		// float64 gives 0.1 × 1 + 0.09 × 10 = 0.9999999999999999.
		{"decimal floor is exact", 0.1, 0.09, 10 * time.Second, 1, 1},
		{"decimal ratio and floor are exact", 0.3, 0.03, 10 * time.Second, 9, 3},
		{"halves make a whole", 0.1, 0.05, 10 * time.Second, 5, 1},
		{"short window, small reservoir", 0.1, 1, 500 * time.Millisecond, 0, 0},
		{"short window, reservoir and ratio", 0.1, 2, 500 * time.Millisecond, 0, 1},
		{"largest floor", 1, hedge.MaxMinPerSec, 10 * time.Millisecond, 0, 10000},
		{"floor off", 0.1, hedge.Off, 10 * time.Second, 9, 0},
		{"floor off, ratio only", 0.1, hedge.Off, 10 * time.Second, 10, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			rc, _ := newCapConfig(t, hedge.RateCapConfig{MaxRatio: c.ratio, MinPerSec: c.minPerSec, Window: c.window})
			requests(rc, c.requests)
			if got := tryHedges(rc, c.want+50); got != c.want {
				t.Fatalf("%d hedges granted, want %d", got, c.want)
			}
			wantStats(t, rc, float64(c.requests), float64(c.want))
		})
	}
}

func TestRateCapFloorRefillsAsHedgesLeaveTheWindow(t *testing.T) {
	rc, clk := newCapConfig(t, hedge.RateCapConfig{MaxRatio: 0.1, MinPerSec: 1, Window: 10 * time.Second})
	if got := tryHedges(rc, 20); got != 10 {
		t.Fatalf("burst: %d hedges, want the reservoir of 10", got)
	}
	clk.Advance(10*time.Second - 1)
	if rc.TryHedge() {
		t.Fatal("granted a hedge with the reservoir spent")
	}
	rc.Request() // 1 request earns 0.1 hedge: not enough
	if rc.TryHedge() {
		t.Fatal("granted a hedge for 0.1 of one")
	}
	clk.Advance(1) // t = 10s: the burst's bucket leaves the window
	if got := tryHedges(rc, 20); got != 10 {
		t.Fatalf("after the window: %d hedges, want 10", got)
	}
}

func TestRateCapFloorNeverExceedsTheBound(t *testing.T) {
	// Requests and hedges race on many goroutines, on one frozen bucket
	// and then on a clock that crosses buckets and windows. The bound:
	// 0.1 × requests + 1/s × 10s per window of the run.
	t.Run("one bucket, exact", func(t *testing.T) {
		rc, _ := newCapConfig(t, hedge.RateCapConfig{MaxRatio: 0.1, MinPerSec: 1, Window: 10 * time.Second})
		requests(rc, 1000)
		var granted atomic.Int64
		var wg sync.WaitGroup
		for range 64 {
			wg.Go(func() { granted.Add(int64(tryHedges(rc, 50))) })
		}
		wg.Wait()
		if g := granted.Load(); g != 110 {
			t.Fatalf("%d hedges granted for 1,000 requests, want exactly 100 + 10", g)
		}
		wantStats(t, rc, 1000, 110)
	})
	t.Run("requests racing hedges", func(t *testing.T) {
		rc, _ := newCapConfig(t, hedge.RateCapConfig{MaxRatio: 0.1, MinPerSec: 1, Window: 10 * time.Second})
		var granted, reqs atomic.Int64
		var wg sync.WaitGroup
		for g := range 16 {
			wg.Go(func() {
				for range 500 {
					if g%2 == 0 {
						rc.Request()
						reqs.Add(1)
					} else if rc.TryHedge() {
						granted.Add(1)
					}
				}
			})
		}
		wg.Wait()
		if g, n := granted.Load(), reqs.Load(); g*10 > n+100 {
			t.Fatalf("%d hedges for %d requests, above 0.1 × requests + 10", g, n)
		}
	})
	t.Run("clock crossing windows", func(t *testing.T) {
		rc, clk := newCapConfig(t, hedge.RateCapConfig{MaxRatio: 0.1, MinPerSec: 1, Window: 10 * time.Second})
		var granted, reqs atomic.Int64
		var wg sync.WaitGroup
		for g := range 16 {
			wg.Go(func() {
				for i := range 2000 {
					if i%4 == 0 {
						rc.Request()
						reqs.Add(1)
					}
					if rc.TryHedge() {
						granted.Add(1)
					}
					if g == 0 && i%50 == 0 {
						clk.Advance(time.Second)
					}
				}
			})
		}
		wg.Wait()
		// 40 s elapsed: at most ⌊40/10⌋ + 1 = 5 reservoirs.
		if g, n := granted.Load(), reqs.Load(); g*10 > n+5*100 {
			t.Fatalf("%d hedges for %d requests over 40s, above 0.1 × requests + 50", g, n)
		}
	})
}

func TestRateCapFloorBoundsHedgesOverTime(t *testing.T) {
	// 2,000 requests at random times over ~200s (10/s), half of which want
	// to hedge. At every grant, counting it, hedges ≤ 0.1 × requests + 10
	// over the window; over the run, at most 0.1 × requests + 10 per
	// window of the run (⌊T/W⌋ + 1 of them).
	rc, clk := newCapConfig(t, hedge.RateCapConfig{MaxRatio: 0.1, MinPerSec: 1, Window: 10 * time.Second})
	r := rand.New(rand.NewPCG(21, 22))
	granted := 0
	for i := range 2000 {
		clk.Advance(time.Duration(r.Int64N(int64(200 * time.Millisecond))))
		rc.Request()
		if r.Float64() >= 0.5 {
			continue
		}
		if rc.TryHedge() {
			granted++
			if req, h := rc.Stats(); h*10 > req+100 {
				t.Fatalf("request %d: %v hedges for %v requests in the window", i, h, req)
			}
		}
	}
	windows := int(clk.Now().Sub(t0)/(10*time.Second)) + 1
	if bound := 200 + 10*windows; granted > bound {
		t.Errorf("%d hedges granted for 2,000 requests in %d windows, above %d", granted, windows, bound)
	}
	if granted < 200+5*windows {
		t.Errorf("%d hedges granted: the floor is not being used", granted)
	}
}
