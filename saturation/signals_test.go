package saturation

import (
	"math"
	"strings"
	"testing"
	"time"
)

const textType = "text/plain; version=0.0.4; charset=utf-8"

// vllmTwoEngines is what a vLLM V1 server with two data-parallel engines
// serves on /metrics (trimmed): every series labelled with engine and
// model_name, both KV-cache names (the old one with a different value, so a
// test can tell which was read), histograms with vLLM's buckets.
const vllmTwoEngines = `# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.61
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.11
vllm:gpu_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.12
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
vllm:prompt_tokens_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.9e+06
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 61.5
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="meta-llama/Llama-3.1-8B-Instruct"} 60.0
vllm:request_queue_time_seconds_bucket{engine="0",le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 70.0
vllm:request_queue_time_seconds_bucket{engine="0",le="0.8",model_name="meta-llama/Llama-3.1-8B-Instruct"} 80.0
vllm:request_queue_time_seconds_bucket{engine="0",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 90.0
vllm:request_queue_time_seconds_bucket{engine="0",le="2.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 95.0
vllm:request_queue_time_seconds_bucket{engine="0",le="5.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 99.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:request_queue_time_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:request_queue_time_seconds_sum{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 20.0
vllm:request_queue_time_seconds_bucket{engine="1",le="0.3",model_name="meta-llama/Llama-3.1-8B-Instruct"} 40.0
vllm:request_queue_time_seconds_bucket{engine="1",le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 50.0
vllm:request_queue_time_seconds_bucket{engine="1",le="0.8",model_name="meta-llama/Llama-3.1-8B-Instruct"} 60.0
vllm:request_queue_time_seconds_bucket{engine="1",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 70.0
vllm:request_queue_time_seconds_bucket{engine="1",le="2.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 85.0
vllm:request_queue_time_seconds_bucket{engine="1",le="5.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 91.0
vllm:request_queue_time_seconds_bucket{engine="1",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:request_queue_time_seconds_count{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 30.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 20.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 80.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 30.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 20.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 80.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
`

// vllmOldKV is an older vLLM (V0 engine): only vllm:gpu_cache_usage_perc.
const vllmOldKV = `# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.93
`

// vllmTwoModels has one server's series for two model names.
const vllmTwoModels = `# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 2
vllm:num_requests_waiting{model_name="b"} 5
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 1
vllm:num_requests_running{model_name="b"} 7
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="a"} 0.2
vllm:kv_cache_usage_perc{model_name="b"} 0.7
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{model_name="a",le="1"} 1
vllm:request_queue_time_seconds_bucket{model_name="a",le="+Inf"} 2
vllm:request_queue_time_seconds_count{model_name="a"} 2
vllm:request_queue_time_seconds_sum{model_name="a"} 3
vllm:request_queue_time_seconds_bucket{model_name="b",le="1"} 10
vllm:request_queue_time_seconds_bucket{model_name="b",le="+Inf"} 20
vllm:request_queue_time_seconds_count{model_name="b"} 20
vllm:request_queue_time_seconds_sum{model_name="b"} 30
`

// vllmOpenMetrics is the OpenMetrics 1.0 form prometheus_client serves when
// asked (Accept: application/openmetrics-text): _total and _created
// series, # UNIT, # EOF.
const vllmOpenMetrics = `# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 6.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.5
# HELP vllm:num_preemptions Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{model_name="m"} 3.0
vllm:num_preemptions_created{model_name="m"} 1.7e+09
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
# UNIT vllm:request_queue_time_seconds seconds
vllm:request_queue_time_seconds_bucket{le="0.5",model_name="m"} 1.0
vllm:request_queue_time_seconds_bucket{le="1.0",model_name="m"} 3.0
vllm:request_queue_time_seconds_bucket{le="+Inf",model_name="m"} 4.0
vllm:request_queue_time_seconds_count{model_name="m"} 4.0
vllm:request_queue_time_seconds_sum{model_name="m"} 3.5
vllm:request_queue_time_seconds_created{model_name="m"} 1.7e+09
# EOF
`

