package saturation

import (
	"errors"
	"fmt"
	"io"
	"math"
	"mime"
	"slices"
	"sort"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
)

// This file is the pure part of saturation (DESIGN §7):
// the names of an inference server's load signals, the parse of one
// /metrics scrape into a Sample, staleness, and the recent quantile of a
// histogram from the difference of two scrapes. It does no I/O: the
// scraper that fetches /metrics, the scoring and the breaker trips are
// built on it elsewhere.

// SignalNames are the Prometheus metric family names read for each signal.
// Each list is tried in order and the first family the server exposes
// (with at least one series for the model asked for) is used, so a metric
// renamed between server versions is listed new name first, old name second;
// an empty list means the signal is never known.
//
// Waiting, Running and KVUsage name gauges (a counter or untyped value is
// accepted too); QueueTime and TTFT name classic histograms in seconds (a
// summary, or a native histogram without classic buckets, reads as unknown).
type SignalNames struct {
	// Waiting is the queue depth: requests accepted by the server and not
	// yet scheduled (a count).
	Waiting []string
	// Running is the number of requests in the running batch (a count).
	Running []string
	// KVUsage is the KV-cache usage as a ratio, 0 (empty) to 1 (full).
	KVUsage []string
	// QueueTime is the histogram of the time each request waited in the
	// server's queue before it was scheduled, in seconds.
	QueueTime []string
	// TTFT is the histogram of the time to the first output token, in
	// seconds, as the server measures it.
	TTFT []string
	// PrefixQueries and PrefixHits are counters of the prompt tokens the
	// server looked up in its prefix cache and found there; PrefixHitRate
	// is a gauge of the share found (0–1), read when the counters are not
	// exposed. They are not load signals: the gateway reports the server's
	// own prefix-cache hit ratio next to lb_policy prefix_cache's guess.
	PrefixQueries, PrefixHits, PrefixHitRate []string
}

// VLLMSignals are vLLM's metric names, the default preset. KV-cache usage
// is read from vllm:kv_cache_usage_perc, else from the older
// vllm:gpu_cache_usage_perc (the V0 engine's name, deprecated since the V1
// engine; both are a ratio 0–1 despite "perc"). Source: vLLM's
// vllm/v1/metrics/loggers.py and docs/design/metrics.md; series carry a
// model_name label (and engine under data parallelism).
var VLLMSignals = SignalNames{
	Waiting:   []string{"vllm:num_requests_waiting"},
	Running:   []string{"vllm:num_requests_running"},
	KVUsage:   []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"},
	QueueTime: []string{"vllm:request_queue_time_seconds"},
	TTFT:      []string{"vllm:time_to_first_token_seconds"},
	// vLLM V1's counters (vllm/v1/metrics/loggers.py; the text exposition
	// names them with _total), then V0's gauge.
	PrefixQueries: []string{"vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries"},
	PrefixHits:    []string{"vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"},
	PrefixHitRate: []string{"vllm:gpu_prefix_cache_hit_rate"},
}

// SGLangSignals are SGLang's metric names (server started with
// --enable-metrics). sglang:token_usage is the fraction of the KV-cache
// token pool in use, 0–1. Source: sgl-project/sglang
// python/sglang/srt/metrics/collector.py (SchedulerMetricsCollector:
// num_queue_reqs, num_running_reqs, token_usage, queue_time_seconds;
// TokenizerMetricsCollector: time_to_first_token_seconds) and
// docs/references/production_metrics.md; series carry a model_name label.
var SGLangSignals = SignalNames{
	Waiting:   []string{"sglang:num_queue_reqs"},
	Running:   []string{"sglang:num_running_reqs"},
	KVUsage:   []string{"sglang:token_usage"},
	QueueTime: []string{"sglang:queue_time_seconds"},
	TTFT:      []string{"sglang:time_to_first_token_seconds"},
	// SchedulerMetricsCollector's cache_hit_rate: the prefix (radix)
	// cache's hit ratio, 0–1.
	PrefixHitRate: []string{"sglang:cache_hit_rate"},
}

// TGISignals are Hugging Face Text Generation Inference's metric names.
// TGI publishes no KV-cache usage gauge and no time-to-first-token
// histogram, so KVUsage and TTFT are empty (always unknown);
// tgi_request_queue_duration is a histogram in seconds (the router gives
// every "*duration" metric classic buckets). Running is the current batch
// size. Source: huggingface/text-generation-inference
// docs/source/reference/metrics.md and router/src/server.rs; series carry
// no model label.
var TGISignals = SignalNames{
	Waiting:   []string{"tgi_queue_size"},
	Running:   []string{"tgi_batch_current_size"},
	QueueTime: []string{"tgi_request_queue_duration"},
}

