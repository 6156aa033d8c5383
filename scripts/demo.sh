#!/usr/bin/env bash
# The llm_proxy demo (make demo): a fleet of three mock vLLM replicas, two of
# them flaky, and a smaller fallback model behind Caddy with llm_proxy; 20 s
# of streaming load from a free and a gold tenant — Chat Completions, plus
# agent-style OpenAI Responses (free) and Anthropic Messages (gold) streams
# — with the whole primary pool failing for 10 s in the middle (the
# degradation act); a summary of what the clients saw and what the gateway
# counted (attempts, failovers, answers served by the fallback, by tier,
# and a table by API).
#
# Needs only Go. Builds ./caddy and bin/{mockllm,llmload}, refuses to start
# if a port it needs is taken, and stops everything it started on exit,
# Ctrl-C or TERM. Logs go to a temporary directory whose path is printed.
#
# Environment: DURATION (default 20s), CONCURRENCY (default 8), RATE
# (default 10 requests per second per tenant).
set -euo pipefail
cd "$(dirname "$0")/.."
SCRIPT_NAME=demo
. scripts/lib.sh

DURATION=${DURATION:-20s}
CONCURRENCY=${CONCURRENCY:-8}
# Each tenant sends at most RATE requests per second: clients that ignore
# Retry-After would otherwise spin on the outage's instant 503s.
RATE=${RATE:-10}
ADMIN_PORT=2019
GATEWAY_PORT=8089
MOCK_PORTS=(9101 9102 9103)
FALLBACK_PORT=9104

install_cleanup
logdir=$(mktemp -d "${TMPDIR:-/tmp}/llm-proxy-demo.XXXXXX")
log "logs in $logdir"
build_all "$logdir"
require_free_ports "$ADMIN_PORT" "$GATEWAY_PORT" "${MOCK_PORTS[@]}" "$FALLBACK_PORT"

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
# The fallback: a smaller, faster model on its own replica.
start_bg mockllm-small "$logdir/mockllm-small.log" bin/mockllm \
	--listen "127.0.0.1:$FALLBACK_PORT" --replicas 1 --model mock-llama-small \
	--ttft 60ms --tokens 32 --token-interval 10ms
small_pid=$!
wait_ports mockllm-small "$small_pid" "$logdir/mockllm-small.log" 30 "$FALLBACK_PORT"

start_bg caddy "$logdir/caddy.log" ./caddy run \
	--config caddyfile-examples/demo.Caddyfile --adapter caddyfile
caddy_pid=$!
wait_ports caddy "$caddy_pid" "$logdir/caddy.log" 30 "$ADMIN_PORT" "$GATEWAY_PORT"

# The agents' share: Responses and Messages streams beside the chat load.
quarter=$(((CONCURRENCY + 3) / 4))
secs=${DURATION%s}
case "$secs" in '' | *[!0-9]*) die "DURATION must be whole seconds such as 20s, not $DURATION" ;; esac
outage_at=$(((secs - 10) / 2))
[ "$outage_at" -lt 0 ] && outage_at=0

cat >&2 <<EOF

  mock fleet   127.0.0.1:9101 (healthy), 127.0.0.1:9102 (5% of streams cut after 8 tokens),
               127.0.0.1:9103 (30% of requests answered 503)
  fallback     127.0.0.1:$FALLBACK_PORT (mock-llama-small, max_output_tokens 256, tier free only)
  gateway      http://127.0.0.1:$GATEWAY_PORT/v1/chat/completions (llm_proxy, round_robin, max_attempts 3)
  metrics      http://127.0.0.1:$ADMIN_PORT/metrics
  load         $DURATION of streaming chat completions, $CONCURRENCY concurrent, half free, half gold;
               beside them $quarter Responses streams (free) and $quarter Messages streams (gold, x-api-key)
  outage       every primary replica answers 503 from ${outage_at}s to $((outage_at + 10))s

EOF