// sglangMetrics follows SGLang's docs/references/production_metrics.md.
const sglangMetrics = `# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 28.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:queue_time_seconds Histogram of queueing time in seconds.
# TYPE sglang:queue_time_seconds histogram
sglang:queue_time_seconds_bucket{le="0.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
sglang:queue_time_seconds_bucket{le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.0
sglang:queue_time_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
sglang:queue_time_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
sglang:queue_time_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.5
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
sglang:time_to_first_token_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
sglang:time_to_first_token_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.1
`

// tgiMetrics is TGI's router output (metrics-exporter-prometheus): no
// HELP, no model label.
const tgiMetrics = `# TYPE tgi_queue_size gauge
tgi_queue_size 7
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 16
# TYPE tgi_request_queue_duration histogram
tgi_request_queue_duration_bucket{le="0.00015"} 0
tgi_request_queue_duration_bucket{le="0.000225"} 3
tgi_request_queue_duration_bucket{le="+Inf"} 5
tgi_request_queue_duration_sum 0.02
tgi_request_queue_duration_count 5
`

func parse(t *testing.T, body, ct string, names SignalNames, model string) Readings {
	t.Helper()
	s, err := ParseSignals(strings.NewReader(body), ct, names, model, time.Unix(100, 0))
	if err != nil {
		t.Fatalf("ParseSignals: %v", err)
	}
	return s.Readings()
}

func known(v float64) Value { return Known(v) }

var unknown Value

func TestParseSignalsScalars(t *testing.T) {
	for _, tc := range []struct {
		name                  string
		body, ct              string
		names                 SignalNames
		model                 string
		waiting, running, kv  Value
		queueCount, ttftCount float64 // 0: histogram unknown
	}{
		{name: "vLLM two engines summed, KV the fuller engine, new KV name first",
			body: vllmTwoEngines, ct: textType, names: VLLMSignals,
			waiting: known(7), running: known(21), kv: known(0.61), queueCount: 200, ttftCount: 200},
		{name: "vLLM filtered by its model",
			body: vllmTwoEngines, ct: textType, names: VLLMSignals, model: "meta-llama/Llama-3.1-8B-Instruct",
			waiting: known(7), running: known(21), kv: known(0.61), queueCount: 200, ttftCount: 200},
		{name: "vLLM filtered by a model it does not serve",
			body: vllmTwoEngines, ct: textType, names: VLLMSignals, model: "other",
			waiting: unknown, running: unknown, kv: unknown},
		{name: "old KV name only",
			body: vllmOldKV, ct: textType, names: VLLMSignals,
			waiting: known(0), running: known(5), kv: known(0.93)},
		{name: "two models summed",
			body: vllmTwoModels, ct: textType, names: VLLMSignals,
			waiting: known(7), running: known(8), kv: known(0.7), queueCount: 22},
		{name: "two models, filter a",
			body: vllmTwoModels, ct: textType, names: VLLMSignals, model: "a",
			waiting: known(2), running: known(1), kv: known(0.2), queueCount: 2},
		{name: "two models, filter b",
			body: vllmTwoModels, ct: textType, names: VLLMSignals, model: "b",
			waiting: known(5), running: known(7), kv: known(0.7), queueCount: 20},
		{name: "OpenMetrics",
			body: vllmOpenMetrics, ct: "application/openmetrics-text; version=1.0.0; charset=utf-8", names: VLLMSignals,
			waiting: known(6), running: known(2), kv: known(0.5), queueCount: 4},
		{name: "SGLang preset",
			body: sglangMetrics, ct: textType, names: SGLangSignals, model: "meta-llama/Llama-3.1-8B-Instruct",
			waiting: known(3), running: known(28), kv: known(0.28), queueCount: 10, ttftCount: 2},
		{name: "TGI preset: no KV, no TTFT; unlabelled series kept under a model filter",
			body: tgiMetrics, ct: "text/plain; version=0.0.4", names: TGISignals, model: "bigscience/bloom",
			waiting: known(7), running: known(16), kv: unknown, queueCount: 5},
		{name: "missing metrics are unknown, not 0",
			body: tgiMetrics, ct: textType, names: VLLMSignals,
			waiting: unknown, running: unknown, kv: unknown},
		{name: "empty body: everything unknown",
			body: "", ct: "", names: VLLMSignals,
			waiting: unknown, running: unknown, kv: unknown},
		{name: "a value that is not finite is unknown",
			body: "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting NaN\n# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc +Inf\nvllm:num_requests_running 3\n",
			ct:   textType, names: VLLMSignals,
			waiting: unknown, running: known(3), kv: unknown},
		{name: "a custom name for anything else",
			body: "my_queue 4\n", names: SignalNames{Waiting: []string{"missing_name", "my_queue"}},
			waiting: known(4), running: unknown, kv: unknown},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := parse(t, tc.body, tc.ct, tc.names, tc.model)
			if r.Waiting != tc.waiting || r.Running != tc.running || r.KVUsage != tc.kv {
				t.Errorf("waiting %v running %v kv %v, want %v %v %v", r.Waiting, r.Running, r.KVUsage, tc.waiting, tc.running, tc.kv)
			}
			if got := r.QueueTime.Count(); got != tc.queueCount || r.QueueTime.Known() != (tc.queueCount > 0) {
				t.Errorf("queue-time count %v (known %v), want %v", got, r.QueueTime.Known(), tc.queueCount)
			}
			if got := r.TTFT.Count(); got != tc.ttftCount || r.TTFT.Known() != (tc.ttftCount > 0) {
				t.Errorf("TTFT count %v (known %v), want %v", got, r.TTFT.Known(), tc.ttftCount)
			}
		})
	}
}

