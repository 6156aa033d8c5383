package caddymodule

import (
	"errors"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/saturation"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// metrics holds the collectors. They are created once per process and
// registered again in each config's registry, so values survive reloads.
var metrics = struct {
	once           sync.Once
	requests       *prometheus.CounterVec
	attempts       *prometheus.CounterVec
	ttft           *prometheus.HistogramVec
	streamDuration *prometheus.HistogramVec
	eventsRelayed  prometheus.Counter

	breakerState       prometheus.Collector
	breakerTransitions *prometheus.CounterVec
	shortCircuited     *prometheus.CounterVec

	retries         *prometheus.CounterVec
	budgetExhausted prometheus.Counter
	hedges          *prometheus.CounterVec
	hedgeDelay      *prometheus.GaugeVec
	staleConns      *prometheus.CounterVec

	admissions    *prometheus.CounterVec
	queueWait     *prometheus.HistogramVec
	queueDepth    *prometheus.GaugeVec
	inflight      *prometheus.GaugeVec
	tokens        *prometheus.CounterVec
	tenantBreaker prometheus.Collector

	saturation     *prometheus.GaugeVec
	signalState    *prometheus.GaugeVec
	scrapeDuration *prometheus.HistogramVec
	scrapeErrors   *prometheus.CounterVec

	fleetOps      *prometheus.HistogramVec
	fleetErrors   *prometheus.CounterVec
	fleetDegraded prometheus.Collector
	probeLeases   *prometheus.CounterVec
}{}

// queueWaitBuckets span no wait to a tier's whole queue_timeout.
var queueWaitBuckets = []float64{.001, .005, .01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}

// ttftBuckets span a warm GPU's 25 ms to a saturated queue's minute.
var ttftBuckets = []float64{.025, .05, .1, .25, .5, 1, 2.5, 5, 10, 20, 40, 60}

// scrapeBuckets span a local server's millisecond to the default 500ms
// scrape timeout and past it.
var scrapeBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5}

// fleetOpBuckets span a local Redis's 100µs to past the default 50ms
// op_timeout.
var fleetOpBuckets = []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25}

// durationBuckets span short answers to long generations.
var durationBuckets = []float64{.1, .25, .5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640}

