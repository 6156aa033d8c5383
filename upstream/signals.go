package upstream

import (
	"io"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/saturation"
)

// The signals of an inference server's /metrics (names, the parse into a
// Sample, staleness, recent quantiles) live in package saturation; these
// are the names upstream and its users have always used for them.
type (
	// SignalNames is saturation.SignalNames.
	SignalNames = saturation.SignalNames
	// Value is saturation.Value: a reading and whether it is known.
	Value = saturation.Value
	// Bucket is saturation.Bucket.
	Bucket = saturation.Bucket
	// Histogram is saturation.Histogram.
	Histogram = saturation.Histogram
	// Readings is saturation.Readings.
	Readings = saturation.Readings
	// Sample is saturation.Sample: readings stamped with their time.
	Sample = saturation.Sample
	// Scrape is saturation.Scrape: one /metrics scrape, per server and model.
	Scrape = saturation.Scrape
)

// The saturation config and its signal names live in package saturation
// too (see there for fields, units and defaults).
type (
	// Saturation is saturation.Saturation: scraping each upstream's
	// /metrics and acting on its signals.
	Saturation = saturation.Saturation
	// TripRules is saturation.TripRules: the saturation breaker's rules.
	TripRules = saturation.TripRules
	// Signal is saturation.Signal: one signal's label.
	Signal = saturation.Signal
	// SignalState is saturation.SignalState: fresh, stale or missing.
	SignalState = saturation.SignalState
)

// The defaults of Saturation, as in package saturation.
const (
	DefaultMetricsPath      = saturation.DefaultMetricsPath      // "/metrics"
	DefaultScrapeInterval   = saturation.DefaultScrapeInterval   // 1s
	DefaultScrapeTimeout    = saturation.DefaultScrapeTimeout    // 500ms
	DefaultQueueThreshold   = saturation.DefaultQueueThreshold   // 5 waiting requests
	DefaultKVThreshold      = saturation.DefaultKVThreshold      // 0.8
	DefaultSaturationWindow = saturation.DefaultSaturationWindow // 30s
	DefaultTripQueueWaitP99 = saturation.DefaultTripQueueWaitP99 // 5s
	DefaultTripQueueWaitFor = saturation.DefaultTripQueueWaitFor // 30s
	DefaultTripKVUsage      = saturation.DefaultTripKVUsage      // 0.92
	DefaultTripKVFor        = saturation.DefaultTripKVFor        // 60s
)

// The signals and their states, as in package saturation.
const (
	SignalQueueDepth = saturation.SignalQueueDepth
	SignalRunning    = saturation.SignalRunning
	SignalKVUsage    = saturation.SignalKVUsage
	SignalQueueTime  = saturation.SignalQueueTime
	SignalTTFT       = saturation.SignalTTFT
	SignalFresh      = saturation.SignalFresh
	SignalStale      = saturation.SignalStale
	SignalMissing    = saturation.SignalMissing
)

// Signals lists every signal (saturation.Signals).
var Signals = saturation.Signals

// DefaultTripRules returns the saturation breaker's default rules
// (saturation.DefaultTripRules).
func DefaultTripRules() *TripRules { return saturation.DefaultTripRules() }

// ParseSignal returns the signal named name (saturation.ParseSignal).
func ParseSignal(name string) (Signal, error) { return saturation.ParseSignal(name) }

// Signal name presets, as in package saturation.
var (
	// VLLMSignals is saturation.VLLMSignals.
	VLLMSignals = saturation.VLLMSignals
	// SGLangSignals is saturation.SGLangSignals.
	SGLangSignals = saturation.SGLangSignals
	// TGISignals is saturation.TGISignals.
	TGISignals = saturation.TGISignals
)

// ModelLabel is saturation.ModelLabel ("model_name").
const ModelLabel = saturation.ModelLabel

// Known returns a known Value v (saturation.Known).
func Known(v float64) Value { return saturation.Known(v) }

// NewSample returns the sample of r at time at (saturation.NewSample).
func NewSample(at time.Time, r Readings) Sample { return saturation.NewSample(at, r) }

// ParseScrape parses one /metrics body (saturation.ParseScrape).
func ParseScrape(r io.Reader, contentType string, names SignalNames, at time.Time) (Scrape, error) {
	return saturation.ParseScrape(r, contentType, names, at)
}

// QuantileBetween is saturation.QuantileBetween: the q-quantile of the
// observations between two cumulative histograms.
func QuantileBetween(prev, cur Histogram, q float64) Value {
	return saturation.QuantileBetween(prev, cur, q)
}

// ShareAboveBetween is saturation.ShareAboveBetween: the share of the
// observations between two cumulative histograms above v.
func ShareAboveBetween(prev, cur Histogram, v float64) Value {
	return saturation.ShareAboveBetween(prev, cur, v)
}

// ParseSignals parses one /metrics body into model's sample
// (saturation.ParseSignals).
func ParseSignals(r io.Reader, contentType string, names SignalNames, model string, at time.Time) (Sample, error) {
	return saturation.ParseSignals(r, contentType, names, model, at)
}
