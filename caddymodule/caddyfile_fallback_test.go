package caddymodule

import (
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

func TestFallbackCaddyfile(t *testing.T) {
	out, err := adapt(t, `:8080 {
	llm_proxy 10.0.0.1:8000 10.0.0.2:8000 {
		fallback small {
			to 10.0.1.1:8000 10.0.1.2:8000
			model llama-8b
			context_window 8192
			max_output_tokens 4096
			when unavailable saturated
			tiers free batch
			per_upstream 16
		}
		fallback last {
			to 10.0.2.1:8000
		}
	}
}`)
	if err != nil {
		t.Fatal(err)
	}
	got := compact(t, llmHandler(t, out)["fallbacks"])
	want := `[{"context_window":8192,"max_output_tokens":4096,"model":"llama-8b","name":"small","per_upstream":16,"tiers":["free","batch"],` +
		`"upstreams":[{"dial":"10.0.1.1:8000"},{"dial":"10.0.1.2:8000"}],"when":["unavailable","saturated"]},` +
		`{"name":"last","upstreams":[{"dial":"10.0.2.1:8000"}]}]`
	if got != want {
		t.Fatalf("fallbacks\n%s\nwant\n%s", got, want)
	}
}

func TestFallbackCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ block, want string }{
		{"fallback {\n to 10.0.1.1:8000\n}", "fallback needs a name"},
		{"fallback a {\n model x\n}", "fallback a has no upstreams"},
		{"fallback a {\n to 10.0.1.1:8000\n when sometimes\n}", `when "sometimes": want unavailable or saturated`},
		{"fallback a {\n to 10.0.1.1:8000\n capacity 2\n per_upstream 2\n}", "capacity or per_upstream, not both"},
		{"fallback a {\n to 10.0.1.1:8000\n context_window 0\n}", "bad context_window"},
		{"fallback a {\n to 10.0.1.1:8000 10.0.1.1:8000\n}", "listed twice"},
		{"fallback a {\n to 10.0.1.1:8000\n model x\n model y\n}", "model already specified"},
		{"fallback a {\n to 10.0.1.1:8000\n bogus 1\n}", `unrecognized option "bogus"`},
		{"fallback a {\n to 10.0.1.1:8000\n}\nfallback a {\n to 10.0.2.1:8000\n}", "fallback a already specified"},
		{"fallback a {\n to https://10.0.1.1\n}", "mix schemes"},
	} {
		_, err := adapt(t, ":8080 {\n llm_proxy 10.0.0.1:8000 {\n"+tc.block+"\n }\n}")
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want one containing %q", tc.block, err, tc.want)
		}
	}
}

func TestFallbackNames(t *testing.T) {
	for _, name := range []string{"primary", "a;b", "a=b", "a b"} {
		_, err := adapt(t, ":8080 {\n llm_proxy 10.0.0.1:8000 {\n fallback \""+name+"\" {\n to 10.0.1.1:8000\n }\n }\n}")
		if err == nil || !strings.Contains(err.Error(), "fallback name") {
			t.Errorf("name %q: error %v", name, err)
		}
	}
}

func TestFallbackTiersMustBeConfigured(t *testing.T) {
	for _, tc := range []struct{ globals, want string }{
		{"", "need tenants and tiers"},
		{"llm_proxy {\n tenants {\n key sk-x x tier free\n }\n tier free {\n rpm 10\n }\n}", `tier "batch" is not configured`},
	} {
		out, err := adapt(t, "{\n"+tc.globals+"\n}\n:8080 {\n llm_proxy 10.0.0.1:8000 {\n fallback small {\n to 10.0.1.1:8000\n tiers free batch\n }\n }\n}")
		if err != nil {
			t.Fatal(err)
		}
		if err := caddy.Validate(mustConfig(t, out)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("globals %q: %v, want an error containing %q", tc.globals, err, tc.want)
		}
	}
}
