package caddymodule

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/llmproxy/caddy-llm-proxy/saturation"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// prefixCachePolicy is the name of the pool's own prefix_cache policy in
// load_balancing.selection_policy. Like least_queue it is not a Caddy
// module: Provision recognises it before loading the policy module.
const prefixCachePolicy = "prefix_cache"

// PrefixCacheConfig is the JSON of the prefix_cache selection policy:
// {"policy": "prefix_cache", "block_chars": 256, ...} in
// load_balancing.selection_policy. It sends each request to the upstream
// most likely to hold its prompt's prefix in its KV cache, unless that
// upstream is loaded well beyond the least loaded candidate; a request
// whose prefix no upstream holds goes to the least loaded, ties broken by
// a hash of its first block that every gateway computes alike. Breakers,
// saturation and retries filter the candidates first, as for every
// policy. The defaults need no tuning for chat and agent traffic.
type PrefixCacheConfig struct {
	// Policy is "prefix_cache".
	Policy string `json:"policy"`
	// BlockChars is the block size in characters (bytes of UTF-8 prompt
	// text) that prompts are cut into and remembered by. Default 256
	// (about 64 tokens).
	BlockChars int `json:"block_chars,omitempty"`
	// MaxBlocks is how many blocks the gateway remembers per upstream,
	// least recently used forgotten first; the index's memory grows with
	// it (docs/benchmarks.md has the bytes per block). Default 8192 (2 MiB
	// of prompt text). Handlers sharing an upstream share its index; the
	// largest max_blocks applies.
	MaxBlocks int `json:"max_blocks,omitempty"`
	// LoadFactor bounds affinity: the upstream holding the prefix keeps
	// the request while its load (saturation score, or attempts in flight
	// without saturation signals) is at most load_factor × (the least
	// loaded candidate's load + one request). At least 1. Default 2.
	LoadFactor float64 `json:"load_factor,omitempty"`
}

// prefixCacheConfig reads a raw selection policy: nil, false when it is
// not prefix_cache; an error for unknown fields or bad values.
func prefixCacheConfig(raw json.RawMessage) (*PrefixCacheConfig, bool, error) {
	var probe struct {
		Policy string `json:"policy"`
	}
	if json.Unmarshal(raw, &probe) != nil || probe.Policy != prefixCachePolicy {
		return nil, false, nil
	}
	var c PrefixCacheConfig
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return nil, true, fmt.Errorf("selection policy prefix_cache: %w", err)
	}
	if err := c.selector().Validate(); err != nil {
		return nil, true, err
	}
	return &c, true, nil
}

// selector returns the pool's policy for c, reporting to the metrics.
func (c *PrefixCacheConfig) selector() *upstream.PrefixCache {
	return &upstream.PrefixCache{BlockChars: c.BlockChars, MaxBlocks: c.MaxBlocks, LoadFactor: c.LoadFactor, Observer: prefixMetrics{}}
}

// parsePrefixCache parses the options of lb_policy prefix_cache (the
// dispenser is on "prefix_cache"). Syntax:
//
//	lb_policy prefix_cache {
//	    block_chars <n>
//	    max_blocks <n>
//	    load_factor <ratio>
//	}
func parsePrefixCache(d *caddyfile.Dispenser) (json.RawMessage, error) {
	c := PrefixCacheConfig{Policy: prefixCachePolicy}
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		if seen[name] {
			return nil, d.Errf("prefix_cache: %s already specified", name)
		}
		seen[name] = true
		if !d.NextArg() {
			return nil, d.ArgErr()
		}
		v := d.Val()
		switch name {
		case "block_chars", "max_blocks":
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > 1<<24 {
				return nil, d.Errf("bad %s %q: want a positive whole number", name, v)
			}
			if name == "block_chars" {
				c.BlockChars = n
			} else {
				c.MaxBlocks = n
			}
		case "load_factor":
			r, err := strconv.ParseFloat(v, 64)
			if err != nil || !(r >= 1 && r <= 1000) {
				return nil, d.Errf("bad load_factor %q: want a ratio of at least 1, such as 2", v)
			}
			c.LoadFactor = r
		default:
			return nil, d.Errf("unrecognized prefix_cache option %q", name)
		}
		if d.NextArg() {
			return nil, d.ArgErr()
		}
	}
	return json.Marshal(c)
}

// prefixMatchBuckets span no match to a 32K-token conversation in
// 256-character blocks.
var prefixMatchBuckets = []float64{0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512}

var (
	prefixMatchBlocks = prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: "caddy", Subsystem: "llm_proxy", Name: "prefix_match_blocks",
		Help:    "Blocks of the prompt's prefix that the chosen upstream held by the gateway's index, per pick of lb_policy prefix_cache.",
		Buckets: prefixMatchBuckets,
	})
	prefixPromptBlocks = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "llm_proxy", Name: "prefix_prompt_blocks_total",
		Help: "Blocks of the prompts routed by lb_policy prefix_cache: with the sum of caddy_llm_proxy_prefix_match_blocks, the gateway's guess of the fleet's prefix-cache hit ratio.",
	})
	prefixServerHitRatio = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "caddy", Subsystem: "llm_proxy", Name: "upstream_prefix_cache_hit_ratio",
		Help: "The upstream's own prefix-cache hit ratio (0-1) over its last scrape interval, from its /metrics (vLLM prefix_cache_hits / prefix_cache_queries, SGLang cache_hit_rate), by upstream; needs saturation.",
	}, []string{"upstream"})
	prefixRouted = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "llm_proxy", Name: "prefix_routed_total",
		Help: "Picks of lb_policy prefix_cache by result: hit (to the upstream holding the longest prefix), miss (no upstream held any), overloaded (the holder was loaded beyond load_factor).",
	}, []string{"result"})
)

// prefixMetrics feeds PrefixCache's decisions into the collectors.
type prefixMetrics struct{}

func (prefixMetrics) PrefixRouted(matched, prompt int, r upstream.PrefixResult) {
	prefixMatchBlocks.Observe(float64(matched))
	prefixPromptBlocks.Add(float64(prompt))
	prefixRouted.WithLabelValues(r.String()).Inc()
}

// prefixCollectors are registered with the others (registerMetrics); the
// result series exist from the start, so a dashboard reads 0, not nothing.
func prefixCollectors() []prometheus.Collector {
	for _, r := range []upstream.PrefixResult{upstream.PrefixHit, upstream.PrefixMiss, upstream.PrefixOverloaded} {
		prefixRouted.WithLabelValues(r.String())
	}
	return []prometheus.Collector{prefixMatchBlocks, prefixPromptBlocks, prefixRouted}
}

// ServerPrefixHitRatio implements saturation.PrefixHitObserver: the
// scraped upstream's own hit ratio.
func (upstreamObserver) ServerPrefixHitRatio(addr string, ratio float64) {
	prefixServerHitRatio.WithLabelValues(addr).Set(ratio)
}

var _ saturation.PrefixHitObserver = upstreamObserver{}
