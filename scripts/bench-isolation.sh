#!/usr/bin/env bash
# The noisy-neighbour benchmark (make bench-isolation): tenant A sends ten
# times its fair share of long requests while tenants B, C and D send a
# normal load, on a capacity-limited mock fleet whose TTFT grows with its
# queue (4 replicas × 5 concurrent generations, FIFO beyond, like vLLM's
# scheduler). Three arms in one run (llmload isolation):
#
#   victims-alone          B, C, D only, through the gateway without admission control
#   noisy-no-admission     A + B, C, D through caddy :8097: llm_proxy, no tenants, no admission
#   noisy-with-admission   A + B, C, D through caddy :8098: tenants by key (sha256 in the
#                          Caddyfile), tier "standard" with max_concurrent/rpm/tpm/queue
#                          limits for each tenant, admission { capacity 20 }
#
# Reports the victims' p99 TTFT in each arm against solo (target: ≤ 1.2×
# with admission control; ≥ 10× expected without), and the p99 of A's
# refusals, gateway-side (the access log's duration of its 429s; target
# < 100µs) and client-side; writes a PNG of the victims' TTFT CDFs and the
# JSON report. Both Caddyfiles are written to a temporary directory, keys
# are random per run. Loopback only; about 1.5 minutes once ./caddy is built
# (a cold build takes minutes more); stops everything it started on exit,
# Ctrl-C or TERM.
#
# Environment: DURATION (per arm, default 15s), VICTIM_RATE (requests/s of
# each victim, 5), NOISY_FACTOR (10), MAX_CONCURRENT (the tier's, 8),
# CAPACITY (per replica, 5), TTFT (lognormal:50ms:0.25), TOKEN_INTERVAL
# (10ms), SEED (1), OUT (directory for the report and plot; default the
# log directory).
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT_NAME=bench-isolation
. scripts/lib.sh

