package caddymodule

import (
	"errors"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llmproxy/caddy-llm-proxy/proxy"
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

	breakerState       *prometheus.GaugeVec
	breakerTransitions *prometheus.CounterVec
	shortCircuited     *prometheus.CounterVec

	retries         *prometheus.CounterVec
	budgetExhausted prometheus.Counter
	hedges          *prometheus.CounterVec
	hedgeDelay      *prometheus.GaugeVec
}{}

// ttftBuckets span a warm GPU's 25 ms to a saturated queue's minute.
var ttftBuckets = []float64{.025, .05, .1, .25, .5, 1, 2.5, 5, 10, 20, 40, 60}

// durationBuckets span short answers to long generations.
var durationBuckets = []float64{.1, .25, .5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640}

func initMetrics() {
	metrics.once.Do(func() {
		const ns, sub = "caddy", "llm_proxy"
		metrics.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "requests_total",
			Help: "Requests handled by llm_proxy, by the upstream that served them (or was tried last), model and outcome.",
		}, []string{"upstream", "model", "outcome"})
		metrics.attempts = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Subsystem: sub, Name: "upstream_attempts_total",
			Help: "Upstream attempts, by upstream and outcome (success or the failure kind).",
		}, []string{"upstream", "outcome"})
		metrics.ttft = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Subsystem: sub, Name: "ttft_seconds",
			Help:    "Time from the start of an upstream attempt to its first SSE data event (or full JSON body), for attempts that got that far.",
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
		metrics.breakerState = prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: ns, Subsystem: sub, Name: "breaker_state",
			Help: "Circuit breaker state per upstream (and model with scope model): 0 closed, 1 half-open, 2 open.",
		}, []string{"upstream", "model"})
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
	})
}

// registerMetrics adds the collectors to a config's registry.
func registerMetrics(reg *prometheus.Registry) error {
	initMetrics()
	for _, c := range []prometheus.Collector{metrics.requests, metrics.attempts, metrics.ttft,
		metrics.streamDuration, metrics.eventsRelayed, metrics.breakerState, metrics.breakerTransitions,
		metrics.shortCircuited, metrics.retries, metrics.budgetExhausted, metrics.hedges, metrics.hedgeDelay} {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) {
				return err
			}
		}
	}
	return nil
}

// maxModelLabels caps the distinct values of the "model" label. The model
// name comes from the client, so a name becomes a label only once an
// upstream has served it successfully (junk names never do), and at most
// this many; the rest are reported as "other".
const maxModelLabels = 64

var modelLabels = struct {
	sync.Map
	n atomic.Int64
}{}

// modelLabel returns the label value for a model name: the name once
// learnModel has accepted it, "other" before, "unknown" for none.
func modelLabel(model string) string {
	if model == "" {
		return "unknown"
	}
	if _, ok := modelLabels.Load(model); ok {
		return model
	}
	return "other"
}

// learnModel accepts a model name that an upstream served successfully as
// a label value, while fewer than maxModelLabels are known.
func learnModel(model string) {
	if model == "" {
		return
	}
	if _, ok := modelLabels.Load(model); ok {
		return
	}
	if modelLabels.n.Add(1) > maxModelLabels {
		modelLabels.n.Add(-1)
		return
	}
	if _, loaded := modelLabels.LoadOrStore(model, struct{}{}); loaded {
		modelLabels.n.Add(-1)
	}
}

// observer feeds proxy measurements into the collectors.
type observer struct{}

func (observer) AttemptDone(a *proxy.AttemptReport) {
	if a.Outcome == proxy.AttemptSuccess {
		learnModel(a.Model)
	}
	metrics.attempts.WithLabelValues(a.Upstream, a.Outcome.String()).Inc()
	if a.TTFT > 0 {
		metrics.ttft.WithLabelValues(a.Upstream, modelLabel(a.Model)).Observe(a.TTFT.Seconds())
	}
}

func (observer) EventRelayed() { metrics.eventsRelayed.Inc() }

func (observer) Retry(upstream string, reason proxy.AttemptOutcome) {
	metrics.retries.WithLabelValues(upstream, reason.String()).Inc()
}

func (observer) RetryBudgetExhausted() { metrics.budgetExhausted.Inc() }

func (observer) Hedge(outcome string) { metrics.hedges.WithLabelValues(outcome).Inc() }

func (observer) RequestDone(r *proxy.Result) {
	model := modelLabel(r.Info.Model)
	metrics.requests.WithLabelValues(r.Upstream, model, r.Outcome.String()).Inc()
	if r.Streamed {
		metrics.streamDuration.WithLabelValues(r.Upstream, model).Observe(r.Duration.Seconds())
	}
}

var _ proxy.Observer = observer{}
