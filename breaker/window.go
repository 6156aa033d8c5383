package breaker

import (
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/rolling"
)

// bucket is one slice of a window. Each counter carries its own epoch.
type bucket struct {
	requests, failures, slow rolling.Counter
}

// window is a rolling window of rolling.Buckets (10) buckets advanced by the
// times given to it; it has no timer. A window of 30s is kept as 10 buckets
// of 3s, so it forgets old calls 3s at a time; windows below 10ms get 1ms
// buckets (rolling.MinWidth). Safe for concurrent use without a lock.
type window struct {
	// ep maps times to epochs. Its cached epoch is read by every call
	// and written once per bucket width, so it sits apart from the
	// counters.
	ep      rolling.Epochs
	_       [64]byte
	buckets [rolling.Buckets]bucket
}

func newWindow(base time.Time, d time.Duration) *window {
	return &window{ep: rolling.NewEpochs(base, d)}
}

func (w *window) bucket(ep uint64) *bucket { return &w.buckets[ep%rolling.Buckets] }

// record counts a call at t: a request, and a failure and/or slow call.
func (w *window) record(t time.Time, failure, slow bool) {
	ep := w.ep.Epoch(t)
	b := w.bucket(ep)
	b.requests.Add(ep)
	if failure {
		b.failures.Add(ep)
	}
	if slow {
		b.slow.Add(ep)
	}
}

// counts are the sums over a window.
type counts struct{ requests, failures, slow int }

// sum returns the counts of the window ending at t.
func (w *window) sum(t time.Time) counts {
	ep := w.ep.Epoch(t)
	var c counts
	for i := range w.buckets {
		b := &w.buckets[i]
		c.requests += int(b.requests.Get(ep))
		c.failures += int(b.failures.Get(ep))
		c.slow += int(b.slow.Get(ep))
	}
	return c
}
