package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// nodeDir holds the npm clients' package.json and package-lock.json
// (openai, @anthropic-ai/sdk, the Vercel AI SDK), stream.mjs and sdk.mjs.
const nodeDir = "node"

var npmOnce struct {
	sync.Mutex
	done bool
}

// ensureNodeModules runs `npm ci` in e2e/node unless node_modules already
// holds every package at the version that package.json pins.
func ensureNodeModules(t *testing.T) {
	t.Helper()
	npmOnce.Lock()
	defer npmOnce.Unlock()
	if npmOnce.done {
		return
	}
	var pkg struct {
		Dependencies map[string]string `json:"dependencies"`
	}
	b, err := os.ReadFile(filepath.Join(nodeDir, "package.json"))
	if err != nil || json.Unmarshal(b, &pkg) != nil {
		t.Fatalf("e2e/node/package.json: %v", err)
	}
	for _, name := range []string{"openai", "@anthropic-ai/sdk", "ai", "@ai-sdk/openai"} {
		if pkg.Dependencies[name] == "" {
			t.Fatalf("e2e/node/package.json does not pin %s", name)
		}
	}
	if missing := missingNodeModules(pkg.Dependencies); len(missing) > 0 {
		if _, err := exec.LookPath("npm"); err != nil {
			t.Fatalf("node is installed but npm is not: %v", err)
		}
		t.Logf("npm ci in e2e/node: %v not installed at the pinned versions", missing)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "npm", "ci", "--no-audit", "--no-fund")
		cmd.Dir = nodeDir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("npm ci in e2e/node: %v\n%s", err, out)
		}
		if missing := missingNodeModules(pkg.Dependencies); len(missing) > 0 {
			t.Fatalf("after npm ci, e2e/node/node_modules still lacks %v at the pinned versions", missing)
		}
	}
	npmOnce.done = true
}

// missingNodeModules lists the dependencies (name → exact version) that
// e2e/node/node_modules does not hold at that version.
func missingNodeModules(deps map[string]string) []string {
	var missing []string
	for name, version := range deps {
		var installed struct {
			Version string `json:"version"`
		}
		b, err := os.ReadFile(filepath.Join(nodeDir, "node_modules", filepath.FromSlash(name), "package.json"))
		if err != nil || json.Unmarshal(b, &installed) != nil || installed.Version != version {
			missing = append(missing, name+"@"+version)
		}
	}
	return missing
}

// nodeLine is one line printed by stream.mjs.
type nodeLine struct {
	TMs          float64 `json:"t_ms"`
	Delta        *string `json:"delta"`
	FinishReason *string `json:"finish_reason"`
	Done         bool    `json:"done"`
	ErrorClass   string  `json:"error_class"`
	APIError     bool    `json:"api_error"`
	Status       int     `json:"status"`
	Message      string  `json:"message"`
}

// runNode runs stream.mjs against baseURL and parses its output.
func runNode(t *testing.T, baseURL, mode string, headers map[string]string) []nodeLine {
	t.Helper()
	hj, _ := json.Marshal(headers)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", "stream.mjs", baseURL, mode, string(hj))
	cmd.Dir = nodeDir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("node stream.mjs %s: %v\nstdout:\n%s\nstderr:\n%s", mode, err, out, stderr.String())
	}
	var lines []nodeLine
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		var l nodeLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatalf("stream.mjs printed a line that is not JSON: %q", sc.Text())
		}
		lines = append(lines, l)
	}
	return lines
}

// TestOpenAINodeClientStreamsAndSeesTypedErrors: the official openai npm
// client streams a chat completion through the gateway chunk by chunk,
// and surfaces the gateway's 503 (every upstream answered 503) as its
// typed API error.
func TestOpenAINodeClientStreamsAndSeesTypedErrors(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("node"); err != nil {
		t.Skip("node is not on PATH: this test drives the openai npm client with Node.js")
	}
	ensureNodeModules(t)

	t.Run("stream", func(t *testing.T) {
		fleet := startFleet(t, mockllm.FleetConfig{})
		gw := startGateway(t, "\tllm_proxy "+upstreams(fleet))
		const tokens = 10
		lines := runNode(t, gw.URL, "stream", map[string]string{
			mockllm.HeaderTokens: "10", mockllm.HeaderTokenInterval: "100ms",
		})
		if len(lines) == 0 || !lines[len(lines)-1].Done {
			t.Fatalf("stream.mjs did not finish the stream: %+v", lines)
		}
		chunks := lines[:len(lines)-1]
		// role chunk + one chunk per token
		if len(chunks) != tokens+1 {
			t.Errorf("got %d chunks, want %d", len(chunks), tokens+1)
		}
		var text strings.Builder
		spaced := 0
		for i, ch := range chunks {
			if ch.Delta != nil {
				text.WriteString(*ch.Delta)
			}
			if i > 0 && ch.TMs-chunks[i-1].TMs >= 50 {
				spaced++
			}
		}
		if span := chunks[len(chunks)-1].TMs - chunks[0].TMs; span < 700 {
			t.Errorf("chunks spread over %.0fms, want about %dms (tokens 100ms apart): a burst", span, (tokens-1)*100)
		}
		if spaced < tokens-3 {
			t.Errorf("only %d chunk gaps of 50ms or more, want at least %d: chunks arrived in bursts", spaced, tokens-3)
		}
		if fr := chunks[len(chunks)-1].FinishReason; fr == nil || *fr != "stop" {
			t.Errorf("last chunk finish_reason %v, want stop", fr)
		}
		// The same prompt, bytes as the SDK sends them, answered whole by
		// the mock: the streamed deltas must add up to that text.
		want := directChatText(t, fleet.Replica(0).URL(),
			`{"model":"mock-llama","messages":[{"role":"user","content":"Say hello from the openai npm client."}],"stream":false}`,
			tokens)
		if text.String() != want {
			t.Errorf("streamed text %q, want %q", text.String(), want)
		}
	})

	t.Run("all-upstreams-503", func(t *testing.T) {
		fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2,
			Behavior: mockllm.Behavior{Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503}}})
		gw := startGateway(t, "\tllm_proxy "+upstreams(fleet))
		lines := runNode(t, gw.URL, "expect-error", nil)
		if len(lines) != 1 {
			t.Fatalf("stream.mjs printed %+v, want one error line", lines)
		}
		e := lines[0]
		t.Logf("SDK error: %s (status %d): %s", e.ErrorClass, e.Status, e.Message)
		if e.ErrorClass != "InternalServerError" && e.ErrorClass != "APIError" {
			t.Errorf("SDK error class %q, want InternalServerError or APIError", e.ErrorClass)
		}
		if !e.APIError || e.Status != 503 {
			t.Errorf("SDK error: instanceof APIError %v, status %d; want true, 503", e.APIError, e.Status)
		}
		if n := fleetRequests(fleet); n != 2 {
			t.Errorf("the fleet got %d requests, want 2 (the gateway tried both upstreams; the SDK did not retry)", n)
		}
	})
}

// directChatText asks the replica for a non-streamed completion and
// returns its message content.
func directChatText(t *testing.T, replicaURL, body string, tokens int) string {
	t.Helper()
	ctx := testContext(t, 30*time.Second)
	r, err := doPlain(ctx, newClient(t), replicaURL+"/v1/chat/completions", body,
		mockllm.HeaderTokens+": "+strconv.Itoa(tokens), mockllm.HeaderTokenInterval+": 0")
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		Choices []struct {
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(r.Body, &v); err != nil || len(v.Choices) != 1 {
		t.Fatalf("direct completion: %v: %s", err, r.Body)
	}
	return v.Choices[0].Message.Content
}
