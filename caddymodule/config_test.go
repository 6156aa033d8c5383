package caddymodule

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// jsonConfig is a whole Caddy config with one llm_proxy handler.
func jsonConfig(handler string) string {
	return `{"admin":{"disabled":true},"apps":{"http":{"servers":{"s":{"listen":["127.0.0.1:0"],"routes":[{"handle":[` + handler + `]}]}}}}}`
}

// TestJSONConfigsGetTheCaddyfilesErrors: checks the Caddyfile parser makes
// are made again in Provision, so a JSON config (the admin API, caddy
// adapt output edited by hand) cannot get past them.
func TestJSONConfigsGetTheCaddyfilesErrors(t *testing.T) {
	up := `"upstreams":[{"dial":"127.0.0.1:9000"}]`
	for _, tc := range []struct{ name, handler, want string }{
		{"hedges need attempts", `{"handler":"llm_proxy",` + up + `,"max_attempts":2,"hedge":{"after":100000000,"max_hedges":2}}`,
			"2 backup(s) need max_attempts of at least 3"},
		{"hedge default attempts", `{"handler":"llm_proxy",` + up + `,"max_attempts":1,"hedge":{"after":100000000}}`,
			"1 backup(s) need max_attempts of at least 2"},
		{"bucket and ratio", `{"handler":"llm_proxy",` + up + `,"retries":{"ratio":0.2,"bucket":{"max_tokens":10,"refill_per_sec":1}}}`,
			"bucket replaces ratio"},
		{"bucket without refill", `{"handler":"llm_proxy",` + up + `,"retries":{"bucket":{"max_tokens":10}}}`,
			"positive refill_per_sec"},
		{"backoff cap below base", `{"handler":"llm_proxy",` + up + `,"retries":{"backoff_base":2000000000,"backoff_cap":1000000000}}`,
			"backoff cap 1s is below its base 2s"},
		{"unknown scope", `{"handler":"llm_proxy",` + up + `,"breaker":{"scope":"tenant"}}`, `unknown scope "tenant"`},
		{"probe uri and chat", `{"handler":"llm_proxy",` + up + `,"breaker":{"probe":{"uri":"/health","chat":"{}"}}}`, "use uri or chat, not both"},
		{"max_attempts over 10", `{"handler":"llm_proxy",` + up + `,"max_attempts":11}`, "max_attempts 11"},
		{"no upstreams", `{"handler":"llm_proxy"}`, "no upstreams"},
		{"duplicate upstream", `{"handler":"llm_proxy","upstreams":[{"dial":"127.0.0.1:9000"},{"dial":"127.0.0.1:9000"}]}`, "listed twice"},
		{"hedge max_ratio over 1", `{"handler":"llm_proxy",` + up + `,"max_attempts":3,"hedge":{"after":100000000,"max_ratio":2}}`, "max_ratio 2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var cfg caddy.Config
			if err := json.Unmarshal([]byte(jsonConfig(tc.handler)), &cfg); err != nil {
				t.Fatal(err)
			}
			err := caddy.Validate(&cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// TestGlobalOptionAdaptsToTheApp: `llm_proxy { }` in the global options
// becomes apps.llm_proxy, and the handlers of the config use it.
func TestGlobalOptionAdaptsToTheApp(t *testing.T) {
	out, err := adapt(t, "{\n\tllm_proxy {\n\t}\n}\n:8080 {\n\tllm_proxy 127.0.0.1:9000\n}\n")
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		Apps map[string]json.RawMessage `json:"apps"`
	}
	if err := json.Unmarshal(out, &cfg); err != nil {
		t.Fatal(err)
	}
	if _, ok := cfg.Apps["llm_proxy"]; !ok {
		t.Fatalf("no llm_proxy app in %s", out)
	}
	if err := caddy.Validate(mustConfig(t, out)); err != nil {
		t.Fatalf("provisioning: %v", err)
	}
}

func TestGlobalOptionErrors(t *testing.T) {
	for _, tc := range []struct{ name, src, want string }{
		{"unknown setting", "{\n\tllm_proxy {\n\t\tbogus 1\n\t}\n}\n:8080 {\n\tllm_proxy 127.0.0.1:9000\n}\n", `unrecognized llm_proxy global option "bogus", at Caddyfile:3`},
		{"argument", "{\n\tllm_proxy extra\n}\n:8080 {\n\tllm_proxy 127.0.0.1:9000\n}\n", "at Caddyfile:2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := adapt(t, tc.src)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("adapt = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// FuzzGlobalOption feeds arbitrary global option blocks to the app's
// parser: it must never panic, and whatever it accepts must marshal.
func FuzzGlobalOption(f *testing.F) {
	for _, s := range []string{"llm_proxy", "llm_proxy {\n}", "llm_proxy {\n bogus\n}", "llm_proxy x {\n}", "llm_proxy {\n {\n}\n}"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, src string) {
		var a App
		if err := a.UnmarshalCaddyfile(caddyfile.NewTestDispenser(src)); err != nil {
			return
		}
		if _, err := json.Marshal(&a); err != nil {
			t.Fatalf("accepted config does not marshal: %v", err)
		}
	})
}
