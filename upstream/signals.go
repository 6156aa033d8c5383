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
