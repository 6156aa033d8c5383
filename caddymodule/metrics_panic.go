package caddymodule

import (
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// The panic rule's collectors, registered with the others in
// registerMetrics. pool is the pool's label (poolLabel): its sorted
// upstream addresses, or its dynamic source's short hash.
var (
	// poolPanic is read from the running configs' pools at each scrape, so
	// every pool has a series (0) from its first scrape and none after it
	// leaves the last running config. Two handlers over the same upstreams
	// share one label: the series is 1 while either of them is in panic.
	poolPanic = func() poolPanicCollector {
		const ns, sub = "caddy", "llm_proxy"
		return poolPanicCollector{prometheus.NewDesc(ns+"_"+sub+"_pool_panic",
			"1 while the pool routes over upstreams held open on statistical evidence (fewer than panic_threshold available), else 0; read from the running configs' pools at each scrape.",
			[]string{"pool"}, nil)}
	}()
	panicRequests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "llm_proxy", Name: "panic_requests_total",
		Help: "Picks made in panic mode, routed over upstreams held open on statistical evidence.",
	}, []string{"pool"})
)

// poolPanicCollector is caddy_llm_proxy_pool_panic{pool}.
type poolPanicCollector struct{ desc *prometheus.Desc }

func (c poolPanicCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c poolPanicCollector) Collect(ch chan<- prometheus.Metric) {
	panics := map[string]bool{}
	var order []string
	for _, p := range runningPools() {
		label := poolLabel(p.Key())
		on, seen := panics[label]
		if !seen {
			order = append(order, label)
		}
		panics[label] = on || p.Status().Panic
	}
	for _, label := range order {
		v := 0.0
		if panics[label] {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, v, label)
	}
}

// PoolPanic implements upstream.PanicObserver. The gauge is read from the
// pools at each scrape (poolPanicCollector), so a change needs no write.
func (upstreamObserver) PoolPanic(string, bool) {}

// PanicRequest implements upstream.PanicObserver.
func (upstreamObserver) PanicRequest(pool string) {
	panicRequests.WithLabelValues(poolLabel(pool)).Inc()
}

var _ upstream.PanicObserver = upstreamObserver{}

// PoolFailed implements upstream.PoolFailObserver: a pool that fails as a
// whole, and its re-admission by a probe, are logged (a warning, then an
// info), as a breaker's transitions are.
func (upstreamObserver) PoolFailed(pool string, on bool, reason string) {
	logger := shared.live.Logger()
	if logger == nil {
		return
	}
	level, msg := zapcore.InfoLevel, "pool re-admitted by a probe's success"
	if on {
		level, msg = zapcore.WarnLevel, "pool failed as a whole: 503 but for probes"
	}
	if ce := logger.Check(level, msg); ce != nil {
		fields := []zap.Field{zap.String("pool", poolLabel(pool))}
		if reason != "" {
			fields = append(fields, zap.String("reason", reason))
		}
		ce.Write(fields...)
	}
}

var _ upstream.PoolFailObserver = upstreamObserver{}
