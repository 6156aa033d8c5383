#!/usr/bin/env bash
# The gateway overhead benchmark (make bench-overhead): what llm_proxy adds to
# TTFT and to the gaps between streamed events, next to what Caddy's stock
# reverse_proxy adds, both against talking to the same mock directly.
#
#   direct         llmload -> mockllm 127.0.0.1:9201
#   llm_proxy      llmload -> caddy :8091 (llm_proxy)     -> mockllm
#   reverse_proxy  llmload -> caddy :8092 (reverse_proxy) -> mockllm
#
# The mock has a fixed TTFT and a steady token interval, so any spread is
# the machine's and the proxies'. Prints a markdown table for
# docs/benchmarks.md; stops everything it started on exit, Ctrl-C or TERM.
#
# Environment: STREAMS (default 1,100), REQUESTS (per path and level;
# default max(200, 10 x streams)), TTFT (20ms), TOKENS (8),
# TOKEN_INTERVAL (10ms), JSON (also write the results there).
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT_NAME=bench-overhead
. scripts/lib.sh

STREAMS=${STREAMS:-1,100}
REQUESTS=${REQUESTS:-0}
TTFT=${TTFT:-20ms}
TOKENS=${TOKENS:-8}
TOKEN_INTERVAL=${TOKEN_INTERVAL:-10ms}
MOCK_PORT=9201

install_cleanup
logdir=$(mktemp -d "${TMPDIR:-/tmp}/llm-proxy-bench.XXXXXX")
log "logs in $logdir"
build_all "$logdir"
require_free_ports 2019 8091 8092 "$MOCK_PORT"

# One replica, no faults, no stragglers, and no capacity limit (the
# default) so that nothing queues in the mock.
start_bg mockllm "$logdir/mockllm.log" bin/mockllm \
	--listen "127.0.0.1:$MOCK_PORT" --replicas 1 \
	--ttft "$TTFT" --tokens "$TOKENS" --token-interval "$TOKEN_INTERVAL"
mock_pid=$!
wait_ports mockllm "$mock_pid" "$logdir/mockllm.log" 30 "$MOCK_PORT"

start_bg caddy "$logdir/caddy.log" ./caddy run \
	--config caddyfile-examples/bench.Caddyfile --adapter caddyfile
caddy_pid=$!
wait_ports caddy "$caddy_pid" "$logdir/caddy.log" 30 2019 8091 8092

json=${JSON:-$logdir/overhead.json}
log "mock: ttft $TTFT, $TOKENS tokens every $TOKEN_INTERVAL; streams $STREAMS"
run_fg bin/llmload overhead \
	--direct "http://127.0.0.1:$MOCK_PORT" \
	--llm-proxy http://127.0.0.1:8091 \
	--reverse-proxy http://127.0.0.1:8092 \
	--streams "$STREAMS" --requests-per-level "$REQUESTS" \
	--note "Mock: TTFT $TTFT fixed, $TOKENS tokens every $TOKEN_INTERVAL, one replica" \
	--json "$json"
log "results also in $json"
