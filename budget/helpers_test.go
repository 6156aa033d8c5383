package budget_test

import (
	"math"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/budget"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// t0 is the fake clock's start.
var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// newRatio builds a Ratio on a fresh fake clock.
func newRatio(t testing.TB, c budget.RatioConfig) (*budget.Ratio, *clocktest.Fake) {
	t.Helper()
	clk := clocktest.New(t0)
	r, err := budget.NewRatio(c, clk)
	if err != nil {
		t.Fatal(err)
	}
	return r, clk
}

// ratioBound is the bound documented on Ratio: the most retries a Ratio may
// grant over a run of length elapsed with the given requests,
// Ratio × requests + max(1, MinPerSec) + MinPerSec × elapsed.
func ratioBound(c budget.RatioConfig, requests int, elapsed time.Duration) int {
	floor := 0.0
	if c.MinPerSec > 0 {
		floor = max(1, c.MinPerSec) + c.MinPerSec*elapsed.Seconds()
	}
	return int(math.Floor(c.Ratio*float64(requests) + floor + 1e-9))
}

// drain asks for retries until refused and returns how many were granted.
func drain(b budget.Budget) int {
	n := 0
	for b.TryRetry() {
		n++
	}
	return n
}
