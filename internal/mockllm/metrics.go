package mockllm

import (
	"bytes"
	"fmt"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
)

// vLLM's bucket boundaries for its latency histograms.
var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}
	itlBuckets  = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}
	// vLLM uses its request-latency buckets for e2e latency and queue time.
	e2eBuckets       = []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}
	queueTimeBuckets = e2eBuckets
)

// replicaMetrics are a replica's vLLM-named Prometheus metrics, in a
// registry of its own.
type replicaMetrics struct {
	reg          *prometheus.Registry
	ttft         *prometheus.HistogramVec
	itl          *prometheus.HistogramVec
	e2e          *prometheus.HistogramVec
	queueTime    *prometheus.HistogramVec
	success      *prometheus.CounterVec
	promptTokens *prometheus.CounterVec
	genTokens    *prometheus.CounterVec

	handlers map[KVMetric]http.Handler // GET /metrics in normal mode, by KV name
}

func newReplicaMetrics(r *Replica) *replicaMetrics {
	m := &replicaMetrics{
		reg: prometheus.NewRegistry(),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "vllm:time_to_first_token_seconds", Help: "Histogram of time to first token in seconds.", Buckets: ttftBuckets,
		}, []string{"model_name"}),
		itl: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "vllm:inter_token_latency_seconds", Help: "Histogram of inter-token latency in seconds.", Buckets: itlBuckets,
		}, []string{"model_name"}),
		e2e: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "vllm:e2e_request_latency_seconds", Help: "Histogram of end to end request latency in seconds.", Buckets: e2eBuckets,
		}, []string{"model_name"}),
		queueTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "vllm:request_queue_time_seconds", Help: "Histogram of time spent in WAITING phase for request.", Buckets: queueTimeBuckets,
		}, []string{"model_name"}),
		success: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vllm:request_success_total", Help: "Count of successfully processed requests.",
		}, []string{"model_name", "finished_reason"}),
		promptTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vllm:prompt_tokens_total", Help: "Number of prefill tokens processed.",
		}, []string{"model_name"}),
		genTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vllm:generation_tokens_total", Help: "Number of generation tokens processed.",
		}, []string{"model_name"}),
	}
	m.reg.MustRegister(m.ttft, m.itl, m.e2e, m.queueTime, m.success, m.promptTokens, m.genTokens, loadCollector{r})
	m.handlers = map[KVMetric]http.Handler{}
	for _, kv := range []KVMetric{KVNew, KVOld, KVBoth, KVNone} {
		m.handlers[kv] = promhttp.HandlerFor(prometheus.GathererFunc(func() ([]*dto.MetricFamily, error) {
			return m.gather(kv)
		}), promhttp.HandlerOpts{})
	}
	return m
}

// touch creates the per-model series of model at zero, as vLLM creates
// its labelled metrics at start-up, so that a scrape shows them before the
// first request.
func (m *replicaMetrics) touch(model string) {
	m.ttft.WithLabelValues(model)
	m.itl.WithLabelValues(model)
	m.e2e.WithLabelValues(model)
	m.queueTime.WithLabelValues(model)
	m.promptTokens.WithLabelValues(model)
	m.genTokens.WithLabelValues(model)
}

// gather collects the metric families, keeping the KV-cache usage
// family or families that kv names.
func (m *replicaMetrics) gather(kv KVMetric) ([]*dto.MetricFamily, error) {
	fams, err := m.reg.Gather()
	keepNew, keepOld := kv == KVNew || kv == KVBoth, kv == KVOld || kv == KVBoth
	out := fams[:0]
	for _, f := range fams {
		switch f.GetName() {
		case kvNewName:
			if !keepNew {
				continue
			}
		case kvOldName:
			if !keepOld {
				continue
			}
		}
		out = append(out, f)
	}
	return out, err
}

// handler serves the metrics with the KV-cache family chosen by kv, in
// the format the scraper negotiates.
func (m *replicaMetrics) handler(kv KVMetric) http.Handler { return m.handlers[kv] }

// render is the text exposition of the metrics with the KV-cache family
// chosen by kv, as a frozen /metrics serves it.
func (m *replicaMetrics) render(kv KVMetric) ([]byte, error) {
	fams, err := m.gather(kv)
	if err != nil {
		return nil, fmt.Errorf("gather metrics: %w", err)
	}
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, expfmt.FmtText)
	for _, f := range fams {
		if err := enc.Encode(f); err != nil {
			return nil, fmt.Errorf("encode %s: %w", f.GetName(), err)
		}
	}
	return buf.Bytes(), nil
}

// loadCollector reports the scheduler gauges from the replica's live state
// at scrape time, labelled with its current model.
type loadCollector struct{ r *Replica }

// The KV-cache usage gauge under its current name and the name of vLLM's
// V0 engine.
const (
	kvNewName = "vllm:kv_cache_usage_perc"
	kvOldName = "vllm:gpu_cache_usage_perc"
)

var (
	runningDesc = prometheus.NewDesc("vllm:num_requests_running", "Number of requests in model execution batches.", []string{"model_name"}, nil)
	waitingDesc = prometheus.NewDesc("vllm:num_requests_waiting", "Number of requests waiting to be processed.", []string{"model_name"}, nil)
	kvNewDesc   = prometheus.NewDesc(kvNewName, "KV-cache usage. 1 means 100 percent usage.", []string{"model_name"}, nil)
	kvOldDesc   = prometheus.NewDesc(kvOldName, "GPU KV-cache usage. 1 means 100 percent usage.", []string{"model_name"}, nil)
)

func (c loadCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- runningDesc
	ch <- waitingDesc
	ch <- kvNewDesc
	ch <- kvOldDesc
}

// Collect reports both KV-cache names; gather keeps those the replica's
// MetricsMode exposes.
func (c loadCollector) Collect(ch chan<- prometheus.Metric) {
	model := c.r.model()
	l := c.r.queue.load()
	ch <- prometheus.MustNewConstMetric(runningDesc, prometheus.GaugeValue, float64(l.running), model)
	ch <- prometheus.MustNewConstMetric(waitingDesc, prometheus.GaugeValue, float64(l.waiting), model)
	ch <- prometheus.MustNewConstMetric(kvNewDesc, prometheus.GaugeValue, l.kvUsage(), model)
	ch <- prometheus.MustNewConstMetric(kvOldDesc, prometheus.GaugeValue, l.kvUsage(), model)
}
