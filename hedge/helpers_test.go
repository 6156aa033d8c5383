package hedge_test

import (
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// t0 is the fake clock's start.
var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// newClock returns a fake clock at t0.
func newClock() *clocktest.Fake { return clocktest.New(t0) }

// relErr returns |got-want|/want.
func relErr(got, want time.Duration) float64 {
	d := float64(got - want)
	if d < 0 {
		d = -d
	}
	return d / float64(want)
}
