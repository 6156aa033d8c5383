package e2e

// Helpers of the tests of the Responses and Messages APIs (apis_test.go):
// the official SDKs driven through e2e/node/sdk.mjs, request bodies and
// the named events of those APIs.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// sdkResult is the line sdk.mjs prints: what the SDK returned, or what it
// threw.
type sdkResult struct {
	OK             bool           `json:"ok"`
	Text           string         `json:"text"`
	StopReason     *string        `json:"stop_reason"`
	ResponseStatus *string        `json:"response_status"`
	Usage          map[string]any `json:"usage"`
	Starts         int            `json:"starts"`
	Events         int            `json:"events"`
	ErrorEvents    int            `json:"error_events"`
	TMs            float64        `json:"t_ms"`

	ErrorClass string            `json:"error_class"`
	APIError   bool              `json:"api_error"`
	Status     *int              `json:"status"`
	Type       *string           `json:"type"`
	Code       any               `json:"code"`
	BodyType   *string           `json:"body_type"`
	Message    string            `json:"message"`
	Headers    map[string]string `json:"headers"`
}

// thrown describes what the SDK threw.
func (r sdkResult) thrown() string {
	status, typ := "none", "none"
	if r.Status != nil {
		status = strconv.Itoa(*r.Status)
	}
	if r.Type != nil {
		typ = *r.Type
	}
	return fmt.Sprintf("%s (status %s, type %s, code %v): %s", r.ErrorClass, status, typ, r.Code, r.Message)
}

// stop is the stop reason, "" when none.
func (r sdkResult) stop() string {
	if r.StopReason == nil {
		return ""
	}
	return *r.StopReason
}

// usageInt returns usage[key] as an integer, -1 when absent.
func (r sdkResult) usageInt(key string) int {
	v, ok := r.Usage[key].(float64)
	if !ok {
		return -1
	}
	return int(v)
}

// requireNode skips the test without node and installs the pinned SDKs.
func requireNode(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("node"); err != nil {
		t.Skip("node is not on PATH: this test drives the official npm SDKs with Node.js (scripts/setup-test.sh installs it)")
	}
	ensureNodeModules(t)
}

// runSDK runs sdk.mjs in mode against baseURL with extra request headers
// and options ({"apiKey","maxTokens","prompt"}) and returns its result.
func runSDK(t *testing.T, mode, baseURL string, headers map[string]string, opts map[string]any) sdkResult {
	t.Helper()
	if headers == nil {
		headers = map[string]string{}
	}
	if opts == nil {
		opts = map[string]any{}
	}
	hj, _ := json.Marshal(headers)
	oj, _ := json.Marshal(opts)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", "sdk.mjs", mode, baseURL, string(hj), string(oj))
	cmd.Dir = nodeDir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("node sdk.mjs %s: %v\nstdout:\n%s\nstderr:\n%s", mode, err, out, stderr.String())
	}
	var r sdkResult
	if err := json.Unmarshal(bytes.TrimSpace(out), &r); err != nil {
		t.Fatalf("node sdk.mjs %s printed %q, not one JSON line: %v\nstderr:\n%s", mode, out, err, stderr.String())
	}
	t.Logf("sdk.mjs %s %s: %s", mode, baseURL, bytes.TrimSpace(out))
	return r
}

// apiCase is what the tests need to know of one streaming API.
type apiCase struct {
	api mockllm.API
	// body is a request body with one user message of content and an
	// output limit (0: none, or 256 where the API requires one).
	body func(content string, maxTokens int, stream bool) string
	// begin is the stream's beginning (held by the gateway until the
	// first generated event); end its normal last event; delta the event
	// that carries text.
	begin, end, delta string
	// sdkStream is the sdk.mjs mode that streams this API; sdkRaise the
	// modes that must throw when a committed stream is cut.
	sdkStream string
	sdkRaise  []string
	// outputTokens is the usage key of generated tokens in the SDK's
	// result.
	outputTokens string
}

