#!/usr/bin/env bash
# The saturation benchmark (make bench-saturation, issue 9): selection under
# overload. A 3-replica mock vLLM fleet whose replicas have a capacity (a
# FIFO queue beyond it, as vLLM's scheduler), one of them a straggler with
# half the capacity (and half the KV cache); the same open-loop load
# (Poisson arrivals at RATE, the same arrival times in every phase) through
# one Caddy with three llm_proxy sites that differ only in selection:
#
#   least_queue   caddy :8113  saturation { interval 250ms } (least_queue is then the default)
#   least_conn    caddy :8112  lb_policy least_conn
#   round_robin   caddy :8111  lb_policy round_robin
#
# The phases run one after another against the same fleet (llmload
# overload), each after the fleet has drained (nothing running or waiting on
# any replica) and its statistics were reset, each with WARMUP of unmeasured
# arrivals before DURATION of measured ones. round_robin runs last: its
# straggler's queue wait climbs past 5 s, and the upstream entries (and so
# their breakers) are shared by the three sites, so the saturation
# breaker's 30 s window would otherwise carry that phase's queue into the
# next one and open the straggler there.
#
# The default RATE is about 77% of the fleet's capacity: 16 + 16 + 8 slots,
# each request holding one for ~0.96 s (TTFT ~100 ms + 20 tokens 45 ms
# apart), so ~41.7 req/s; round robin sends a third of the load, 10.7 req/s,
# to a straggler that completes ~8.3 req/s.
#
# Prints a markdown table (TTFT p50/p99, throughput, each replica's share)
# and a verdict against the issue's target: least_queue's p99 TTFT ≤ 0.5×
# round_robin's and ≤ 0.8× least_conn's at equal throughput; writes the JSON
# report and a PNG of the TTFT CDFs. Loopback only; about 2.5 minutes once
# ./caddy is built (a cold build takes minutes more); stops everything it
# started on exit, Ctrl-C or TERM.
#
# Environment: RATE (requests/s, default 32), DURATION (measured, per phase,
# 30s), WARMUP (5s), GRACE (10s), CAPACITY (of the two fast replicas, 16),
# STRAGGLER_CAPACITY (CAPACITY / 2), TTFT (lognormal:100ms:0.2), TOKENS
# (20), TOKEN_INTERVAL (45ms), INTERVAL (the saturation scrape interval,
# 250ms), SEED (1), OUT (directory for the report and plot; default the log
# directory).
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT_NAME=bench-saturation
. scripts/lib.sh

RATE=${RATE:-32}
DURATION=${DURATION:-30s}
WARMUP=${WARMUP:-5s}
GRACE=${GRACE:-10s}
CAPACITY=${CAPACITY:-16}
STRAGGLER_CAPACITY=${STRAGGLER_CAPACITY:-$((CAPACITY / 2))}
TTFT=${TTFT:-lognormal:100ms:0.2}
TOKENS=${TOKENS:-20}
TOKEN_INTERVAL=${TOKEN_INTERVAL:-45ms}
INTERVAL=${INTERVAL:-250ms}
SEED=${SEED:-1}
KV_BLOCKS=2048
ADMIN_PORT=2111
# The phases: policy and port, in the order they run (see above).
PHASES=(least_queue:8113 least_conn:8112 round_robin:8111)
# Two mockllm processes, since a capacity is per process: the fast
# replicas, then the straggler.
FAST_PORTS=(9501 9502)
STRAGGLER_PORT=9503

install_cleanup
logdir=$(mktemp -d "${TMPDIR:-/tmp}/llm-proxy-saturation.XXXXXX")
OUT=${OUT:-$logdir}
mkdir -p "$OUT"
log "logs and Caddyfile in $logdir"
build_all "$logdir"
phase_ports=()
for p in "${PHASES[@]}"; do phase_ports+=("${p#*:}"); done
require_free_ports "$ADMIN_PORT" "${phase_ports[@]}" "${FAST_PORTS[@]}" "$STRAGGLER_PORT"

ups=""
for p in "${FAST_PORTS[@]}" "$STRAGGLER_PORT"; do ups="$ups 127.0.0.1:$p"; done
{
	cat <<EOF
{
	admin 127.0.0.1:$ADMIN_PORT
	auto_https off
	persist_config off
	grace_period 1s
	storage file_system $logdir/storage
}
EOF
	for p in "${PHASES[@]}"; do
		policy=${p%%:*}
		case $policy in
		least_queue) selection="saturation {
			interval $INTERVAL
		}" ;;
		*) selection="lb_policy $policy" ;;
		esac
		cat <<EOF

http://127.0.0.1:${p#*:} {
	llm_proxy$ups {
		$selection
	}
}
EOF
	done
} >"$logdir/Caddyfile"

mock_args=(--ttft "$TTFT" --tokens "$TOKENS" --token-interval "$TOKEN_INTERVAL")
start_bg mockllm-fast "$logdir/mockllm-fast.log" bin/mockllm \
	--listen "127.0.0.1:${FAST_PORTS[0]}" --replicas "${#FAST_PORTS[@]}" \
	--capacity "$CAPACITY" --kv-blocks "$KV_BLOCKS" --seed "$SEED" "${mock_args[@]}"
fast_pid=$!
start_bg mockllm-straggler "$logdir/mockllm-straggler.log" bin/mockllm \
	--listen "127.0.0.1:$STRAGGLER_PORT" --replicas 1 \
	--capacity "$STRAGGLER_CAPACITY" --kv-blocks $((KV_BLOCKS * STRAGGLER_CAPACITY / CAPACITY)) \
	--seed $((SEED + 1)) "${mock_args[@]}"
straggler_pid=$!
wait_ports mockllm-fast "$fast_pid" "$logdir/mockllm-fast.log" 30 "${FAST_PORTS[@]}"
wait_ports mockllm-straggler "$straggler_pid" "$logdir/mockllm-straggler.log" 30 "$STRAGGLER_PORT"

start_bg caddy "$logdir/caddy.log" ./caddy run --config "$logdir/Caddyfile" --adapter caddyfile
caddy_pid=$!
wait_ports caddy "$caddy_pid" "$logdir/caddy.log" 30 "$ADMIN_PORT" "${phase_ports[@]}"

log "mock: 2 replicas × capacity $CAPACITY and a straggler × $STRAGGLER_CAPACITY, TTFT $TTFT, $TOKENS tokens every $TOKEN_INTERVAL"
log "load: $RATE req/s (Poisson, seed $SEED) per phase, $WARMUP warm-up + $DURATION measured; load average $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?')"
targets=()
for p in "${PHASES[@]}"; do targets+=(--target "${p%%:*}=http://127.0.0.1:${p#*:}"); done
run_fg bin/llmload overload "${targets[@]}" \
	--mock "http://127.0.0.1:${FAST_PORTS[0]}" --mock "http://127.0.0.1:$STRAGGLER_PORT" \
	--straggler "127.0.0.1:$STRAGGLER_PORT" \
	--rate "$RATE" --duration "$DURATION" --warmup "$WARMUP" --grace "$GRACE" --seed "$SEED" \
	--json "$OUT/saturation.json" --plot "$OUT/saturation-ttft-cdf.png"
# A breaker that opened during the run changes the candidates of every site
# (the entries are shared): say so.
opened=$(grep -c '"msg":"circuit breaker open"' "$logdir/caddy.log" || true)
if [ "${opened:-0}" -gt 0 ]; then
	log "warning: $opened circuit breaker open event(s) in $logdir/caddy.log"
fi
log "report $OUT/saturation.json, plot $OUT/saturation-ttft-cdf.png, logs in $logdir"