func initMetrics() {
	metrics.once.Do(func() {
		const ns, sub = "caddy", "llm_proxy"
		metrics.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "requests_total",
			Help: "Requests handled by llm_proxy, by the upstream that served them (or was tried last), model, api (chat, completions, responses, messages, none) and outcome.",
		}, []string{"upstream", "model", "api", "outcome"})
		metrics.attempts = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "upstream_attempts_total",
			Help: "Upstream attempts, by upstream and outcome (success or the failure kind).",
		}, []string{"upstream", "outcome"})
		metrics.ttft = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Subsystem: sub, Name: "ttft_seconds",
			Help:    "Time from the start of an upstream attempt to its first generated SSE event (or full JSON body), for attempts that got that far.",
			Buckets: ttftBuckets,
		}, []string{"upstream", "model"})
		metrics.streamDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Subsystem: sub, Name: "stream_duration_seconds",
			Help:    "Time from a request's arrival to the end of its streamed response.",
			Buckets: durationBuckets,
		}, []string{"upstream", "model"})
		metrics.eventsRelayed = prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "events_relayed_total",
			Help: "SSE events written to clients.",
		})
		metrics.breakerState = breakerStateCollector{prometheus.NewDesc(ns+"_"+sub+"_breaker_state",
			"Circuit breaker state per pool, upstream (and model with scope model), read from the breakers at each scrape: 0 closed, 1 half-open, 2 open.",
			[]string{"pool", "upstream", "model"}, nil)}
		metrics.breakerTransitions = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "breaker_transitions_total",
			Help: "Circuit breaker state changes, by upstream, from and to state.",
		}, []string{"upstream", "from", "to"})
		metrics.shortCircuited = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "short_circuited_total",
			Help: "Times an upstream was skipped because its circuit breaker refused.",
		}, []string{"upstream"})
		metrics.retries = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "retries_total",
			Help: "Retries scheduled, by the upstream whose attempt failed and the failure (reason).",
		}, []string{"upstream", "reason"})
		metrics.budgetExhausted = prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "retry_budget_exhausted_total",
			Help: "Retries refused by the retry budget; the request got its failure at once.",
		})
		metrics.hedges = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "hedges_total",
			Help: "Hedged requests: fired (backup started), won (backup committed), lost (primary committed), suppressed (a gate refused).",
		}, []string{"outcome"})
		metrics.hedgeDelay = prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Subsystem: sub, Name: "hedge_delay_seconds",
			Help: "The hedge delay last computed, by model and mode (stream: TTFT of SSE responses; json: time to a full non-streaming body).",
		}, []string{"model", "mode"})
		metrics.staleConns = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "stale_connection_retries_total",
			Help: "Attempts that failed as stale_connection: written onto a reused keep-alive connection that the upstream closed at once, before any response byte; neutral for the breaker, sent again only under the retry rules.",
		}, []string{"upstream"})
		metrics.admissions = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "admission_total",
			Help: "Admission decisions by tier: admitted, queued_admitted, or the refusal code (tenant_rpm, tenant_tpm, tenant_concurrency, queue_full, queue_timeout, displaced, saturated, tenant_circuit_open, request_exceeds_limit, invalid_api_key). tenant is set only with metrics_tenant_label.",
		}, []string{"tier", "decision", "tenant"})
		metrics.queueWait = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Subsystem: sub, Name: "queue_wait_seconds",
			Help:    "Time requests waited in a pool's priority queue before admission or refusal, by tier.",
			Buckets: queueWaitBuckets,
		}, []string{"tier", "tenant"})
		metrics.queueDepth = prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Subsystem: sub, Name: "queue_depth",
			Help: "Requests waiting in the priority queues, by tier: the sum over every pool's gate (every handler and fallback pool).",
		}, []string{"tier"})
		metrics.inflight = prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Subsystem: sub, Name: "inflight",
			Help: "Admitted requests in flight, by tier: the sum over every pool's gate (every handler and fallback pool).",
		}, []string{"tier"})
		metrics.tokens = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "tokens_total",
			Help: "Tokens settled against tenants' limits, by tier, api (chat, completions, responses, messages, none), kind (prompt, completion) and source (usage: reported by the upstream; estimate: counted by the gateway).",
		}, []string{"tier", "api", "kind", "source", "tenant"})
		metrics.tenantBreaker = tenantBreakerCollector{prometheus.NewDesc(ns+"_"+sub+"_tenant_breaker_state",
			"Tenant circuit breakers not closed, by the tenant's tier in the running config and state (open, half-open), counted from the breakers at each scrape.",
			[]string{"tier", "state"}, nil), runningTenants}
		metrics.saturation = prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Subsystem: sub, Name: "upstream_saturation",
			Help: "The last known value of an upstream's saturation signal scraped from its /metrics: queue_depth and running (requests), kv_usage (ratio 0-1), queue_time (recent queue-wait p99, seconds), ttft (recent server TTFT p95, seconds). No series until the value is known; see saturation_signal_state for whether it is current.",
		}, []string{"upstream", "signal"})
		metrics.signalState = prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Subsystem: sub, Name: "saturation_signal_state",
			Help: "Whether an upstream's saturation signal can be used: 0 fresh, 1 stale (the last good value is older than stale_after, or scrapes fail), 2 missing (the latest successful scrape lacks it).",
		}, []string{"upstream", "signal"})
		metrics.scrapeDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Subsystem: sub, Name: "scrape_duration_seconds",
			Help:    "Time taken by each scrape of an upstream's /metrics, failed ones included.",
			Buckets: scrapeBuckets,
		}, []string{"upstream"})
		metrics.scrapeErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "scrape_errors_total",
			Help: "Scrapes of an upstream's /metrics that failed (connection error, timeout, non-200 status, unparsable body).",
		}, []string{"upstream"})
		metrics.fleetOps = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Subsystem: sub, Name: "fleet_op_seconds",
			Help:    "Latency of Redis operations of the fleet connection, by operation, failed ones included (each bounded by op_timeout).",
			Buckets: fleetOpBuckets,
		}, []string{"op"})
		metrics.fleetErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "fleet_errors_total",
			Help: "Failed Redis operations of the fleet connection, by operation and kind (timeout, conn, readonly, script, other).",
		}, []string{"op", "kind"})
		metrics.probeLeases = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "probe_leases_total",
			Help: "Probe leases of open fleet breakers tried by this gateway, by result: won (it probes), lost (another gateway probes; once per lease), expired (a probe result written after its lease ran out, dropped).",
		}, []string{"result"})
		metrics.fleetDegraded = fleetDegradedCollector{prometheus.NewDesc(ns+"_"+sub+"_fleet_degraded",
			"1 while the fleet connection is in local mode (Redis away, slow or read-only), 0 while Redis is in use; absent without a fleet.", nil, nil)}
	})
}

