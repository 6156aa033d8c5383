package caddymodule

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/llmproxy/caddy-llm-proxy/admission"
)

// tierObjectives exports each tier's configured objectives, so that alerts
// compare a tier's queue wait and TTFT with the tier's own setting instead
// of a number copied into the rules.
var tierObjectives = prometheus.NewGaugeVec(prometheus.GaugeOpts{
	Namespace: "caddy", Subsystem: "llm_proxy", Name: "tier_objective_seconds",
	Help: "A tier's configured objective in seconds, by tier and objective (queue_wait: queue_wait_slo; ttft: ttft_slo); no series for an objective the tier does not set.",
}, []string{"tier", "objective"})

// setObjectives makes the tiers' objectives the exported ones (the newest
// started config's).
func setObjectives(tiers []admission.Tier) {
	tierObjectives.Reset()
	for _, t := range tiers {
		if t.QueueWaitSLO > 0 {
			tierObjectives.WithLabelValues(t.Name, "queue_wait").Set(t.QueueWaitSLO.Seconds())
		}
		if t.TTFTSLO > 0 {
			tierObjectives.WithLabelValues(t.Name, "ttft").Set(t.TTFTSLO.Seconds())
		}
	}
}
