# Developer entry points. See scripts/ for what demo and bench-overhead do.
.PHONY: build demo bench-overhead test clean

# ./caddy with the llm_proxy module (cached by source hash) and the tools.
build:
	./xcaddy.sh
	go build -o bin/ ./cmd/mockllm ./cmd/llmload

# Mock fleet (two flaky replicas) + Caddy + 20 s of streaming load + summary.
demo:
	scripts/demo.sh

# TTFT and inter-event gap: direct vs llm_proxy vs reverse_proxy.
bench-overhead:
	scripts/bench-overhead.sh

test:
	./xcaddy.sh && go test -race -count=1 ./...

# Keeps .cache (the cached caddy builds): a cold build takes minutes.
clean:
	rm -rf bin caddy