DURATION=${DURATION:-15s}
VICTIM_RATE=${VICTIM_RATE:-5}
NOISY_FACTOR=${NOISY_FACTOR:-10}
MAX_CONCURRENT=${MAX_CONCURRENT:-8}
CAPACITY=${CAPACITY:-5}
TTFT=${TTFT:-lognormal:50ms:0.25}
TOKEN_INTERVAL=${TOKEN_INTERVAL:-10ms}
SEED=${SEED:-1}
LONG_MAX_TOKENS=200
VICTIM_MAX_TOKENS=20
PLAIN_PORT=8097
ADMISSION_PORT=8098
PLAIN_ADMIN=2097
ADMISSION_ADMIN=2098
MOCK_PORTS=(9401 9402 9403 9404)
SLOTS=$((CAPACITY * ${#MOCK_PORTS[@]}))

install_cleanup
logdir=$(mktemp -d "${TMPDIR:-/tmp}/llm-proxy-isolation.XXXXXX")
OUT=${OUT:-$logdir}
mkdir -p "$OUT"
log "logs and Caddyfiles in $logdir"
build_all "$logdir"
require_free_ports "$PLAIN_PORT" "$ADMISSION_PORT" "$PLAIN_ADMIN" "$ADMISSION_ADMIN" "${MOCK_PORTS[@]}"

# One random key per tenant; the admission gateway holds only their sha256.
newkey() { printf 'sk-iso-%s-%s' "$1" "$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"; }
sha() { printf '%s' "$1" | sha256sum | cut -d' ' -f1; }
KEY_A=$(newkey a)
KEY_B=$(newkey b)
KEY_C=$(newkey c)
KEY_D=$(newkey d)

ups=""
for p in "${MOCK_PORTS[@]}"; do ups="$ups 127.0.0.1:$p"; done

cat >"$logdir/plain.Caddyfile" <<EOF
{
	admin 127.0.0.1:$PLAIN_ADMIN
	auto_https off
	persist_config off
	grace_period 1s
	storage file_system $logdir/storage-plain
}

http://127.0.0.1:$PLAIN_PORT {
	llm_proxy$ups {
		lb_policy least_conn
	}
}
EOF

cat >"$logdir/admission.Caddyfile" <<EOF
{
	admin 127.0.0.1:$ADMISSION_ADMIN
	auto_https off
	persist_config off
	grace_period 1s
	storage file_system $logdir/storage-admission
	llm_proxy {
		tenants {
			key sha256:$(sha "$KEY_A") a tier standard
			key sha256:$(sha "$KEY_B") b tier standard
			key sha256:$(sha "$KEY_C") c tier standard
			key sha256:$(sha "$KEY_D") d tier standard
		}
		tier standard {
			priority 0
			max_concurrent $MAX_CONCURRENT
			rpm 3000
			tpm 400000
			default_max_tokens 256
			queue 20
			queue_timeout 2s
		}
	}
}

http://127.0.0.1:$ADMISSION_PORT {
	log {
		output file $logdir/access-admission.log
		format json
	}
	log_append llm_tenant {http.llm_proxy.tenant}
	log_append llm_admission_us {http.llm_proxy.admission_us}
	llm_proxy$ups {
		lb_policy least_conn
		admission {
			capacity $SLOTS
		}
	}
}
EOF

start_bg mockllm "$logdir/mockllm.log" bin/mockllm \
	--listen "127.0.0.1:${MOCK_PORTS[0]}" --replicas "${#MOCK_PORTS[@]}" --capacity "$CAPACITY" \
	--ttft "$TTFT" --tokens 1000 --token-interval "$TOKEN_INTERVAL" --seed "$SEED"
mock_pid=$!
wait_ports mockllm "$mock_pid" "$logdir/mockllm.log" 30 "${MOCK_PORTS[@]}"

start_bg caddy-plain "$logdir/caddy-plain.log" ./caddy run --config "$logdir/plain.Caddyfile" --adapter caddyfile
plain_pid=$!
start_bg caddy-admission "$logdir/caddy-admission.log" ./caddy run --config "$logdir/admission.Caddyfile" --adapter caddyfile
adm_pid=$!
wait_ports caddy-plain "$plain_pid" "$logdir/caddy-plain.log" 30 "$PLAIN_ADMIN" "$PLAIN_PORT"
wait_ports caddy-admission "$adm_pid" "$logdir/caddy-admission.log" 30 "$ADMISSION_ADMIN" "$ADMISSION_PORT"

log "mock: ${#MOCK_PORTS[@]} replicas × capacity $CAPACITY ($SLOTS slots), TTFT $TTFT, a token every $TOKEN_INTERVAL"
# A long request holds a slot for its TTFT plus LONG_MAX_TOKENS tokens.
interval_ms=${TOKEN_INTERVAL%ms}
long_hold_ms=$((50 + LONG_MAX_TOKENS * interval_ms))
run_fg bin/llmload isolation \
	--plain "http://127.0.0.1:$PLAIN_PORT" --admission "http://127.0.0.1:$ADMISSION_PORT" \
	--mock "http://127.0.0.1:${MOCK_PORTS[0]}" \
	--noisy-key "$KEY_A" --victim-keys "$KEY_B,$KEY_C,$KEY_D" \
	--duration "$DURATION" --slots "$SLOTS" --victim-rate "$VICTIM_RATE" --noisy-factor "$NOISY_FACTOR" \
	--long-max-tokens "$LONG_MAX_TOKENS" --victim-max-tokens "$VICTIM_MAX_TOKENS" --long-hold "${long_hold_ms}ms" \
	--access-log "$logdir/access-admission.log" --noisy-tenant a --seed "$SEED" \
	--json "$OUT/isolation.json" --plot "$OUT/isolation-ttft-cdf.png"
rc=0
if grep -qF -e "$KEY_A" -e "$KEY_B" -e "$KEY_C" -e "$KEY_D" "$logdir"/caddy-*.log "$logdir/access-admission.log" 2>/dev/null; then
	log "error: a tenant key appears in a gateway log"
	rc=1
fi
log "report $OUT/isolation.json, plot $OUT/isolation-ttft-cdf.png, logs in $logdir"
exit "$rc"
