#!/usr/bin/env bash
# Prefix-cache-aware routing (make bench-prefix, and S8 of make bench; issue
# 21): multi-turn conversations, each with a long system prompt of its own,
# through one Caddy with three llm_proxy sites that differ only in
# selection, one after another, to one 3-replica mock vLLM fleet whose
# replicas model vLLM's prefix cache (mockllm --prefix-cache: an LRU of
# 64-byte prompt blocks, TTFT = the base TTFT + PREFILL per missed block):
#
#   round_robin   lb_policy round_robin
#   least_queue   saturation { interval 250ms } (least_queue is then the default)
#   prefix_cache  lb_policy prefix_cache (its defaults)
#
# Each site's conversations have system prompts of their own, so one site's
# turns never warm another's. Prints a markdown table (the fleet's prefix
# hit ratio from the replicas' vllm:prefix_cache_* counters, TTFT p50/p99/
# mean, requests per replica) and writes OUT/prefix.md, OUT/prefix.json and
# OUT/prefix-ttft-cdf.png. Loopback only, free ports; about a minute once
# ./caddy is built; stops everything it started on exit, Ctrl-C or TERM.
#
# Environment: CONVERSATIONS (36), TURNS (4), SYSTEM_CHARS (6000),
# CONCURRENCY (9), TOKENS (8), TTFT (20ms), PREFILL (2ms per 64-byte block),
# CAPACITY (per replica, 8), CACHE_BLOCKS (per replica, 20000), CADDY (a
# caddy binary instead of ./xcaddy.sh), SMOKE=1 (6 conversations × 2 turns),
# OUT (directory for the results; default the log directory).
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT_NAME=bench-prefix
. scripts/lib.sh

SMOKE=${SMOKE:-${BENCH_SMOKE:-}}
case "$SMOKE" in 0 | false | no) SMOKE="" ;; esac
CONVERSATIONS=${CONVERSATIONS:-36}
TURNS=${TURNS:-4}
if [ -n "$SMOKE" ]; then CONVERSATIONS=6 TURNS=2; fi
SYSTEM_CHARS=${SYSTEM_CHARS:-6000}
CONCURRENCY=${CONCURRENCY:-9}
TOKENS=${TOKENS:-8}
TTFT=${TTFT:-20ms}
PREFILL=${PREFILL:-2ms}
CAPACITY=${CAPACITY:-8}
CACHE_BLOCKS=${CACHE_BLOCKS:-20000}
POLICIES=(round_robin least_queue prefix_cache)

install_cleanup
logdir=$(mktemp -d "${TMPDIR:-/tmp}/llm-proxy-prefix.XXXXXX")
OUT=${OUT:-$logdir}
mkdir -p "$OUT"
log "logs and Caddyfile in $logdir, results in $OUT"
if [ -n "${CADDY:-}" ]; then
	caddy_bin=$CADDY
	mkdir -p bin
	go build -o bin/ ./cmd/mockllm ./cmd/llmload
else
	build_all "$logdir"
	caddy_bin=./caddy
fi

mapfile -t ports < <(bin/llmload suite ports 4)
admin=${ports[0]}
start_bg mockllm "$logdir/mockllm.log" bin/mockllm --listen 127.0.0.1:0 --replicas 3 \
	--capacity "$CAPACITY" --kv-blocks 1000000 --ttft "$TTFT" --tokens "$TOKENS" --token-interval 2ms \
	--prefix-cache "$CACHE_BLOCKS" --prefill-per-block "$PREFILL" --seed 1 --grace 1s
mock_pid=$!
mock_addrs=()
for _ in $(seq 100); do
	mapfile -t mock_addrs < <(sed -n 's/^mockllm: replica [0-9]* listening on \([0-9.:]*\).*/\1/p' "$logdir/mockllm.log")
	[ ${#mock_addrs[@]} -ge 3 ] && break
	alive "$mock_pid" || { tail -n 20 "$logdir/mockllm.log" >&2; die "mockllm exited"; }
	sleep 0.1
done
[ ${#mock_addrs[@]} -ge 3 ] || die "mockllm did not report 3 replicas; see $logdir/mockllm.log"

{
	cat <<EOF
{
	admin 127.0.0.1:$admin
	auto_https off
	persist_config off
	grace_period 1s
	storage file_system $logdir/storage
	log {
		level WARN
	}
}
EOF
	i=1
	for policy in "${POLICIES[@]}"; do
		case $policy in
		least_queue) selection="saturation {
			interval 250ms
		}" ;;
		*) selection="lb_policy $policy" ;;
		esac
		cat <<EOF

http://127.0.0.1:${ports[$i]} {
	llm_proxy ${mock_addrs[*]} {
		$selection
	}
}
EOF
		i=$((i + 1))
	done
} >"$logdir/Caddyfile"
start_bg caddy "$logdir/caddy.log" env XDG_CONFIG_HOME="$logdir/xdg" XDG_DATA_HOME="$logdir/xdg" \
	"$caddy_bin" run --config "$logdir/Caddyfile" --adapter caddyfile
caddy_pid=$!
wait_ports caddy "$caddy_pid" "$logdir/caddy.log" 30 "${ports[@]}"

targets=()
i=1
for policy in "${POLICIES[@]}"; do
	targets+=(--target "$policy=http://127.0.0.1:${ports[$i]}")
	i=$((i + 1))
done
log "mock: 3 replicas × capacity $CAPACITY, TTFT $TTFT + $PREFILL per missed 64-byte block, cache $CACHE_BLOCKS blocks each; load average $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?')"
run_fg bin/llmload prefix "${targets[@]}" --mock "http://${mock_addrs[0]}" \
	--conversations "$CONVERSATIONS" --turns "$TURNS" --system-chars "$SYSTEM_CHARS" \
	--concurrency "$CONCURRENCY" --tokens "$TOKENS" \
	--md "$OUT/prefix.md" --json "$OUT/prefix.json" --plot "$OUT/prefix-ttft-cdf.png"
log "table $OUT/prefix.md, report $OUT/prefix.json, plot $OUT/prefix-ttft-cdf.png, logs in $logdir"