// ModelLabel is the label that names a series' model ("model_name" in
// vLLM and SGLang). ParseSignals filters on it when asked for one model.
const ModelLabel = "model_name"

// Value is one scalar signal: V is meaningful only when Known. An unknown
// value (the zero Value) is never to be read as 0 (idle) nor as full
// (DESIGN §7): the server did not expose the metric, or the sample is stale.
type Value struct {
	V     float64
	Known bool
}

// Known returns a known Value.
func Known(v float64) Value { return Value{V: v, Known: true} }

// String formats the value, or "unknown".
func (v Value) String() string {
	if !v.Known {
		return "unknown"
	}
	return fmt.Sprint(v.V)
}

// Bucket is one cumulative histogram bucket: Count observations were ≤
// UpperBound (in the histogram's unit, seconds for QueueTime and TTFT).
type Bucket struct {
	UpperBound float64
	Count      float64
}

// Histogram is a classic Prometheus histogram as scraped: cumulative
// counts since the server started. Buckets ascend by UpperBound, counts
// never decrease, and the last bucket is +Inf, whose Count is the number
// of observations; a Histogram without buckets (the zero value) is
// unknown. Treat Buckets as read-only: samples share them.
type Histogram struct {
	Buckets []Bucket
	// Sum is the sum of the observations (seconds for QueueTime and TTFT).
	Sum float64
}

// Known reports whether the histogram was exposed.
func (h Histogram) Known() bool { return len(h.Buckets) > 0 }

// Count returns the number of observations (the +Inf bucket), 0 when
// unknown.
func (h Histogram) Count() float64 {
	if len(h.Buckets) == 0 {
		return 0
	}
	return h.Buckets[len(h.Buckets)-1].Count
}

// Quantile returns the q-quantile (0 ≤ q ≤ 1) of every observation since
// the server started, interpolated within buckets as PromQL's
// histogram_quantile does; unknown when there are no observations. For a
// recent quantile use QuantileBetween.
func (h Histogram) Quantile(q float64) Value { return bucketQuantile(q, h.Buckets) }

// Readings are the signals of one scrape, whatever their age.
type Readings struct {
	// Waiting is the queue depth (requests), summed over the series read.
	Waiting Value
	// Running is the requests running (requests), summed over the series.
	Running Value
	// KVUsage is the KV-cache usage ratio 0–1: the largest of the series
	// read (one per engine under data parallelism), since a sum of ratios
	// would call two half-full caches full.
	KVUsage Value
	// QueueTime is the queue-wait histogram (seconds), buckets summed over
	// the series.
	QueueTime Histogram
	// TTFT is the time-to-first-token histogram (seconds), summed likewise.
	TTFT Histogram
	// PrefixQueries and PrefixHits are the prefix-cache counters (tokens
	// since the server started), summed over the series; PrefixHitRate the
	// hit-ratio gauge (0–1), the mean of the series.
	PrefixQueries, PrefixHits, PrefixHitRate Value
}

// Sample is one scrape's signals and the time it was taken. The zero
// Sample is "never scraped": stale, every signal unknown. The accessors
// (Waiting, Running, KVUsage, QueueTime, TTFT) read unknown once the
// sample is older than the staleness bound, so a stale value is never
// mistaken for a current one (DESIGN §7).
type Sample struct {
	at time.Time
	r  Readings
}

// NewSample returns the sample of readings taken at at; it keeps r's
// histogram buckets (do not modify them afterwards).
func NewSample(at time.Time, r Readings) Sample { return Sample{at: at, r: r} }

// At returns when the scrape was taken (the zero time: never).
func (s Sample) At() time.Time { return s.at }

// Age returns how old the sample is at now (0 for a sample from the future).
func (s Sample) Age(now time.Time) time.Duration { return max(now.Sub(s.at), 0) }

// Fresh reports whether the sample was taken and is at most staleAfter old
// at now. A staleAfter ≤ 0 makes every sample stale.
func (s Sample) Fresh(now time.Time, staleAfter time.Duration) bool {
	return !s.at.IsZero() && staleAfter > 0 && now.Sub(s.at) <= staleAfter
}

// Readings returns the sample's values whatever its age: for metrics, the
// admin API, and as the older side of QuantileBetween. Decisions read the
// accessors instead, which apply staleness.
func (s Sample) Readings() Readings { return s.r }

