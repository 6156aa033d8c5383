#!/usr/bin/env bash
# The benchmark suite (make bench, issue 12): every scenario in one run, each
# side by side against four targets in front of one mock fleet:
#
#   direct         llmload -> mockllm
#   llm_proxy      llmload -> caddy (llm_proxy at its defaults)   -> mockllm
#   reverse_proxy  llmload -> caddy (stock reverse_proxy, the same binary,
#                             flush_interval -1)                  -> mockllm
#   nginx          llmload -> nginx (proxy_buffering off, HTTP/1.1
#                             keep-alive upstream)                -> mockllm
#   llm_proxy_tenants (S3 only) llm_proxy with tenants (a key and a tier
#                  with limits) and saturation, in its own caddy process
#
# Scenarios (llmload suite run; see cmd/llmload/suite*.go):
#   S1      latency floor: zero-delay mock, c=1, added TTFT p50/p99
#   S3      stream fidelity, c=1 and c=100 (three runs, each interleaving
#           every target): added TTFT p50/p99, added gap p99, CPU and
#           allocations per request of each proxy process
#   S4      1,000 / 4,000 / 5,000 streams at 1 event/s: proxy RSS per stream,
#           CPU per relayed event (/proc/<pid>/stat), events late > 50 ms
#   S4b     200 streams at 50 events/s: CPU per event, achieved events/s
#   S6      retry storm, 3 replicas, error rate 0 -> 100%: attempts per request
#   S7      hedging (scripts/bench-hedge.sh, at a smaller size)
#   S8      prefix-cache routing: multi-turn conversations against
#           round_robin, least_queue and prefix_cache on a mock fleet with a
#           prefix cache (scripts/bench-prefix.sh)
#   bodies  the request-body memory burst (scripts/bench-bodies.sh, if present)
#
# Usage: scripts/bench.sh [SCENARIO...]      (default: all, in the order above)
#
#   scripts/bench.sh S4b        one scenario alone (e.g. while optimising the
#                               relay): tables on stdout and in a temp dir
#
# A full run (no scenario named, not smoke) also rewrites the suite section of
# docs/benchmarks.md (between its markers; the rest of the file is kept) and
# docs/img/suite-*.png. Loopback only, free ports picked at start; about 11
# minutes; stops everything it started on exit, Ctrl-C or TERM.
#
# Environment:
#   BENCH_SMOKE=1 (or SMOKE=1)  tiny sizes, a few seconds per scenario; never
#                               writes docs/ (CI: e2e/bench_smoke_test.go)
#   CADDY=path                  use this caddy binary instead of ./xcaddy.sh
#   OUT=dir                     where the JSON, suite.md and plots go
#                               (default: a new temp dir)
#   BENCH_DOCS=0                a full run leaves docs/ alone
#   TARGETS="llm_proxy nginx"   only these targets (direct always runs) in
#                               S1-S6; implies docs/ untouched
#   LEVELS=1000 WINDOW=20s      override the streams levels / the window of
#                               S4, S4b (LEVELS also the c= levels of S1, S3)
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT_NAME=bench
. scripts/lib.sh

