package caddymodule

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// interEventGap is the time between two events of a committed stream as
// the gateway read them from the upstream: what a user sees as stutter,
// measured where the upstream is not hidden by the client's own pace.
var interEventGap = prometheus.NewHistogramVec(prometheus.HistogramOpts{
	Namespace: "caddy", Subsystem: "llm_proxy", Name: "inter_event_gap_seconds",
	Help: "Time between two reads of events from the upstream in a committed stream (events that arrive together count once), by upstream and model.",
	// From 50 tokens/s (20 ms) to a stall that the idle timeout ends.
	Buckets: []float64{.005, .01, .02, .035, .05, .075, .1, .15, .25, .5, 1, 2.5, 5, 10, 30},
}, []string{"upstream", "model"})

// StreamGaps implements proxy.GapObserver: one series per upstream and
// model label, looked up once per stream.
func (o requestObserver) StreamGaps(upstream, model string) proxy.GapRecorder {
	return interEventGap.WithLabelValues(upstream, o.models.Label(model))
}

var _ proxy.GapObserver = requestObserver{}