// Waiting returns the queue depth, unknown when stale or not exposed.
func (s Sample) Waiting(now time.Time, staleAfter time.Duration) Value {
	return s.value(s.r.Waiting, now, staleAfter)
}

// Running returns the running requests, unknown when stale or not exposed.
func (s Sample) Running(now time.Time, staleAfter time.Duration) Value {
	return s.value(s.r.Running, now, staleAfter)
}

// KVUsage returns the KV-cache usage ratio, unknown when stale or not
// exposed.
func (s Sample) KVUsage(now time.Time, staleAfter time.Duration) Value {
	return s.value(s.r.KVUsage, now, staleAfter)
}

// QueueTime returns the queue-wait histogram, unknown (zero) when stale or
// not exposed.
func (s Sample) QueueTime(now time.Time, staleAfter time.Duration) Histogram {
	return s.hist(s.r.QueueTime, now, staleAfter)
}

// TTFT returns the time-to-first-token histogram, unknown (zero) when
// stale or not exposed.
func (s Sample) TTFT(now time.Time, staleAfter time.Duration) Histogram {
	return s.hist(s.r.TTFT, now, staleAfter)
}

func (s Sample) value(v Value, now time.Time, staleAfter time.Duration) Value {
	if !s.Fresh(now, staleAfter) {
		return Value{}
	}
	return v
}

func (s Sample) hist(h Histogram, now time.Time, staleAfter time.Duration) Histogram {
	if !s.Fresh(now, staleAfter) {
		return Histogram{}
	}
	return h
}

// ParseSignals reads one /metrics response body into a Sample taken at at.
// contentType is the response's Content-Type: the Prometheus text format
// (text/plain, the default when empty), OpenMetrics 1.0
// (application/openmetrics-text; exemplars are not supported) or
// delimited protobuf; anything else is an error. The body is parsed by
// Prometheus' own decoder (github.com/prometheus/common/expfmt).
//
// For each signal the first name in names that has a matching series is
// read; the series of all models are combined (summed; KV usage takes the
// largest), or, when model is not empty, only those whose model_name label
// is model, plus those without a model_name label (a server that labels no
// model serves one). A signal without a usable series, or whose value is
// not finite, or a histogram whose buckets are not cumulative, is unknown.
// A body that does not parse is an error; the caller counts the scrape as
// failed (its signals unknown) rather than using a partial one.
func ParseSignals(r io.Reader, contentType string, names SignalNames, model string, at time.Time) (Sample, error) {
	fams, err := decodeFamilies(r, contentType)
	if err != nil {
		return Sample{}, err
	}
	return Sample{at: at, r: readings(fams, names, model)}, nil
}

// Scrape is one /metrics response read for the whole server and for each
// model it serves.
type Scrape struct {
	// Server holds the signals of every model's series combined.
	Server Sample
	// Models holds each model's signals (its series plus those without a
	// model_name label), keyed by model_name, when the server exposes more
	// than one model; nil otherwise (the server's signals are the model's).
	Models map[string]Sample
}

// Stamp sets the time of the server's sample and of every model's to at
// (the scrape stamps them when the body was read).
func (s *Scrape) Stamp(at time.Time) {
	s.Server.at = at
	for k, m := range s.Models {
		m.at = at
		s.Models[k] = m
	}
}

// Empty reports whether n names no series at all.
func (n SignalNames) Empty() bool {
	return len(n.Waiting) == 0 && len(n.Running) == 0 && len(n.KVUsage) == 0 && len(n.QueueTime) == 0 && len(n.TTFT) == 0
}

// Model returns the sample for model: its own when the server labels
// several models and model is one of them, else the server's.
func (s Scrape) Model(model string) Sample {
	if m, ok := s.Models[model]; ok && model != "" {
		return m
	}
	return s.Server
}

// ParseScrape reads one /metrics response body as ParseSignals does, once
// for the whole server and once per model_name found on the signals'
// families, so that one parse answers requests for any model.
func ParseScrape(r io.Reader, contentType string, names SignalNames, at time.Time) (Scrape, error) {
	fams, err := decodeFamilies(r, contentType)
	if err != nil {
		return Scrape{}, err
	}
	out := Scrape{Server: Sample{at: at, r: readings(fams, names, "")}}
	models := modelNames(fams, names)
	if len(models) > 1 {
		out.Models = make(map[string]Sample, len(models))
		for _, m := range models {
			out.Models[m] = Sample{at: at, r: readings(fams, names, m)}
		}
	}
	return out, nil
}

