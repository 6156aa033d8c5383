// Package mockllm is a fake vLLM fleet for end-to-end tests, demos and
// benchmarks of the gateway. It speaks the four APIs vLLM serves: Chat
// Completions, legacy Completions, OpenAI Responses and Anthropic
// Messages, JSON and streaming, each in its own shapes (see [API] and the
// dialects in completion.go, responses.go and messages.go).
//
// A [Fleet] runs one or more replicas, each an HTTP/1.1 server on its own
// port that answers like a vLLM OpenAI server:
//
//	POST /v1/chat/completions   chat.completion / chat.completion.chunk (SSE)
//	POST /v1/completions        text_completion (JSON or SSE)
//	POST /v1/responses          response (JSON) / response.* events (SSE)
//	POST /v1/messages           message (JSON) / message_start … message_stop (SSE)
//	POST /v1/messages/count_tokens  {"input_tokens":N} (not a completion: not counted)
//	GET  /v1/models             the served model
//	GET  /health                200, or Behavior.HealthStatus
//	GET  /metrics               vllm:* Prometheus metrics, labelled model_name (or a MetricsMode fault)
//	GET  /mock/stats            FleetStats JSON (every replica of the fleet)
//	POST /mock/reset            reset the statistics of every replica
//	GET  /mock/behavior         this replica's Behavior as a spec string
//	PUT  /mock/behavior         replace this replica's Behavior (spec or JSON body)
//	GET  /mock/metrics          this replica's MetricsMode as a spec string
//	PUT  /mock/metrics          replace this replica's MetricsMode (spec body, see ParseMetricsMode)
//
// Every response carries X-Mock-Replica with the replica's address.
//
// What a replica does is a [Behavior]: time to first token (fixed or
// lognormal, plus stragglers), number of tokens, inter-token interval,
// token size and a [Fault]. The Behavior of a replica is set by
// [FleetConfig], changed live by [Replica.SetBehavior], and overridden per
// request by these headers (see [Behavior.WithHeaders]):
//
//	X-Mock-TTFT: 200ms | lognormal:150ms:0.5 | 0
//	X-Mock-Straggler: 0.05:2s-5s            (fraction:delay or fraction:min-max; replaces the TTFT)
//	X-Mock-Tokens: 32                       (0 = empty completion)
//	X-Mock-Token-Interval: 20ms             (0 = no delay between tokens)
//	X-Mock-TPS: 50                          (tokens per second; sets the interval)
//	X-Mock-Token-Bytes: 1024                (pad each token's content to about N bytes)
//	X-Mock-Fault: status=503,every=3        (see ParseFault; "none" clears a replica fault)
//
// Each replica schedules requests as vLLM does: a request runs when one of
// [FleetConfig.Capacity] slots is free and its KV cache
// ([FleetConfig.KVBlocks] blocks of [FleetConfig.KVBlockTokens] tokens) has
// room for its prompt; otherwise it waits in FIFO order. A running request
// holds the blocks of its prompt and of the tokens generated so far, freed
// when it ends. /metrics reports vllm:num_requests_running and
// vllm:num_requests_waiting, vllm:kv_cache_usage_perc (blocks in use over
// blocks, 0 to 1) and the vllm:request_queue_time_seconds histogram
// (observed once per request when it is scheduled; 0 when at once).
//
// With [FleetConfig.PrefixCache] each replica models vLLM's automatic
// prefix caching: an LRU of the chained keys of the prompt blocks it
// prefilled; a request's TTFT grows by a prefill cost per block of its
// prompt not cached from the start, and /metrics reports
// vllm:prefix_cache_queries_total and vllm:prefix_cache_hits_total.
//
// How /metrics answers is a [MetricsMode], apart from the Behavior:
// normal, frozen (the same body on every scrape), hang, status=CODE or
// slow=DURATION, and which KV-cache gauge it exposes (kv=new, old, both or
// none), e.g. "frozen,kv=old". It is set by [FleetConfig.Metrics], changed
// live by [Replica.SetMetricsMode] or PUT /mock/metrics. Every replica
// counts the scrapes it gets and the most it answered at once
// ([ReplicaStats.Scrapes], [ReplicaStats.MaxConcurrentScrapes]).
//
// A fleet's replicas can close idle keep-alive connections as uvicorn does
// ([FleetConfig.IdleTimeout]) and drop the requests that race such a close
// ([FleetConfig.IdleCloseRace]), the stale-connection failure a gateway
// must not blame on the upstream.
//
// Faults apply to every API in its own shapes: a status fault answers
// with the API's error body (Anthropic's {"type":"error","error":{…}} on
// /v1/messages), cut=N closes after N tokens, error_event=N sends the
// API's in-band error (on Responses and Messages error_event=0 comes after
// the stream's lifecycle events: lifecycle-then-error).
//
// Generated text is deterministic: token i is a function of i and the
// request's prompt (the raw JSON of messages or prompt; Responses'
// instructions and input; Messages' system and messages) only, and every
// other token holds multi-byte UTF-8 ("é", "日本", "🙂", ...), so tests can
// compare bytes across replicas, runs, and streamed and plain responses.
package mockllm
