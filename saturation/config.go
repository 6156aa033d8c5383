package saturation

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"
)

// Defaults of Saturation (DESIGN §7).
const (
	// DefaultMetricsPath is the path scraped on each upstream.
	DefaultMetricsPath = "/metrics"
	// DefaultScrapeInterval is the time between two scrapes of one upstream.
	DefaultScrapeInterval = time.Second
	// DefaultScrapeTimeout bounds one scrape.
	DefaultScrapeTimeout = 500 * time.Millisecond
	// DefaultQueueThreshold is the effective queue depth (waiting
	// requests) at which an upstream's score reaches 1 (saturated).
	DefaultQueueThreshold = 5
	// DefaultKVThreshold is the KV-cache usage ratio at which an
	// upstream's score reaches 1. vLLM starts preempting (recomputing)
	// requests when the cache is full; 0.8 leaves room for the running
	// batch to grow.
	DefaultKVThreshold = 0.8
	// DefaultSaturationWindow is the span over which "recent" histogram
	// quantiles (queue wait, TTFT) are computed from bucket differences.
	DefaultSaturationWindow = 30 * time.Second
	// DefaultTripQueueWaitP99 and DefaultTripQueueWaitFor: the saturation
	// breaker opens when the recent queue-wait p99 stays above 5s for 30s.
	DefaultTripQueueWaitP99 = 5 * time.Second
	DefaultTripQueueWaitFor = 30 * time.Second
	// DefaultTripKVUsage and DefaultTripKVFor: it opens when KV-cache usage
	// stays above 0.92 for 60s.
	DefaultTripKVUsage = 0.92
	DefaultTripKVFor   = 60 * time.Second
)

// Saturation configures reading each upstream's load signals from its
// Prometheus /metrics and acting on them: selection by score, removal of
// saturated upstreams from the candidates, the saturation breaker, and the
// pool signal for admission (DESIGN §7). Zero fields take their defaults
// (Defaults).
type Saturation struct {
	// MetricsPath is the path scraped. Default DefaultMetricsPath.
	MetricsPath string
	// Interval is the time between two scrapes of one upstream. Default
	// DefaultScrapeInterval.
	Interval time.Duration
	// Timeout bounds one scrape. Default DefaultScrapeTimeout (capped at
	// Interval).
	Timeout time.Duration
	// StaleAfter is the age past which a scraped value is unknown.
	// Default 3 × Interval; below 2 × Interval is an error (one late
	// scrape must not make every signal unknown).
	StaleAfter time.Duration
	// Names are the metric names of the signals. Default VLLMSignals.
	Names SignalNames
	// QueueThreshold is the effective queue depth at which the score
	// reaches 1. Default DefaultQueueThreshold.
	QueueThreshold float64
	// KVThreshold is the KV-cache usage ratio at which the score reaches
	// 1. Default DefaultKVThreshold.
	KVThreshold float64
	// Trip holds the saturation breaker's rules; nil turns it off.
	Trip *TripRules
	// Window is the span of "recent" histogram quantiles. Default
	// DefaultSaturationWindow, or 2 × Interval when that is longer.
	Window time.Duration

	// Transport sends the scrapes (the handler's transport). Required.
	Transport http.RoundTripper
	// Dial decorates a scrape's context with what Transport needs to
	// reach addr (Caddy's dial info). Optional.
	Dial func(ctx context.Context, addr string) context.Context
}

// TripRules are the saturation breaker's trip rules. A rule whose
// threshold is 0 is off. A rule trips the upstream's breaker when its
// signal stays above the threshold for its For duration; unknown values
// never trip it and restart the count.
type TripRules struct {
	// QueueWaitP99 is the recent queue-wait p99 threshold; QueueWaitFor
	// how long it must hold. Defaults DefaultTripQueueWaitP99 for
	// DefaultTripQueueWaitFor.
	QueueWaitP99, QueueWaitFor time.Duration
	// KVUsage is the KV-cache usage ratio threshold; KVFor how long it
	// must hold. Defaults DefaultTripKVUsage for DefaultTripKVFor.
	KVUsage float64
	KVFor   time.Duration
	// TTFTP95 is the server's recent TTFT p95 threshold; TTFTFor how long
	// it must hold. Default off; TTFTFor defaults to QueueWaitFor's
	// default when TTFTP95 is set.
	TTFTP95, TTFTFor time.Duration
}

// DefaultTripRules returns the saturation breaker's default rules.
func DefaultTripRules() *TripRules {
	return &TripRules{
		QueueWaitP99: DefaultTripQueueWaitP99, QueueWaitFor: DefaultTripQueueWaitFor,
		KVUsage: DefaultTripKVUsage, KVFor: DefaultTripKVFor,
	}
}

// Defaults returns s with every zero field set to its default (Trip is
// left as it is: nil is off).
func (s Saturation) Defaults() Saturation {
	if s.MetricsPath == "" {
		s.MetricsPath = DefaultMetricsPath
	}
	if s.Interval <= 0 {
		s.Interval = DefaultScrapeInterval
	}
	if s.Timeout <= 0 {
		s.Timeout = min(DefaultScrapeTimeout, s.Interval)
	}
	if s.StaleAfter <= 0 {
		s.StaleAfter = 3 * s.Interval
	}
	if s.Names.Empty() {
		s.Names = VLLMSignals
	}
	if s.QueueThreshold <= 0 {
		s.QueueThreshold = DefaultQueueThreshold
	}
	if s.KVThreshold <= 0 {
		s.KVThreshold = DefaultKVThreshold
	}
	if s.Window <= 0 {
		s.Window = max(DefaultSaturationWindow, 2*s.Interval)
	}
	if s.Trip != nil {
		t := *s.Trip
		if t.QueueWaitP99 > 0 && t.QueueWaitFor <= 0 {
			t.QueueWaitFor = DefaultTripQueueWaitFor
		}
		if t.KVUsage > 0 && t.KVFor <= 0 {
			t.KVFor = DefaultTripKVFor
		}
		if t.TTFTP95 > 0 && t.TTFTFor <= 0 {
			t.TTFTFor = DefaultTripQueueWaitFor
		}
		s.Trip = &t
	}
	return s
}

