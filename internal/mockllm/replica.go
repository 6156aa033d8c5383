package mockllm

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
)

// Replica is one fake vLLM server of a Fleet.
type Replica struct {
	index   int
	fleet   *Fleet
	addr    string // dialable host:port
	bind    string // address to listen on (for Start)
	log     *zap.Logger
	queue   *scheduler
	metrics *replicaMetrics
	prefix  *prefixCache // nil without FleetConfig.PrefixCache (prefixcache.go)
	created int64        // unix time, for /v1/models

	idleTimeout time.Duration // http.Server.IdleTimeout (FleetConfig.IdleTimeout)
	idleRace    time.Duration // FleetConfig.IdleCloseRace

	mu       sync.Mutex
	behavior Behavior
	rng      *rand.Rand
	stats    counters
	inFlight int

	metricsMode     MetricsMode
	frozenMetrics   []byte // the body of a frozen /metrics
	scrapesInFlight int    // GET /metrics requests being answered

	srv  *http.Server
	done chan struct{} // closed when srv.Serve returns
}

func newReplica(f *Fleet, index int, b Behavior, q *scheduler, seed uint64, log *zap.Logger) *Replica {
	r := &Replica{
		index:    index,
		fleet:    f,
		log:      log,
		queue:    q,
		created:  time.Now().Unix(),
		behavior: b,
		rng:      rand.New(rand.NewPCG(seed, uint64(index))),
	}
	r.stats.reset()
	r.metrics = newReplicaMetrics(r)
	r.metrics.touch(r.model())
	return r
}

// Index returns the replica's position in the fleet, from 0.
func (r *Replica) Index() int { return r.index }

// Addr returns the replica's "host:port" (127.0.0.1 when it listens on
// every interface).
func (r *Replica) Addr() string { return r.addr }

// URL returns "http://" + Addr().
func (r *Replica) URL() string { return "http://" + r.addr }

// Behavior returns the replica's current Behavior.
func (r *Replica) Behavior() Behavior {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.behavior
}

// SetBehavior replaces the replica's Behavior; requests that arrive from
// now on use it (requests in progress keep theirs).
func (r *Replica) SetBehavior(b Behavior) {
	r.mu.Lock()
	r.behavior = b
	r.mu.Unlock()
	r.metrics.touch(cmp.Or(b.Model, DefaultModel))
	r.log.Info("behavior changed", zap.Int("replica", r.index), zap.Stringer("behavior", b))
}

// SetCapacity changes the number of concurrent generations (0 = unlimited);
// queued requests that now fit start at once.
func (r *Replica) SetCapacity(n int) { r.queue.setCapacity(n) }

// SetKVBlocks changes the size of the replica's KV cache, in blocks of
// FleetConfig.KVBlockTokens tokens (n <= 0 means DefaultKVBlocks).
// Blocks held by running requests stay held, even past the new size;
// queued requests that now fit start at once.
func (r *Replica) SetKVBlocks(n int) { r.queue.setBlocks(n) }

// Stats returns a snapshot of the replica's statistics.
func (r *Replica) Stats() ReplicaStats {
	r.mu.Lock()
	s := r.stats.snapshot()
	s.InFlight = r.inFlight
	s.Behavior = r.behavior.String()
	s.Metrics = r.metricsMode.String()
	s.ScrapesInFlight = r.scrapesInFlight
	r.mu.Unlock()
	s.Index, s.Addr = r.index, r.addr
	l := r.queue.load()
	s.Running, s.Waiting, s.KVBlocks, s.KVBlocksUsed = l.running, l.waiting, l.blocks, l.used
	return s
}

// ResetStats clears the counters and history of the replica (and the
// request sequence that Fault.Every counts). Live gauges (in flight,
// running, waiting, KV blocks, scrapes in flight) are kept; requests in
// progress are not counted when they end. The maxima start again from the
// in-flight counts of the moment.
func (r *Replica) ResetStats() {
	r.mu.Lock()
	r.stats.reset()
	r.stats.maxInFlight = r.inFlight
	r.stats.maxScrapes = r.scrapesInFlight
	r.mu.Unlock()
}

// Stop closes the replica's listener and connections, so that dialing it
// is refused until Start. Requests in progress see their context
// cancelled.
func (r *Replica) Stop() error {
	r.mu.Lock()
	srv, done := r.srv, r.done
	r.srv = nil
	r.mu.Unlock()
	if srv == nil {
		return nil
	}
	err := srv.Close()
	<-done
	return err
}

// shutdown stops the replica gracefully: it waits for requests in progress
// until ctx ends, then closes what is left.
func (r *Replica) shutdown(ctx context.Context) error {
	r.mu.Lock()
	srv, done := r.srv, r.done
	r.srv = nil
	r.mu.Unlock()
	if srv == nil {
		return nil
	}
	err := srv.Shutdown(ctx)
	if err != nil {
		err = errors.Join(err, srv.Close())
	}
	<-done
	return err
}

// Start listens again on the replica's address after Stop.
func (r *Replica) Start() error {
	r.mu.Lock()
	running := r.srv != nil
	r.mu.Unlock()
	if running {
		return nil
	}
	ln, err := net.Listen("tcp", r.bind)
	if err != nil {
		return fmt.Errorf("replica %d: listen %s: %w", r.index, r.bind, err)
	}
	r.serve(ln)
	return nil
}

