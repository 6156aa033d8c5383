package mockllm

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strconv"
	"time"

	"go.uber.org/zap"
)

// FleetConfig configures a fleet of mock replicas.
type FleetConfig struct {
	// Listen is the address of replica 0. With port 0 ("127.0.0.1:0",
	// the default) every replica gets its own free port; with a fixed
	// port ("127.0.0.1:9101") replicas take consecutive ports (9101,
	// 9102, ...).
	Listen string

	// Replicas is the number of replicas. Default 1.
	Replicas int

	// Behavior is applied to every replica.
	Behavior Behavior

	// PerReplica replaces Behavior entirely for the replicas it names
	// (0-based index).
	PerReplica map[int]Behavior

	// Capacity is the number of concurrent generations per replica
	// (0 = unlimited). Excess requests wait in FIFO order: their TTFT
	// grows with the queue while the token interval stays flat. Requests
	// also wait for room in the KV cache (KVBlocks).
	Capacity int

	// KVBlocks is the size of each replica's KV cache, in blocks of
	// KVBlockTokens tokens. A request is scheduled only when a capacity
	// slot is free and the cache has room for its prompt; while it runs it
	// holds ceil((prompt + generated tokens) / KVBlockTokens) blocks,
	// freed when it ends (completed, cancelled or cut by a fault).
	// vllm:kv_cache_usage_perc is the fraction in use. Prompt tokens are
	// the estimate usage.prompt_tokens reports (one per 4 bytes of the
	// prompt's JSON). Waiting is FIFO: a request that does not fit holds
	// back those behind it. The mock never preempts: a running request's
	// growth is granted past the cache (usage reads 1, and nothing more
	// is scheduled until blocks are freed), and a prompt larger than the
	// whole cache runs when nothing else does. Zero means DefaultKVBlocks
	// (2048).
	KVBlocks int

	// KVBlockTokens is the number of tokens per KV-cache block. Zero means
	// DefaultKVBlockTokens (16, vLLM's block size).
	KVBlockTokens int

	// Metrics is how every replica answers GET /metrics (fault and
	// KV-cache metric name). Zero means the live metrics with
	// vllm:kv_cache_usage_perc.
	Metrics MetricsMode

	// PerReplicaMetrics replaces Metrics for the replicas it names
	// (0-based index).
	PerReplicaMetrics map[int]MetricsMode

	// IdleTimeout is each replica's HTTP keep-alive idle timeout: a
	// connection left idle this long after a response is closed by the
	// server, as uvicorn (which serves vLLM) does after 5 s. Zero means
	// none (Go's default: idle connections stay open).
	IdleTimeout time.Duration

	// IdleCloseRace widens the race in which the server's idle close and
	// the client's next request cross on the wire: a request that arrives
	// on a keep-alive connection idle for longer than IdleTimeout minus
	// IdleCloseRace is dropped unanswered (the connection is closed once
	// the request's first bytes are read, before any response byte), as
	// when the server's keep-alive timer fires while the request is in
	// flight. Such requests are not completion requests as far as the
	// statistics go; ReplicaStats.IdleDrops counts them. Zero means no
	// such drops (only IdleTimeout's own close, which a client usually
	// sees in time). Needs IdleTimeout; at most IdleTimeout.
	IdleCloseRace time.Duration

	// PrefixCache models vLLM's automatic prefix caching on every replica
	// (see PrefixCacheConfig); its zero value turns it off.
	PrefixCache PrefixCacheConfig

	// Seed seeds the random generators (lognormal TTFT, stragglers, fault
	// fractions); replica i uses the stream (Seed, i). Zero picks a random
	// seed.
	Seed uint64

	// Logger receives lifecycle messages and, at debug level, one line per
	// request. Default: no logging.
	Logger *zap.Logger
}

// Fleet is a set of running mock replicas.
type Fleet struct {
	replicas []*Replica
}