// fleetDegradedCollector reads the newest running config's fleet mode at
// each scrape: no series without a fleet, never a stale value.
type fleetDegradedCollector struct{ desc *prometheus.Desc }

func (c fleetDegradedCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c fleetDegradedCollector) Collect(ch chan<- prometheus.Metric) {
	f := liveFleet()
	if f == nil {
		return
	}
	v := 0.0
	if f.Degraded() {
		v = 1
	}
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, v)
}

// probeLeaseCounted counts one probe lease outcome of the fleet's breaker
// store (fleet.BreakersOptions.OnLease).
func probeLeaseCounted(result string) {
	initMetrics()
	metrics.probeLeases.WithLabelValues(result).Inc()
}

// registerMetrics adds the collectors to a config's registry.
func registerMetrics(reg *prometheus.Registry) error {
	initMetrics()
	for _, c := range []prometheus.Collector{metrics.eventsRelayed, metrics.breakerState,
		metrics.budgetExhausted, metrics.hedges, metrics.hedgeDelay,
		metrics.admissions, metrics.queueWait, metrics.queueDepth, metrics.inflight, metrics.tokens, metrics.tenantBreaker,
		metrics.fleetOps, metrics.fleetErrors, metrics.fleetDegraded, metrics.probeLeases,
		degradedTotal, tierObjectives, poolPanic, panicRequests} {
		if err := register(reg, c); err != nil {
			return err
		}
	}
	if err := register(reg, prefixCollectors()...); err != nil { // prefixcache.go
		return err
	}
	// The per-upstream series go when their upstream leaves (series.go).
	if err := register(reg, perUpstream(metrics.requests, metrics.attempts, metrics.ttft, metrics.streamDuration,
		interEventGap, metrics.breakerTransitions, metrics.shortCircuited, metrics.retries, metrics.staleConns,
		metrics.saturation, metrics.signalState, metrics.scrapeDuration, metrics.scrapeErrors, prefixServerHitRatio)...); err != nil {
		return err
	}
	return register(reg, bodyMemory...)
}

// register registers cs with reg; one already there (a reload's handler,
// the app and the handlers sharing a registry) is fine.
func register(reg *prometheus.Registry, cs ...prometheus.Collector) error {
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) {
				return err
			}
		}
	}
	return nil
}

// requestObserver feeds the lifecycle's measurements into the collectors.
type requestObserver struct{ models *upstream.ModelNames }

func (o requestObserver) AttemptDone(a *proxy.AttemptReport) {
	if a.Outcome == proxy.AttemptSuccess {
		o.models.Learn(a.Model)
	}
	metrics.attempts.WithLabelValues(a.Upstream, a.Outcome.String()).Inc()
	if a.TTFT > 0 {
		metrics.ttft.WithLabelValues(a.Upstream, o.models.Label(a.Model)).Observe(a.TTFT.Seconds())
	}
}