ALL=(S1 S3 S4 S4b S6 S7 S8 bodies)
SMOKE=${BENCH_SMOKE:-${SMOKE:-}}
case "$SMOKE" in 0 | false | no) SMOKE="" ;; esac
full=1
want=()
if [ $# -gt 0 ]; then
	full=""
	for s in "$@"; do
		ok=""
		for a in "${ALL[@]}"; do [ "$s" = "$a" ] && ok=1; done
		[ -n "$ok" ] || die "unknown scenario $s; known: ${ALL[*]}"
	done
fi
# Always in the canonical order (each scenario gets fresh proxies anyway:
# start_proxies).
for a in "${ALL[@]}"; do
	if [ -n "$full" ]; then
		want+=("$a")
		continue
	fi
	for s in "$@"; do [ "$s" = "$a" ] && want+=("$a") && break; done
done
wants() {
	local s
	for s in "${want[@]}"; do [ "$s" = "$1" ] && return 0; done
	return 1
}
docs=""
if [ -n "$full" ] && [ -z "$SMOKE" ] && [ "${BENCH_DOCS:-1}" != 0 ] && [ -z "${TARGETS:-}${LEVELS:-}${WINDOW:-}" ]; then docs=1; fi

install_cleanup
started=$(date +%s)
loadavg() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?"; }
load_start=$(loadavg)
logdir=$(mktemp -d "${TMPDIR:-/tmp}/llm-proxy-suite.XXXXXX")
OUT=${OUT:-$logdir/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
log "scenarios: ${want[*]}${SMOKE:+ (smoke)}; logs in $logdir, results in $OUT"

# --- build -----------------------------------------------------------------
if [ -n "${CADDY:-}" ]; then
	caddy_bin=$CADDY
else
	log "building ./caddy (./xcaddy.sh: cached by source hash, a cold build takes minutes)"
	if ! ./xcaddy.sh >"$logdir/build.log" 2>&1; then
		tail -n 30 "$logdir/build.log" >&2
		die "./xcaddy.sh failed; full output in $logdir/build.log"
	fi
	caddy_bin=$(pwd)/caddy
fi
[ -x "$caddy_bin" ] || die "caddy binary $caddy_bin is not executable"
mkdir -p "$logdir/bin"
go build -o "$logdir/bin/" ./cmd/mockllm ./cmd/llmload
llmload=$logdir/bin/llmload
mockllm=$logdir/bin/mockllm
scripts/setup-bench.sh
nginx_bin=$(command -v nginx || echo /usr/sbin/nginx)

# 5,000 streams need ~10,000 descriptors in the proxy; Go programs raise
# their soft limit to the hard one themselves, nginx gets
# worker_rlimit_nofile. If the hard limit is lower, S4 says so.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
fd_limit=$(ulimit -n)
log "open files limit $fd_limit"

# --- processes -------------------------------------------------------------
mapfile -t ports < <("$llmload" suite ports 10)
llm_admin=${ports[0]} llm_one=${ports[1]} llm_three=${ports[2]}
rp_admin=${ports[3]} rp_one=${ports[4]} rp_three=${ports[5]}
ng_one=${ports[6]} ng_three=${ports[7]}
lt_admin=${ports[8]} lt_one=${ports[9]}

# Four replicas: the first serves the single-upstream scenarios, the other
# three S6 (so that S6's breakers never touch the first's). Every scenario
# sets TTFT, tokens, interval and faults per request (X-Mock-* headers);
# the KV cache is made large enough never to queue 5,000 streams.
start_bg mockllm "$logdir/mockllm.log" "$mockllm" --listen 127.0.0.1:0 --replicas 4 \
	--kv-blocks 1000000000 --ttft 0 --tokens 1 --grace 1s
mock_pid=$!
mock_addrs=()
for _ in $(seq 100); do
	mapfile -t mock_addrs < <(sed -n 's/^mockllm: replica [0-9]* listening on \([0-9.:]*\).*/\1/p' "$logdir/mockllm.log")
	[ ${#mock_addrs[@]} -ge 4 ] && break
	alive "$mock_pid" || { tail -n 20 "$logdir/mockllm.log" >&2; die "mockllm exited"; }
	sleep 0.1
done
[ ${#mock_addrs[@]} -ge 4 ] || die "mockllm did not report 4 replicas; see $logdir/mockllm.log"
m0=${mock_addrs[0]} m1=${mock_addrs[1]} m2=${mock_addrs[2]} m3=${mock_addrs[3]}
log "mock replicas ${mock_addrs[*]}"

cat >"$logdir/llm_proxy.Caddyfile" <<EOF
{
	admin 127.0.0.1:$llm_admin
	log {
		level WARN
	}
}
:$llm_one {
	bind 127.0.0.1
	llm_proxy $m0
}
:$llm_three {
	bind 127.0.0.1
	llm_proxy $m1 $m2 $m3
}
EOF
# S3's llm_proxy_tenants: the same handler with tenants (one key, a tier
# whose limits every request is checked and charged against) and
# saturation (the mock's /metrics scraped every second, the pool gate on
# its signal), in a process of its own so that its CPU is its own.
cat >"$logdir/llm_proxy_tenants.Caddyfile" <<EOF
{
	admin 127.0.0.1:$lt_admin
	log {
		level WARN
	}
	llm_proxy {
		tenants {
			key sk-bench bench tier bench
		}
		tier bench {
			max_concurrent 100000
			rpm 100000000
			tpm 1000000000
		}
	}
}
:$lt_one {
	bind 127.0.0.1
	llm_proxy $m0 {
		saturation
	}
}
EOF
cat >"$logdir/reverse_proxy.Caddyfile" <<EOF
{
	admin 127.0.0.1:$rp_admin
	log {
		level WARN
	}
}
:$rp_one {
	bind 127.0.0.1
	reverse_proxy $m0 {
		flush_interval -1
	}
}
:$rp_three {
	bind 127.0.0.1
	reverse_proxy $m1 $m2 $m3 {
		flush_interval -1
		lb_retries 3
		# Without a matcher on the response, Caddy retries a POST only when
		# the dial failed; this makes it retry 5xx answers as nginx does,
		# and request_buffers lets a retry resend the body (unbuffered, the
		# retry goes out with an empty body and fails in the transport).
		request_buffers 1MiB
		lb_retry_match {
			expression \`{rp.status_code} in [502, 503, 504]\`
		}
	}
}
EOF
# nginx runs unprivileged: as nobody when the suite runs as root.
ngdir=$(mktemp -d "${TMPDIR:-/tmp}/llm-proxy-suite-nginx.XXXXXX")
chmod 755 "$ngdir"
cat >"$ngdir/nginx.conf" <<EOF
daemon off;
master_process on;
worker_processes auto;
worker_rlimit_nofile $fd_limit;
pid $ngdir/nginx.pid;
error_log $ngdir/error.log warn;
events {
	worker_connections $((fd_limit - 100));
}
http {
	access_log off;
	client_body_temp_path $ngdir/client_body;
	proxy_temp_path $ngdir/proxy;
	fastcgi_temp_path $ngdir/fastcgi;
	uwsgi_temp_path $ngdir/uwsgi;
	scgi_temp_path $ngdir/scgi;
	upstream one {
		server $m0;
		keepalive 512;
	}
	# max_fails=0: no passive health marking, so S6 measures nginx's
	# retries (by default one failure takes a server out for 10 s, and at
	# any error rate nginx soon refuses everything without an attempt).
	upstream three {
		server $m1 max_fails=0;
		server $m2 max_fails=0;
		server $m3 max_fails=0;
		keepalive 512;
	}
	proxy_http_version 1.1;
	proxy_set_header Connection "";
	proxy_buffering off;
	proxy_request_buffering off;
	proxy_read_timeout 1h;
	server {
		listen 127.0.0.1:$ng_one;
		location / {
			proxy_pass http://one;
		}
	}
	server {
		listen 127.0.0.1:$ng_three;
		location / {
			proxy_pass http://three;
			proxy_next_upstream error timeout http_502 http_503 http_504 non_idempotent;
			proxy_next_upstream_tries 4;
		}
	}
}
EOF
nginx_cmd=("$nginx_bin" -p "$ngdir" -c "$ngdir/nginx.conf" -e "$ngdir/error.log")
if [ "$(id -u)" = 0 ]; then
	chown -R 65534:65534 "$ngdir"
	nginx_cmd=(setpriv --reuid=65534 --regid=65534 --clear-groups "${nginx_cmd[@]}")
fi

xdg=$logdir/xdg
mkdir -p "$xdg"

# stop_one PID stops one started process group: TERM, up to 5 s, then KILL.
stop_one() {
	local pid=$1 deadline=$((SECONDS + 5))
	kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
	while alive "$pid"; do
		if [ "$SECONDS" -ge "$deadline" ]; then
			kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
			break
		fi
		sleep 0.1
	done
	wait "$pid" 2>/dev/null || true
}

# start_proxies (re)starts the three proxies, so that every scenario meets a
# fresh gateway: no breaker, budget or connection pool state carried from
# the scenario before (S4's ramp once opened the only breaker and refused
# half of its streams; S6's breakers must not reach the streaming
# scenarios). It sets the targets of llmload.
llm_pid="" rp_pid="" ng_pid="" lt_pid="" run_no=0
start_proxies() {
	local p
	for p in "$llm_pid" "$rp_pid" "$ng_pid" "$lt_pid"; do
		[ -n "$p" ] && stop_one "$p"
	done
	lt_pid=""
	run_no=$((run_no + 1))
	start_bg llm_proxy "$logdir/llm_proxy.$run_no.log" env XDG_CONFIG_HOME="$xdg/llm" XDG_DATA_HOME="$xdg/llm" \
		"$caddy_bin" run --config "$logdir/llm_proxy.Caddyfile" --adapter caddyfile
	llm_pid=$!
	start_bg reverse_proxy "$logdir/reverse_proxy.$run_no.log" env XDG_CONFIG_HOME="$xdg/rp" XDG_DATA_HOME="$xdg/rp" \
		"$caddy_bin" run --config "$logdir/reverse_proxy.Caddyfile" --adapter caddyfile
	rp_pid=$!
	start_bg nginx "$logdir/nginx.$run_no.log" "${nginx_cmd[@]}"
	ng_pid=$!
	wait_ports llm_proxy "$llm_pid" "$logdir/llm_proxy.$run_no.log" 30 "$llm_admin" "$llm_one" "$llm_three"
	wait_ports reverse_proxy "$rp_pid" "$logdir/reverse_proxy.$run_no.log" 30 "$rp_admin" "$rp_one" "$rp_three"
	wait_ports nginx "$ng_pid" "$ngdir/error.log" 30 "$ng_one" "$ng_three"
	targets=(--target "direct=http://$m0")
	want_target llm_proxy && targets+=(--target "llm_proxy=http://127.0.0.1:$llm_one" --storm "llm_proxy=http://127.0.0.1:$llm_three" --pid "llm_proxy=$llm_pid")
	if [ "${1:-}" = S3 ] && want_target llm_proxy_tenants; then
		start_bg llm_proxy_tenants "$logdir/llm_proxy_tenants.$run_no.log" env XDG_CONFIG_HOME="$xdg/lt" XDG_DATA_HOME="$xdg/lt" \
			"$caddy_bin" run --config "$logdir/llm_proxy_tenants.Caddyfile" --adapter caddyfile
		lt_pid=$!
		wait_ports llm_proxy_tenants "$lt_pid" "$logdir/llm_proxy_tenants.$run_no.log" 30 "$lt_admin" "$lt_one"
		targets+=(--target "llm_proxy_tenants=http://127.0.0.1:$lt_one" --pid "llm_proxy_tenants=$lt_pid"
			--metrics "llm_proxy_tenants=http://127.0.0.1:$lt_admin/metrics" --header "Authorization: Bearer sk-bench")
	fi
	want_target llm_proxy && targets+=(--metrics "llm_proxy=http://127.0.0.1:$llm_admin/metrics")
	want_target reverse_proxy && targets+=(--target "reverse_proxy=http://127.0.0.1:$rp_one" --storm "reverse_proxy=http://127.0.0.1:$rp_three" --pid "reverse_proxy=$rp_pid")
	want_target nginx && targets+=(--target "nginx=http://127.0.0.1:$ng_one" --storm "nginx=http://127.0.0.1:$ng_three" --pid "nginx=$ng_pid")
	want_target reverse_proxy && targets+=(--metrics "reverse_proxy=http://127.0.0.1:$rp_admin/metrics")
	return 0
}

# --- scenarios -------------------------------------------------------------
failed=()
missing=()
targets=()
want_target() { [ -z "${TARGETS:-}" ] || [[ " $TARGETS " == *" $1 "* ]]; }
for s in S1 S3 S4 S4b S6; do
	wants "$s" || continue
	start_proxies "$s"
	log "scenario $s"
	if ! run_fg "$llmload" suite run --scenario "$s" --out "$OUT" --mock "http://$m0" ${SMOKE:+--smoke} \
		${LEVELS:+--levels "$LEVELS"} ${WINDOW:+--window "$WINDOW"} "${targets[@]}"; then
		failed+=("$s")
		missing+=("$s: failed (llmload suite run exited with an error; logs in $logdir)")
	fi
done

# ports_busy LOG prints the ports that a script of lib.sh's
# require_free_ports found taken, and fails when it found none.
ports_busy() {
	sed -n 's/.*error: port(s) \(.*\) on 127.0.0.1 already in use.*/\1/p' "$1" | grep .
}

includes=()
if wants S7; then
	log "scenario S7 (scripts/bench-hedge.sh)"
	if [ -n "$SMOKE" ]; then
		s7env=(REQUESTS=40 CONCURRENCY=8 WARMUP=1s MAX_DURATION=30s)
	else
		s7env=(REQUESTS=1000 WARMUP=5s MAX_DURATION=90s)
	fi
	# Its stdout has each arm's llmload summary, then the comparison from
	# the "Mock:" line on: the suite keeps the comparison.
	if run_fg env "${s7env[@]}" OUT="$OUT/S7" scripts/bench-hedge.sh >"$OUT/S7.full.md" 2>"$logdir/S7.log" &&
		sed -n '/^Mock: /,$p' "$OUT/S7.full.md" >"$OUT/S7.md" && [ -s "$OUT/S7.md" ]; then
		includes+=(--include "S7 hedging (scripts/bench-hedge.sh with ${s7env[*]//=/ })=$OUT/S7.md")
	elif busy=$(ports_busy "$logdir/S7.log"); then
		# Its ports are fixed (caddyfile-examples/hedge-bench.Caddyfile):
		# someone else's process there is not a failure of the suite.
		missing+=("S7: not run, scripts/bench-hedge.sh found its fixed port(s) $busy in use")
	else
		tail -n 5 "$logdir/S7.log" >&2 || true
		failed+=(S7)
		missing+=("S7: scripts/bench-hedge.sh failed; its log is $logdir/S7.log")
	fi
fi
if wants S8; then
	log "scenario S8 (scripts/bench-prefix.sh)"
	if run_fg env BENCH_SMOKE="$SMOKE" SMOKE="${SMOKE:+1}" CADDY="$caddy_bin" OUT="$OUT/S8" scripts/bench-prefix.sh >"$OUT/S8.full.md" 2>"$logdir/S8.log" &&
		[ -s "$OUT/S8/prefix.md" ]; then
		includes+=(--include "S8 prefix-cache routing (scripts/bench-prefix.sh; TTFT CDFs in $OUT/S8/prefix-ttft-cdf.png)=$OUT/S8/prefix.md")
	else
		tail -n 5 "$logdir/S8.log" >&2 || true
		failed+=(S8)
		missing+=("S8: scripts/bench-prefix.sh failed; its log is $logdir/S8.log")
	fi
fi
if wants bodies; then
	if [ -x scripts/bench-bodies.sh ]; then
		log "request-body burst (scripts/bench-bodies.sh)"
		if run_fg env BENCH_SMOKE="$SMOKE" SMOKE="${SMOKE:+1}" CADDY="$caddy_bin" OUT="$OUT/bodies" scripts/bench-bodies.sh >"$OUT/bodies.md" 2>"$logdir/bodies.log"; then
			includes+=(--include "Request-body memory burst (scripts/bench-bodies.sh)=$OUT/bodies.md")
		elif busy=$(ports_busy "$logdir/bodies.log"); then
			missing+=("request-body burst: not run, scripts/bench-bodies.sh found its fixed port(s) $busy in use")
		else
			tail -n 5 "$logdir/bodies.log" >&2 || true
			failed+=(bodies)
			missing+=("request-body burst: scripts/bench-bodies.sh failed; its log is $logdir/bodies.log")
		fi
	else
		missing+=("request-body burst: scripts/bench-bodies.sh does not exist yet")
	fi
fi

# --- report ----------------------------------------------------------------
report=(--dir "$OUT" --md "$OUT/suite.md" --started "$started" --load-start "$load_start"
	--ended "$(date +%s)" --load-end "$(loadavg)"
	--command "${SUITE_COMMAND:-scripts/bench.sh${*:+ $*}}${SMOKE:+ (BENCH_SMOKE=1)}"
	--commit "$(git describe --always --dirty 2>/dev/null || echo unknown)"
	--caddy-version "$("$caddy_bin" version 2>/dev/null | cut -d' ' -f1)"
	--nginx-version "$("$nginx_bin" -v 2>&1 | sed 's/^nginx version: //')")
[ -n "$SMOKE" ] && report+=(--smoke)
if [ -n "$docs" ]; then
	report+=(--docs docs/benchmarks.md --img docs/img)
else
	report+=(--img "$OUT/img")
fi
for m in "${missing[@]}"; do report+=(--missing "$m"); done
"$llmload" suite report "${report[@]}" "${includes[@]}"
echo
cat "$OUT/suite.md"
log "results in $OUT (suite.md, <scenario>.json, img/), logs in $logdir; $(($(date +%s) - started)) s"
if [ ${#failed[@]} -gt 0 ]; then
	die "failed: ${failed[*]}"
fi