// Validate checks s after Defaults: StaleAfter at least 2 × Interval, a
// positive Timeout no longer than Interval, thresholds in range, a path
// that starts with "/".
func (s Saturation) Validate() error {
	var errs []error
	if len(s.MetricsPath) == 0 || s.MetricsPath[0] != '/' {
		errs = append(errs, fmt.Errorf("metrics_path %q must start with /", s.MetricsPath))
	}
	if s.Interval <= 0 || s.Timeout <= 0 {
		errs = append(errs, errors.New("interval and timeout must be positive"))
	}
	if s.Timeout > s.Interval {
		errs = append(errs, fmt.Errorf("timeout %s must not exceed interval %s (one scrape in flight per upstream)", s.Timeout, s.Interval))
	}
	if s.StaleAfter < 2*s.Interval {
		errs = append(errs, fmt.Errorf("stale_after %s is below 2 × interval (%s): one late scrape would make every signal unknown", s.StaleAfter, 2*s.Interval))
	}
	if s.QueueThreshold <= 0 {
		errs = append(errs, errors.New("queue_threshold must be positive"))
	}
	if !(s.KVThreshold > 0 && s.KVThreshold <= 1) {
		errs = append(errs, fmt.Errorf("kv_threshold %v must be in (0, 1]", s.KVThreshold))
	}
	if s.Window < 2*s.Interval {
		errs = append(errs, fmt.Errorf("window %s must be at least 2 × interval (%s): a recent quantile needs two scrapes", s.Window, 2*s.Interval))
	}
	if t := s.Trip; t != nil {
		if t.QueueWaitP99 < 0 || t.TTFTP95 < 0 || t.QueueWaitFor < 0 || t.KVFor < 0 || t.TTFTFor < 0 {
			errs = append(errs, errors.New("trip durations must not be negative"))
		}
		if t.KVUsage < 0 || t.KVUsage > 1 {
			errs = append(errs, fmt.Errorf("trip kv_usage %v must be in (0, 1]", t.KVUsage))
		}
	}
	return errors.Join(errs...)
}

// Signal names one saturation signal, for metrics labels and the admin API.
type Signal uint8

// The signals, in the order of the caddy_llm_proxy_saturation_signal_state
// series.
const (
	SignalQueueDepth Signal = iota // waiting requests
	SignalRunning                  // requests in the running batch
	SignalKVUsage                  // KV-cache usage ratio
	SignalQueueTime                // recent queue-wait p99, seconds
	SignalTTFT                     // recent server TTFT p95, seconds
	numSignals
)

var signalNames = [numSignals]string{"queue_depth", "running", "kv_usage", "queue_time", "ttft"}

// Signals lists every signal.
var Signals = [numSignals]Signal{SignalQueueDepth, SignalRunning, SignalKVUsage, SignalQueueTime, SignalTTFT}

// String returns the signal's label value: queue_depth, running, kv_usage,
// queue_time or ttft.
func (s Signal) String() string {
	if s < numSignals {
		return signalNames[s]
	}
	return fmt.Sprintf("signal(%d)", s)
}

// MarshalText encodes the signal as its String.
func (s Signal) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// UnmarshalText parses a signal written by MarshalText.
func (s *Signal) UnmarshalText(b []byte) error {
	for i, n := range signalNames {
		if string(b) == n {
			*s = Signal(i)
			return nil
		}
	}
	return fmt.Errorf("saturation signal %q: want queue_depth, running, kv_usage, queue_time or ttft", b)
}

// ParseSignal returns the signal named name (as String writes it).
func ParseSignal(name string) (Signal, error) {
	var s Signal
	err := s.UnmarshalText([]byte(name))
	return s, err
}

// SignalState is whether a signal's value can be used: the value of
// caddy_llm_proxy_saturation_signal_state.
type SignalState uint8

const (
	// SignalFresh: the latest scrape succeeded within stale_after and has
	// the signal (gauge 0).
	SignalFresh SignalState = iota
	// SignalStale: the last good value is older than stale_after, or
	// scrapes fail (gauge 1).
	SignalStale
	// SignalMissing: the latest successful scrape lacks the signal (gauge 2).
	SignalMissing
)

var signalStateNames = [...]string{"fresh", "stale", "missing"}

// String returns "fresh", "stale" or "missing".
func (s SignalState) String() string {
	if int(s) < len(signalStateNames) {
		return signalStateNames[s]
	}
	return fmt.Sprintf("state(%d)", s)
}

// MarshalText encodes the state as its String.
func (s SignalState) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// UnmarshalText parses a state written by MarshalText.
func (s *SignalState) UnmarshalText(b []byte) error {
	for i, n := range signalStateNames {
		if string(b) == n {
			*s = SignalState(i)
			return nil
		}
	}
	return fmt.Errorf("signal state %q: want fresh, stale or missing", b)
}
