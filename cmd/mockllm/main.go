// Command mockllm runs a fleet of fake vLLM servers (OpenAI-compatible)
// for demos, benchmarks and manual tests of the gateway. The fleet itself
// lives in internal/mockllm; this is its command line.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

const usage = `Usage: mockllm [flags]

Runs a fleet of fake vLLM servers, each an HTTP server on its own port that
speaks Chat Completions, Completions, OpenAI Responses and Anthropic Messages
(JSON and streaming), until SIGINT or SIGTERM.

Flags:
  --listen ADDR            address of replica 0; with a fixed port, replica i
                           listens on port+i; port 0 picks free ports
                           (default 127.0.0.1:9101)
  --replicas N             number of replicas (default 1)
  --model NAME             model name served (default mock-llama)
  --ttft LATENCY           time to first token: 150ms, or lognormal:MEDIAN:SIGMA
                           such as lognormal:150ms:0.5 (default 50ms)
  --straggler SPEC         FRACTION:MIN-MAX, e.g. 0.05:2s-5s: that fraction of
                           requests waits a uniform delay in the range instead
                           of the TTFT (default none)
  --tokens N               tokens per completion, unless max_tokens is lower
                           (default 16)
  --token-interval DUR     delay between tokens (default 20ms)
  --tps RATE               tokens per second; sets --token-interval
  --token-bytes N          pad each token's content to about N bytes
  --capacity N             concurrent generations per replica; more requests
                           wait in FIFO order (default 0 = unlimited)
  --kv-blocks N            KV cache per replica, in blocks: a request waits
                           until its prompt fits, then holds the blocks of its
                           prompt and generated tokens (default 2048)
  --kv-block-tokens N      tokens per KV-cache block (default 16)
  --prefix-cache N         model vLLM's prefix caching: each replica keeps the
                           last N prompt blocks it prefilled, and a request's
                           TTFT grows by --prefill-per-block per block of its
                           prompt not cached from the start; /metrics reports
                           vllm:prefix_cache_queries_total and _hits_total
                           (default 0 = off)
  --prefix-block-chars N   bytes of prompt JSON per cached block (default 64)
  --prefill-per-block DUR  TTFT of one missed block (default 2ms)
  --fault SPEC             fault for every replica (see Faults)
  --replica-fault I=SPEC   fault for replica I only, e.g. 2=status=503,fraction=0.3
                           (repeatable; replaces --fault for that replica)
  --replica-ttft I=LATENCY TTFT for replica I only, e.g. 1=lognormal:2s:0.3
                           (repeatable)
  --health-status CODE     status of GET /health (default 200)
  --metrics SPEC           how GET /metrics answers on every replica (see
                           Metrics modes; default normal)
  --replica-metrics I=SPEC /metrics mode of replica I only, e.g. 1=hang
                           (repeatable; replaces --metrics for that replica)
  --idle-timeout DUR       close keep-alive connections idle this long, as
                           uvicorn does after 5s (default 0 = never)
  --idle-race DUR          drop unanswered a request that arrives on a
                           connection idle for over idle-timeout minus DUR, as
                           when the server's idle close crosses it on the wire
                           (default 0 = none; needs --idle-timeout)
  --seed N                 seed of the random draws (default random)
  --grace DUR              on SIGINT/SIGTERM, wait this long for requests in
                           progress before closing them (default 5s)
  -v, --verbose            log every request to stderr

Faults (comma-separated, one kind plus modifiers):
  status=CODE              answer CODE (400-599) with a JSON error in the API's
                           shape (vLLM's; Anthropic's on /v1/messages)
  hang                     read the request, never answer
  hang_after_headers       send 200 and SSE headers, then nothing
  reset                    close with TCP RST before any response byte
  cut=N                    close (FIN) after N content events: truncated body
  cut_rst=N                same with a TCP RST
  error_event=N            in-band error event after N content events, no [DONE]
                           (the API's own: data: {"error":…}; Responses
                           event: error; Messages event: error). With N=0 on
                           Responses and Messages: lifecycle-then-error
                           (response.created + in_progress, message_start +
                           ping, then the error)
  every=N                  the kind hits every N-th request to the replica
  fraction=F               the kind hits a random fraction F of requests
  retry_after=SECONDS      Retry-After on status faults
  error_code=CODE          code and type of error_event (default 500; Messages:
                           503/529 overloaded_error, other 5xx api_error, 429
                           rate_limit_error, 400 invalid_request_error, ...;
                           Responses: 5xx server_error, 429 rate_limit_exceeded)
  error_type=NAME          the error event's type (Messages error.type,
                           Responses code) instead of the one CODE picks
  response_failed          Responses: response.failed instead of event: error
  fragment=N               write the body N bytes at a time, flushing each
  comment_every=N|DUR      ": ping" after every N content events, or headers at
                           once and ": ping" every DUR while waiting

Metrics modes (comma-separated, at most one of the first five, one kv):
  normal                   live metrics
  frozen                   the body of the moment the mode was set, every time
  hang                     never answer, until the client goes away
  status=CODE              answer CODE (400-599) with a short text body
  slow=DUR                 wait DUR, then answer normally
  kv=new|old|both|none     KV-cache gauge exposed: vllm:kv_cache_usage_perc
                           (new, the default), vllm:gpu_cache_usage_perc (old),
                           both, or none

Per-request headers (override the replica's settings):
  X-Mock-TTFT: 200ms | lognormal:150ms:0.5 | 0
  X-Mock-Straggler: 0.05:2s-5s
  X-Mock-Tokens: N
  X-Mock-Token-Interval: 20ms
  X-Mock-TPS: 50
  X-Mock-Token-Bytes: N
  X-Mock-Fault: SPEC | none

Endpoints of every replica:
  POST /v1/chat/completions, POST /v1/completions, POST /v1/responses,
  POST /v1/messages, POST /v1/messages/count_tokens, GET /v1/models,
  GET /health, GET /metrics (vllm:* metrics), GET /mock/stats (whole fleet),
  POST /mock/reset (whole fleet), GET|PUT /mock/behavior (this replica;
  body "ttft=200ms; tokens=8; fault=status=503" or a JSON object),
  GET|PUT /mock/metrics (this replica's metrics mode; body "frozen,kv=old").
Responses carry X-Mock-Replica: ADDR.
`

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "mockllm:", err)
		os.Exit(2)
	}
}

