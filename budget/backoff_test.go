package budget_test

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/budget"
)

// constRand returns a Rand that always draws x.
func constRand(x float64) func() float64 { return func() float64 { return x } }

// refCeiling is min(cap, base × 2^n) computed in floating point, as a
// reference independent of Backoff's integer arithmetic.
func refCeiling(base, cp time.Duration, n int) time.Duration {
	if base <= 0 {
		base = budget.DefaultBackoffBase
	}
	if cp <= 0 {
		cp = budget.DefaultBackoffCap
	}
	if f := float64(base) * math.Exp2(float64(max(n, 0))); f < float64(cp) {
		return time.Duration(f)
	}
	return cp
}

func TestBackoffCeiling(t *testing.T) {
	cases := []struct {
		b       budget.Backoff
		attempt int
		want    time.Duration
	}{
		{budget.Backoff{}, 0, 100 * time.Millisecond},
		{budget.Backoff{}, 1, 200 * time.Millisecond},
		{budget.Backoff{}, 4, 1600 * time.Millisecond},
		{budget.Backoff{}, 5, 2 * time.Second},
		{budget.Backoff{}, 62, 2 * time.Second},
		{budget.Backoff{}, 63, 2 * time.Second},
		{budget.Backoff{}, 64, 2 * time.Second},
		{budget.Backoff{}, math.MaxInt, 2 * time.Second},
		{budget.Backoff{}, -1, 100 * time.Millisecond},
		{budget.Backoff{}, math.MinInt, 100 * time.Millisecond},
		{budget.Backoff{Base: time.Second, Cap: 500 * time.Millisecond}, 0, 500 * time.Millisecond},
		{budget.Backoff{Base: 1, Cap: math.MaxInt64}, 62, 1 << 62},
		{budget.Backoff{Base: 1, Cap: math.MaxInt64}, 63, math.MaxInt64},
		{budget.Backoff{Base: math.MaxInt64, Cap: math.MaxInt64}, 1, math.MaxInt64},
		{budget.Backoff{Base: -time.Second, Cap: -time.Second}, 2, 400 * time.Millisecond},
	}
	for _, tc := range cases {
		if got := tc.b.Ceiling(tc.attempt); got != tc.want {
			t.Errorf("%+v.Ceiling(%d) = %v, want %v", tc.b, tc.attempt, got, tc.want)
		}
	}
}

// Draws stay within [0, min(cap, base·2^n)] for every n, including those
// where base·2^n overflows.
func TestBackoffDrawsStayWithinCeiling(t *testing.T) {
	rnd := rand.New(rand.NewPCG(5, 6))
	for _, b := range []budget.Backoff{
		{},
		{Base: 10 * time.Millisecond, Cap: time.Minute},
		{Base: 1, Cap: math.MaxInt64},
		{Base: 3 * time.Second, Cap: time.Second},
	} {
		b.Rand = rnd.Float64
		for n := -3; n < 200; n++ {
			ceil := refCeiling(b.Base, b.Cap, n)
			if b.Ceiling(n) != ceil {
				t.Fatalf("%v, %v: Ceiling(%d) = %v, want %v", b.Base, b.Cap, n, b.Ceiling(n), ceil)
			}
			var top time.Duration
			for range 200 {
				d, ok := b.Delay(n, 0, budget.NoDeadline)
				if !ok || d < 0 || d > ceil {
					t.Fatalf("%v, %v: Delay(%d) = %v, %v; want within [0, %v]", b.Base, b.Cap, n, d, ok, ceil)
				}
				top = max(top, d)
			}
			if top < ceil/2 {
				t.Fatalf("%v, %v: Delay(%d) never above %v in 200 draws, ceiling %v", b.Base, b.Cap, n, top, ceil)
			}
		}
	}
	// Extreme and invalid draws are clamped into the range.
	for _, x := range []float64{0, math.Nextafter(1, 0), 1, 2, -1, math.NaN(), math.Inf(1)} {
		b := budget.Backoff{Base: 1, Cap: math.MaxInt64, Rand: constRand(x)}
		if d, ok := b.Delay(100, 0, budget.NoDeadline); !ok || d < 0 {
			t.Errorf("draw %v: Delay = %v, %v", x, d, ok)
		}
	}
}

func TestBackoffIsDeterministicWithInjectedRand(t *testing.T) {
	b := budget.Backoff{Rand: constRand(0.5)}
	for n, want := range []time.Duration{50, 100, 200, 400, 800, 1000, 1000} {
		if d, ok := b.Delay(n, 0, budget.NoDeadline); !ok || d != want*time.Millisecond {
			t.Errorf("Delay(%d) = %v, %v; want %v", n, d, ok, want*time.Millisecond)
		}
	}
}

func TestBackoffRespectsDeadline(t *testing.T) {
	b := budget.Backoff{Rand: constRand(math.Nextafter(1, 0))}
	for _, remaining := range []time.Duration{time.Nanosecond, 30 * time.Millisecond, time.Second, time.Hour} {
		for n := range 10 {
			d, ok := b.Delay(n, 0, remaining)
			if !ok || d > remaining || d > b.Ceiling(n) {
				t.Errorf("Delay(%d, 0, %v) = %v, %v; want ok and ≤ %v", n, remaining, d, ok, min(remaining, b.Ceiling(n)))
			}
		}
	}
	if d, ok := b.Delay(0, 0, -time.Millisecond); ok || d != 0 {
		t.Errorf("past deadline: Delay = %v, %v; want 0, false", d, ok)
	}
}

