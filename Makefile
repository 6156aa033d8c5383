# Developer entry points. See scripts/ for what demo and bench-overhead do.
.PHONY: build demo bench bench-overhead bench-hedge bench-isolation test clean

# ./caddy with the llm_proxy module (cached by source hash) and the tools.
build:
	./xcaddy.sh
	go build -o bin/ ./cmd/mockllm ./cmd/llmload

# Mock fleet (two flaky replicas) + Caddy + 20 s of streaming load + summary.
demo:
	scripts/demo.sh

# The whole benchmark suite (issue 12) in one run, under 15 minutes: S1, S3,
# S4, S4b, S6, S7, S8 (prefix-cache routing) and the request-body burst, each against a direct
# connection, stock reverse_proxy and nginx (installed by
# scripts/setup-bench.sh when missing); rewrites the suite section of
# docs/benchmarks.md and docs/img/suite-*.png. SMOKE=1 (or BENCH_SMOKE=1): a
# few seconds per scenario, results in a temp dir. SCENARIOS="S4b": only
# those, docs/ untouched (same as scripts/bench.sh S4b).
bench:
	SUITE_COMMAND="make bench$(if $(SCENARIOS), SCENARIOS=\"$(SCENARIOS)\")" BENCH_SMOKE=$(or $(SMOKE),$(BENCH_SMOKE)) scripts/bench.sh $(SCENARIOS)

# TTFT and inter-event gap: direct vs llm_proxy vs reverse_proxy.
bench-overhead:
	scripts/bench-overhead.sh

# The Tail at Scale's hedging experiment on TTFT: no hedging vs hedge at p95.
bench-hedge:
	scripts/bench-hedge.sh

# Noisy neighbour: victims' p99 TTFT alone, with a noisy tenant without and
# with admission control; A's refusal latency; a PNG of the TTFT CDFs.
bench-isolation:
	scripts/bench-isolation.sh

# Selection under overload (issue 9): round_robin, least_conn and
# least_queue (saturation) on a fleet with a half-capacity straggler; TTFT
# p50/p99, throughput, replica shares; a PNG of the TTFT CDFs.
# Prefix-cache-aware routing (issue 21, S8 of make bench): conversations
# through round_robin, least_queue and prefix_cache to a mock fleet with a
# prefix cache; hit ratio, TTFT p50/p99, replica shares and a PNG.
.PHONY: bench-prefix
bench-prefix:
	scripts/bench-prefix.sh

.PHONY: bench-saturation
bench-saturation:
	scripts/bench-saturation.sh

# Installs what the tests need (scripts/setup-test.sh), then every test
# with the race detector, end-to-end tests against the real caddy included,
# then the allocation-count tests without it.
test:
	scripts/setup-test.sh
	go test -race -count=1 -timeout 30m ./...
	# Allocation counts, which the race detector inflates (those tests skip
	# under -race): per request and per relayed event (issue 22).
	go test -count=1 -run 'Alloc' ./proxy/ ./sse/ ./api/

# Keeps .cache (the cached caddy builds): a cold build takes minutes.
clean:
	rm -rf bin caddy