func (requestObserver) EventRelayed() { metrics.eventsRelayed.Inc() }

func (requestObserver) Retry(upstream string, reason proxy.AttemptOutcome) {
	metrics.retries.WithLabelValues(upstream, reason.String()).Inc()
}

func (requestObserver) RetryBudgetExhausted() { metrics.budgetExhausted.Inc() }

func (requestObserver) Hedge(outcome string) { metrics.hedges.WithLabelValues(outcome).Inc() }

func (requestObserver) StaleConnection(upstream string) {
	metrics.staleConns.WithLabelValues(upstream).Inc()
}

func (o requestObserver) RequestDone(r *proxy.Result) {
	if r.Outcome == proxy.OutcomeRefused && r.Status == 401 {
		// Refused by identify, before admission: still an admission decision.
		metrics.admissions.WithLabelValues(r.Identity.Tier, admission.CodeUnknownKey, "").Inc()
	}
	model := o.models.Label(r.Info.Model)
	metrics.requests.WithLabelValues(r.Upstream, model, r.API, r.Outcome.String()).Inc()
	if r.Streamed {
		metrics.streamDuration.WithLabelValues(r.Upstream, model).Observe(r.Duration.Seconds())
	}
}

// upstreamObserver turns the pool's events into metrics, one log line per
// breaker transition and a Caddy event (llm_proxy_breaker_open, ...), through
// the newest running config's logger and events app.
type upstreamObserver struct{}

// BreakerCreated and BreakerGone need nothing: breaker_state is read from
// the pools' breakers at each scrape (breakerStateCollector).
func (upstreamObserver) BreakerCreated(string, string) {}

func (upstreamObserver) BreakerGone(string, string) {}

func (upstreamObserver) ShortCircuited(addr string) {
	metrics.shortCircuited.WithLabelValues(addr).Inc()
}

func (upstreamObserver) HedgeDelay(model string, stream bool, d time.Duration) {
	mode := "json"
	if stream {
		mode = "stream"
	}
	metrics.hedgeDelay.WithLabelValues(model, mode).Set(d.Seconds())
}

func (upstreamObserver) BreakerTransition(addr, key, handler string, tr breaker.Transition) {
	initMetrics()
	metrics.breakerTransitions.WithLabelValues(addr, tr.From.String(), tr.To.String()).Inc()
	cfg := shared.live.Newest()
	if cfg == nil {
		return
	}
	level := zapcore.InfoLevel
	if tr.To == breaker.Open {
		level = zapcore.WarnLevel
	}
	if ce := cfg.Logger.Check(level, "circuit breaker "+tr.To.String()); ce != nil {
		fields := []zap.Field{
			zap.String("breaker", tr.Key),
			zap.String("upstream", addr),
			zap.String("handler", handler),
			zap.String("from", tr.From.String()),
			zap.String("to", tr.To.String()),
			zap.String("reason", tr.Reason),
			zap.Int("consecutive_failures", tr.ConsecutiveFailures),
			zap.Int("failures_in_window", tr.FailuresInWindow),
		}
		if !tr.OpenUntil.IsZero() {
			fields = append(fields, zap.Time("open_until", tr.OpenUntil))
		}
		ce.Write(fields...)
	}
	if cfg.Emit != nil {
		cfg.Emit("llm_proxy_breaker_"+tr.To.String(), map[string]any{
			"breaker":  tr.Key,
			"upstream": addr,
			"handler":  handler,
			"model":    key,
			"from":     tr.From.String(),
			"to":       tr.To.String(),
			"reason":   tr.Reason,
		})
	}
}

// Scraped records one scrape. It runs on the upstream's scrape loop
// (saturation.Scraper), under the scraper's lock, outside the entry's.
func (upstreamObserver) Scraped(addr string, took time.Duration, err error) {
	initMetrics()
	metrics.scrapeDuration.WithLabelValues(addr).Observe(took.Seconds())
	errs := metrics.scrapeErrors.WithLabelValues(addr) // at 0 from the first scrape
	if err != nil {
		errs.Inc()
	}
}