# The degradation act: the whole primary pool fails for 10 s mid-run, then
# each replica gets its own behaviour back.
outage() {
	sleep "$outage_at"
	local p i saved=()
	for p in "${MOCK_PORTS[@]}"; do
		saved+=("$(curl -fsS "http://127.0.0.1:$p/mock/behavior")")
		curl -fsS -X PUT "http://127.0.0.1:$p/mock/behavior" -d '{"fault":"status=503"}' >/dev/null
	done
	echo "outage: every primary replica answers 503 for 10s"
	sleep 10
	for i in "${!MOCK_PORTS[@]}"; do
		curl -fsS -X PUT "http://127.0.0.1:${MOCK_PORTS[$i]}/mock/behavior" --data-binary "${saved[$i]}" >/dev/null
	done
	echo "outage over: the primary replicas are back"
}
start_bg outage "$logdir/outage.log" bash -c "$(declare -f outage); MOCK_PORTS=(${MOCK_PORTS[*]}); outage_at=$outage_at; outage"

half=$(((CONCURRENCY + 1) / 2))
start_bg load-gold "$logdir/llmload-gold.txt" bin/llmload run --progress=false --label gold \
	--url "http://127.0.0.1:$GATEWAY_PORT/v1/chat/completions" \
	--header "Authorization: Bearer sk-demo-gold" \
	--concurrency "$half" --rate "$RATE" --duration "$DURATION" --stream=true \
	--json "$logdir/llmload-gold.json"
gold_pid=$!
# Agent-style clients: Codex-like (OpenAI Responses) on the free tenant,
# Claude-Code-like (Anthropic Messages, key in x-api-key) on the gold one.
start_bg load-responses "$logdir/llmload-responses.txt" bin/llmload run --progress=false --label free-responses \
	--api responses --url "http://127.0.0.1:$GATEWAY_PORT/v1/responses" \
	--header "Authorization: Bearer sk-demo-free" \
	--concurrency "$quarter" --rate "$RATE" --duration "$DURATION" --stream=true \
	--json "$logdir/llmload-responses.json"
responses_pid=$!
start_bg load-messages "$logdir/llmload-messages.txt" bin/llmload run --progress=false --label gold-messages \
	--api messages --url "http://127.0.0.1:$GATEWAY_PORT/v1/messages" \
	--header "x-api-key: sk-demo-gold" --header "anthropic-version: 2023-06-01" \
	--concurrency "$quarter" --rate "$RATE" --duration "$DURATION" --stream=true \
	--json "$logdir/llmload-messages.json"
messages_pid=$!
echo "--- the free tenant's run ---"
run_fg bin/llmload run --label free \
	--url "http://127.0.0.1:$GATEWAY_PORT/v1/chat/completions" \
	--header "Authorization: Bearer sk-demo-free" \
	--concurrency "$half" --rate "$RATE" --duration "$DURATION" --stream=true \
	--metrics-url "http://127.0.0.1:$ADMIN_PORT/metrics" \
	--json "$logdir/llmload-free.json"
while alive "$gold_pid" || alive "$responses_pid" || alive "$messages_pid"; do sleep 0.2; done
echo
echo "--- the gold tenant's run ---"
cat "$logdir/llmload-gold.txt"

metrics=$(curl -fsS "http://127.0.0.1:$ADMIN_PORT/metrics")

# By API: each run's requests, successes, TTFT (at each API's first
# generated event) and failures, as the clients saw them; then the
# gateway's requests_total by its api label and outcome.
echo
echo "--- by API ---"
bin/llmload table "$logdir/llmload-free.json" "$logdir/llmload-gold.json" \
	"$logdir/llmload-responses.json" "$logdir/llmload-messages.json" || true
echo
echo "  gateway requests by api and outcome (caddy_llm_proxy_requests_total):"
printf '%s\n' "$metrics" | awk '
	index($0, "caddy_llm_proxy_requests_total{") == 1 {
		api = "?"; out = "?"
		if (match($0, /api="[^"]*"/)) api = substr($0, RSTART + 5, RLENGTH - 6)
		if (match($0, /outcome="[^"]*"/)) out = substr($0, RSTART + 9, RLENGTH - 10)
		s[api " " out] += $NF
	}
	END { for (k in s) { split(k, p, " "); printf "  %-12s %-16s %6d\n", p[1], p[2], s[k] } }' | sort

# By tier: what each tenant's requests got, and how many the fallback served.
sum_of() { printf '%s\n' "$metrics" | awk -v m="$1" -v t="tier=\"$2\"" -v d="$3" \
	'index($0, m "{") == 1 && index($0, t) && (d == "" || $0 ~ d) { s += $NF } END { printf "%d", s }'; }
echo
echo "--- the degradation act, by tier ---"
printf '%-6s %10s %20s\n' tier admitted "served by fallback"
for t in free gold; do
	printf '%-6s %10s %20s\n' "$t" \
		"$(sum_of caddy_llm_proxy_admission_total "$t" 'decision="(admitted|queued_admitted)"')" \
		"$(sum_of caddy_llm_proxy_degraded_total "$t" '')"
done

cat <<EOF

What to look for:
- Outside the outage, 127.0.0.1:9103 answers 503 to about 30% of what it gets
  (gateway "attempts"), yet no client sees those: each failed attempt came
  before the first token, so the gateway failed over to another replica
  ("failovers"). Its failure ratio stands out against its peers', so the pool
  ejects it as an outlier (statistical evidence) until a probe succeeds at the
  pool's usual rate; it gets only a small share of the traffic.
- The few streams cut by 127.0.0.1:9102 after 8 tokens had already been
  committed to the client: no retry is possible, so the client got an in-band
  error event ("error_event") instead of a silent truncation.
- TTFT p99 shows the 2% stragglers (1-3 s); p50 stays near 150 ms.
- The Responses and Messages runs ("by API") get the same guarantees as chat:
  their beginnings (response.created, message_start) are held until the first
  token, so a replica that fails before it is failed over unseen; a cut
  stream ends with the API's own error event; the gold Messages run's outage
  503s carry Anthropic's error body (overloaded_error).
- During the outage every primary replica answers 503. A 503 amid successes
  is statistical evidence, and no replica is worse than another, so the
  breakers stay closed (they open on a near-total ratio, or after a whole
  30 s window without a success, longer than this outage): the retry budget
  keeps the extra attempts to about 10%. Free requests are served by
  mock-llama-small (X-LLM-Proxy-Degraded, "served by fallback" above) and
  none fails; gold requests get the upstream's 503, whose message says that
  their tier may not degrade — the gold run's http_503 count is the outage,
  as the gateway saw it.
Logs and the JSON report: $logdir
EOF