func TestParseSignalsSumsHistogramBuckets(t *testing.T) {
	r := parse(t, vllmTwoEngines, textType, VLLMSignals, "")
	want := []Bucket{{0.3, 100}, {0.5, 120}, {0.8, 140}, {1, 160}, {2.5, 180}, {5, 190}, {math.Inf(1), 200}}
	if !equalBuckets(r.QueueTime.Buckets, want) {
		t.Errorf("buckets %v, want %v", r.QueueTime.Buckets, want)
	}
	if r.QueueTime.Sum != 81.5 {
		t.Errorf("sum %v, want 81.5", r.QueueTime.Sum)
	}
}

func TestParseSignalsHistogramShapes(t *testing.T) {
	for _, tc := range []struct {
		name string
		body string
		want []Bucket // nil: unknown
	}{
		{name: "the +Inf bucket comes from the count when left out",
			body: "# TYPE vllm:request_queue_time_seconds histogram\nvllm:request_queue_time_seconds_bucket{le=\"1\"} 2\nvllm:request_queue_time_seconds_count 5\nvllm:request_queue_time_seconds_sum 9\n",
			want: []Bucket{{1, 2}, {math.Inf(1), 5}}},
		{name: "series with different bounds sum on the bounds both have",
			body: "# TYPE vllm:request_queue_time_seconds histogram\n" +
				"vllm:request_queue_time_seconds_bucket{engine=\"0\",le=\"1\"} 2\nvllm:request_queue_time_seconds_bucket{engine=\"0\",le=\"2\"} 3\nvllm:request_queue_time_seconds_bucket{engine=\"0\",le=\"+Inf\"} 4\nvllm:request_queue_time_seconds_count{engine=\"0\"} 4\n" +
				"vllm:request_queue_time_seconds_bucket{engine=\"1\",le=\"2\"} 1\nvllm:request_queue_time_seconds_bucket{engine=\"1\",le=\"+Inf\"} 1\nvllm:request_queue_time_seconds_count{engine=\"1\"} 1\n",
			want: []Bucket{{2, 4}, {math.Inf(1), 5}}},
		{name: "buckets that are not cumulative: unknown",
			body: "# TYPE vllm:request_queue_time_seconds histogram\nvllm:request_queue_time_seconds_bucket{le=\"1\"} 5\nvllm:request_queue_time_seconds_bucket{le=\"+Inf\"} 3\nvllm:request_queue_time_seconds_count 3\n"},
		{name: "a summary is not a histogram: unknown",
			body: "# TYPE vllm:request_queue_time_seconds summary\nvllm:request_queue_time_seconds{quantile=\"0.99\"} 5\nvllm:request_queue_time_seconds_count 3\nvllm:request_queue_time_seconds_sum 3\n"},
		{name: "untyped _bucket series are not a histogram: unknown",
			body: "vllm:request_queue_time_seconds_bucket{le=\"1\"} 5\nvllm:request_queue_time_seconds_bucket{le=\"+Inf\"} 5\n"},
		{name: "a histogram with only _count and _sum: unknown",
			body: "# TYPE vllm:request_queue_time_seconds histogram\nvllm:request_queue_time_seconds_count 3\nvllm:request_queue_time_seconds_sum 3\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := parse(t, tc.body, textType, VLLMSignals, "")
			if !equalBuckets(r.QueueTime.Buckets, tc.want) || r.QueueTime.Known() != (tc.want != nil) {
				t.Errorf("buckets %v, want %v", r.QueueTime.Buckets, tc.want)
			}
		})
	}
}