// SignalUpdated sets a signal's gauges and logs a change of its state once:
// warn when it goes stale or missing, info when it is fresh again.
func (upstreamObserver) SignalUpdated(addr string, sig saturation.Signal, last saturation.Value, state, prev saturation.SignalState) {
	initMetrics()
	name := sig.String()
	if last.Known {
		metrics.saturation.WithLabelValues(addr, name).Set(last.V)
	}
	metrics.signalState.WithLabelValues(addr, name).Set(float64(state))
	if state == prev {
		return
	}
	logger := shared.live.Logger()
	if logger == nil {
		return
	}
	level := zapcore.WarnLevel
	if state == saturation.SignalFresh {
		level = zapcore.InfoLevel
	}
	if ce := logger.Check(level, "saturation signal "+state.String()); ce != nil {
		fields := []zap.Field{
			zap.String("upstream", addr),
			zap.String("signal", name),
			zap.String("from", prev.String()),
			zap.String("to", state.String()),
		}
		if last.Known {
			fields = append(fields, zap.Float64("last_value", last.V))
		}
		ce.Write(fields...)
	}
}

// ScraperGone deletes the upstream's saturation series.
func (upstreamObserver) ScraperGone(addr string) {
	initMetrics()
	for _, sig := range saturation.Signals {
		metrics.saturation.DeleteLabelValues(addr, sig.String())
		metrics.signalState.DeleteLabelValues(addr, sig.String())
	}
	metrics.scrapeDuration.DeleteLabelValues(addr)
	metrics.scrapeErrors.DeleteLabelValues(addr)
	prefixServerHitRatio.DeleteLabelValues(addr) // prefixcache.go
}

// admissionObserver turns admission's measurements into metrics. The
// tenant label is the tenant id, and only with metrics_tenant_label.
type admissionObserver struct{}

func tenantLabel(tenant string) string {
	if shared.live.TenantLabels() {
		return tenant
	}
	return ""
}

func (admissionObserver) Decision(tenant, tier, decision string) {
	initMetrics()
	metrics.admissions.WithLabelValues(tier, decision, tenantLabel(tenant)).Inc()
}

func (admissionObserver) QueueWait(tenant, tier string, d time.Duration) {
	initMetrics()
	metrics.queueWait.WithLabelValues(tier, tenantLabel(tenant)).Observe(d.Seconds())
}

// QueueDepth and Inflight are reported by the gates, each through its own
// gateObserver (gauges.go): the gauges are sums over every gate.
func (admissionObserver) QueueDepth(string, int) {}

func (admissionObserver) Inflight(string, int) {}

func (admissionObserver) Tokens(tenant, tier, api, kind, source string, n int) {
	initMetrics()
	metrics.tokens.WithLabelValues(tier, api, kind, source, tenantLabel(tenant)).Add(float64(n))
}

func (admissionObserver) TenantBreaker(tenant, tier string, tr breaker.Transition) {
	// caddy_llm_proxy_tenant_breaker_state is counted from the breakers
	// at each scrape (tenantBreakerCollector): here, only the log line.
	if logger := shared.live.Logger(); logger != nil {
		level := zapcore.InfoLevel
		if tr.To == breaker.Open {
			level = zapcore.WarnLevel
		}
		if ce := logger.Check(level, "tenant circuit breaker "+tr.To.String()); ce != nil {
			ce.Write(zap.String("tenant", tenant), zap.String("tier", tier), zap.String("from", tr.From.String()),
				zap.String("to", tr.To.String()), zap.String("reason", tr.Reason))
		}
	}
}

var (
	_ admission.Observer = admissionObserver{}
	_ proxy.Observer     = requestObserver{}
	_ upstream.Observer  = upstreamObserver{}
)
