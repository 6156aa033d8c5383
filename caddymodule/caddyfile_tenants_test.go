package caddymodule

import (
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"

	"github.com/llmproxy/caddy-llm-proxy/internal/registry"
)

const tenantsSite = `{
	llm_proxy {
		tenants {
			key sk-literal-secret-1 acme
			key sk-literal-secret-2 acme tier gold
			key sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 globex
			key {env.BETA_KEY} beta
			header X-Tenant trusted_proxies 10.0.0.0/8 192.168.1.1
			unknown free
		}
		tier gold {
			priority 10
			max_concurrent 8
			rpm 600
			tpm 200000
			default_max_tokens 512
			queue 50
			queue_timeout 10s
			ttft_slo 2s per_1k_prompt_tokens 100ms
			queue_wait_slo 5s
			breaker {
				consecutive_failures 5
			}
		}
		tier free {
			priority -1
			rpm 10
		}
		tier default {
			rpm 60
		}
		tenant acme {
			tier gold
			rpm 1200
		}
		metrics_tenant_label
	}
}
:8080 {
	llm_proxy 127.0.0.1:9000 {
		admission {
			capacity 32
			queue 200
		}
	}
}
`

// TestTenantsAdaptWithoutKeys: the Caddyfile adapter stores literal keys
// as their sha256, so neither the adapted JSON nor the admin API's
// /config/ ever holds one; placeholders are kept for load time.
func TestTenantsAdaptWithoutKeys(t *testing.T) {
	out, err := adapt(t, tenantsSite)
	if err != nil {
		t.Fatal(err)
	}
	s := string(out)
	for _, secret := range []string{"sk-literal-secret-1", "sk-literal-secret-2"} {
		if strings.Contains(s, secret) {
			t.Errorf("adapted JSON holds the literal key %q: %s", secret, s)
		}
	}
	for _, want := range []string{
		`"sha256":"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08","tenant":"globex"`,
		`"key":"{env.BETA_KEY}","tenant":"beta"`,
		`"tenant":"acme","tier":"gold"`,
		`"header":"X-Tenant","trusted_proxies":["10.0.0.0/8","192.168.1.1"]`,
		`"unknown":"free"`,
		`"name":"gold","priority":10,"max_concurrent":8,"rpm":600,"tpm":200000,"default_max_tokens":512,"queue":50,"queue_timeout":10000000000,"ttft_slo":2000000000,"ttft_per_1k_prompt_tokens":100000000,"queue_wait_slo":5000000000,"breaker":{"consecutive_failures":5}`,
		`"name":"free","priority":-1,"rpm":10`,
		`"tenant_overrides":[{"id":"acme","tier":"gold","rpm":1200}]`,
		`"metrics_tenant_label":true`,
		`"admission":{"capacity":32,"queue":200}`,
	} {
		if !strings.Contains(s, want) {
			t.Errorf("adapted JSON lacks %s\n%s", want, s)
		}
	}
}

