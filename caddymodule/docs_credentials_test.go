package caddymodule

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// caddyfileBlock matches a ```caddyfile fenced block of a Markdown file.
var caddyfileBlock = regexp.MustCompile("(?ms)^```caddyfile\n(.*?)^```")

// TestUpstreamCredentialsDocSnippets adapts every ```caddyfile block of
// docs/upstream-credentials.md through the Caddyfile adapter and
// provisions it as `caddy validate` does, so the page cannot drift from
// the grammar; each block's llm_proxy handler must carry the headers or
// the option the page shows it for.
func TestUpstreamCredentialsDocSnippets(t *testing.T) {
	src, err := os.ReadFile("../docs/upstream-credentials.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := caddyfileBlock.FindAllSubmatch(src, -1)
	if len(blocks) != 4 {
		t.Fatalf("found %d caddyfile blocks, want 4 (vLLM, hosted OpenAI, Anthropic, forward_tenant_keys)", len(blocks))
	}
	for _, k := range []string{"ACME_KEY", "GLOBEX_KEY"} {
		t.Setenv(k, "sk-doc-"+strings.ToLower(k))
	}
	for i, b := range blocks {
		block := string(b[1])
		out, err := adapt(t, block)
		if err != nil {
			t.Errorf("block %d: adapt: %v\n%s", i+1, err, block)
			continue
		}
		h := llmHandler(t, out)
		if h["headers"] == nil && h["forward_tenant_keys"] != true {
			t.Errorf("block %d: the llm_proxy handler has neither headers nor forward_tenant_keys: %s", i+1, compact(t, h))
		}
		if strings.Contains(block, "fallback ") {
			fb := h["fallbacks"].([]any)[0].(map[string]any)
			if !strings.Contains(compact(t, fb["headers"]), "{env.") {
				t.Errorf("block %d: the fallback's own key is not in its headers: %s", i+1, compact(t, fb))
			}
		}
		if err := caddy.Validate(mustConfig(t, out)); err != nil {
			t.Errorf("block %d: provisioning: %v", i+1, err)
		}
	}
}