// serve starts an HTTP server on ln.
func (r *Replica) serve(ln net.Listener) {
	srv := &http.Server{
		Handler:           r.routes(),
		ReadHeaderTimeout: 30 * time.Second,
		IdleTimeout:       r.idleTimeout,
		ErrorLog:          zap.NewStdLog(r.log.Named("http")),
	}
	if r.idleTimeout > 0 && r.idleRace > 0 {
		ln = &idleRaceListener{Listener: ln, r: r, threshold: r.idleTimeout - r.idleRace}
	}
	done := make(chan struct{})
	r.mu.Lock()
	r.srv, r.done = srv, done
	r.mu.Unlock()
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			r.log.Error("serve failed", zap.Int("replica", r.index), zap.Error(err))
		}
	}()
}

func (r *Replica) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/chat/completions", r.serveAPI(APIChat))
	mux.HandleFunc("/v1/completions", r.serveAPI(APICompletions))
	mux.HandleFunc("/v1/responses", r.serveAPI(APIResponses))
	mux.HandleFunc("/v1/messages", r.serveAPI(APIMessages))
	mux.HandleFunc("POST /v1/messages/count_tokens", r.serveCountTokens)
	mux.HandleFunc("GET /v1/models", r.serveModels)
	mux.HandleFunc("GET /health", r.serveHealth)
	mux.HandleFunc("GET /metrics", r.serveMetrics)
	mux.HandleFunc("GET /mock/stats", r.serveStats)
	mux.HandleFunc("POST /mock/reset", r.serveReset)
	mux.HandleFunc("GET /mock/behavior", r.serveGetBehavior)
	mux.HandleFunc("PUT /mock/behavior", r.servePutBehavior)
	mux.HandleFunc("GET /mock/metrics", r.serveGetMetricsMode)
	mux.HandleFunc("PUT /mock/metrics", r.servePutMetricsMode)
	mux.HandleFunc("/", func(w http.ResponseWriter, req *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		io.WriteString(w, `{"detail":"Not Found"}`)
	})
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		w.Header().Set(HeaderReplica, r.addr)
		mux.ServeHTTP(w, req)
	})
}

// model is the model name the replica serves.
func (r *Replica) model() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.behavior.Model != "" {
		return r.behavior.Model
	}
	return DefaultModel
}

func (r *Replica) serveModels(w http.ResponseWriter, _ *http.Request) {
	m := r.model()
	type model struct {
		ID          string  `json:"id"`
		Object      string  `json:"object"`
		Created     int64   `json:"created"`
		OwnedBy     string  `json:"owned_by"`
		Root        string  `json:"root"`
		Parent      *string `json:"parent"`
		MaxModelLen int     `json:"max_model_len"`
	}
	w.Header().Set("Content-Type", "application/json")
	w.Write(marshal(struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}{"list", []model{{ID: m, Object: "model", Created: r.created, OwnedBy: "vllm", Root: m, MaxModelLen: 4096}}}))
}

func (r *Replica) serveHealth(w http.ResponseWriter, _ *http.Request) {
	r.mu.Lock()
	r.stats.healthChecks++
	status := r.behavior.HealthStatus
	r.mu.Unlock()
	if status != 0 {
		w.WriteHeader(status)
	}
}

func (r *Replica) serveStats(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.Write(marshal(r.fleet.Stats()))
}

func (r *Replica) serveReset(w http.ResponseWriter, _ *http.Request) {
	r.fleet.ResetStats()
	w.WriteHeader(http.StatusNoContent)
}

func (r *Replica) serveGetBehavior(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	io.WriteString(w, r.Behavior().String()+"\n")
}

// servePutBehavior replaces the replica's Behavior with the body: a spec
// ("ttft=200ms; fault=status=503") or a JSON object of knob → value
// ({"ttft":"200ms","tokens":32}).
func (r *Replica) servePutBehavior(w http.ResponseWriter, req *http.Request) {
	body, err := io.ReadAll(io.LimitReader(req.Body, 1<<16))
	if err != nil {
		writeError(w, http.StatusBadRequest, "read body: "+err.Error())
		return
	}
	b, err := parseBehaviorBody(body)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	r.SetBehavior(b)
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	io.WriteString(w, b.String()+"\n")
}

func parseBehaviorBody(body []byte) (Behavior, error) {
	s := strings.TrimSpace(string(body))
	if !strings.HasPrefix(s, "{") {
		return ParseBehavior(s)
	}
	var m map[string]any
	if err := json.Unmarshal(body, &m); err != nil {
		return Behavior{}, fmt.Errorf("behavior JSON: %w", err)
	}
	var b Behavior
	for _, k := range append(append([]string{}, knobs...), "tps") {
		for mk, v := range m {
			nk := strings.ReplaceAll(strings.ToLower(mk), "-", "_")
			if nk != k {
				continue
			}
			var err error
			if b, err = b.With(k, fmt.Sprint(v)); err != nil {
				return Behavior{}, err
			}
			delete(m, mk)
		}
	}
	for mk := range m {
		return Behavior{}, fmt.Errorf("unknown behavior key %q", mk)
	}
	return b, nil
}