// StartFleet validates cfg, starts every replica and returns once they all
// listen. On error nothing is left running.
func StartFleet(cfg FleetConfig) (*Fleet, error) {
	if cfg.Replicas < 0 {
		return nil, fmt.Errorf("replicas %d: must not be negative", cfg.Replicas)
	}
	if cfg.Capacity < 0 {
		return nil, fmt.Errorf("capacity %d: must not be negative", cfg.Capacity)
	}
	if cfg.KVBlocks < 0 || cfg.KVBlockTokens < 0 {
		return nil, fmt.Errorf("kv blocks %d of %d tokens: must not be negative", cfg.KVBlocks, cfg.KVBlockTokens)
	}
	if cfg.IdleTimeout < 0 || cfg.IdleCloseRace < 0 {
		return nil, fmt.Errorf("idle timeout %v, idle close race %v: must not be negative", cfg.IdleTimeout, cfg.IdleCloseRace)
	}
	if cfg.IdleCloseRace > 0 && cfg.IdleCloseRace > cfg.IdleTimeout {
		return nil, fmt.Errorf("idle close race %v: needs an idle timeout at least as long (have %v)", cfg.IdleCloseRace, cfg.IdleTimeout)
	}
	n := max(cfg.Replicas, 1)
	if err := cfg.PrefixCache.validate(); err != nil {
		return nil, err
	}
	if err := cfg.Behavior.Validate(); err != nil {
		return nil, fmt.Errorf("behavior: %w", err)
	}
	for i, b := range cfg.PerReplica {
		if i < 0 || i >= n {
			return nil, fmt.Errorf("per-replica behavior for replica %d: fleet has replicas 0-%d", i, n-1)
		}
		if err := b.Validate(); err != nil {
			return nil, fmt.Errorf("replica %d behavior: %w", i, err)
		}
	}
	if err := cfg.Metrics.Validate(); err != nil {
		return nil, fmt.Errorf("metrics mode: %w", err)
	}
	for i, m := range cfg.PerReplicaMetrics {
		if i < 0 || i >= n {
			return nil, fmt.Errorf("per-replica metrics mode for replica %d: fleet has replicas 0-%d", i, n-1)
		}
		if err := m.Validate(); err != nil {
			return nil, fmt.Errorf("replica %d metrics mode: %w", i, err)
		}
	}
	listen := cfg.Listen
	if listen == "" {
		listen = "127.0.0.1:0"
	}
	host, portStr, err := net.SplitHostPort(listen)
	if err != nil {
		return nil, fmt.Errorf("listen %q: %w", listen, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil || port < 0 || port+n-1 > 65535 {
		return nil, fmt.Errorf("listen %q: invalid port for %d replicas", listen, n)
	}
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	seed := cfg.Seed
	if seed == 0 {
		seed = rand.Uint64()
	}

	f := &Fleet{}
	for i := range n {
		b := cfg.Behavior
		if pb, ok := cfg.PerReplica[i]; ok {
			b = pb
		}
		r := newReplica(f, i, b, newScheduler(cfg.Capacity, cfg.KVBlocks, cfg.KVBlockTokens), seed, log)
		r.idleTimeout, r.idleRace = cfg.IdleTimeout, cfg.IdleCloseRace
		r.enablePrefixCache(cfg.PrefixCache)
		m := cfg.Metrics
		if pm, ok := cfg.PerReplicaMetrics[i]; ok {
			m = pm
		}
		if m != (MetricsMode{}) {
			if err := r.SetMetricsMode(m); err != nil {
				f.Close()
				return nil, err
			}
		}
		bind := net.JoinHostPort(host, "0")
		if port != 0 {
			bind = net.JoinHostPort(host, strconv.Itoa(port+i))
		}
		ln, err := net.Listen("tcp", bind)
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("replica %d: listen %s: %w", i, bind, err)
		}
		_, actual, _ := net.SplitHostPort(ln.Addr().String())
		r.bind = net.JoinHostPort(host, actual)
		r.addr = r.bind
		if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
			r.addr = net.JoinHostPort("127.0.0.1", actual)
		}
		r.serve(ln)
		f.replicas = append(f.replicas, r)
		log.Info("replica listening", zap.Int("replica", i), zap.String("addr", r.addr), zap.Stringer("behavior", b))
	}
	return f, nil
}

// Addrs returns each replica's "host:port", in index order.
func (f *Fleet) Addrs() []string {
	addrs := make([]string, len(f.replicas))
	for i, r := range f.replicas {
		addrs[i] = r.addr
	}
	return addrs
}

// Replicas returns the replicas in index order.
func (f *Fleet) Replicas() []*Replica { return append([]*Replica(nil), f.replicas...) }

// Replica returns replica i (0-based); it panics when i is out of range.
func (f *Fleet) Replica(i int) *Replica { return f.replicas[i] }

// Stats returns the statistics of every replica (GET /mock/stats).
func (f *Fleet) Stats() FleetStats {
	s := FleetStats{Replicas: make([]ReplicaStats, len(f.replicas))}
	for i, r := range f.replicas {
		s.Replicas[i] = r.Stats()
	}
	return s
}

// ResetStats resets the statistics of every replica (POST /mock/reset).
func (f *Fleet) ResetStats() {
	for _, r := range f.replicas {
		r.ResetStats()
	}
}

// SetBehavior sets the Behavior of every replica.
func (f *Fleet) SetBehavior(b Behavior) {
	for _, r := range f.replicas {
		r.SetBehavior(b)
	}
}

// Shutdown stops every replica gracefully: listeners close at once,
// requests in progress may finish until ctx ends, then connections are
// closed.
func (f *Fleet) Shutdown(ctx context.Context) error {
	errs := make([]error, len(f.replicas))
	done := make(chan int)
	for i, r := range f.replicas {
		go func() {
			errs[i] = r.shutdown(ctx)
			done <- i
		}()
	}
	for range f.replicas {
		<-done
	}
	return errors.Join(errs...)
}

// Close stops every replica at once; requests in progress see their
// context cancelled.
func (f *Fleet) Close() error {
	var errs []error
	for _, r := range f.replicas {
		errs = append(errs, r.Stop())
	}
	return errors.Join(errs...)
}