func TestTenantsCaddyfileErrors(t *testing.T) {
	wrap := func(body string) string {
		return "{\n\tllm_proxy {\n" + body + "\n\t}\n}\n:8080 {\n\tllm_proxy 127.0.0.1:9000\n}\n"
	}
	for _, tc := range []struct{ name, src, want string }{
		{"key without tenant", wrap("\t\ttenants {\n\t\t\tkey sk-1\n\t\t}"), "want: key <key>|sha256:<hex>|{env.X} <tenant> [tier <tier>], at Caddyfile:4"},
		{"bad sha256", wrap("\t\ttenants {\n\t\t\tkey sha256:abc acme\n\t\t}"), "sha256 must be 64 hex digits, at Caddyfile:4"},
		{"header without proxies", wrap("\t\ttenants {\n\t\t\theader X-Tenant\n\t\t}"), "want: header <name> trusted_proxies <ranges...>, at Caddyfile:4"},
		{"bad proxy range", wrap("\t\ttenants {\n\t\t\theader X-Tenant trusted_proxies 10.0.0.0/33\n\t\t}"), "neither an address nor a CIDR range"},
		{"unknown tenants option", wrap("\t\ttenants {\n\t\t\tbogus\n\t\t}"), `unrecognized tenants option "bogus", at Caddyfile:4`},
		{"tier without name", wrap("\t\ttier {\n\t\t}"), "want: tier <name>"},
		{"bad rpm", wrap("\t\ttier gold {\n\t\t\trpm lots\n\t\t}"), `bad rpm "lots"`},
		{"bad priority", wrap("\t\ttier gold {\n\t\t\tpriority high\n\t\t}"), `bad priority "high"`},
		{"bad ttft_slo", wrap("\t\ttier gold {\n\t\t\tttft_slo 2s per_token 1ms\n\t\t}"), "want: ttft_slo <duration> [per_1k_prompt_tokens <duration>], at Caddyfile:4"},
		{"unknown tier option", wrap("\t\ttier gold {\n\t\t\tburst 5\n\t\t}"), `unrecognized tier option "burst"`},
		{"tier twice", wrap("\t\ttier gold {\n\t\t}\n\t\ttier gold {\n\t\t}"), "tier gold already specified"},
		{"tenant option", wrap("\t\ttenant acme {\n\t\t\tpriority 3\n\t\t}"), `unrecognized tenant option "priority"`},
		{"tenant twice", wrap("\t\ttenant acme {\n\t\t}\n\t\ttenant acme {\n\t\t}"), "tenant acme already specified"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := adapt(t, tc.src)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("adapt = %v, want an error containing %q", err, tc.want)
			}
		})
	}
	for _, tc := range []struct{ name, src, want string }{
		{"capacity and per_upstream", ":8080 {\n\tllm_proxy 127.0.0.1:9000 {\n\t\tadmission {\n\t\t\tcapacity 4\n\t\t\tper_upstream 2\n\t\t}\n\t}\n}\n", "use capacity or per_upstream, not both"},
		{"admission option", ":8080 {\n\tllm_proxy 127.0.0.1:9000 {\n\t\tadmission {\n\t\t\tslots 4\n\t\t}\n\t}\n}\n", `unrecognized admission option "slots"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := adapt(t, tc.src)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("adapt = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// FuzzTenantsOption feeds arbitrary global llm_proxy blocks to the parser.
func FuzzTenantsOption(f *testing.F) {
	for _, s := range []string{"llm_proxy {\n tenants {\n key sk-1 acme\n unknown free\n }\n tier free {\n priority -1\n }\n}", "llm_proxy {\n tier x {\n rpm 1\n }\n}", "llm_proxy {\n tenants {\n key a b tier c\n }\n}"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, src string) {
		var a App
		_ = a.UnmarshalCaddyfile(caddyfile.NewTestDispenser(src))
	})
}

// TestTenantsProvision: the adapted tenants config provisions (keys from
// the environment resolved), and a key whose tenant leads to no tier, or a
// tier that names an unknown one, is refused at load.
func TestTenantsProvision(t *testing.T) {
	t.Setenv("BETA_KEY", "sk-from-env")
	out, err := adapt(t, tenantsSite)
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Validate(mustConfig(t, out)); err != nil {
		t.Fatalf("provisioning: %v", err)
	}
	t.Setenv("BETA_KEY", "")
	if err := caddy.Validate(mustConfig(t, out)); err == nil || !strings.Contains(err.Error(), "{env.BETA_KEY} is empty") {
		t.Fatalf("an empty env key: %v, want it refused by name", err)
	}
	noTier := "{\n\tllm_proxy {\n\t\ttenants {\n\t\t\tkey sk-1 acme\n\t\t}\n\t\ttier gold {\n\t\t}\n\t}\n}\n:8080 {\n\tllm_proxy 127.0.0.1:9000\n}\n"
	out, err = adapt(t, noTier)
	if err != nil {
		t.Fatal(err)
	}
	err = caddy.Validate(mustConfig(t, out))
	if err == nil || !strings.Contains(err.Error(), "tenant acme has no tier") || strings.Contains(err.Error(), "sk-1") {
		t.Fatalf("a key without a tier: %v", err)
	}
	typo := "{\n\tllm_proxy {\n\t\ttenants {\n\t\t\tkey sk-1 hobby tier fre\n\t\t}\n\t\ttier free {\n\t\t}\n\t}\n}\n:8080 {\n\tllm_proxy 127.0.0.1:9000\n}\n"
	out, err = adapt(t, typo)
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Validate(mustConfig(t, out)); err == nil || !strings.Contains(err.Error(), `names tier "fre", which no tier block defines`) {
		t.Fatalf("a key naming an undefined tier: %v, want the tier named", err)
	}
}

// TestOnlyEnvPlaceholdersAreKeptAsKeys: a key that merely looks like a
// placeholder is hashed like any literal (it used to be kept as given, and
// shown by /config/); a literal key in JSON is refused.
func TestOnlyEnvPlaceholdersAreKeptAsKeys(t *testing.T) {
	out, err := adapt(t, "{\n\tllm_proxy {\n\t\ttenants {\n\t\t\tkey {not-a-placeholder} acme\n\t\t}\n\t\ttier default {\n\t\t}\n\t}\n}\n:8080 {\n\tllm_proxy 127.0.0.1:9000\n}\n")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(out), "not-a-placeholder") {
		t.Fatalf("the adapted JSON holds the key: %s", out)
	}
	cfg := `{"admin":{"disabled":true},"apps":{"llm_proxy":{"tenants":{"keys":[{"key":"sk-literal","tenant":"acme"}]},"tiers":[{"name":"default"}]},` +
		`"http":{"servers":{"s":{"listen":["127.0.0.1:0"],"routes":[{"handle":[{"handler":"llm_proxy","upstreams":[{"dial":"127.0.0.1:9000"}]}]}]}}}}}`
	err = caddy.Validate(mustConfig(t, []byte(cfg)))
	if err == nil || !strings.Contains(err.Error(), "give a literal key as sha256") || strings.Contains(err.Error(), "sk-literal") {
		t.Fatalf("a literal key in JSON: %v", err)
	}
}

// TestAppStopHandsTiersBack: a config whose start failed elsewhere (its
// app is stopped while the old one runs) leaves the old config's limits in
// force, not its own.
func TestAppStopHandsTiersBack(t *testing.T) {
	build := func(rpm int) *App {
		a := &App{Tenants: &TenantsConfig{Keys: []TenantKey{{SHA256: strings.Repeat("ab", 32), Tenant: "acme"}}},
			Tiers: []TierConfig{{Name: "default", RPM: rpm}}}
		a.claims = new(registry.Claims)
		t.Cleanup(func() { _ = a.Cleanup() })
		tn, err := newTenancy(a)
		if err != nil {
			t.Fatal(err)
		}
		a.tenancy, a.logger = tn, zap.NewNop()
		return a
	}
	rpm := func() int {
		ti, ok := liveController().Tier("acme", "")
		if !ok {
			t.Fatal("no tier")
		}
		return ti.RPM
	}
	old := build(100)
	if err := old.Start(); err != nil {
		t.Fatal(err)
	}
	defer old.Stop()
	failed := build(7)
	if err := failed.Start(); err != nil {
		t.Fatal(err)
	}
	if rpm() != 7 {
		t.Fatalf("after the new config started: rpm %d, want 7", rpm())
	}
	if err := failed.Stop(); err != nil {
		t.Fatal(err)
	}
	if rpm() != 100 {
		t.Fatalf("after the new config stopped: rpm %d, want the running config's 100", rpm())
	}
}