// maxScrapeModels bounds the models read per server, so a server labelling
// junk cannot make every scrape allocate without bound.
const maxScrapeModels = 64

// modelNames returns the distinct model_name values on the families the
// signals read, sorted, at most maxScrapeModels.
func modelNames(fams map[string]*dto.MetricFamily, names SignalNames) []string {
	var out []string
	for _, list := range [][]string{names.Waiting, names.Running, names.KVUsage, names.QueueTime, names.TTFT} {
		for _, n := range list {
			mf, ok := fams[n]
			if !ok {
				continue
			}
			for _, m := range mf.GetMetric() {
				if v, ok := label(m, ModelLabel); ok && v != "" && !slices.Contains(out, v) && len(out) < maxScrapeModels {
					out = append(out, v)
				}
			}
		}
	}
	slices.Sort(out)
	return out
}

func decodeFamilies(r io.Reader, contentType string) (map[string]*dto.MetricFamily, error) {
	format, err := scrapeFormat(contentType)
	if err != nil {
		return nil, err
	}
	fams := make(map[string]*dto.MetricFamily)
	dec := expfmt.NewDecoder(r, format)
	for {
		var mf dto.MetricFamily
		if err := dec.Decode(&mf); err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			return nil, fmt.Errorf("parsing metrics as %s: %w", format, err)
		}
		name := mf.GetName()
		if prev, ok := fams[name]; ok {
			// The protobuf format may split a family; keep it whole.
			prev.Metric = append(prev.Metric, mf.Metric...)
			continue
		}
		fams[name] = &mf
	}
	return fams, nil
}

func readings(fams map[string]*dto.MetricFamily, names SignalNames, model string) Readings {
	return Readings{
		Waiting:   scalar(fams, names.Waiting, model, sumValues),
		Running:   scalar(fams, names.Running, model, sumValues),
		KVUsage:   scalar(fams, names.KVUsage, model, maxValues),
		QueueTime: histogram(fams, names.QueueTime, model),
		TTFT:      histogram(fams, names.TTFT, model),

		PrefixQueries: scalar(fams, names.PrefixQueries, model, sumValues),
		PrefixHits:    scalar(fams, names.PrefixHits, model, sumValues),
		PrefixHitRate: scalar(fams, names.PrefixHitRate, model, meanValues),
	}
}

// scrapeFormat maps a Content-Type to the decoder's format.
func scrapeFormat(contentType string) (expfmt.Format, error) {
	if strings.TrimSpace(contentType) == "" {
		return expfmt.FmtText, nil
	}
	mediatype, params, err := mime.ParseMediaType(contentType)
	if err != nil {
		return expfmt.FmtUnknown, fmt.Errorf("metrics content type %q: %w", contentType, err)
	}
	switch mediatype {
	case "text/plain":
		return expfmt.FmtText, nil
	case expfmt.OpenMetricsType:
		v := params["version"]
		if v == "" {
			v = expfmt.OpenMetricsVersion_1_0_0
		}
		f, err := expfmt.NewOpenMetricsFormat(v)
		if err != nil || v == expfmt.OpenMetricsVersion_2_0_0 {
			return expfmt.FmtUnknown, fmt.Errorf("metrics content type %q: unsupported OpenMetrics version", contentType)
		}
		return f, nil
	case expfmt.ProtoType:
		if p, ok := params["proto"]; ok && p != expfmt.ProtoProtocol {
			break
		}
		if e, ok := params["encoding"]; ok && e != "delimited" {
			break
		}
		return expfmt.FmtProtoDelim, nil
	}
	return expfmt.FmtUnknown, fmt.Errorf("metrics content type %q: not a Prometheus exposition format", contentType)
}

// series returns the family's series for model ("" all of them).
func series(mf *dto.MetricFamily, model string) []*dto.Metric {
	if model == "" {
		return mf.GetMetric()
	}
	var out []*dto.Metric
	for _, m := range mf.GetMetric() {
		if v, ok := label(m, ModelLabel); !ok || v == model {
			out = append(out, m)
		}
	}
	return out
}

func label(m *dto.Metric, name string) (string, bool) {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue(), true
		}
	}
	return "", false
}

func sumValues(vs []float64) float64 {
	var s float64
	for _, v := range vs {
		s += v
	}
	return s
}

func maxValues(vs []float64) float64 { return slices.Max(vs) }

