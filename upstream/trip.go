package upstream

import (
	"fmt"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// signalsNow are the values one scrape gives the saturation breaker.
type signalsNow struct {
	// ok is whether the scrape succeeded (else everything is unknown).
	ok bool
	// queueWait (p99) and ttft (p95) are recent, over the window: shown
	// in reasons.
	queueWait, ttft Value
	// queueWaitOver and ttftOver say whether the recent quantile is
	// certainly above its threshold (see over).
	queueWaitOver, ttftOver overness
	// intervalQueueWaitOver and intervalTTFTOver judge the last scrape
	// interval alone: what recovery looks at.
	intervalQueueWaitOver, intervalTTFTOver overness
	kv, waiting                             Value
}

// overness is whether a histogram's quantile is above a threshold, when
// known (there were observations to judge).
type overness struct{ known, over bool }

// over reports whether the q-quantile of the observations between prev and
// cur is certainly above thr: more than 1 − q of them fell in buckets that
// start at or above thr (ShareAboveBetween). Judging by buckets rather than
// by the interpolated quantile keeps a threshold below the first bucket
// bound (vLLM's queue-time buckets start at 0.3s) from being crossed by
// requests that did not wait at all.
func over(prev, cur Histogram, q float64, thr time.Duration) overness {
	share := ShareAboveBetween(prev, cur, thr.Seconds())
	if !share.Known {
		return overness{}
	}
	return overness{known: true, over: share.V > 1-q+1e-12}
}

// tripMonitor counts how long each trip rule has held. Only the entry's
// scrape loop touches it.
type tripMonitor struct {
	// since is when each rule (queue wait, KV, TTFT) was first seen
	// above its threshold in the current run; zero when it is not.
	since [3]time.Time
}

// update records one scrape and reports whether a rule has now held for
// its duration, with the reason. An unknown value ends a rule's run:
// unknown signals never trip the breaker.
func (m *tripMonitor) update(now time.Time, t *TripRules, s signalsNow) (string, bool) {
	rules := [3]struct {
		on   bool
		over bool
		v    Value
		thr  float64
		hold time.Duration
		name string
		show func(float64) string
	}{
		{t.QueueWaitP99 > 0, s.queueWaitOver.known && s.queueWaitOver.over, s.queueWait, t.QueueWaitP99.Seconds(), t.QueueWaitFor, "queue wait p99", seconds},
		{t.KVUsage > 0, s.kv.Known && s.kv.V > t.KVUsage, s.kv, t.KVUsage, t.KVFor, "KV-cache usage", ratio},
		{t.TTFTP95 > 0, s.ttftOver.known && s.ttftOver.over, s.ttft, t.TTFTP95.Seconds(), t.TTFTFor, "TTFT p95", seconds},
	}
	for i, r := range rules {
		if !r.on || !s.ok || !r.over {
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

// reset forgets the rules' running counts.
func (m *tripMonitor) reset() { m.since = [3]time.Time{} }

func seconds(v float64) string {
	return time.Duration(v * float64(time.Second)).Round(time.Millisecond).String()
}

func ratio(v float64) string { return fmt.Sprintf("%.2f", v) }

// verdictOf judges one scrape for a breaker the saturation rules tripped:
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
func verdictOf(cfg *Saturation, s signalsNow) (breaker.Observation, string) {
	t := cfg.Trip
	if !s.ok {
		return breaker.ObservedUnknown, "saturation signals unknown"
	}
	switch {
	case t.QueueWaitP99 > 0 && s.intervalQueueWaitOver.known && s.intervalQueueWaitOver.over:
		return breaker.ObservedUnhealthy, fmt.Sprintf("saturation: queue wait p99 above %s", t.QueueWaitP99)
	case t.KVUsage > 0 && s.kv.Known && s.kv.V > t.KVUsage:
		return breaker.ObservedUnhealthy, fmt.Sprintf("saturation: KV-cache usage %s above %s", ratio(s.kv.V), ratio(t.KVUsage))
	case t.TTFTP95 > 0 && s.intervalTTFTOver.known && s.intervalTTFTOver.over:
		return breaker.ObservedUnhealthy, fmt.Sprintf("saturation: TTFT p95 above %s", t.TTFTP95)
	case s.waiting.Known && s.waiting.V >= cfg.QueueThreshold:
		return breaker.ObservedUnknown, fmt.Sprintf("saturation: %v requests still waiting", s.waiting.V)
	case t.QueueWaitP99 > 0 && !s.intervalQueueWaitOver.known && !(s.waiting.Known && s.waiting.V == 0):
		return breaker.ObservedUnknown, "saturation: no request left the queue this interval"
	}
	return breaker.ObservedHealthy, "saturation signals under their thresholds"
}