// indexed collects repeatable I=VALUE flags.
type indexed map[int]string

func (m indexed) String() string { return fmt.Sprint(map[int]string(m)) }

func (m indexed) Set(s string) error {
	is, v, ok := strings.Cut(s, "=")
	i, err := strconv.Atoi(is)
	if !ok || err != nil || i < 0 {
		return fmt.Errorf("%q: want INDEX=VALUE", s)
	}
	m[i] = v
	return nil
}

func run(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("mockllm", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, usage) }

	listen := fs.String("listen", "127.0.0.1:9101", "")
	replicas := fs.Int("replicas", 1, "")
	capacity := fs.Int("capacity", 0, "")
	kvBlocks := fs.Int("kv-blocks", mockllm.DefaultKVBlocks, "")
	kvBlockTokens := fs.Int("kv-block-tokens", mockllm.DefaultKVBlockTokens, "")
	prefixBlocks := fs.Int("prefix-cache", 0, "")
	prefixChars := fs.Int("prefix-block-chars", 0, "")
	prefill := fs.Duration("prefill-per-block", 0, "")
	metricsSpec := fs.String("metrics", "", "")
	seed := fs.Uint64("seed", 0, "")
	grace := fs.Duration("grace", 5*time.Second, "")
	idleTimeout := fs.Duration("idle-timeout", 0, "")
	idleRace := fs.Duration("idle-race", 0, "")
	var verbose bool
	fs.BoolVar(&verbose, "verbose", false, "")
	fs.BoolVar(&verbose, "v", false, "")
	// Behavior knobs, applied in this order through Behavior.With.
	knobs := []struct{ flag, key string }{
		{"model", "model"}, {"ttft", "ttft"}, {"straggler", "straggler"}, {"tokens", "tokens"},
		{"token-interval", "token_interval"}, {"tps", "tps"}, {"token-bytes", "token_bytes"},
		{"fault", "fault"}, {"health-status", "health_status"},
	}
	values := map[string]*string{}
	for _, k := range knobs {
		values[k.flag] = fs.String(k.flag, "", "")
	}
	replicaFault, replicaTTFT, replicaMetrics := indexed{}, indexed{}, indexed{}
	fs.Var(replicaFault, "replica-fault", "")
	fs.Var(replicaTTFT, "replica-ttft", "")
	fs.Var(replicaMetrics, "replica-metrics", "")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}

	var b mockllm.Behavior
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	for _, k := range knobs {
		if !set[k.flag] {
			continue
		}
		var err error
		if b, err = b.With(k.key, *values[k.flag]); err != nil {
			return fmt.Errorf("--%s: %w", k.flag, err)
		}
	}
	per := map[int]mockllm.Behavior{}
	for i, spec := range replicaFault {
		rb := b
		var err error
		if rb.Fault, err = mockllm.ParseFault(spec); err != nil {
			return fmt.Errorf("--replica-fault %d: %w", i, err)
		}
		per[i] = rb
	}
	for i, spec := range replicaTTFT {
		rb, ok := per[i]
		if !ok {
			rb = b
		}
		var err error
		if rb.TTFT, err = mockllm.ParseLatency(spec); err != nil {
			return fmt.Errorf("--replica-ttft %d: %w", i, err)
		}
		per[i] = rb
	}

	if *kvBlocks < 1 || *kvBlockTokens < 1 {
		return fmt.Errorf("--kv-blocks %d, --kv-block-tokens %d: want at least 1", *kvBlocks, *kvBlockTokens)
	}
	metrics, err := mockllm.ParseMetricsMode(*metricsSpec)
	if err != nil {
		return fmt.Errorf("--metrics: %w", err)
	}
	perMetrics := map[int]mockllm.MetricsMode{}
	for i, spec := range replicaMetrics {
		if perMetrics[i], err = mockllm.ParseMetricsMode(spec); err != nil {
			return fmt.Errorf("--replica-metrics %d: %w", i, err)
		}
	}

	level := zapcore.WarnLevel
	if verbose {
		level = zapcore.DebugLevel
	}
	logCfg := zap.NewDevelopmentConfig()
	logCfg.Level = zap.NewAtomicLevelAt(level)
	logCfg.OutputPaths, logCfg.ErrorOutputPaths = []string{"stderr"}, []string{"stderr"}
	logCfg.DisableStacktrace = true
	log, err := logCfg.Build()
	if err != nil {
		return err
	}
	defer log.Sync()

	fleet, err := mockllm.StartFleet(mockllm.FleetConfig{
		Listen:            *listen,
		Replicas:          *replicas,
		Behavior:          b,
		PerReplica:        per,
		Capacity:          *capacity,
		KVBlocks:          *kvBlocks,
		KVBlockTokens:     *kvBlockTokens,
		Metrics:           metrics,
		PerReplicaMetrics: perMetrics,
		IdleTimeout:       *idleTimeout,
		IdleCloseRace:     *idleRace,
		PrefixCache:       mockllm.PrefixCacheConfig{Blocks: *prefixBlocks, BlockChars: *prefixChars, PrefillPerBlock: *prefill},
		Seed:              *seed,
		Logger:            log,
	})
	if err != nil {
		return err
	}
	for i, addr := range fleet.Addrs() {
		r := fleet.Replica(i)
		var items []string
		if b := r.Behavior().String(); b != "" {
			items = append(items, b)
		}
		if m := r.MetricsMode(); m != (mockllm.MetricsMode{}) {
			items = append(items, "metrics "+m.String())
		}
		desc := ""
		if len(items) > 0 {
			desc = " (" + strings.Join(items, "; ") + ")"
		}
		fmt.Fprintf(stdout, "mockllm: replica %d listening on %s%s\n", i, addr, desc)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	<-ctx.Done()
	stop()
	fmt.Fprintln(stdout, "mockllm: shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), *grace)
	defer cancel()
	if err := fleet.Shutdown(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return nil
}
