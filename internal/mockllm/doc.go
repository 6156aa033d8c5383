// Package mockllm is an OpenAI-compatible fake vLLM fleet for end-to-end
// tests, demos and benchmarks of the gateway.
//
// A [Fleet] runs one or more replicas, each an HTTP/1.1 server on its own
// port that answers like a vLLM OpenAI server:
//
//	POST /v1/chat/completions   chat.completion / chat.completion.chunk (SSE)
//	POST /v1/completions        text_completion (JSON or SSE)
//	GET  /v1/models             the served model
//	GET  /health                200, or Behavior.HealthStatus
//	GET  /metrics               vllm:* Prometheus metrics, labelled model_name
//	GET  /mock/stats            FleetStats JSON (every replica of the fleet)
//	POST /mock/reset            reset the statistics of every replica
//	GET  /mock/behavior         this replica's Behavior as a spec string
//	PUT  /mock/behavior         replace this replica's Behavior (spec or JSON body)
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
// A fleet's replicas can close idle keep-alive connections as uvicorn does
// ([FleetConfig.IdleTimeout]) and drop the requests that race such a close
// ([FleetConfig.IdleCloseRace]), the stale-connection failure a gateway
// must not blame on the upstream.
//
// Generated text is deterministic: token i is a function of i and the
// request's prompt (the raw JSON of messages or prompt) only, and every
// other token holds multi-byte UTF-8 ("é", "日本", "🙂", ...), so tests can
// compare bytes across replicas, runs, and streamed and plain responses.
package mockllm
