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
	// queueWait (p99) and ttft (p95) are recent: over the window.
	queueWait, ttft Value
	// intervalQueueWait and intervalTTFT are over the last scrape
	// interval alone: what recovery looks at, so that the long waits of
	// the trip do not hold the breaker open for a whole window.
	intervalQueueWait, intervalTTFT Value
	kv, waiting                     Value
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
		on    bool
		v     Value
		thr   float64
		hold  time.Duration
		name  string
		shown func(float64) string
	}{
		{t.QueueWaitP99 > 0, s.queueWait, t.QueueWaitP99.Seconds(), t.QueueWaitFor, "queue wait p99", seconds},
		{t.KVUsage > 0, s.kv, t.KVUsage, t.KVFor, "KV-cache usage", ratio},
		{t.TTFTP95 > 0, s.ttft, t.TTFTP95.Seconds(), t.TTFTFor, "TTFT p95", seconds},
	}
	for i, r := range rules {
		if !r.on || !s.ok || !r.v.Known || r.v.V <= r.thr {
			m.since[i] = time.Time{}
			continue
		}
		if m.since[i].IsZero() {
			m.since[i] = now
		}
		if held := now.Sub(m.since[i]); held >= r.hold {
			m.since = [3]time.Time{}
			return fmt.Sprintf("saturation: %s %s above %s for %s", r.name, r.shown(r.v.V), r.shown(r.thr), held.Round(time.Millisecond)), true
		}
	}
	return "", false
}

func seconds(v float64) string {
	return time.Duration(v * float64(time.Second)).Round(time.Millisecond).String()
}

func ratio(v float64) string { return fmt.Sprintf("%.2f", v) }

// verdictOf judges one scrape for a breaker the saturation rules tripped:
// unhealthy when a rule's signal is over its threshold in the last
// interval; unknown when the scrape failed, or requests still queue at or
// past queue_threshold (do not close into a full queue); healthy
// otherwise. A signal the server does not expose does not hold the
// breaker open (a server without a KV gauge recovers on its queue alone).
func verdictOf(cfg *Saturation, s signalsNow) (breaker.Observation, string) {
	t := cfg.Trip
	if !s.ok {
		return breaker.ObservedUnknown, "saturation signals unknown"
	}
	switch {
	case t.QueueWaitP99 > 0 && s.intervalQueueWait.Known && s.intervalQueueWait.V > t.QueueWaitP99.Seconds():
		return breaker.ObservedUnhealthy, fmt.Sprintf("saturation: queue wait p99 %s above %s", seconds(s.intervalQueueWait.V), t.QueueWaitP99)
	case t.KVUsage > 0 && s.kv.Known && s.kv.V > t.KVUsage:
		return breaker.ObservedUnhealthy, fmt.Sprintf("saturation: KV-cache usage %s above %s", ratio(s.kv.V), ratio(t.KVUsage))
	case t.TTFTP95 > 0 && s.intervalTTFT.Known && s.intervalTTFT.V > t.TTFTP95.Seconds():
		return breaker.ObservedUnhealthy, fmt.Sprintf("saturation: TTFT p95 %s above %s", seconds(s.intervalTTFT.V), t.TTFTP95)
	case s.waiting.Known && s.waiting.V >= cfg.QueueThreshold:
		return breaker.ObservedUnknown, fmt.Sprintf("saturation: %v requests still waiting", s.waiting.V)
	}
	return breaker.ObservedHealthy, "saturation signals under their thresholds"
}
