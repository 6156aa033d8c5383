package mockllm

import (
	"fmt"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llmproxy/caddy-llm-proxy/prefix"
)

// Defaults of PrefixCacheConfig.
const (
	// DefaultPrefixBlockChars is 64 characters per cached block: vLLM's
	// 16-token KV block at the mock's 4 characters per token.
	DefaultPrefixBlockChars = 64
	// DefaultPrefillPerBlock is the prefill time of one missed block: 2 ms
	// per 16 tokens, 8,000 prompt tokens per second (an 8B model on one
	// GPU prefills some 10,000).
	DefaultPrefillPerBlock = 2 * time.Millisecond
)

// PrefixCacheConfig models vLLM's automatic prefix caching on each
// replica: the replica keeps the chained keys of the prompt blocks it
// prefilled recently (at most Blocks, least recently used evicted first,
// a prompt's last blocks before its first), and a request's time to first
// token is its Behavior's TTFT plus PrefillPerBlock for every block of its
// prompt not found from the start. The prompt is the raw JSON the request
// sent (its messages, or prompt), cut into BlockChars-byte blocks, each
// keyed over every byte before it, so a block hits only with its whole
// prefix, as vLLM's block hashes do. /metrics then reports
// vllm:prefix_cache_queries_total and vllm:prefix_cache_hits_total (tokens
// looked up and found, BlockChars/4 tokens per block; vLLM V1's counters,
// vllm/v1/metrics/loggers.py).
type PrefixCacheConfig struct {
	// Blocks is the cache's capacity per replica, in blocks; 0 turns the
	// model off.
	Blocks int
	// BlockChars is the block size in bytes of prompt JSON. Default
	// DefaultPrefixBlockChars.
	BlockChars int
	// PrefillPerBlock is the TTFT a missed block adds. Default
	// DefaultPrefillPerBlock.
	PrefillPerBlock time.Duration
}

// prefixCache is one replica's prefix cache.
type prefixCache struct {
	cfg           PrefixCacheConfig
	index         *prefix.Index
	queries, hits atomic.Int64 // blocks
	queriesVec    *prometheus.CounterVec
	hitsVec       *prometheus.CounterVec
}

// validate checks c and fills its defaults.
func (c *PrefixCacheConfig) validate() error {
	if c.Blocks < 0 || c.BlockChars < 0 || c.PrefillPerBlock < 0 {
		return fmt.Errorf("prefix cache %+v: must not be negative", *c)
	}
	if c.BlockChars == 0 {
		c.BlockChars = DefaultPrefixBlockChars
	}
	if c.PrefillPerBlock == 0 {
		c.PrefillPerBlock = DefaultPrefillPerBlock
	}
	return nil
}

// enablePrefixCache gives the replica a prefix cache (cfg validated).
func (r *Replica) enablePrefixCache(cfg PrefixCacheConfig) {
	if cfg.Blocks <= 0 {
		return
	}
	c := &prefixCache{cfg: cfg, index: prefix.NewIndex(cfg.Blocks),
		queriesVec: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vllm:prefix_cache_queries_total", Help: "Prefix cache queries, in terms of number of queried tokens.",
		}, []string{"model_name"}),
		hitsVec: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vllm:prefix_cache_hits_total", Help: "Prefix cache hits, in terms of number of cached tokens.",
		}, []string{"model_name"}),
	}
	c.queriesVec.WithLabelValues(r.model())
	c.hitsVec.WithLabelValues(r.model())
	r.metrics.reg.MustRegister(c.queriesVec, c.hitsVec)
	r.prefix = c
}

// prefill looks the request's prompt up in the replica's prefix cache,
// remembers it, and returns the prefill time of its missed blocks (0
// without a cache).
func (x *exchange) prefill() time.Duration {
	c := x.r.prefix
	if c == nil {
		return 0
	}
	keys := prefix.Keys(c.cfg.BlockChars, string(x.prompt()))
	hit := c.index.Match(keys)
	c.index.Insert(keys)
	c.queries.Add(int64(len(keys)))
	c.hits.Add(int64(hit))
	tokens := float64(c.cfg.BlockChars) / 4
	c.queriesVec.WithLabelValues(x.p.served).Add(float64(len(keys)) * tokens)
	c.hitsVec.WithLabelValues(x.p.served).Add(float64(hit) * tokens)
	return time.Duration(len(keys)-hit) * c.cfg.PrefillPerBlock
}

// PrefixCacheStats returns the blocks the replica's prefix cache was asked
// for and found since it started (0, 0 without one).
func (r *Replica) PrefixCacheStats() (queries, hits int64) {
	if r.prefix == nil {
		return 0, 0
	}
	return r.prefix.queries.Load(), r.prefix.hits.Load()
}
