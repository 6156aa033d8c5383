package caddymodule

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/llmproxy/caddy-llm-proxy/saturation"
)

// SaturationConfig turns on reading each upstream's load from its
// Prometheus /metrics (vLLM's names by default), and acting on it:
//
//   - selection: the default policy becomes least_queue, which picks the
//     upstream with the lowest saturation score, max(waiting /
//     queue_threshold, kv_usage / kv_threshold), where waiting counts the
//     attempts this gateway started since the last scrape; any other
//     lb_policy still works;
//   - an upstream whose score is 1 or more is removed from the candidates
//     while an unsaturated one exists (saturation alone never refuses a
//     request);
//   - the saturation breaker opens an upstream's breaker when its queue
//     wait or KV-cache usage stays high (see Trip);
//   - the pool is saturated when every healthy upstream is: admission
//     (when configured) then refuses sheddable tiers and queues the others.
//
// A value older than stale_after, a failed scrape, or a metric the server
// does not expose is unknown: never read as idle, never as full. One
// scraper runs per upstream however many handlers use it; it keeps its
// snapshot across reloads.
type SaturationConfig struct {
	// MetricsPath is the path scraped on each upstream, over the
	// handler's transport. Default: "/metrics".
	MetricsPath string `json:"metrics_path,omitempty"`

	// Interval is the time between two scrapes of one upstream.
	// Default: 1s.
	Interval caddy.Duration `json:"interval,omitempty"`

	// Timeout bounds one scrape; it may not exceed Interval.
	// Default: 500ms (or Interval, if shorter).
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// StaleAfter is the age past which a scraped value is unknown. It may
	// not be below 2 × Interval (one late scrape must not make every
	// signal unknown). Default: 3 × Interval.
	StaleAfter caddy.Duration `json:"stale_after,omitempty"`

	// Preset names the server's metric names: "vllm"
	// (vllm:num_requests_waiting, vllm:num_requests_running,
	// vllm:kv_cache_usage_perc or the older vllm:gpu_cache_usage_perc,
	// vllm:request_queue_time_seconds, vllm:time_to_first_token_seconds),
	// "sglang" (sglang:num_queue_reqs, sglang:num_running_reqs,
	// sglang:token_usage, sglang:queue_time_seconds,
	// sglang:time_to_first_token_seconds) or "tgi" (tgi_queue_size,
	// tgi_batch_current_size, tgi_request_queue_duration; TGI publishes
	// no KV-cache or TTFT metric). Default: "vllm".
	Preset string `json:"preset,omitempty"`

	// Metrics overrides the preset's metric name of a signal: keys are
	// queue_depth (gauge of waiting requests), running (gauge of running
	// requests), kv_usage (gauge, ratio 0–1), queue_time (histogram of
	// queue wait, seconds) and ttft (histogram of time to first token,
	// seconds); each value replaces that signal's names in the preset.
	// Default: none.
	Metrics map[string]string `json:"metrics,omitempty"`

	// QueueThreshold is the effective queue depth (waiting requests) at
	// which an upstream's score reaches 1, saturated. Default: 5.
	QueueThreshold float64 `json:"queue_threshold,omitempty"`

	// KVThreshold is the KV-cache usage ratio at which an upstream's score
	// reaches 1. Default: 0.8.
	KVThreshold float64 `json:"kv_threshold,omitempty"`

	// Trip sets the saturation breaker's rules. The saturation breaker is
	// on whenever saturation is configured, with the defaults documented
	// on SaturationTrip; each rule set here replaces that rule's default
	// only, and {"off": true} turns the saturation rules off (the error
	// rules of the breaker still apply). It acts on the upstream's
	// breaker: with breaker off it does nothing. Default: the defaults.
	Trip *SaturationTrip `json:"trip,omitempty"`

	// Window is the span over which "recent" quantiles (queue-wait p99,
	// TTFT p95) are computed from the difference of histogram buckets
	// between scrapes; at least 2 × Interval. Default: 30s, or 2 × Interval
	// when that is longer.
	Window caddy.Duration `json:"window,omitempty"`
}

// SaturationTrip is the saturation breaker: an upstream's breaker opens
// when a rule's signal stays above its threshold for its duration, and
// half-opens after the breaker's cooldown; it closes once the signal is
// under the threshold for recovery_successes consecutive scrapes (no user
// request is risked). Unknown signals never trip it.
type SaturationTrip struct {
	// Off turns the saturation rules off; no other field may be set with
	// it. Default: false.
	Off bool `json:"off,omitempty"`

	// QueueWaitP99 trips when the recent queue-wait p99 stays above it
	// for QueueWaitFor. Default: 5s.
	QueueWaitP99 caddy.Duration `json:"queue_wait_p99,omitempty"`

	// QueueWaitFor is how long QueueWaitP99 must hold. Default: 30s.
	QueueWaitFor caddy.Duration `json:"queue_wait_for,omitempty"`

	// KVUsage trips when the KV-cache usage ratio stays above it for
	// KVFor. Default: 0.92.
	KVUsage float64 `json:"kv_usage,omitempty"`

	// KVFor is how long KVUsage must hold. Default: 60s.
	KVFor caddy.Duration `json:"kv_for,omitempty"`

	// TTFTP95 trips when the server's recent TTFT p95 (from its own
	// histogram) stays above it for TTFTFor. Default: 0 (rule off).
	TTFTP95 caddy.Duration `json:"ttft_p95,omitempty"`

	// TTFTFor is how long TTFTP95 must hold. Default: 30s.
	TTFTFor caddy.Duration `json:"ttft_for,omitempty"`
}

