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
)

func newCap(t *testing.T, ratio float64, window time.Duration) (*hedge.RateCap, *fakeClock) {
	t.Helper()
	clk := newClock()
	c, err := hedge.NewRateCap(ratio, window, clk)
	if err != nil {
		t.Fatal(err)
	}
	return c, clk
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
		ratio  float64
		window time.Duration
		err    string
	}{
		{-0.1, time.Second, "max_ratio -0.1 must be above 0"},
		{1.5, time.Second, "max_ratio 1.5 must be above 0 and at most 1"},
		{math.NaN(), time.Second, "max_ratio NaN"},
		{math.Inf(1), time.Second, "max_ratio +Inf"},
		{0.1, -time.Second, "window -1s must be at least 10ms"},
		{0.1, 5 * time.Millisecond, "window 5ms must be at least 10ms"},
	} {
		if _, err := hedge.NewRateCap(c.ratio, c.window, nil); err == nil || !strings.Contains(err.Error(), c.err) {
			t.Errorf("NewRateCap(%v, %v) error = %v, want %q", c.ratio, c.window, err, c.err)
		}
	}
	c, err := hedge.NewRateCap(0, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.MaxRatio() != hedge.DefaultMaxRatio || c.Window() != hedge.DefaultWindow {
		t.Errorf("defaults: ratio %v, window %v", c.MaxRatio(), c.Window())
	}
	requests(c, 10)
	if !c.TryHedge() || c.TryHedge() {
		t.Error("the default cap (system clock) does not allow exactly 1 hedge in 10 requests")
	}
	if c, err := hedge.NewRateCap(1, 10*time.Millisecond, nil); err != nil || c.MaxRatio() != 1 {
		t.Errorf("NewRateCap(1, 10ms) = %v, %v", c, err)
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
