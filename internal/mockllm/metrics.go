package mockllm

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// nominalSlots stands for the KV cache size of a replica with unlimited
// capacity when computing vllm:kv_cache_usage_perc.
const nominalSlots = 256

// vLLM's bucket boundaries for its latency histograms.
var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}
	itlBuckets  = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}
	e2eBuckets  = []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}
)

// replicaMetrics are a replica's vLLM-named Prometheus metrics, in a
// registry of its own.
type replicaMetrics struct {
	reg          *prometheus.Registry
	ttft         *prometheus.HistogramVec
	itl          *prometheus.HistogramVec
	e2e          *prometheus.HistogramVec
	success      *prometheus.CounterVec
	promptTokens *prometheus.CounterVec
	genTokens    *prometheus.CounterVec
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
	m.reg.MustRegister(m.ttft, m.itl, m.e2e, m.success, m.promptTokens, m.genTokens, loadCollector{r})
	return m
}

func (m *replicaMetrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}

// loadCollector reports the scheduler gauges from the replica's live state
// at scrape time, labelled with its current model.
type loadCollector struct{ r *Replica }

var (
	runningDesc = prometheus.NewDesc("vllm:num_requests_running", "Number of requests in model execution batches.", []string{"model_name"}, nil)
	waitingDesc = prometheus.NewDesc("vllm:num_requests_waiting", "Number of requests waiting to be processed.", []string{"model_name"}, nil)
	kvDesc      = prometheus.NewDesc("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", []string{"model_name"}, nil)
)

func (c loadCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- runningDesc
	ch <- waitingDesc
	ch <- kvDesc
}

func (c loadCollector) Collect(ch chan<- prometheus.Metric) {
	model := c.r.model()
	running, waiting, capacity := c.r.queue.load()
	slots := capacity
	if slots == 0 {
		slots = nominalSlots
	}
	ch <- prometheus.MustNewConstMetric(runningDesc, prometheus.GaugeValue, float64(running), model)
	ch <- prometheus.MustNewConstMetric(waitingDesc, prometheus.GaugeValue, float64(waiting), model)
	ch <- prometheus.MustNewConstMetric(kvDesc, prometheus.GaugeValue, min(1, float64(running)/float64(slots)), model)
}
