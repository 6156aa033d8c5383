package saturation

import (
	"fmt"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// TripInput are the values one scrape gives the saturation breaker.
type TripInput struct {
	// OK is whether the scrape succeeded (else everything is unknown).
	OK bool
	// QueueWait (p99, seconds) and TTFT (p95, seconds) are recent, over
	// the window: shown in reasons.
	QueueWait, TTFT Value
	// QueueWaitOver and TTFTOver say whether the recent quantile is
	// certainly above its threshold (see Over).
	QueueWaitOver, TTFTOver Overness
	// IntervalQueueWaitOver and IntervalTTFTOver judge the last scrape
	// interval alone: what recovery looks at.
	IntervalQueueWaitOver, IntervalTTFTOver Overness
	// KV is the KV-cache usage ratio (0..1) and Waiting the queue depth
	// (requests) of the scrape.
	KV, Waiting Value
}

// Overness is whether a histogram's quantile is above a threshold, when
// known (there were observations to judge).
type Overness struct{ Known, Over bool }

// Over reports whether the q-quantile of the observations between prev and
// cur is certainly above thr: more than 1 − q of them fell in buckets that
// start at or above thr (ShareAboveBetween). Judging by buckets rather than
// by the interpolated quantile keeps a threshold below the first bucket
// bound (vLLM's queue-time buckets start at 0.3s) from being crossed by
// requests that did not wait at all.
func Over(prev, cur Histogram, q float64, thr time.Duration) Overness {
	share := ShareAboveBetween(prev, cur, thr.Seconds())
	if !share.Known {
		return Overness{}
	}
	return Overness{Known: true, Over: share.V > 1-q+1e-12}
}

// TripMonitor counts how long each trip rule has held. Not safe for
// concurrent use: one scrape loop owns it.
type TripMonitor struct {
	// since is when each rule (queue wait, KV, TTFT) was first seen
	// above its threshold in the current run; zero when it is not.
	since [3]time.Time
}

// Update records one scrape and reports whether a rule has now held for
// its duration, with the reason. An unknown value ends a rule's run:
// unknown signals never trip the breaker.
func (m *TripMonitor) Update(now time.Time, t *TripRules, s TripInput) (string, bool) {
	rules := [3]struct {
		on   bool
		over bool
		v    Value
		thr  float64
		hold time.Duration
		name string
		show func(float64) string
	}{
		{t.QueueWaitP99 > 0, s.QueueWaitOver.Known && s.QueueWaitOver.Over, s.QueueWait, t.QueueWaitP99.Seconds(), t.QueueWaitFor, "queue wait p99", seconds},
		{t.KVUsage > 0, s.KV.Known && s.KV.V > t.KVUsage, s.KV, t.KVUsage, t.KVFor, "KV-cache usage", ratio},
		{t.TTFTP95 > 0, s.TTFTOver.Known && s.TTFTOver.Over, s.TTFT, t.TTFTP95.Seconds(), t.TTFTFor, "TTFT p95", seconds},
	}
	for i, r := range rules {
		if !r.on || !s.OK || !r.over {
			m.since[i] = time.Time{}
			continue
		}
		if m.since[i].IsZero() {
			m.since[i] = now
		}
		if held := now.Sub(m.since[i]); held >= r.hold {
			m.since = [3]time.Time{}
			shown := "above " + r.show(r.thr)
			if r.v.Known {
				shown = r.show(r.v.V) + " " + shown
			}
			return fmt.Sprintf("saturation: %s %s for %s", r.name, shown, held.Round(time.Millisecond)), true
		}
	}
	return "", false
}

// Reset forgets the rules' running counts.
func (m *TripMonitor) Reset() { m.since = [3]time.Time{} }

func seconds(v float64) string {
	return time.Duration(v * float64(time.Second)).Round(time.Millisecond).String()
}

func ratio(v float64) string { return fmt.Sprintf("%.2f", v) }

// Verdict judges one scrape for a breaker the saturation rules tripped:
//   - unhealthy when a rule's signal is certainly over its threshold in the
//     last interval (or KV usage is over it);
//   - unknown when the scrape failed, when requests still queue at or past
//     queue_threshold (do not close into a full queue), or when nothing
//     left the queue during the interval while requests wait (a stuck
//     queue says nothing good), or nothing is known of the queue at all;
//   - healthy otherwise.
//
// A signal the server does not expose does not hold the breaker open (a
// server without a KV gauge recovers on its queue alone).
func Verdict(cfg *Saturation, s TripInput) (breaker.Observation, string) {
	t := cfg.Trip
	if !s.OK {
		return breaker.ObservedUnknown, "saturation signals unknown"
	}
	switch {
	case t.QueueWaitP99 > 0 && s.IntervalQueueWaitOver.Known && s.IntervalQueueWaitOver.Over:
		return breaker.ObservedUnhealthy, fmt.Sprintf("saturation: queue wait p99 above %s", t.QueueWaitP99)
	case t.KVUsage > 0 && s.KV.Known && s.KV.V > t.KVUsage:
		return breaker.ObservedUnhealthy, fmt.Sprintf("saturation: KV-cache usage %s above %s", ratio(s.KV.V), ratio(t.KVUsage))
	case t.TTFTP95 > 0 && s.IntervalTTFTOver.Known && s.IntervalTTFTOver.Over:
		return breaker.ObservedUnhealthy, fmt.Sprintf("saturation: TTFT p95 above %s", t.TTFTP95)
	case s.Waiting.Known && s.Waiting.V >= cfg.QueueThreshold:
		return breaker.ObservedUnknown, fmt.Sprintf("saturation: %v requests still waiting", s.Waiting.V)
	case t.QueueWaitP99 > 0 && !s.IntervalQueueWaitOver.Known && !(s.Waiting.Known && s.Waiting.V == 0):
		return breaker.ObservedUnknown, "saturation: no request left the queue this interval"
	}
	return breaker.ObservedHealthy, "saturation signals under their thresholds"
}