func TestBackoffHonoursRetryAfter(t *testing.T) {
	cases := []struct {
		name                  string
		draw                  float64
		attempt               int
		retryAfter, remaining time.Duration
		want                  time.Duration
		ok                    bool
	}{
		{"fits, no deadline: at least Retry-After", 0, 0, 2 * time.Second, budget.NoDeadline, 2 * time.Second, true},
		{"fits: at least Retry-After", 0.9, 0, 2 * time.Second, 10 * time.Second, 2 * time.Second, true},
		{"jitter above Retry-After wins", 0.5, 10, 200 * time.Millisecond, budget.NoDeadline, time.Second, true},
		{"jitter bounded by deadline", 0.99, 10, 200 * time.Millisecond, 300 * time.Millisecond, 297 * time.Millisecond, true},
		{"exactly fits", 1, 0, 2 * time.Second, 2 * time.Second, 2 * time.Second, true},
		{"does not fit: return it now", 0, 0, 30 * time.Second, 5 * time.Second, 30 * time.Second, false},
		{"does not fit by 1ns", 0, 0, 2*time.Second + 1, 2 * time.Second, 2*time.Second + 1, false},
		{"absurd Retry-After clamped", 0, 0, 1000 * time.Hour, budget.NoDeadline, budget.MaxRetryAfter, true},
		{"absurd Retry-After, deadline", 0, 0, 1000 * time.Hour, time.Minute, budget.MaxRetryAfter, false},
		{"past deadline", 0, 0, time.Second, -time.Second, 0, false},
		{"negative Retry-After ignored", 0.5, 0, -time.Second, budget.NoDeadline, 50 * time.Millisecond, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := budget.Backoff{Rand: constRand(tc.draw)}
			d, ok := b.Delay(tc.attempt, tc.retryAfter, tc.remaining)
			if d != tc.want || ok != tc.ok {
				t.Fatalf("Delay(%d, %v, %v) = %v, %v; want %v, %v", tc.attempt, tc.retryAfter, tc.remaining, d, ok, tc.want, tc.ok)
			}
		})
	}
	// Retry-After parsed from a header flows straight in.
	now := time.Date(2026, 11, 30, 6, 0, 0, 0, time.UTC)
	ra, _ := budget.ParseRetryAfter("Mon, 30 Nov 2026 06:00:03 GMT", now)
	if d, ok := (budget.Backoff{}).Delay(0, ra, 5*time.Second); !ok || d < 3*time.Second || d > 5*time.Second {
		t.Fatalf("Delay with Retry-After 3s, 5s left = %v, %v", d, ok)
	}
}

// FuzzBackoffDelay checks Delay's invariants for any configuration, attempt,
// Retry-After, deadline and draw.
func FuzzBackoffDelay(f *testing.F) {
	f.Add(int64(0), int64(0), 0, int64(0), int64(0), 0.5)
	f.Add(int64(100e6), int64(2e9), 3, int64(2e9), int64(5e9), 0.99)
	f.Add(int64(1), int64(math.MaxInt64), 63, int64(0), int64(0), 1.0)
	f.Add(int64(-1), int64(-1), -5, int64(-1), int64(-1), math.NaN())
	f.Add(int64(100e6), int64(2e9), math.MaxInt, int64(30e9), int64(1e9), 0.0)
	f.Fuzz(func(t *testing.T, base, cp int64, attempt int, retryAfter, remaining int64, draw float64) {
		b := budget.Backoff{Base: time.Duration(base), Cap: time.Duration(cp), Rand: constRand(draw)}
		ra, rem := time.Duration(retryAfter), time.Duration(remaining)
		d, ok := b.Delay(attempt, ra, rem)
		ceil := b.Ceiling(attempt)
		if want := refCeiling(b.Base, b.Cap, attempt); math.Abs(float64(ceil-want)) > 1e-12*float64(want) {
			t.Fatalf("Ceiling(%d) = %v, reference %v", attempt, ceil, want)
		}
		if ceil <= 0 {
			t.Fatalf("Ceiling(%d) = %v", attempt, ceil)
		}
		if d < 0 {
			t.Fatalf("negative delay %v", d)
		}
		raWant := min(ra, budget.MaxRetryAfter)
		switch {
		case rem < 0:
			if ok || d != 0 {
				t.Fatalf("past deadline: %v, %v", d, ok)
			}
		case !ok:
			if !(raWant > 0 && rem > 0 && raWant > rem) || d != raWant {
				t.Fatalf("refused without cause: Delay(%d, %v, %v) = %v, false", attempt, ra, rem, d)
			}
		case raWant > 0:
			if d < raWant || (rem > 0 && d > rem) || d > max(raWant, ceil) {
				t.Fatalf("Delay(%d, %v, %v) = %v; want in [%v, min(%v, max(Retry-After, %v))]", attempt, ra, rem, d, raWant, rem, ceil)
			}
		default:
			if d > ceil || (rem > 0 && d > rem) {
				t.Fatalf("Delay(%d, 0, %v) = %v; ceiling %v", attempt, rem, d, ceil)
			}
		}
	})
}
