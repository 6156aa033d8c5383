package e2e

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// One site routes models to two pools by the body's model with ordinary
// handle blocks (llm_model): each pool gets only its model's requests, and
// the bytes it receives are the ones the client sent (read once by the
// matcher, handed to llm_proxy). A body over the matcher's max_body gets
// 413 with zero upstream calls, as does one over the 16MiB default; a model
// no pattern matches falls through to the site's last handle.
func TestModelMatcherRoutesByBodyModel(t *testing.T) {
	behavior := mockllm.Behavior{TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}
	big := startFleet(t, mockllm.FleetConfig{Behavior: behavior})
	small := startFleet(t, mockllm.FleetConfig{Behavior: behavior})
	gw := startGateway(t, fmt.Sprintf(`	@big llm_model llama-70b* */Llama-3.1-70B*
	handle @big {
		llm_proxy %s
	}
	@small llm_model llama-8b* {
		max_body 64KiB
	}
	handle @small {
		llm_proxy %s
	}
	handle {
		respond "no pool serves this model" 404
	}`, upstreams(big), upstreams(small)))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	url := gw.URL + "/v1/chat/completions"

	// Spacing and escapes that a re-encoding would change.
	bodies := []struct {
		body string
		to   *mockllm.Fleet
	}{
		{body: "{ \"model\" : \"llama-70b-instruct\",\n  \"stream\": true, \"messages\":[{\"role\":\"user\",\"content\":\"h\\u00e9 🙂\"}] }\n", to: big},
		{body: `{"messages":[{"role":"user","content":"hi"}],"model":"meta-llama/Llama-3.1-70B-Instruct","stream":false}`, to: big},
		{body: `{"model":"llama-8b","stream":true,"messages":[{"role":"user","content":"x"}],"max_tokens":4}`, to: small},
	}
	for i, b := range bodies {
		resp := post(ctx, t, c, url, b.body)
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: status %d: %s", i, resp.StatusCode, got)
		}
		last := b.to.Stats().Replicas[0].LastBody
		if !bytes.Equal(last, []byte(b.body)) {
			t.Fatalf("request %d: the pool received other bytes than sent: %s", i, firstDiff(last, []byte(b.body)))
		}
	}
	if nb, ns := fleetRequests(big), fleetRequests(small); nb != 2 || ns != 1 {
		t.Fatalf("70B pool got %d requests, 8B pool %d; want 2 and 1", nb, ns)
	}

	// Refused before any handler: over the 8B matcher's max_body, and
	// over the 70B matcher's default 16MiB (declared, so unread).
	over := `{"model":"llama-8b","messages":[{"role":"user","content":"` + strings.Repeat("a", 70<<10) + `"}]}`
	huge := `{"model":"llama-70b","messages":[{"role":"user","content":"` + strings.Repeat("a", 17<<20) + `"}]}`
	for name, body := range map[string]string{"over max_body 64KiB": over, "over the default 16MiB": huge} {
		resp := post(ctx, t, c, url, body)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestEntityTooLarge {
			t.Fatalf("%s: status %d, want 413", name, resp.StatusCode)
		}
	}
	resp := post(ctx, t, c, url, `{"model":"gpt-4o","messages":[]}`)
	msg, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound || !strings.Contains(string(msg), "no pool") {
		t.Fatalf("unrouted model: status %d %q, want the site's 404", resp.StatusCode, msg)
	}
	if nb, ns := fleetRequests(big), fleetRequests(small); nb != 2 || ns != 1 {
		t.Fatalf("after the refusals the pools got %d and %d requests, want still 2 and 1", nb, ns)
	}
}
