package hedge_test

import (
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/hedge"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// tolerance is the bucket error bound, plus rounding to whole nanoseconds.
const tolerance = hedge.TrackerRelativeError + 1e-6

// exactQuantile returns the sample of rank ceil(q·n) (1-based) of sorted.
func exactQuantile(sorted []time.Duration, q float64) time.Duration {
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[max(i, 0)]
}

// checkQuantiles observes samples without moving time (all weigh 1) and
// compares the tracker's quantiles with the exact ones.
func checkQuantiles(t *testing.T, samples []time.Duration) {
	t.Helper()
	tr := hedge.NewLatencyTracker(time.Minute, newClock())
	for _, d := range samples {
		tr.Observe(d)
	}
	if got := tr.Count(); got != float64(len(samples)) {
		t.Errorf("Count() = %v, want %d", got, len(samples))
	}
	sorted := slices.Clone(samples)
	slices.Sort(sorted)
	for _, q := range []float64{0, 0.01, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1} {
		got, ok := tr.Quantile(q)
		want := exactQuantile(sorted, q)
		if !ok || relErr(got, want) > tolerance {
			t.Errorf("Quantile(%v) = %v, %v; want %v ±%.0f%%", q, got, ok, want, 100*hedge.TrackerRelativeError)
		}
	}
}

func TestQuantileUniformWithinBucketError(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	s := make([]time.Duration, 100_000)
	for i := range s {
		s[i] = 100*time.Millisecond + time.Duration(r.Int64N(int64(1900*time.Millisecond)))
	}
	checkQuantiles(t, s)
}

func TestQuantileLognormalWithinBucketError(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	s := make([]time.Duration, 100_000)
	for i := range s {
		// Median 150ms, σ 0.5: p99 ≈ 480ms.
		s[i] = time.Duration(150e6 * math.Exp(0.5*r.NormFloat64()))
	}
	checkQuantiles(t, s)
}

func TestQuantileStragglerMixtureWithinBucketError(t *testing.T) {
	// The tail experiment: 95% lognormal around 150ms, 5% stalled
	// for 2–5s.
	r := rand.New(rand.NewPCG(5, 6))
	s := make([]time.Duration, 100_000)
	for i := range s {
		if r.Float64() < 0.05 {
			s[i] = 2*time.Second + time.Duration(r.Int64N(int64(3*time.Second)))
		} else {
			s[i] = time.Duration(150e6 * math.Exp(0.3*r.NormFloat64()))
		}
	}
	checkQuantiles(t, s)
}

func TestQuantileErrorBoundAcrossRange(t *testing.T) {
	// 2,000 values spread geometrically over [1ms, 10min], each alone in
	// its tracker.
	ratio := math.Pow(float64(hedge.TrackerMax/hedge.TrackerMin), 1.0/1999)
	for i := range 2000 {
		d := time.Duration(float64(hedge.TrackerMin) * math.Pow(ratio, float64(i)))
		d = min(max(d, hedge.TrackerMin), hedge.TrackerMax)
		tr := hedge.NewLatencyTracker(0, newClock())
		for range 20 {
			tr.Observe(d)
		}
		if got, ok := tr.Quantile(0.5); !ok || relErr(got, d) > tolerance {
			t.Fatalf("one value %v: Quantile(0.5) = %v, %v (error %.4f)", d, got, ok, relErr(got, d))
		}
	}
}

func TestValuesOutsideRangeCountAsBounds(t *testing.T) {
	for _, c := range []struct{ in, want time.Duration }{
		{0, hedge.TrackerMin},
		{-time.Second, hedge.TrackerMin},
		{100 * time.Microsecond, hedge.TrackerMin},
		{time.Hour, hedge.TrackerMax},
		{math.MaxInt64, hedge.TrackerMax},
	} {
		tr := hedge.NewLatencyTracker(0, newClock())
		for range 20 {
			tr.Observe(c.in)
		}
		if got, ok := tr.Quantile(0.5); !ok || relErr(got, c.want) > tolerance {
			t.Errorf("Observe(%v): Quantile(0.5) = %v, %v; want about %v", c.in, got, ok, c.want)
		}
	}
}

func TestQuantileNeedsMinSamples(t *testing.T) {
	clk := newClock()
	tr := hedge.NewLatencyTracker(time.Minute, clk)
	if _, ok := tr.Quantile(0.95); ok {
		t.Fatal("empty tracker answered")
	}
	for i := 1; i <= 20; i++ {
		tr.Observe(200 * time.Millisecond)
		if _, ok := tr.Quantile(0.95); ok != (float64(i) >= hedge.MinSamples) {
			t.Fatalf("after %d samples: ok = %v", i, ok)
		}
	}
	// One half-life later the 20 samples weigh 10: not enough any more.
	clk.Advance(time.Minute)
	if n := tr.Count(); math.Abs(n-10) > 1e-9 {
		t.Fatalf("Count() after a half-life = %v, want 10", n)
	}
	if _, ok := tr.Quantile(0.95); ok {
		t.Fatal("answered with a decayed weight of 10")
	}
	for _, q := range []float64{-0.1, 1.1, math.NaN(), math.Inf(1)} {
		if _, ok := tr.Quantile(q); ok {
			t.Errorf("Quantile(%v) answered", q)
		}
	}
}

func TestCountHalvesEveryHalfLife(t *testing.T) {
	clk := newClock()
	tr := hedge.NewLatencyTracker(10*time.Second, clk)
	if tr.HalfLife() != 10*time.Second {
		t.Fatalf("HalfLife() = %v", tr.HalfLife())
	}
	for range 1000 {
		tr.Observe(time.Second)
	}
	for _, c := range []struct {
		after time.Duration
		want  float64
	}{{0, 1000}, {10 * time.Second, 500}, {10 * time.Second, 250}, {5 * time.Second, 250 / math.Sqrt2}, {time.Hour, 0}} {
		clk.Advance(c.after)
		if got := tr.Count(); math.Abs(got-c.want) > 1e-9*c.want+1e-12 {
			t.Errorf("Count() = %v, want %v", got, c.want)
		}
	}
}

func TestDefaultsOfNewLatencyTracker(t *testing.T) {
	for _, hl := range []time.Duration{0, -time.Second} {
		if got := hedge.NewLatencyTracker(hl, nil).HalfLife(); got != hedge.DefaultHalfLife {
			t.Errorf("NewLatencyTracker(%v).HalfLife() = %v, want %v", hl, got, hedge.DefaultHalfLife)
		}
	}
	// With the system clock time passes between observations, so 20 would
	// weigh a little under MinSamples.
	tr := hedge.NewLatencyTracker(0, nil)
	for range 25 {
		tr.Observe(300 * time.Millisecond)
	}
	if got, ok := tr.Quantile(0.5); !ok || relErr(got, 300*time.Millisecond) > tolerance {
		t.Errorf("with the system clock: Quantile(0.5) = %v, %v", got, ok)
	}
}

// regime feeds tr 10 TTFTs per second, lognormal (σ 0.1) around median,
// for d, and calls check after every second.
func regime(clk *clocktest.Fake, tr *hedge.LatencyTracker, r *rand.Rand, median, d time.Duration, check func(elapsed time.Duration) bool) {
	for el := time.Duration(0); el < d; el += time.Second {
		for range 10 {
			tr.Observe(time.Duration(float64(median) * math.Exp(0.1*r.NormFloat64())))
			clk.Advance(100 * time.Millisecond)
		}
		if check != nil && !check(el+time.Second) {
			return
		}
	}
}

func TestP95FollowsRegimeChange(t *testing.T) {
	const halfLife = time.Minute
	clk := newClock()
	tr := hedge.NewLatencyTracker(halfLife, clk)
	r := rand.New(rand.NewPCG(7, 8))
	p95 := func() time.Duration {
		d, ok := tr.Quantile(0.95)
		if !ok {
			t.Fatal("no p95")
		}
		return d
	}
	// The p95 of each regime: the median × e^(0.1·1.645).
	fast := time.Duration(150e6 * math.Exp(0.1*1.645))
	slow := time.Duration(2e9 * math.Exp(0.1*1.645))

	regime(clk, tr, r, 150*time.Millisecond, 10*time.Minute, nil)
	if got := p95(); relErr(got, fast) > 0.1 {
		t.Fatalf("steady p95 = %v, want about %v", got, fast)
	}

	// TTFT jumps to 2s: within 2 half-lives the p95 is the new regime's.
	// (It gets there once the new samples weigh over 5% of the total, in a
	// few seconds.)
	var took time.Duration
	regime(clk, tr, r, 2*time.Second, 2*halfLife, func(el time.Duration) bool {
		if relErr(p95(), slow) <= 0.1 {
			took = el
			return false
		}
		return true
	})
	if took == 0 {
		t.Fatalf("p95 = %v after 2 half-lives of 2s TTFTs, want about %v", p95(), slow)
	}
	t.Logf("p95 followed the rise to 2s in %v", took)
	regime(clk, tr, r, 2*time.Second, 2*halfLife, nil)

	// Back to 150ms: the p95 comes down once the old samples weigh under
	// 5%, after log2(20) ≈ 4.3 half-lives; not after 2, surely after 5.
	regime(clk, tr, r, 150*time.Millisecond, 2*halfLife, nil)
	if got := p95(); relErr(got, fast) <= 0.5 {
		t.Fatalf("p95 = %v already down after 2 half-lives", got)
	}
	regime(clk, tr, r, 150*time.Millisecond, 3*halfLife, nil)
	if got := p95(); relErr(got, fast) > 0.1 {
		t.Fatalf("p95 = %v after 5 half-lives back at 150ms, want about %v", got, fast)
	}
}

func TestRescaleKeepsQuantilesAndCount(t *testing.T) {
	// A half-life of 5s and 100 minutes of traffic: the landmark moves on
	// twice (every 512 half-lives, 42m40s).
	clk := newClock()
	tr := hedge.NewLatencyTracker(5*time.Second, clk)
	r := rand.New(rand.NewPCG(9, 10))
	regime(clk, tr, r, 150*time.Millisecond, 100*time.Minute, nil)
	// Steady state of 10 samples a second, 0.1s apart, half-life 5s:
	// Σ 2^(-k/50), k ≥ 1 (the newest sample is 0.1s old).
	want := math.Exp2(-0.02) / (1 - math.Exp2(-0.02))
	if got := tr.Count(); math.Abs(got-want) > 1e-6*want {
		t.Errorf("Count() = %v, want %v", got, want)
	}
	if got, ok := tr.Quantile(0.5); !ok || relErr(got, 150*time.Millisecond) > 0.1 {
		t.Errorf("Quantile(0.5) = %v, %v", got, ok)
	}

	// Idle for 10,000 half-lives: everything forgotten, nothing overflows.
	clk.Advance(10000 * 5 * time.Second)
	if got := tr.Count(); got != 0 {
		t.Errorf("Count() after a long idle = %v", got)
	}
	if _, ok := tr.Quantile(0.5); ok {
		t.Error("Quantile answered after a long idle")
	}
	for range 20 {
		tr.Observe(time.Second)
	}
	if got := tr.Count(); got != 20 {
		t.Errorf("Count() = %v after 20 fresh samples", got)
	}
	if got, ok := tr.Quantile(0.5); !ok || relErr(got, time.Second) > tolerance {
		t.Errorf("Quantile(0.5) = %v, %v after 20 fresh samples", got, ok)
	}
}

func TestObserveConcurrent(t *testing.T) {
	tr := hedge.NewLatencyTracker(time.Minute, newClock())
	const g, n = 8, 5000
	var wg sync.WaitGroup
	for i := range g {
		wg.Go(func() {
			for j := range n {
				tr.Observe(time.Duration(i*n+j) * time.Microsecond)
				if j%100 == 0 {
					tr.Quantile(0.95)
				}
			}
		})
	}
	wg.Wait()
	if got := tr.Count(); got != g*n {
		t.Fatalf("Count() = %v, want %d: observations lost", got, g*n)
	}
}

func TestObserveConcurrentWithRescales(t *testing.T) {
	// A 1µs half-life and a clock moving under the observers: rescales
	// happen while others observe. Nothing may become NaN or infinite.
	clk := newClock()
	tr := hedge.NewLatencyTracker(time.Microsecond, clk)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
				clk.Advance(50 * time.Microsecond)
			}
		}
	})
	var obs sync.WaitGroup
	for range 4 {
		obs.Go(func() {
			for range 20000 {
				tr.Observe(time.Second)
			}
		})
	}
	obs.Wait()
	close(stop)
	wg.Wait()
	if c := tr.Count(); math.IsNaN(c) || math.IsInf(c, 0) || c < 0 {
		t.Fatalf("Count() = %v", c)
	}
	for range 20 {
		tr.Observe(time.Second)
	}
	if got, ok := tr.Quantile(0.5); !ok || relErr(got, time.Second) > tolerance {
		t.Fatalf("Quantile(0.5) = %v, %v", got, ok)
	}
}

func TestTrackerAllocatesNothing(t *testing.T) {
	tr := hedge.NewLatencyTracker(time.Minute, newClock())
	for range 100 {
		tr.Observe(200 * time.Millisecond)
	}
	if a := testing.AllocsPerRun(1000, func() { tr.Observe(300 * time.Millisecond) }); a != 0 {
		t.Errorf("Observe: %v allocs", a)
	}
	if a := testing.AllocsPerRun(1000, func() { tr.Quantile(0.95) }); a != 0 {
		t.Errorf("Quantile: %v allocs", a)
	}
	p := hedge.DelayPolicy{Percentile: 0.95, Min: 100 * time.Millisecond, Max: 2 * time.Second}
	if a := testing.AllocsPerRun(1000, func() { p.Delay(tr) }); a != 0 {
		t.Errorf("Delay: %v allocs", a)
	}
}