// The values of SaturationConfig.Preset.
var saturationPresets = map[string]saturation.SignalNames{
	"vllm":   saturation.VLLMSignals,
	"sglang": saturation.SGLangSignals,
	"tgi":    saturation.TGISignals,
}

// metricName is a Prometheus metric name (the classic charset, which
// every inference server's names use).
var metricName = regexp.MustCompile(`^[a-zA-Z_:][a-zA-Z0-9_:]*$`)

// names returns the signal names of the preset with the overrides applied.
func (c *SaturationConfig) names() (saturation.SignalNames, error) {
	preset := c.Preset
	if preset == "" {
		preset = "vllm"
	}
	n, ok := saturationPresets[preset]
	if !ok {
		return n, fmt.Errorf("unknown preset %q: want vllm, sglang or tgi", c.Preset)
	}
	keys := make([]string, 0, len(c.Metrics))
	for k := range c.Metrics {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, sig := range keys {
		name := c.Metrics[sig]
		if !metricName.MatchString(name) {
			return n, fmt.Errorf("metric %s: %q is not a Prometheus metric name", sig, name)
		}
		list := []string{name}
		switch sig {
		case "queue_depth":
			n.Waiting = list
		case "running":
			n.Running = list
		case "kv_usage":
			n.KVUsage = list
		case "queue_time":
			n.QueueTime = list
		case "ttft":
			n.TTFT = list
		default:
			return n, fmt.Errorf("unknown signal %q: want one of %s", sig, strings.Join(signalLabels(), ", "))
		}
	}
	return n, nil
}

func signalLabels() []string {
	out := make([]string, len(saturation.Signals))
	for i, s := range saturation.Signals {
		out[i] = s.String()
	}
	return out
}

// rules returns the saturation breaker's rules: the defaults with the
// rules set in t, nil when off.
func (t *SaturationTrip) rules() (*saturation.TripRules, error) {
	r := saturation.DefaultTripRules()
	if t == nil {
		return r, nil
	}
	if t.Off {
		if *t != (SaturationTrip{Off: true}) {
			return nil, errors.New("trip off turns the saturation rules off: set no rule with it")
		}
		return nil, nil
	}
	for _, d := range []struct {
		name string
		v    caddy.Duration
	}{{"queue_wait_p99", t.QueueWaitP99}, {"queue_wait_for", t.QueueWaitFor}, {"kv_for", t.KVFor}, {"ttft_p95", t.TTFTP95}, {"ttft_for", t.TTFTFor}} {
		if d.v < 0 {
			return nil, fmt.Errorf("trip %s: negative duration %v", d.name, time.Duration(d.v))
		}
	}
	if t.TTFTFor > 0 && t.TTFTP95 == 0 {
		return nil, errors.New("trip ttft_for needs ttft_p95 (the TTFT rule is off by default)")
	}
	if t.QueueWaitP99 > 0 {
		r.QueueWaitP99 = time.Duration(t.QueueWaitP99)
	}
	if t.QueueWaitFor > 0 {
		r.QueueWaitFor = time.Duration(t.QueueWaitFor)
	}
	if t.KVUsage != 0 {
		r.KVUsage = t.KVUsage
	}
	if t.KVFor > 0 {
		r.KVFor = time.Duration(t.KVFor)
	}
	r.TTFTP95, r.TTFTFor = time.Duration(t.TTFTP95), time.Duration(t.TTFTFor)
	return r, nil
}

// upstreamConfig returns the pool's saturation settings with defaults
// applied and validated (nil when saturation is off); Provision adds the
// transport. The Caddyfile parser calls it too, so both get the same errors.
func (c *SaturationConfig) upstreamConfig() (*saturation.Saturation, error) {
	if c == nil {
		return nil, nil
	}
	names, err := c.names()
	if err != nil {
		return nil, fmt.Errorf("saturation: %w", err)
	}
	trip, err := c.Trip.rules()
	if err != nil {
		return nil, fmt.Errorf("saturation: %w", err)
	}
	for _, d := range []struct {
		name string
		v    caddy.Duration
	}{{"interval", c.Interval}, {"timeout", c.Timeout}, {"stale_after", c.StaleAfter}, {"window", c.Window}} {
		if d.v < 0 {
			return nil, fmt.Errorf("saturation: negative %s %v", d.name, time.Duration(d.v))
		}
	}
	if c.QueueThreshold < 0 || c.KVThreshold < 0 {
		return nil, errors.New("saturation: queue_threshold and kv_threshold must not be negative")
	}
	s := saturation.Saturation{
		MetricsPath:    c.MetricsPath,
		Interval:       time.Duration(c.Interval),
		Timeout:        time.Duration(c.Timeout),
		StaleAfter:     time.Duration(c.StaleAfter),
		Names:          names,
		QueueThreshold: c.QueueThreshold,
		KVThreshold:    c.KVThreshold,
		Trip:           trip,
		Window:         time.Duration(c.Window),
	}.Defaults()
	if err := s.Validate(); err != nil {
		return nil, fmt.Errorf("saturation: %w", err)
	}
	return &s, nil
}

// leastQueuePolicy is the name of the pool's own least_queue policy in
// load_balancing.selection_policy: {"policy": "least_queue"}. It is not a
// Caddy module (reverse_proxy has no saturation signals), so Provision
// recognises it before loading the policy module.
const leastQueuePolicy = "least_queue"

// leastQueue reports whether a raw selection policy is least_queue, which
// takes no options.
func leastQueue(raw json.RawMessage) (bool, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		return false, nil // loading the module reports it
	}
	var name string
	if err := json.Unmarshal(m["policy"], &name); err != nil || name != leastQueuePolicy {
		return false, nil
	}
	if len(m) > 1 {
		return true, errors.New("selection policy least_queue takes no options")
	}
	return true, nil
}