func TestParseSignalsErrors(t *testing.T) {
	for _, tc := range []struct{ name, body, ct string }{
		{"not a metrics format", "{}", "application/json"},
		{"unparsable content type", "x 1\n", "text/plain; ;;=="},
		{"OpenMetrics 2.0 is not decoded", "x 1\n# EOF\n", "application/openmetrics-text; version=2.0.0; charset=utf-8"},
		{"syntax error", "vllm:num_requests_waiting{model_name=\"m\" 1\n", textType},
		{"OpenMetrics exemplars are not supported", "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1 # {trace_id=\"a\"} 0.5\n# EOF\n", "application/openmetrics-text; version=1.0.0; charset=utf-8"},
		{"a TYPE line after the samples", "x 1\n# TYPE x gauge\n", textType},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := ParseSignals(strings.NewReader(tc.body), tc.ct, VLLMSignals, "", time.Unix(1, 0))
			if err == nil {
				t.Fatalf("no error; readings %+v", s.Readings())
			}
			if r := s.Readings(); !s.At().IsZero() || r.Waiting.Known || r.Running.Known || r.KVUsage.Known || r.QueueTime.Known() || r.TTFT.Known() {
				t.Errorf("sample %+v on error, want the zero sample", s)
			}
		})
	}
}

func TestSampleStaleness(t *testing.T) {
	at := time.Unix(1000, 0)
	s, err := ParseSignals(strings.NewReader(vllmOldKV+vllmQueueHist), textType, VLLMSignals, "", at)
	if err != nil {
		t.Fatal(err)
	}
	const stale = 3 * time.Second
	for _, tc := range []struct {
		name   string
		sample Sample
		now    time.Time
		stale  time.Duration
		fresh  bool
	}{
		{"just scraped", s, at, stale, true},
		{"at the bound", s, at.Add(stale), stale, true},
		{"past the bound", s, at.Add(stale + time.Nanosecond), stale, false},
		{"never scraped", Sample{}, at, stale, false},
		{"no staleness bound", s, at, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			smp, now := tc.sample, tc.now
			if got := smp.Fresh(now, tc.stale); got != tc.fresh {
				t.Fatalf("Fresh = %v, want %v", got, tc.fresh)
			}
			w, r, kv := smp.Waiting(now, tc.stale), smp.Running(now, tc.stale), smp.KVUsage(now, tc.stale)
			q, f := smp.QueueTime(now, tc.stale), smp.TTFT(now, tc.stale)
			if tc.fresh {
				if w != known(0) || r != known(5) || kv != known(0.93) || q.Count() != 4 || f.Known() {
					t.Errorf("fresh sample reads %v %v %v %v %v", w, r, kv, q, f)
				}
				return
			}
			if w.Known || r.Known || kv.Known || q.Known() || f.Known() {
				t.Errorf("stale sample reads %v %v %v %v %v, want all unknown", w, r, kv, q, f)
			}
		})
	}
	// The readings stay for metrics and the admin API.
	if got := s.Readings().KVUsage; got != known(0.93) {
		t.Errorf("Readings().KVUsage = %v", got)
	}
	if got := s.Age(at.Add(5 * time.Second)); got != 5*time.Second {
		t.Errorf("Age = %v", got)
	}
}

const vllmQueueHist = `# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{model_name="m",le="1"} 3
vllm:request_queue_time_seconds_bucket{model_name="m",le="+Inf"} 4
vllm:request_queue_time_seconds_count{model_name="m"} 4
vllm:request_queue_time_seconds_sum{model_name="m"} 2
`

func hist(bounds []float64, counts ...float64) Histogram {
	h := Histogram{}
	for i, b := range bounds {
		h.Buckets = append(h.Buckets, Bucket{UpperBound: b, Count: counts[i]})
	}
	return h
}

