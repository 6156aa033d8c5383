package caddymodule

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// The panic rule's collectors (issue 19), registered with the others in
// registerMetrics. pool is the pool's key: its sorted upstream addresses, or
// its dynamic source's configuration.
var (
	poolPanic = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "caddy", Subsystem: "llm_proxy", Name: "pool_panic",
		Help: "1 while the pool routes over upstreams held open on statistical evidence (fewer than panic_threshold available), else 0.",
	}, []string{"pool"})
	panicRequests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "llm_proxy", Name: "panic_requests_total",
		Help: "Picks made in panic mode, routed over upstreams held open on statistical evidence.",
	}, []string{"pool"})
)

// PoolPanic implements upstream.PanicObserver.
func (upstreamObserver) PoolPanic(pool string, on bool) {
	v := 0.0
	if on {
		v = 1
	}
	poolPanic.WithLabelValues(pool).Set(v)
}

// PanicRequest implements upstream.PanicObserver.
func (upstreamObserver) PanicRequest(pool string) { panicRequests.WithLabelValues(pool).Inc() }

var _ upstream.PanicObserver = upstreamObserver{}
