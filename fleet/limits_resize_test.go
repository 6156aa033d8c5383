package fleet

import (
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/internal/redistest"
)

// TestLimitsResizeMovesTheFleetReservation: a reservation shrunk on one
// gateway (the ladder's clamped max_tokens) frees its tokens for the whole
// fleet at once; growing past the fleet's tpm is refused and changes
// nothing; settlement then takes back what is reserved by then, once.
func TestLimitsResizeMovesTheFleetReservation(t *testing.T) {
	s := redistest.Start(t, redistest.Options{})
	gws := limitsFleet(t, s.Addr(), 2, limTier(admission.Tier{TPM: 2000}), Config{}, LimitsConfig{})
	rdb := limDirect(t, s.Addr())
	tokens := func() int64 { _, toks := limWindow(t, rdb, "acme"); return toks }

	tk, r := gws[0].ctl.Reserve(admission.Request{Tenant: "acme", PromptTokens: 100, MaxTokens: 1500})
	if r != nil {
		t.Fatal(r)
	}
	if got := tokens(); got != 1600 {
		t.Fatalf("reserved %d in redis, want 1600", got)
	}
	// The other gateway cannot fit 1000 more until the first shrinks.
	if _, r := gws[1].ctl.Reserve(admission.Request{Tenant: "acme", MaxTokens: 1000}); r == nil || r.Code != admission.CodeTenantTPM {
		t.Fatalf("gateway 1 before the shrink: %v, want tenant_tpm", r)
	}
	if r := tk.Resize(300, 1); r != nil {
		t.Fatalf("shrink refused: %v", r)
	}
	if got := tokens(); got != 400 {
		t.Fatalf("after the shrink %d in redis, want 400", got)
	}
	other, r := gws[1].ctl.Reserve(admission.Request{Tenant: "acme", MaxTokens: 1000})
	if r != nil {
		t.Fatalf("gateway 1 after the shrink: %v", r)
	}
	if r := tk.Resize(1500, 1); r == nil || r.Code != admission.CodeTenantTPM {
		t.Fatalf("grow past the fleet's tpm: %v, want a refusal", r)
	}
	if got := tokens(); got != 1400 {
		t.Fatalf("a refused grow changed redis: %d, want 1400", got)
	}
	tk.Settle(admission.Usage{PromptTokens: 100, CompletionTokens: 20}, 0)
	other.Cancel()
	if got := tokens(); got != 120 {
		t.Fatalf("after settlement %d in redis, want 120 (what was used)", got)
	}
}