var inf = math.Inf(1)

func TestQuantileBetween(t *testing.T) {
	bounds := []float64{0.3, 0.5, 0.8, 1, 2.5, 5, inf}
	prev := hist(bounds, 10, 15, 20, 20, 22, 22, 22)
	cur := hist(bounds, 10, 15, 20, 30, 80, 110, 120)
	// cur − prev: 0 0 0 10 58 88 98 (cumulative), 98 observations.
	for _, tc := range []struct {
		name      string
		prev, cur Histogram
		q         float64
		want      Value
	}{
		// rank 49 lands in (1, 2.5] holding 48 (10 below): 1 + 1.5×39/48.
		{"p50 of the difference", prev, cur, 0.5, known(2.21875)},
		// rank 78.4 in (2.5, 5] holding 30 (58 below): 2.5 + 2.5×20.4/30.
		{"p80 of the difference", prev, cur, 0.8, known(4.2)},
		// rank 88.2 is past the 88 of the last finite bucket: the +Inf
		// bucket, read as the largest finite bound.
		{"p90 in the +Inf bucket", prev, cur, 0.9, known(5)},
		{"p99 in the +Inf bucket", prev, cur, 0.99, known(5)},
		// q = 0: the lower edge of the first bucket with an observation.
		{"p0", prev, cur, 0, known(0.8)},
		{"p100", prev, cur, 1, known(5)},
		{"no observations between: unknown, not 0", cur, cur, 0.99, unknown},
		{"no earlier scrape: unknown", Histogram{}, cur, 0.99, unknown},
		{"histogram not exposed: unknown", prev, Histogram{}, 0.99, unknown},
		{"q above 1", prev, cur, 1.5, unknown},
		{"q below 0", prev, cur, -0.1, unknown},
		{"q NaN", prev, cur, math.NaN(), unknown},
		// Server restarted: cur alone (4 observations since the restart).
		// p50: rank 2 in (0.3, 0.5] holding 1 (1 below) = 0.5.
		{"counter reset: total went down, cur alone (p50)", cur, hist(bounds, 1, 2, 2, 3, 4, 4, 4), 0.5, known(0.5)},
		// p99: rank 3.96 in (1, 2.5] holding 1 (3 below): 1 + 1.5×0.96.
		{"counter reset: total went down, cur alone (p99)", cur, hist(bounds, 1, 2, 2, 3, 4, 4, 4), 0.99, known(2.44)},
		// Total and every cumulative count went up, but bucket (1, 2]'s own
		// count went from 5 to 3: a reset. cur alone, p50: rank 5.5 in
		// (0, 1] holding 8: 5.5/8.
		{"counter reset seen in one bucket's own count",
			hist([]float64{1, 2, inf}, 5, 10, 10), hist([]float64{1, 2, inf}, 8, 11, 11), 0.5, known(0.6875)},
		// Bounds changed (a new server version): cur alone. p50 of
		// [2 ≤ 0.5, 4 ≤ +Inf]: rank 2 reaches 0.5 exactly.
		{"bucket layout changed: cur alone",
			hist([]float64{1, inf}, 5, 10), hist([]float64{0.5, inf}, 2, 4), 0.5, known(0.5)},
		// SGLang's first bucket is 0.0: a quantile there is 0.
		{"first bound 0", hist([]float64{0, 0.1, inf}, 0, 0, 0), hist([]float64{0, 0.1, inf}, 6, 8, 10), 0.5, known(0)},
		{"only a +Inf bucket: unknown", hist([]float64{inf}, 0), hist([]float64{inf}, 5), 0.5, unknown},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := QuantileBetween(tc.prev, tc.cur, tc.q)
			if got.Known != tc.want.Known || math.Abs(got.V-tc.want.V) > 1e-9 {
				t.Errorf("QuantileBetween = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestQuantileBetweenScrapes(t *testing.T) {
	// Two scrapes of the same server; the recent p50 is computed from the
	// difference of the parsed buckets, not since server start.
	first := "# TYPE vllm:request_queue_time_seconds histogram\n" +
		"vllm:request_queue_time_seconds_bucket{model_name=\"m\",le=\"1\"} 100\n" +
		"vllm:request_queue_time_seconds_bucket{model_name=\"m\",le=\"10\"} 100\n" +
		"vllm:request_queue_time_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 100\n" +
		"vllm:request_queue_time_seconds_count{model_name=\"m\"} 100\n"
	second := "# TYPE vllm:request_queue_time_seconds histogram\n" +
		"vllm:request_queue_time_seconds_bucket{model_name=\"m\",le=\"1\"} 100\n" +
		"vllm:request_queue_time_seconds_bucket{model_name=\"m\",le=\"10\"} 110\n" +
		"vllm:request_queue_time_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 110\n" +
		"vllm:request_queue_time_seconds_count{model_name=\"m\"} 110\n"
	prev := parse(t, first, textType, VLLMSignals, "m").QueueTime
	cur := parse(t, second, textType, VLLMSignals, "m").QueueTime
	// Since start the median is under 1s; the 10 recent observations all
	// waited between 1 and 10s: p50 = 1 + 9×5/10.
	if got := cur.Quantile(0.5); got.V >= 1 {
		t.Errorf("since-start p50 = %v, want < 1", got)
	}
	if got := QuantileBetween(prev, cur, 0.5); got != known(5.5) {
		t.Errorf("recent p50 = %v, want 5.5", got)
	}
}

func equalBuckets(a, b []Bucket) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// FuzzParseSignals checks that no input makes the parser panic, and that
// whatever it accepts is well formed: known values finite, histograms
// cumulative and ending in +Inf, quantiles of them finite or unknown.
func FuzzParseSignals(f *testing.F) {
	for _, body := range []string{vllmTwoEngines, vllmOldKV, vllmTwoModels, sglangMetrics, tgiMetrics, vllmQueueHist, ""} {
		f.Add(body, textType, "")
		f.Add(body, "", "m")
	}
	f.Add(vllmOpenMetrics, "application/openmetrics-text; version=1.0.0; charset=utf-8", "m")
	f.Add("# TYPE vllm:request_queue_time_seconds histogram\nvllm:request_queue_time_seconds_bucket{le=\"NaN\"} 1\n", textType, "")
	f.Add("vllm:num_requests_waiting 1e309\n", textType, "")
	f.Fuzz(func(t *testing.T, body, ct, model string) {
		for _, names := range []SignalNames{VLLMSignals, SGLangSignals, TGISignals} {
			s, err := ParseSignals(strings.NewReader(body), ct, names, model, time.Unix(1, 0))
			if err != nil {
				continue
			}
			r := s.Readings()
			for _, v := range []Value{r.Waiting, r.Running, r.KVUsage} {
				if v.Known && (math.IsNaN(v.V) || math.IsInf(v.V, 0)) {
					t.Fatalf("known value %v is not finite", v.V)
				}
			}
			for _, h := range []Histogram{r.QueueTime, r.TTFT} {
				checkHistogram(t, h)
				for _, q := range []float64{0, 0.5, 0.99, 1} {
					for _, v := range []Value{h.Quantile(q), QuantileBetween(hist([]float64{1, inf}, 1, 2), h, q)} {
						if v.Known && (math.IsNaN(v.V) || math.IsInf(v.V, 0)) {
							t.Fatalf("quantile %v of %v = %v", q, h.Buckets, v.V)
						}
					}
					if v := QuantileBetween(h, h, q); v.Known {
						t.Fatalf("quantile between equal scrapes is %v, want unknown", v)
					}
				}
			}
		}
	})
}

func checkHistogram(t *testing.T, h Histogram) {
	t.Helper()
	if !h.Known() {
		return
	}
	if !math.IsInf(h.Buckets[len(h.Buckets)-1].UpperBound, +1) {
		t.Fatalf("last bucket %v is not +Inf", h.Buckets)
	}
	for i, b := range h.Buckets {
		if math.IsNaN(b.Count) || b.Count < 0 || math.IsInf(b.Count, 0) {
			t.Fatalf("bucket %v has count %v", b.UpperBound, b.Count)
		}
		if i > 0 && (b.UpperBound <= h.Buckets[i-1].UpperBound || b.Count < h.Buckets[i-1].Count) {
			t.Fatalf("buckets %v not ascending and cumulative", h.Buckets)
		}
	}
}
