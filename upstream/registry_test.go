package upstream

import (
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

func TestRegistryBreakerFindsByAddressAndModel(t *testing.T) {
	reg := NewRegistry(nil)
	reg.Models.Learn("llama")
	scoped := startPool(t, reg, Config{Static: targets("10.5.0.1:80"), ScopeModel: true, Breaker: &breaker.Settings{}})
	plain := startPool(t, reg, Config{Static: targets("10.5.0.1:8000"), Breaker: &breaker.Settings{}})
	mustPick(t, scoped, "llama").Done(nil)
	mustPick(t, plain, "llama").Done(nil)
	for _, tc := range []struct {
		key, addr string
		found     bool
	}{
		{"10.5.0.1:80|llama", "10.5.0.1:80", true},
		{"10.5.0.1:8000", "10.5.0.1:8000", true},
		{"10.5.0.1:80", "", false},         // no per-upstream breaker under scope model
		{"10.5.0.1:8000|llama", "", false}, // no model breaker without it
		{"10.5.0.1:800", "", false},
		{"10.5.0.1:80|qwen", "", false},
		{"", "", false},
	} {
		e, vs, ok := reg.Find(tc.key)
		if ok != tc.found || (tc.found && (e.Addr() != tc.addr || len(vs) != 1)) {
			t.Errorf("Find(%q) = %v, %d verdicts, %v; want found %t at %s, one verdict", tc.key, e, len(vs), ok, tc.found, tc.addr)
		}
	}
	views := reg.Breakers()
	// Sorted by key: "10.5.0.1:8000" < "10.5.0.1:80|llama".
	if len(views) != 2 || views[0].Upstream != "10.5.0.1:8000" || views[0].Model != "" ||
		views[1].Key != "10.5.0.1:80|llama" || views[1].Model != "llama" || views[1].Upstream != "10.5.0.1:80" {
		t.Fatalf("views %+v", views)
	}
}
