#!/usr/bin/env bash
# The llm_proxy demo (make demo): a fleet of three mock vLLM replicas, one of
# them flaky, behind Caddy with llm_proxy; 20 s of streaming load; a summary
# of what the clients saw and what the gateway counted (attempts, failovers).
#
# Needs only Go. Builds ./caddy and bin/{mockllm,llmload}, refuses to start
# if a port it needs is taken, and stops everything it started on exit,
# Ctrl-C or TERM. Logs go to a temporary directory whose path is printed.
#
# Environment: DURATION (default 20s), CONCURRENCY (default 8).
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT_NAME=demo
. scripts/lib.sh

DURATION=${DURATION:-20s}
CONCURRENCY=${CONCURRENCY:-8}
ADMIN_PORT=2019
GATEWAY_PORT=8089
MOCK_PORTS=(9101 9102 9103)

install_cleanup
logdir=$(mktemp -d "${TMPDIR:-/tmp}/llm-proxy-demo.XXXXXX")
log "logs in $logdir"
build_all "$logdir"
require_free_ports "$ADMIN_PORT" "$GATEWAY_PORT" "${MOCK_PORTS[@]}"

# Replicas are numbered from 0 and listen on consecutive ports. Replica 0
# (127.0.0.1:9101) is healthy; replica 1 (:9102) cuts 5% of its streams after
# 8 tokens, i.e. after the gateway committed, which no proxy can hide;
# replica 2 (:9103) answers 30% of requests with 503 before any token,
# which the gateway fails over. TTFT is lognormal around 150 ms with 2%
# stragglers of 1-3 s; 32 tokens 20 ms apart.
start_bg mockllm "$logdir/mockllm.log" bin/mockllm \
	--listen "127.0.0.1:${MOCK_PORTS[0]}" --replicas 3 \
	--ttft lognormal:150ms:0.5 --straggler 0.02:1s-3s \
	--tokens 32 --token-interval 20ms \
	--replica-fault 1=cut=8,fraction=0.05 \
	--replica-fault 2=status=503,fraction=0.3
mock_pid=$!
wait_ports mockllm "$mock_pid" "$logdir/mockllm.log" 30 "${MOCK_PORTS[@]}"

start_bg caddy "$logdir/caddy.log" ./caddy run \
	--config caddyfile-examples/demo.Caddyfile --adapter caddyfile
caddy_pid=$!
wait_ports caddy "$caddy_pid" "$logdir/caddy.log" 30 "$ADMIN_PORT" "$GATEWAY_PORT"

cat >&2 <<EOF

  mock fleet   127.0.0.1:9101 (healthy), 127.0.0.1:9102 (5% of streams cut after 8 tokens),
               127.0.0.1:9103 (30% of requests answered 503)
  gateway      http://127.0.0.1:$GATEWAY_PORT/v1/chat/completions (llm_proxy, round_robin, max_attempts 3)
  metrics      http://127.0.0.1:$ADMIN_PORT/metrics
  load         $DURATION of streaming chat completions, $CONCURRENCY concurrent

EOF

run_fg bin/llmload run \
	--url "http://127.0.0.1:$GATEWAY_PORT/v1/chat/completions" \
	--concurrency "$CONCURRENCY" --duration "$DURATION" --stream=true \
	--metrics-url "http://127.0.0.1:$ADMIN_PORT/metrics" \
	--json "$logdir/llmload.json"

cat <<EOF

What to look for:
- 127.0.0.1:9103 answers 503 to about 30% of what it gets (gateway "attempts"),
  yet no client saw a 503: each failed attempt came before the first token, so
  the gateway failed over to another replica (failovers = attempts - requests).
  Three 503s in a row open its breaker, which keeps it out of rotation until a
  probe succeeds, so it gets only a small share of the traffic.
- The few streams cut by 127.0.0.1:9102 after 8 tokens had already been
  committed to the client: no retry is possible, so the client got an in-band
  error event ("error_event") instead of a silent truncation.
- TTFT p99 shows the 2% stragglers (1-3 s); p50 stays near 150 ms.
Logs and the JSON report: $logdir
EOF
