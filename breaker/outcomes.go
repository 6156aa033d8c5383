package breaker

import (
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// Outcomes is an upstream's record of its attempts' outcomes over a
// rolling window, free of any handler's settings: every attempt on the
// upstream is counted once, whichever handler made it and whether a breaker
// let it through (a pick in panic, or past an ejection cap, takes no
// permit), and each reader judges the counts by its own rules. Safe for
// concurrent use without a lock; Record allocates nothing.
type Outcomes struct {
	w     *window
	d     time.Duration
	clock clock.Reader
}

// OutcomeCounts are the sums of an Outcomes window: Requests counts every
// success and failure, Failures the failures (Down included), Down the
// refused, reset or timed-out connections and first-byte timeouts among
// them.
type OutcomeCounts struct {
	Requests int `json:"requests"`
	Failures int `json:"failures"`
	Down     int `json:"down"`
}

// NewOutcomes returns an empty record over a window of d (10 buckets; d
// below 10ms counts as 10ms), read on clock c (nil: clock.Real).
func NewOutcomes(d time.Duration, c clock.Reader) *Outcomes {
	if c == nil {
		c = clock.Real
	}
	return &Outcomes{w: newWindow(c.Now(), d), d: d, clock: c}
}

// Window returns the window's duration.
func (o *Outcomes) Window() time.Duration { return o.d }

// Record counts one outcome: Success and Failure as such, Down as a
// failure of the Down kind; Neutral is not counted.
func (o *Outcomes) Record(out Outcome) {
	switch out {
	case Success:
		o.w.record(o.clock.Now(), false, false)
	case Failure:
		o.w.record(o.clock.Now(), true, false)
	case Down:
		o.w.record(o.clock.Now(), true, true) // the window's third count holds Down
	}
}

// Counts returns the sums over the window ending now.
func (o *Outcomes) Counts() OutcomeCounts {
	c := o.w.sum(o.clock.Now())
	return OutcomeCounts{Requests: c.requests, Failures: c.failures, Down: c.slow}
}