// streamingAPIs are the two APIs of issue 18 besides Chat.
var streamingAPIs = []apiCase{
	{
		api: mockllm.APIResponses,
		body: func(content string, maxTokens int, stream bool) string {
			m := map[string]any{"model": "mock-llama", "input": []map[string]string{{"role": "user", "content": content}}, "stream": stream}
			if maxTokens > 0 {
				m["max_output_tokens"] = maxTokens
			}
			b, _ := json.Marshal(m)
			return string(b)
		},
		begin: "response.created", end: "response.completed", delta: "response.output_text.delta",
		sdkStream:    "openai-responses",
		sdkRaise:     []string{"openai-responses-helper", "ai-responses"},
		outputTokens: "output_tokens",
	},
	{
		api: mockllm.APIMessages,
		body: func(content string, maxTokens int, stream bool) string {
			if maxTokens <= 0 {
				maxTokens = 256 // required by the API
			}
			b, _ := json.Marshal(map[string]any{"model": "mock-llama", "max_tokens": maxTokens,
				"messages": []map[string]string{{"role": "user", "content": content}}, "stream": stream})
			return string(b)
		},
		begin: "message_start", end: "message_stop", delta: "content_block_delta",
		sdkStream:    "anthropic-stream",
		sdkRaise:     []string{"anthropic-stream"},
		outputTokens: "output_tokens",
	},
}

// name is the event's "event:" field, "" when it has none.
func (e event) name() string {
	for _, l := range strings.Split(strings.TrimRight(string(e.Raw), "\r\n"), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSuffix(l, "\r"), "event:"); ok {
			return strings.TrimPrefix(v, " ")
		}
	}
	return ""
}

// object decodes the event's data as a JSON object (nil when it is not).
func (e event) object() map[string]any {
	var m map[string]any
	if json.Unmarshal([]byte(e.Data()), &m) != nil {
		return nil
	}
	return m
}

// names lists the event names of a stream's events (comments skipped).
func (s *stream) names() []string {
	var out []string
	for _, e := range s.dataEvents() {
		out = append(out, e.name())
	}
	return out
}

// count counts the events named name.
func (s *stream) count(name string) int {
	n := 0
	for _, e := range s.dataEvents() {
		if e.name() == name {
			n++
		}
	}
	return n
}

// lastData is the stream's last data event (zero event when none).
func (s *stream) lastData() event {
	d := s.dataEvents()
	if len(d) == 0 {
		return event{}
	}
	return d[len(d)-1]
}

// checkCompleteAPIStream checks that a stream of api is complete: 200,
// one beginning, text events, the API's end last, no error event, a clean
// end of the body.
func checkCompleteAPIStream(t *testing.T, what string, c apiCase, s *stream) {
	t.Helper()
	if s.Status != 200 {
		t.Fatalf("%s: status %d: %s", what, s.Status, raw(s.Events))
	}
	if s.Err != nil || len(s.Tail) > 0 {
		t.Errorf("%s: the body ended with %v (tail %q), want a clean end", what, s.Err, s.Tail)
	}
	if n := s.count(c.begin); n != 1 {
		t.Errorf("%s: %d %s events, want exactly one: %v", what, n, c.begin, s.names())
	}
	if s.count(c.delta) == 0 {
		t.Errorf("%s: no %s event: %v", what, c.delta, s.names())
	}
	if last := s.lastData().name(); last != c.end {
		t.Errorf("%s: last event %q, want %s: %v", what, last, c.end, s.names())
	}
	for _, e := range s.dataEvents() {
		if e.name() == "error" || e.name() == "response.failed" {
			t.Errorf("%s: an error event reached the client: %q", what, e.Raw)
		}
		if _, isErr := e.ErrorObject(); isErr && e.name() != "error" {
			t.Errorf("%s: a chat-shaped error event reached the client: %q", what, e.Raw)
		}
	}
}
