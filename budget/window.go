package budget

import (
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
	"github.com/llmproxy/caddy-llm-proxy/internal/rolling"
)

// MinWindow is the shortest rolling window accepted (buckets of 10ms).
// Shorter windows make no sense for retries; at 10ms buckets the window's
// epochs last 21.8 years of process lifetime (see rolling.CountBits).
const MinWindow = 100 * time.Millisecond

// clockEpochs maps the times of an injected clock to the epochs of a rolling
// window of rolling.Buckets (10) buckets: a 10s window is kept as 10 buckets
// of 1s, so it forgets old events 1s at a time.
type clockEpochs struct {
	clock clock.Reader
	rolling.Epochs
}

func newClockEpochs(clk clock.Reader, window time.Duration) clockEpochs {
	return clockEpochs{clock: clk, Epochs: rolling.NewEpochs(clk.Now(), window)}
}

// now returns the epoch of the clock's current time (see rolling.Epochs).
func (c *clockEpochs) now() uint64 { return c.Epoch(c.clock.Now()) }
