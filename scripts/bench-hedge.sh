#!/usr/bin/env bash
# The hedging benchmark (make bench-hedge): The Tail at Scale's experiment on
# time to first token. Four mock vLLM replicas whose TTFT is lognormal
# around 150 ms, except 5% of requests that stall 2-5 s before their first
# token; the same bounded streaming load through Caddy three times (see
# caddyfile-examples/hedge-bench.Caddyfile):
#
#   baseline         caddy :8093  llm_proxy, no hedging
#   hedge-p95        caddy :8094  hedge after p95 (min 100ms max 1s), max_ratio 0.1 (default)
#   hedge-p95-cap15  caddy :8095  the same with max_ratio 0.15
#   hedge-p95-2x     caddy :8096  max_ratio 0.15, up to 2 backups (max_hedges 2, max_attempts 3)
#
# Each arm first sends WARMUP of unmeasured load (the hedged arms' p95
# tracker needs 20 TTFTs; until then the delay is the policy's max), then
# REQUESTS measured requests. Client-side TTFT comes from llmload, upstream
# requests and wasted tokens from the mock's /mock/stats (reset before each
# measured run), hedges from the gateway's /metrics. Prints a markdown table
# and, for each hedged arm, a verdict against the target: p99 TTFT at least
# 5x lower than the baseline's with at most 10% extra upstream requests.
# Loopback only; about 4 minutes; stops everything it started on exit,
# Ctrl-C or TERM.
#
# Environment: REQUESTS (per arm, default 2000), CONCURRENCY (16), WARMUP
# (10s), MAX_DURATION (bound per arm, 120s), TTFT (lognormal:150ms:0.25),
# STRAGGLER (0.05:2s-5s), TOKENS (16), TOKEN_INTERVAL (10ms), SEED (mock
# seed, default random), CADDYFILE (caddyfile-examples/hedge-bench.Caddyfile),
# OUT (directory for the JSON reports; default the log directory).
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT_NAME=bench-hedge
. scripts/lib.sh

REQUESTS=${REQUESTS:-2000}
CONCURRENCY=${CONCURRENCY:-16}
WARMUP=${WARMUP:-10s}
MAX_DURATION=${MAX_DURATION:-120s}
TTFT=${TTFT:-lognormal:150ms:0.25}
STRAGGLER=${STRAGGLER:-0.05:2s-5s}
TOKENS=${TOKENS:-16}
TOKEN_INTERVAL=${TOKEN_INTERVAL:-10ms}
SEED=${SEED:-}
CADDYFILE=${CADDYFILE:-caddyfile-examples/hedge-bench.Caddyfile}
ADMIN_PORT=2093
# The arms: label and port, in the order they run; the first is the baseline.
ARMS=(baseline:8093 hedge-p95:8094 hedge-p95-cap15:8095 hedge-p95-2x:8096)
MOCK_PORTS=(9301 9302 9303 9304)

install_cleanup
logdir=$(mktemp -d "${TMPDIR:-/tmp}/llm-proxy-hedge.XXXXXX")
OUT=${OUT:-$logdir}
mkdir -p "$OUT"
log "logs in $logdir"
build_all "$logdir"
arm_ports=()
for a in "${ARMS[@]}"; do arm_ports+=("${a#*:}"); done
require_free_ports "$ADMIN_PORT" "${arm_ports[@]}" "${MOCK_PORTS[@]}"

seed_args=()
if [ -n "$SEED" ]; then seed_args=(--seed "$SEED"); fi
# Unlimited capacity (the default): a stall is the straggler's alone, as a
# worker paused for a KV-cache preemption, not a queue that load builds.
start_bg mockllm "$logdir/mockllm.log" bin/mockllm \
	--listen "127.0.0.1:${MOCK_PORTS[0]}" --replicas "${#MOCK_PORTS[@]}" \
	--ttft "$TTFT" --straggler "$STRAGGLER" \
	--tokens "$TOKENS" --token-interval "$TOKEN_INTERVAL" "${seed_args[@]}"
mock_pid=$!
wait_ports mockllm "$mock_pid" "$logdir/mockllm.log" 30 "${MOCK_PORTS[@]}"

start_bg caddy "$logdir/caddy.log" ./caddy run --config "$CADDYFILE" --adapter caddyfile
caddy_pid=$!
wait_ports caddy "$caddy_pid" "$logdir/caddy.log" 30 "$ADMIN_PORT" "${arm_ports[@]}"

loadavg() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?"; }
load_start=$(loadavg)
started=$SECONDS
log "mock: ttft $TTFT, stragglers $STRAGGLER, $TOKENS tokens every $TOKEN_INTERVAL, ${#MOCK_PORTS[@]} replicas"
log "load: $REQUESTS streaming requests per arm, concurrency $CONCURRENCY, after $WARMUP of warm-up; load average $load_start"

# arm LABEL PORT runs one arm and writes $OUT/LABEL.json.
arm() {
	log "arm $1: http://127.0.0.1:$2"
	run_fg bin/llmload run \
		--url "http://127.0.0.1:$2/v1/chat/completions" \
		--concurrency "$CONCURRENCY" --requests "$REQUESTS" --duration "$MAX_DURATION" \
		--warmup "$WARMUP" --stream=true --timeout 30s \
		--metrics-url "http://127.0.0.1:$ADMIN_PORT/metrics" \
		--mock "http://127.0.0.1:${MOCK_PORTS[0]}" \
		--label "$1" --json "$OUT/$1.json"
}
reports=()
for a in "${ARMS[@]}"; do
	arm "${a%%:*}" "${a#*:}"
	reports+=("$OUT/${a%%:*}.json")
done
load_end=$(loadavg)

echo
echo "Mock: $((${#MOCK_PORTS[@]})) replicas, TTFT $TTFT, stragglers $STRAGGLER, $TOKENS tokens every $TOKEN_INTERVAL."
echo "Load: $REQUESTS streaming requests per arm, $CONCURRENCY concurrent, after $WARMUP of unmeasured warm-up each."
echo "Gateway: $CADDYFILE."
echo "Load average (1/5/15 min): $load_start at the start, $load_end at the end; $((SECONDS - started)) s for ${#ARMS[@]} arms."
echo
bin/llmload compare "${reports[@]}"
log "reports in $OUT, logs in $logdir"
