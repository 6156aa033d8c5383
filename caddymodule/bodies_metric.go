package caddymodule

import (
	"github.com/prometheus/client_golang/prometheus"
)

// bodyMemory exports the body budget's use and size, so that an operator
// sees a burst of large prompts coming before it is refused.
var bodyMemory = []prometheus.Collector{
	prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "caddy", Subsystem: "llm_proxy", Name: "buffered_body_bytes",
		Help: "Bytes of request bodies held in memory now, charged to max_buffered_bodies (the newest config's budget).",
	}, func() float64 {
		if b := shared.live.Bodies(); b != nil {
			return float64(b.InUse())
		}
		return 0
	}),
	prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "caddy", Subsystem: "llm_proxy", Name: "buffered_body_limit_bytes",
		Help: "max_buffered_bodies of the newest started config, in bytes.",
	}, func() float64 {
		if b := shared.live.Bodies(); b != nil {
			return float64(b.Size())
		}
		return 0
	}),
}
