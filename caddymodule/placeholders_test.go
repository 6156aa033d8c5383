package caddymodule

import (
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// The {http.llm_proxy.*} placeholders are read from the finished request's
// Result when a placeholder is used (the access log, a header), with the
// values and types they had when they were set one by one; other keys are
// left to other providers.
func TestPlaceholdersAreReadFromTheResult(t *testing.T) {
	res := &proxy.Result{Upstream: "10.0.0.1:8000", Attempts: 2, Retries: 1, Hedged: true, TTFT: 312 * time.Millisecond,
		Outcome: proxy.OutcomeSuccess, Info: proxy.RequestInfo{Model: "llama"}, API: "chat",
		QueueWait: 40 * time.Millisecond, Decision: 7 * time.Microsecond, Tokens: 400, Degraded: "fallback",
		Identity: proxy.Identity{Tenant: "acme", Tier: "gold"}}
	h := &Handler{}
	repl := caddy.NewReplacer()
	repl.Map(func(key string) (any, bool) { return h.placeholder(res, key) })
	got := repl.ReplaceAll("{http.llm_proxy.upstream} {http.llm_proxy.attempts} {http.llm_proxy.retries} {http.llm_proxy.hedged} "+
		"{http.llm_proxy.ttft_ms} {http.llm_proxy.outcome} {http.llm_proxy.model} {http.llm_proxy.api} {http.llm_proxy.queue_ms} "+
		"{http.llm_proxy.admission_us} {http.llm_proxy.tokens} {http.llm_proxy.degraded} {http.llm_proxy.tenant} {http.llm_proxy.tier} "+
		"[{http.llm_proxy.saturation}] [{http.llm_proxy.nope}]", "-")
	want := "10.0.0.1:8000 2 1 true 312 success llama chat 40 7 400 fallback acme gold [-] [-]"
	if got != want {
		t.Errorf("placeholders:\n got %q\nwant %q", got, want)
	}
	if v, _ := repl.Get("http.llm_proxy.attempts"); v != 2 {
		t.Errorf("attempts is %T %v, want int 2", v, v)
	}
	if v, _ := repl.Get("http.llm_proxy.ttft_ms"); v != int64(312) {
		t.Errorf("ttft_ms is %T %v, want int64 312", v, v)
	}
	h.Saturation = &SaturationConfig{}
	res.Saturation = 0.25
	if v, _ := repl.Get("http.llm_proxy.saturation"); v != "0.250" {
		t.Errorf("saturation %v, want 0.250 when the handler scores", v)
	}
	// Publishing them costs the provider, not a value per placeholder.
	if n := testing.AllocsPerRun(100, func() {
		r := caddy.NewReplacer()
		r.Map(func(key string) (any, bool) { return h.placeholder(res, key) })
	}) - testing.AllocsPerRun(100, func() { _ = caddy.NewReplacer() }); n > 2 {
		t.Errorf("publishing the placeholders took %.0f allocations, want at most 2", n)
	}
}
