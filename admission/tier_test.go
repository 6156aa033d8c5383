package admission

import (
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		err  string // "" valid
	}{
		{"empty", Config{}, ""},
		{"tiers and tenants", Config{Tiers: []Tier{{Name: "gold", RPM: 5}, {Name: "default"}},
			Tenants: []TenantConfig{{ID: "a", Tier: "gold"}, {ID: "b"}}}, ""},
		{"unnamed tier", Config{Tiers: []Tier{{}}}, "tiers[0]: name: empty"},
		{"duplicate tier", Config{Tiers: []Tier{{Name: "x"}, {Name: "x"}}}, `tiers[1] "x": name: duplicate tier`},
		{"negative rpm", Config{Tiers: []Tier{{Name: "x", RPM: -1}}}, `tiers[0] "x": rpm -1: must not be negative`},
		{"negative tpm", Config{Tiers: []Tier{{Name: "x", TPM: -1}}}, `tpm -1`},
		{"negative max_concurrent", Config{Tiers: []Tier{{Name: "x", MaxConcurrent: -1}}}, `max_concurrent -1`},
		{"negative queue", Config{Tiers: []Tier{{Name: "x", Queue: -1}}}, `queue -1`},
		{"negative default_max_tokens", Config{Tiers: []Tier{{Name: "x", DefaultMaxTokens: -1}}}, `default_max_tokens -1`},
		{"negative queue_timeout", Config{Tiers: []Tier{{Name: "x", QueueTimeout: -time.Second}}}, `queue_timeout -1s`},
		{"negative ttft_slo", Config{Tiers: []Tier{{Name: "x", TTFTSLO: -time.Second}}}, `ttft_slo -1s`},
		{"per_1k without ttft_slo", Config{Tiers: []Tier{{Name: "x", TTFTPer1kPrompt: time.Second}}}, `per_1k_prompt_tokens 1s: needs ttft_slo`},
		{"breaker slow_ttft", Config{Tiers: []Tier{{Name: "x", Breaker: &breaker.Settings{SlowTTFT: time.Second}}}}, `breaker slow_ttft 1s`},
		{"slow_ratio without an objective", Config{Tiers: []Tier{{Name: "x", Breaker: &breaker.Settings{SlowRatio: 0.5}}}}, `slow_ratio 0.5: needs ttft_slo`},
		{"slow_ratio with an objective", Config{Tiers: []Tier{{Name: "x", QueueWaitSLO: time.Second, Breaker: &breaker.Settings{SlowRatio: 0.5}}}}, ""},
		{"active probing", Config{Tiers: []Tier{{Name: "x", Breaker: &breaker.Settings{ActiveProbing: true}}}}, `active_probing`},
		{"bad breaker", Config{Tiers: []Tier{{Name: "x", Breaker: &breaker.Settings{FailureRatio: 2}}}}, `"x": breaker: failure_ratio 2`},
		{"unknown default tier", Config{DefaultTier: "gold"}, `default_tier "gold": no such tier`},
		{"unknown unknown tier", Config{UnknownTier: "anon"}, `unknown tier "anon": no such tier`},
		{"tenant of no tier", Config{Tiers: []Tier{{Name: "x"}}, Tenants: []TenantConfig{{ID: "a", Tier: "y"}}}, `tenants[0] "a": tier "y": no such tier`},
		{"tenant without tier or default", Config{Tiers: []Tier{{Name: "x"}}, Tenants: []TenantConfig{{ID: "a"}}}, `no default tier`},
		{"duplicate tenant", Config{Tiers: []Tier{{Name: "x"}}, DefaultTier: "x", Tenants: []TenantConfig{{ID: "a"}, {ID: "a"}}}, `tenants[1] "a": id: duplicate tenant`},
		{"unnamed tenant", Config{Tiers: []Tier{{Name: "x"}}, DefaultTier: "x", Tenants: []TenantConfig{{}}}, `tenants[0]: id: empty`},
		{"negative override", Config{Tiers: []Tier{{Name: "x"}}, DefaultTier: "x", Tenants: []TenantConfig{{ID: "a", TPM: -3}}}, `tenants[0] "a": tpm -3`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			if tc.err == "" {
				if err != nil {
					t.Fatalf("unexpected %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("err %v, want %q", err, tc.err)
			}
			if _, err := NewController(tc.cfg, nil, nil); err == nil {
				t.Fatal("NewController accepted it")
			}
		})
	}
}