func meanValues(vs []float64) float64 { return sumValues(vs) / float64(len(vs)) }

// scalar reads the first listed gauge, counter or untyped family with
// series for model, combining them.
func scalar(fams map[string]*dto.MetricFamily, names []string, model string, combine func([]float64) float64) Value {
	for _, name := range names {
		mf, ok := fams[name]
		if !ok {
			continue
		}
		var vs []float64
		for _, m := range series(mf, model) {
			switch mf.GetType() {
			case dto.MetricType_GAUGE:
				vs = append(vs, m.GetGauge().GetValue())
			case dto.MetricType_COUNTER:
				vs = append(vs, m.GetCounter().GetValue())
			case dto.MetricType_UNTYPED:
				vs = append(vs, m.GetUntyped().GetValue())
			}
		}
		if len(vs) == 0 {
			continue
		}
		v := combine(vs)
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return Value{}
		}
		return Known(v)
	}
	return Value{}
}

// histogram reads the first listed histogram family with series for model,
// summing the series' buckets (on the bounds they all have).
func histogram(fams map[string]*dto.MetricFamily, names []string, model string) Histogram {
	for _, name := range names {
		mf, ok := fams[name]
		if !ok || mf.GetType() != dto.MetricType_HISTOGRAM {
			continue
		}
		var sum Histogram
		n := 0
		for _, m := range series(mf, model) {
			h, ok := fromDTO(m.GetHistogram())
			if !ok {
				return Histogram{}
			}
			if n == 0 {
				sum = h
			} else {
				sum = addHistograms(sum, h)
			}
			n++
		}
		if n == 0 {
			continue
		}
		return sum
	}
	return Histogram{}
}

// fromDTO converts one series' classic histogram, with the +Inf bucket
// added from the sample count when the exposition left it implicit. It
// refuses a histogram whose counts are negative, not finite, or not
// cumulative.
func fromDTO(h *dto.Histogram) (Histogram, bool) {
	if h == nil || len(h.GetBucket()) == 0 {
		return Histogram{}, false
	}
	total := float64(h.GetSampleCount())
	if h.SampleCountFloat != nil {
		total = h.GetSampleCountFloat()
	}
	bs := make([]Bucket, 0, len(h.GetBucket())+1)
	for _, b := range h.GetBucket() {
		c := float64(b.GetCumulativeCount())
		if b.CumulativeCountFloat != nil {
			c = b.GetCumulativeCountFloat()
		}
		bs = append(bs, Bucket{UpperBound: b.GetUpperBound(), Count: c})
	}
	sort.SliceStable(bs, func(i, j int) bool { return bs[i].UpperBound < bs[j].UpperBound })
	if !math.IsInf(bs[len(bs)-1].UpperBound, +1) {
		bs = append(bs, Bucket{UpperBound: math.Inf(+1), Count: total})
	}
	for i, b := range bs {
		if math.IsNaN(b.UpperBound) || math.IsNaN(b.Count) || math.IsInf(b.Count, 0) || b.Count < 0 {
			return Histogram{}, false
		}
		if i > 0 && (b.UpperBound == bs[i-1].UpperBound || b.Count < bs[i-1].Count) {
			return Histogram{}, false
		}
	}
	sum := h.GetSampleSum()
	if math.IsNaN(sum) || math.IsInf(sum, 0) {
		sum = 0
	}
	return Histogram{Buckets: bs, Sum: sum}, true
}

// addHistograms sums two histograms on the bounds both have (always at
// least +Inf): a cumulative count at a bound one of them lacks is not
// known. Series of one family normally share their bounds.
func addHistograms(a, b Histogram) Histogram {
	out := Histogram{Buckets: make([]Bucket, 0, min(len(a.Buckets), len(b.Buckets))), Sum: a.Sum + b.Sum}
	i, j := 0, 0
	for i < len(a.Buckets) && j < len(b.Buckets) {
		x, y := a.Buckets[i], b.Buckets[j]
		switch {
		case x.UpperBound < y.UpperBound:
			i++
		case x.UpperBound > y.UpperBound:
			j++
		default:
			out.Buckets = append(out.Buckets, Bucket{UpperBound: x.UpperBound, Count: x.Count + y.Count})
			i++
			j++
		}
	}
	return out
}

