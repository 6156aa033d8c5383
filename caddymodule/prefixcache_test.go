package caddymodule

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// TestPrefixCacheAdaptsAndProvisions: lb_policy prefix_cache, bare or with
// its block, adapts to the documented JSON and provisions, also with a
// fallback pool (which takes the handler's policy) and with saturation.
func TestPrefixCacheAdaptsAndProvisions(t *testing.T) {
	for _, tc := range []struct{ name, block, lb string }{
		{"bare", "lb_policy prefix_cache", `{"selection_policy":{"policy":"prefix_cache"}}`},
		{"empty block", "lb_policy prefix_cache {\n\t}", `{"selection_policy":{"policy":"prefix_cache"}}`},
		{"full block", "lb_policy prefix_cache {\n\t\tblock_chars 128\n\t\tmax_blocks 4096\n\t\tload_factor 1.5\n\t}",
			`{"selection_policy":{"block_chars":128,"load_factor":1.5,"max_blocks":4096,"policy":"prefix_cache"}}`},
		{"with saturation", "lb_policy prefix_cache\n\tsaturation", `{"selection_policy":{"policy":"prefix_cache"}}`},
		{"with a fallback", "lb_policy prefix_cache\n\tfallback small {\n\t\tto 127.0.0.1:9005\n\t\tmodel small\n\t}", `{"selection_policy":{"policy":"prefix_cache"}}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := adapt(t, ":8080 {\n\tllm_proxy 127.0.0.1:9000 127.0.0.1:9001 {\n\t"+tc.block+"\n\t}\n}\n")
			if err != nil {
				t.Fatalf("adapt: %v", err)
			}
			if got := jsonOrEmpty(t, llmHandler(t, out)["load_balancing"]); got != tc.lb {
				t.Errorf("load_balancing\n got %s\nwant %s", got, tc.lb)
			}
			if err := caddy.Validate(mustConfig(t, out)); err != nil {
				t.Fatalf("provisioning the adapted config: %v", err)
			}
		})
	}
}

func TestPrefixCacheSelectorSettings(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	h := Handler{Saturation: &SaturationConfig{}, LoadBalancing: &LoadBalancing{
		SelectionPolicyRaw: []byte(`{"policy":"prefix_cache","block_chars":100,"max_blocks":50,"load_factor":3}`)}}
	sel, err := h.loadSelector(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pc, ok := sel.(*upstream.PrefixCache)
	if !ok {
		t.Fatalf("selector %T, want *upstream.PrefixCache", sel)
	}
	if pc.BlockChars != 100 || pc.MaxBlocks != 50 || pc.LoadFactor != 3 || pc.Observer == nil {
		t.Fatalf("settings %+v", pc)
	}
}

func TestPrefixCacheCaddyfileErrors(t *testing.T) {
	const up = "llm_proxy 127.0.0.1:9000 {\n"
	for _, tc := range []struct{ name, body, want string }{
		{"argument", up + "\tlb_policy prefix_cache 2\n}", "at Caddyfile:3|wrong argument count"},
		{"unknown option", up + "\tlb_policy prefix_cache {\n\t\tblock_size 64\n\t}\n}", `at Caddyfile:4|unrecognized prefix_cache option "block_size"`},
		{"twice", up + "\tlb_policy prefix_cache {\n\t\tmax_blocks 64\n\t\tmax_blocks 65\n\t}\n}", "at Caddyfile:5|prefix_cache: max_blocks already specified"},
		{"zero blocks", up + "\tlb_policy prefix_cache {\n\t\tblock_chars 0\n\t}\n}", `at Caddyfile:4|bad block_chars "0"`},
		{"load factor below 1", up + "\tlb_policy prefix_cache {\n\t\tload_factor 0.5\n\t}\n}", `at Caddyfile:4|bad load_factor "0.5"`},
		{"missing value", up + "\tlb_policy prefix_cache {\n\t\tload_factor\n\t}\n}", "at Caddyfile:4|wrong argument count"},
		{"two values", up + "\tlb_policy prefix_cache {\n\t\tmax_blocks 1 2\n\t}\n}", "at Caddyfile:4|wrong argument count"},
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

func TestPrefixCacheJSONErrors(t *testing.T) {
	up := `{"handler":"llm_proxy","upstreams":[{"dial":"127.0.0.1:9000"}],`
	for _, tc := range []struct{ name, handler, want string }{
		{"unknown field", up + `"load_balancing":{"selection_policy":{"policy":"prefix_cache","choose":2}}}`, `unknown field "choose"`},
		{"load factor", up + `"load_balancing":{"selection_policy":{"policy":"prefix_cache","load_factor":0.9}}}`, "load_factor 0.9 must be at least 1"},
		{"negative", up + `"load_balancing":{"selection_policy":{"policy":"prefix_cache","max_blocks":-1}}}`, "must not be negative"},
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

func TestPrefixMetricsCountDecisions(t *testing.T) {
	reg := prometheus.NewRegistry()
	if err := registerMetrics(reg); err != nil {
		t.Fatal(err)
	}
	before := testutil.ToFloat64(prefixRouted.WithLabelValues("overloaded"))
	prefixMetrics{}.PrefixRouted(7, 9, upstream.PrefixOverloaded)
	if got := testutil.ToFloat64(prefixRouted.WithLabelValues("overloaded")) - before; got != 1 {
		t.Fatalf("overloaded counted %v, want 1", got)
	}
	n, err := testutil.GatherAndCount(reg, "caddy_llm_proxy_prefix_routed_total", "caddy_llm_proxy_prefix_match_blocks", "caddy_llm_proxy_prefix_prompt_blocks_total")
	if err != nil || n != 5 {
		t.Fatalf("%d series (%v), want 3 results, 1 histogram and the prompt blocks", n, err)
	}
	upstreamObserver{}.ServerPrefixHitRatio("10.9.9.9:8000", 0.75)
	if got := testutil.ToFloat64(prefixServerHitRatio.WithLabelValues("10.9.9.9:8000")); got != 0.75 {
		t.Fatalf("server hit ratio gauge %v, want 0.75", got)
	}
	upstreamObserver{}.ScraperGone("10.9.9.9:8000")
	if n, _ := testutil.GatherAndCount(reg, "caddy_llm_proxy_upstream_prefix_cache_hit_ratio"); n != 0 {
		t.Fatalf("%d hit-ratio series after the scraper went, want 0", n)
	}
}
