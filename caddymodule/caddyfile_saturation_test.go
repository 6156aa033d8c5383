package caddymodule

import (
	"context"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/llmproxy/caddy-llm-proxy/saturation"
)

// llmHandler returns the first llm_proxy handler of an adapted config.
func llmHandler(t *testing.T, adapted []byte) map[string]any {
	t.Helper()
	var cfg any
	if err := json.Unmarshal(adapted, &cfg); err != nil {
		t.Fatal(err)
	}
	var find func(v any) map[string]any
	find = func(v any) map[string]any {
		switch x := v.(type) {
		case map[string]any:
			if x["handler"] == "llm_proxy" {
				return x
			}
			for _, c := range x {
				if h := find(c); h != nil {
					return h
				}
			}
		case []any:
			for _, c := range x {
				if h := find(c); h != nil {
					return h
				}
			}
		}
		return nil
	}
	h := find(cfg)
	if h == nil {
		t.Fatalf("no llm_proxy handler in %s", adapted)
	}
	return h
}

func compact(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestSaturationAdaptsAndProvisions: each saturation Caddyfile adapts to the
// expected JSON (saturation and load_balancing), and the adapted config
// provisions.
func TestSaturationAdaptsAndProvisions(t *testing.T) {
	for _, tc := range []struct {
		name, block, saturation, lb string
	}{
		{"bare", "saturation", `{}`, ``},
		{"empty block", "saturation {\n}", `{}`, ``},
		{"full block", `saturation {
		metrics_path /internal/metrics
		interval 2s
		timeout 1s
		stale_after 10s
		preset sglang
		metric queue_depth my:waiting
		metric kv_usage my:kv
		queue_threshold 8
		kv_threshold 0.9
		trip queue_wait_p99 3s for 20s
		trip kv_usage 0.95 for 2m
		trip ttft_p95 4s for 45s
		window 1m
	}`,
			`{"interval":2000000000,"kv_threshold":0.9,"metrics":{"kv_usage":"my:kv","queue_depth":"my:waiting"},"metrics_path":"/internal/metrics","preset":"sglang","queue_threshold":8,"stale_after":10000000000,"timeout":1000000000,"trip":{"kv_for":120000000000,"kv_usage":0.95,"queue_wait_for":20000000000,"queue_wait_p99":3000000000,"ttft_for":45000000000,"ttft_p95":4000000000},"window":60000000000}`, ``},
		{"one trip rule", "saturation {\n\t\ttrip kv_usage 0.97\n\t}", `{"trip":{"kv_usage":0.97}}`, ``},
		{"trip off", "saturation {\n\t\ttrip off\n\t}", `{"trip":{"off":true}}`, ``},
		{"tgi", "saturation {\n\t\tpreset tgi\n\t}", `{"preset":"tgi"}`, ``},
		{"least_queue explicit", "lb_policy least_queue\n\tsaturation", `{}`, `{"selection_policy":{"policy":"least_queue"}}`},
		{"least_queue without saturation", "lb_policy least_queue", ``, `{"selection_policy":{"policy":"least_queue"}}`},
		{"other policy with saturation", "lb_policy round_robin\n\tsaturation", `{}`, `{"selection_policy":{"policy":"round_robin"}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := adapt(t, ":8080 {\n\tllm_proxy 127.0.0.1:9000 127.0.0.1:9001 {\n\t"+tc.block+"\n\t}\n}\n")
			if err != nil {
				t.Fatalf("adapt: %v", err)
			}
			h := llmHandler(t, out)
			if got := jsonOrEmpty(t, h["saturation"]); got != tc.saturation {
				t.Errorf("saturation\n got %s\nwant %s", got, tc.saturation)
			}
			if got := jsonOrEmpty(t, h["load_balancing"]); got != tc.lb {
				t.Errorf("load_balancing\n got %s\nwant %s", got, tc.lb)
			}
			if err := caddy.Validate(mustConfig(t, out)); err != nil {
				t.Fatalf("provisioning the adapted config: %v", err)
			}
		})
	}
}

func jsonOrEmpty(t *testing.T, v any) string {
	if v == nil {
		return ""
	}
	return compact(t, v)
}

// TestSaturationDefaults: a bare saturation block becomes the documented
// defaults, with the saturation breaker on.
func TestSaturationDefaults(t *testing.T) {
	got, err := (&SaturationConfig{}).upstreamConfig()
	if err != nil {
		t.Fatal(err)
	}
	want := saturation.Saturation{
		MetricsPath: "/metrics", Interval: time.Second, Timeout: 500 * time.Millisecond, StaleAfter: 3 * time.Second,
		Names: saturation.VLLMSignals, QueueThreshold: 5, KVThreshold: 0.8, Window: 30 * time.Second,
		Trip: &saturation.TripRules{QueueWaitP99: 5 * time.Second, QueueWaitFor: 30 * time.Second, KVUsage: 0.92, KVFor: time.Minute},
	}
	if !reflect.DeepEqual(*got, want) {
		t.Fatalf("defaults\n got %+v (trip %+v)\nwant %+v (trip %+v)", *got, *got.Trip, want, *want.Trip)
	}

	// stale_after follows interval; one trip line keeps the other defaults.
	got, err = (&SaturationConfig{Interval: caddy.Duration(2 * time.Second), Trip: &SaturationTrip{TTFTP95: caddy.Duration(3 * time.Second)}}).upstreamConfig()
	if err != nil {
		t.Fatal(err)
	}
	if got.StaleAfter != 6*time.Second || got.Timeout != 500*time.Millisecond {
		t.Errorf("interval 2s: stale_after %v, timeout %v", got.StaleAfter, got.Timeout)
	}
	wantTrip := saturation.TripRules{QueueWaitP99: 5 * time.Second, QueueWaitFor: 30 * time.Second, KVUsage: 0.92, KVFor: time.Minute,
		TTFTP95: 3 * time.Second, TTFTFor: 30 * time.Second}
	if *got.Trip != wantTrip {
		t.Errorf("trip ttft_p95 3s: %+v, want %+v", *got.Trip, wantTrip)
	}

	// trip off: no saturation rules.
	got, err = (&SaturationConfig{Trip: &SaturationTrip{Off: true}}).upstreamConfig()
	if err != nil || got.Trip != nil {
		t.Fatalf("trip off: %v, %+v", err, got)
	}

	// A metric override replaces that signal's names only.
	got, err = (&SaturationConfig{Preset: "sglang", Metrics: map[string]string{"kv_usage": "my:kv"}}).upstreamConfig()
	if err != nil {
		t.Fatal(err)
	}
	wantNames := saturation.SGLangSignals
	wantNames.KVUsage = []string{"my:kv"}
	if !reflect.DeepEqual(got.Names, wantNames) {
		t.Errorf("names %+v, want %+v", got.Names, wantNames)
	}
}

// TestSaturationSelectsLeastQueueByDefault: saturation without lb_policy
// selects least_queue; an explicit policy is kept.
func TestSaturationSelectsLeastQueueByDefault(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	lq := &LoadBalancing{SelectionPolicyRaw: []byte(`{"policy":"least_queue"}`)}
	for _, tc := range []struct {
		name string
		h    Handler
		want string
	}{
		{"saturation, no policy", Handler{Saturation: &SaturationConfig{}}, "upstream.LeastQueue"},
		{"no saturation, no policy", Handler{}, "upstream.LeastConn"},
		{"least_queue", Handler{LoadBalancing: lq}, "upstream.LeastQueue"},
		{"round_robin with saturation", Handler{Saturation: &SaturationConfig{},
			LoadBalancing: &LoadBalancing{SelectionPolicyRaw: []byte(`{"policy":"round_robin"}`)}}, "caddymodule.caddySelector"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sel, err := tc.h.loadSelector(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if got := reflect.TypeOf(sel).String(); got != tc.want {
				t.Errorf("selector %s, want %s", got, tc.want)
			}
		})
	}
}

// TestSaturationCaddyfileErrors checks every error of the saturation block,
// each with the line of the offending token.
func TestSaturationCaddyfileErrors(t *testing.T) {
	const up = "llm_proxy 127.0.0.1:9000 {\n"
	for _, tc := range []struct{ name, body, want string }{
		{"twice", up + "\tsaturation\n\tsaturation\n}", "at Caddyfile:4|saturation already specified"},
		{"argument", up + "\tsaturation on\n}", "at Caddyfile:3|wrong argument count"},
		{"unknown subdirective", up + "\tsaturation {\n\t\tscrape_every 1s\n\t}\n}", `at Caddyfile:4|unrecognized saturation option "scrape_every"`},
		{"bad preset", up + "\tsaturation {\n\t\tpreset llamacpp\n\t}\n}", `at Caddyfile:4|unknown preset "llamacpp": want vllm, sglang or tgi`},
		{"bad signal", up + "\tsaturation {\n\t\tmetric waiting vllm:num_requests_waiting\n\t}\n}", `at Caddyfile:4|unknown signal "waiting": want one of queue_depth, running, kv_usage, queue_time, ttft`},
		{"metric form", up + "\tsaturation {\n\t\tmetric kv_usage\n\t}\n}", "at Caddyfile:4|want: metric queue_depth|running"},
		{"metric name", up + "\tsaturation {\n\t\tmetric kv_usage kv-usage\n\t}\n}", `at Caddyfile:4|metric kv_usage: "kv-usage" is not a Prometheus metric name`},
		{"metric twice", up + "\tsaturation {\n\t\tmetric ttft a\n\t\tmetric ttft b\n\t}\n}", "at Caddyfile:5|metric ttft already specified"},
		{"stale_after below 2x interval", up + "\tsaturation {\n\t\tinterval 2s\n\t\tstale_after 3s\n\t}\n}", "at Caddyfile:6|stale_after 3s is below 2 × interval (4s)"},
		{"timeout over interval", up + "\tsaturation {\n\t\tinterval 1s\n\t\ttimeout 2s\n\t}\n}", "timeout 2s must not exceed interval 1s"},
		{"window below 2x interval", up + "\tsaturation {\n\t\tinterval 20s\n\t\tstale_after 1m\n\t\ttimeout 1s\n\t\twindow 30s\n\t}\n}", "window 30s must be at least 2 × interval (40s)"},
		{"interval junk", up + "\tsaturation {\n\t\tinterval often\n\t}\n}", `at Caddyfile:4|bad interval "often"`},
		{"interval args", up + "\tsaturation {\n\t\tinterval\n\t}\n}", "at Caddyfile:4|wrong argument count"},
		{"interval twice", up + "\tsaturation {\n\t\tinterval 1s\n\t\tinterval 2s\n\t}\n}", "at Caddyfile:5|saturation: interval already specified"},
		{"metrics_path relative", up + "\tsaturation {\n\t\tmetrics_path metrics\n\t}\n}", `at Caddyfile:4|metrics_path "metrics" must start with /`},
		{"queue_threshold zero", up + "\tsaturation {\n\t\tqueue_threshold 0\n\t}\n}", `at Caddyfile:4|bad queue_threshold "0"`},
		{"kv_threshold over 1", up + "\tsaturation {\n\t\tkv_threshold 80\n\t}\n}", `at Caddyfile:4|bad kv_threshold "80"`},
		{"trip bare", up + "\tsaturation {\n\t\ttrip\n\t}\n}", "at Caddyfile:4|want: trip queue_wait_p99"},
		{"trip unknown rule", up + "\tsaturation {\n\t\ttrip error_rate 0.5\n\t}\n}", `at Caddyfile:4|unknown trip rule "error_rate"`},
		{"trip without threshold", up + "\tsaturation {\n\t\ttrip queue_wait_p99\n\t}\n}", "at Caddyfile:4|want: trip queue_wait_p99"},
		{"trip within", up + "\tsaturation {\n\t\ttrip queue_wait_p99 5s within 30s\n\t}\n}", "at Caddyfile:4|want: trip queue_wait_p99"},
		{"trip for missing", up + "\tsaturation {\n\t\ttrip kv_usage 0.9 for\n\t}\n}", "at Caddyfile:4|want: trip queue_wait_p99"},
		{"trip bad duration", up + "\tsaturation {\n\t\ttrip queue_wait_p99 slow for 30s\n\t}\n}", `at Caddyfile:4|bad trip queue_wait_p99 "slow"`},
		{"trip bad for", up + "\tsaturation {\n\t\ttrip ttft_p95 2s for ever\n\t}\n}", `at Caddyfile:4|bad trip ttft_p95 for "ever"`},
		{"trip bad ratio", up + "\tsaturation {\n\t\ttrip kv_usage 92 for 1m\n\t}\n}", `at Caddyfile:4|bad trip kv_usage "92"`},
		{"trip rule twice", up + "\tsaturation {\n\t\ttrip kv_usage 0.9\n\t\ttrip kv_usage 0.95\n\t}\n}", "at Caddyfile:5|trip kv_usage already specified"},
		{"trip off with args", up + "\tsaturation {\n\t\ttrip off now\n\t}\n}", "at Caddyfile:4|want: trip queue_wait_p99"},
		{"trip off after rule", up + "\tsaturation {\n\t\ttrip kv_usage 0.9\n\t\ttrip off\n\t}\n}", "at Caddyfile:5|trip off turns the saturation rules off"},
		{"trip rule after off", up + "\tsaturation {\n\t\ttrip off\n\t\ttrip kv_usage 0.9\n\t}\n}", "at Caddyfile:5|trip kv_usage after trip off"},
		{"least_queue options", up + "\tlb_policy least_queue 2\n}", "at Caddyfile:3|lb_policy least_queue takes no options"},
		{"least_queue block", up + "\tlb_policy least_queue {\n\t\tchoose 2\n\t}\n}", "lb_policy least_queue takes no options"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := adapt(t, ":8080 {\n"+tc.body+"\n}\n")
			if err == nil {
				t.Fatalf("adapt succeeded; want error containing %q", tc.want)
			}
			for _, part := range strings.Split(tc.want, "|") {
				if !strings.Contains(err.Error(), part) {
					t.Fatalf("error %q\ndoes not contain %q", err, part)
				}
			}
		})
	}
}

// TestSaturationJSONGetsTheCaddyfilesErrors: a JSON config is refused in
// Provision with the errors the Caddyfile gives.
func TestSaturationJSONGetsTheCaddyfilesErrors(t *testing.T) {
	up := `{"handler":"llm_proxy","upstreams":[{"dial":"127.0.0.1:9000"}],`
	for _, tc := range []struct{ name, handler, want string }{
		{"stale_after below 2x interval", up + `"saturation":{"interval":2000000000,"stale_after":3000000000}}`, "stale_after 3s is below 2 × interval (4s)"},
		{"bad preset", up + `"saturation":{"preset":"llamacpp"}}`, `unknown preset "llamacpp"`},
		{"bad signal", up + `"saturation":{"metrics":{"waiting":"x"}}}`, `unknown signal "waiting"`},
		{"bad metric name", up + `"saturation":{"metrics":{"ttft":"a b"}}}`, `"a b" is not a Prometheus metric name`},
		{"trip off with a rule", up + `"saturation":{"trip":{"off":true,"kv_usage":0.9}}}`, "trip off turns the saturation rules off"},
		{"trip kv_usage over 1", up + `"saturation":{"trip":{"kv_usage":2}}}`, "trip kv_usage 2 must be in (0, 1]"},
		{"ttft_for without ttft_p95", up + `"saturation":{"trip":{"ttft_for":1000000000}}}`, "trip ttft_for needs ttft_p95"},
		{"negative interval", up + `"saturation":{"interval":-1}}`, "negative interval"},
		{"kv_threshold over 1", up + `"saturation":{"kv_threshold":1.5}}`, "kv_threshold 1.5 must be in (0, 1]"},
		{"metrics_path relative", up + `"saturation":{"metrics_path":"metrics"}}`, `metrics_path "metrics" must start with /`},
		{"least_queue options", up + `"load_balancing":{"selection_policy":{"policy":"least_queue","choose":2}}}`, "least_queue takes no options"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var cfg caddy.Config
			if err := json.Unmarshal([]byte(jsonConfig(tc.handler)), &cfg); err != nil {
				t.Fatal(err)
			}
			err := caddy.Validate(&cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