// QuantileBetween returns the q-quantile (0 ≤ q ≤ 1, e.g. 0.99) of the
// observations made between two scrapes of one histogram, prev the older:
// the difference of their cumulative buckets, interpolated within a bucket
// as PromQL's histogram_quantile does (a quantile in the +Inf bucket reads
// as the largest finite bound). The unit is the histogram's (seconds for
// QueueTime and TTFT).
//
// It is unknown when either histogram is unknown, when there were no
// observations between the two (an idle server has no recent queue wait;
// it is not 0), when q is outside [0, 1], or when the histogram has no
// finite bucket.
//
// A counter reset between the scrapes (the server restarted: a bucket's
// own count or the total went down, or the bucket bounds changed) reads
// cur alone: after a restart cur counts only what happened since, which is
// all after prev, so it is the recent window (as PromQL's rate() takes the
// post-reset value). A restart that refilled every bucket past its old
// count before cur cannot be told from traffic, as in Prometheus.
func QuantileBetween(prev, cur Histogram, q float64) Value {
	if !prev.Known() || !cur.Known() {
		return Value{}
	}
	d, ok := subHistograms(cur, prev)
	if !ok {
		return cur.Quantile(q)
	}
	return bucketQuantile(q, d.Buckets)
}

// subHistograms returns cur − prev, false on a reset (see QuantileBetween).
func subHistograms(cur, prev Histogram) (Histogram, bool) {
	if len(cur.Buckets) != len(prev.Buckets) {
		return Histogram{}, false
	}
	out := Histogram{Buckets: make([]Bucket, len(cur.Buckets)), Sum: cur.Sum - prev.Sum}
	var cLow, pLow float64
	for i, c := range cur.Buckets {
		p := prev.Buckets[i]
		if c.UpperBound != p.UpperBound {
			return Histogram{}, false
		}
		// Each bucket's own count is a counter: it never goes down but
		// on a reset.
		if c.Count-cLow < p.Count-pLow {
			return Histogram{}, false
		}
		cLow, pLow = c.Count, p.Count
		out.Buckets[i] = Bucket{UpperBound: c.UpperBound, Count: c.Count - p.Count}
	}
	return out, true
}

// bucketQuantile is PromQL's histogram_quantile over cumulative buckets
// ascending by bound and ending with +Inf (Prometheus promql/quantile.go),
// answering unknown where PromQL answers NaN or ±Inf.
func bucketQuantile(q float64, bs []Bucket) Value {
	if math.IsNaN(q) || q < 0 || q > 1 || len(bs) < 2 || !math.IsInf(bs[len(bs)-1].UpperBound, +1) {
		return Value{}
	}
	total := bs[len(bs)-1].Count
	if !(total > 0) {
		return Value{}
	}
	rank := q * total
	// The first bucket that reaches the rank; "and is not empty" only
	// matters for q = 0, whose answer is the lower edge of the first
	// bucket holding an observation.
	b := sort.Search(len(bs)-1, func(i int) bool { return bs[i].Count >= rank && bs[i].Count > 0 })
	var v float64
	switch {
	case b == len(bs)-1:
		v = bs[len(bs)-2].UpperBound
	case b == 0 && bs[0].UpperBound <= 0:
		v = bs[0].UpperBound
	default:
		var start float64
		end, count := bs[b].UpperBound, bs[b].Count
		if b > 0 {
			start = bs[b-1].UpperBound
			count -= bs[b-1].Count
			rank -= bs[b-1].Count
		}
		v = start + (end-start)*(rank/count)
	}
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return Value{}
	}
	return Known(v)
}

// ShareAboveBetween returns the share (0–1) of the observations made
// between two scrapes of one histogram (prev the older) that were certainly
// above v: those in buckets whose lower bound is at least v. Unlike an
// interpolated quantile it never reads "above" from the position inside a
// bucket, so a threshold below the first bucket's bound (vLLM's queue-time
// buckets start at 0.3s) is not crossed by requests that waited 0s. It is
// unknown when QuantileBetween would be (no observations between the two,
// or either histogram unknown); a counter reset reads cur alone.
func ShareAboveBetween(prev, cur Histogram, v float64) Value {
	if !prev.Known() || !cur.Known() {
		return Value{}
	}
	d, ok := subHistograms(cur, prev)
	if !ok {
		d = cur
	}
	bs := d.Buckets
	total := bs[len(bs)-1].Count
	if !(total > 0) {
		return Value{}
	}
	// Buckets up to the first whose upper bound reaches v may hold
	// observations at or below v; every bucket after it starts at or
	// above v.
	below := total
	for _, b := range bs {
		if b.UpperBound >= v {
			below = b.Count
			break
		}
	}
	return Known((total - below) / total)
}
