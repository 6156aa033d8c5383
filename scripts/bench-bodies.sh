#!/usr/bin/env bash
# The request-body memory benchmark (issue 12 item 4): a burst of concurrent
# requests with large bodies against llm_proxy at its defaults (16 MiB
# max_request_body, 256 MiB max_buffered_bodies), measuring the RSS of the
# caddy process. The bodies that fit the budget are served; the others wait
# up to 1s and get 503 with Retry-After. Target: RSS growth ≤ 1.2× the
# bodies admitted.
#
#   bodyburst -> caddy :8095 (llm_proxy) -> mockllm 127.0.0.1:9301
#
# The mock holds each request for TTFT (longer than the budget's 1s wait),
# so the bodies admitted first are all held at once. Loopback only; stops
# everything it started on exit, Ctrl-C or TERM. Prints a markdown table.
#
# Environment: BODIES (default 20), SIZE (15MiB), TTFT (2s),
# BUDGET (max_buffered_bodies; default empty: the gateway's default),
# CADDY (a caddy binary with llm_proxy; default: ./xcaddy.sh builds ./caddy),
# SMOKE=1 (a tiny run: 6 bodies of 1 MiB over a 4 MiB budget, TTFT 1.5s).
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT_NAME=bench-bodies
. scripts/lib.sh

if [ "${SMOKE:-0}" = 1 ]; then
	BODIES=${BODIES:-6} SIZE=${SIZE:-1MiB} TTFT=${TTFT:-1500ms} BUDGET=${BUDGET:-4MiB}
fi
BODIES=${BODIES:-20}
SIZE=${SIZE:-15MiB}
TTFT=${TTFT:-2s}
BUDGET=${BUDGET:-}
MOCK_PORT=9301
PORT=8095
ADMIN_PORT=2039

install_cleanup
logdir=$(mktemp -d "${TMPDIR:-/tmp}/llm-proxy-bench-bodies.XXXXXX")
log "logs in $logdir"
caddy=${CADDY:-}
if [ -z "$caddy" ]; then
	log "building ./caddy (./xcaddy.sh: cached by source hash, a cold build takes minutes)"
	if ! ./xcaddy.sh >"$logdir/build.log" 2>&1; then
		tail -n 30 "$logdir/build.log" >&2
		die "./xcaddy.sh failed; full output in $logdir/build.log"
	fi
	caddy=./caddy
fi
mkdir -p bin
go build -o bin/ ./cmd/mockllm ./cmd/bodyburst || die "building bin/mockllm and bin/bodyburst failed"
require_free_ports "$MOCK_PORT" "$PORT" "$ADMIN_PORT"

# Prompts of millions of tokens: a KV cache large enough that the mock
# holds them all at once rather than one after another.
start_bg mockllm "$logdir/mockllm.log" bin/mockllm \
	--listen "127.0.0.1:$MOCK_PORT" --replicas 1 --ttft "$TTFT" --tokens 1 \
	--token-interval 0s --kv-blocks 100000000
mock_pid=$!
wait_ports mockllm "$mock_pid" "$logdir/mockllm.log" 30 "$MOCK_PORT"

global=""
if [ -n "$BUDGET" ]; then
	global="llm_proxy {
		max_buffered_bodies $BUDGET
	}"
fi
cat >"$logdir/Caddyfile" <<EOF
{
	admin 127.0.0.1:$ADMIN_PORT
	default_bind 127.0.0.1
	auto_https off
	persist_config off
	grace_period 1s
	storage file_system $logdir/storage
	$global
}

http://127.0.0.1:$PORT {
	llm_proxy 127.0.0.1:$MOCK_PORT {
		max_attempts 1
	}
}
EOF
start_bg caddy "$logdir/caddy.log" env HOME="$logdir" XDG_CONFIG_HOME="$logdir/config" XDG_DATA_HOME="$logdir/data" \
	"$caddy" run --config "$logdir/Caddyfile" --adapter caddyfile
caddy_pid=$!
wait_ports caddy "$caddy_pid" "$logdir/caddy.log" 30 "$PORT" "$ADMIN_PORT"

# start_bg runs env, which execs caddy: the pid is caddy's.
log "burst: $BODIES bodies of $SIZE, mock TTFT $TTFT, max_buffered_bodies ${BUDGET:-default (256MiB)}"
echo "Body memory: $BODIES concurrent requests of $SIZE, max_buffered_bodies ${BUDGET:-256MiB (default)}, mock TTFT $TTFT; $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo
run_fg bin/bodyburst --url "http://127.0.0.1:$PORT/v1/chat/completions" --pid "$caddy_pid" \
	--bodies "$BODIES" --size "$SIZE" --timeout 120s
