package api

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/sse"
)

func TestChatChunkFinishAndUsage(t *testing.T) {
	tests := []struct {
		name string
		data string
		want chunkInfo
	}{
		{
			name: "role chunk with null finish_reason",
			data: `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1718000000,"model":"llama","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`,
		},
		{
			name: "content chunk",
			data: `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1718000000,"model":"llama","choices":[{"index":0,"delta":{"content":" Hello"},"logprobs":null,"finish_reason":null,"stop_reason":null}]}`,
		},
		{
			name: "final chunk with stop",
			data: `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1718000000,"model":"llama","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop","stop_reason":null}]}`,
			want: chunkInfo{finishReason: true},
		},
		{
			name: "final chunk with length",
			data: `{"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"."},"finish_reason":"length"}]}`,
			want: chunkInfo{finishReason: true},
		},
		{
			name: "tool_calls on the second choice",
			data: `{"choices":[{"index":0,"delta":{},"finish_reason":null},{"index":1,"delta":{},"finish_reason":"tool_calls"}]}`,
			want: chunkInfo{finishReason: true},
		},
		{
			name: "usage chunk with empty choices",
			data: `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1718000000,"model":"llama","choices":[],"usage":{"prompt_tokens":12,"total_tokens":40,"completion_tokens":28}}`,
			want: chunkInfo{usageOnly: true, usage: true, promptTokens: 12, completionTokens: 28},
		},
		{
			name: "openai include_usage chunk with usage null",
			data: `{"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}],"usage":null}`,
		},
		{
			name: "finish and usage together",
			data: `{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}`,
			want: chunkInfo{finishReason: true, usage: true, promptTokens: 1, completionTokens: 2},
		},
		{
			name: "field names inside content do not count",
			data: `{"choices":[{"index":0,"delta":{"content":"\"finish_reason\":\"stop\", \"usage\":{\"prompt_tokens\":1}"},"finish_reason":null}],"usage":null}`,
		},
		{
			name: "content ending in an escaped backslash",
			data: `{"choices":[{"delta":{"content":"C:\\"},"finish_reason":"stop"}]}`,
			want: chunkInfo{finishReason: true},
		},
		{
			name: "content with an escaped quote before the field",
			data: `{"choices":[{"delta":{"content":"say \\\" then \" ,\"finish_reason\":\"stop\"},"finish_reason":null}]}`,
		},
		{
			name: "whitespace around colons and commas",
			data: "{ \"choices\" : [ { \"finish_reason\" :\n\t\"length\" } ] ,\r\n \"usage\" : { } }",
			want: chunkInfo{finishReason: true, usage: true},
		},
		{
			name: "leading whitespace",
			data: "  \n{\"usage\":{}}",
			want: chunkInfo{usageOnly: true, usage: true},
		},
		{
			name: "finish_reason outside choices does not count",
			data: `{"finish_reason":"stop","choices":[{"delta":{"finish_reason":"stop"}}],"x":{"usage":{}}}`,
		},
		{
			name: "usage that is not an object does not count",
			data: `{"usage":0}`,
		},
		{
			name: "non-streaming body with usage and prompt_tokens_details",
			data: `{"id":"chatcmpl-2","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10,"prompt_tokens_details":{"cached_tokens":0,"prompt_tokens":5}}}`,
			want: chunkInfo{finishReason: true, usage: true, promptTokens: 9, completionTokens: 1},
		},
		{
			name: "last usage wins, null resets the counts",
			data: `{"usage":{"prompt_tokens":3,"completion_tokens":4},"usage":null}`,
		},
		{
			name: "last count key wins",
			data: `{"usage":{"completion_tokens":4,"completion_tokens":7,"prompt_tokens":"5"}}`,
			want: chunkInfo{usageOnly: true, usage: true, completionTokens: 7},
		},
		{
			name: "counts that are not plain integers read as 0",
			data: `{"usage":{"prompt_tokens":1.5,"completion_tokens":-2}}`,
			want: chunkInfo{usageOnly: true, usage: true},
		},
		{
			name: "escaped count key",
			data: `{"usage":{"prompt_\u0074okens":8}}`,
			want: chunkInfo{usageOnly: true, usage: true, promptTokens: 8},
		},
		{
			name: "counts in a nested usage do not count",
			data: `{"choices":[{"usage":{"prompt_tokens":1}}],"x":{"usage":{"completion_tokens":2}}}`,
		},
		{
			name: "unicode content",
			data: `{"choices":[{"delta":{"content":"世界 🙂 \u00e9"},"finish_reason":"stop"}]}`,
			want: chunkInfo{finishReason: true},
		},
		{
			name: "usage with choices null or absent is usage-only",
			data: `{"choices":null,"usage":{"prompt_tokens":2,"completion_tokens":3}}`,
			want: chunkInfo{usage: true, usageOnly: true, promptTokens: 2, completionTokens: 3},
		},
		{
			name: "usage on a content chunk (TGI, continuous_usage_stats) is not usage-only",
			data: `{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}],"usage":{"prompt_tokens":2,"completion_tokens":1}}`,
			want: chunkInfo{usage: true, promptTokens: 2, completionTokens: 1},
		},
		{
			name: "the last choices counts for usage-only",
			data: `{"choices":[{"delta":{}}],"usage":{},"choices":[]}`,
			want: chunkInfo{usage: true, usageOnly: true},
		},
		{
			name: "empty choices without usage is not usage-only",
			data: `{"choices":[]}`,
		},
		{name: "done marker", data: "[DONE]"},
		{name: "empty", data: ""},
		{name: "truncated", data: `{"choices":[{"finish_reason":"st`},
		{
			name: "garbage after a valid prefix",
			data: `{"usage":{"a":1}, garbage`,
			want: chunkInfo{usageOnly: true, usage: true},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := inspectChunk([]byte(tt.data)); got != tt.want {
				t.Errorf("InspectChunk = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestChatChunkInspectionDoesNotAllocate(t *testing.T) {
	chunks := [][]byte{
		[]byte(`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1718000000,"model":"llama","choices":[{"index":0,"delta":{"content":" Hello \"q\" \u00e9"},"logprobs":null,"finish_reason":null}],"usage":null}`),
		[]byte(`{"choices":[],"usage":{"prompt_tokens":12,"total_tokens":40,"completion_tokens":28}}`),
		[]byte(`{"\u0065rror":{"message":"m"}}`),
	}
	for _, c := range chunks {
		ev := sse.Event{Data: c, HasData: true}
		allocs := testing.AllocsPerRun(1000, func() {
			_ = inspectChunk(c)
			_ = ev.Kind()
		})
		if allocs != 0 {
			t.Errorf("%s: %v allocs, want 0", c, allocs)
		}
	}
}

func TestChatErrorShapesAreClassed(t *testing.T) {
	tests := []struct {
		name string
		data string
		want InbandError
	}{
		{
			name: "openai shape with string code",
			data: `{"error":{"message":"The server had an error","type":"server_error","param":null,"code":"server_error"}}`,
			want: InbandError{Message: "The server had an error", Type: "server_error", Code: "server_error", Status: 500},
		},
		{
			name: "openai context length",
			data: `{"error":{"message":"too long","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}`,
			want: InbandError{Message: "too long", Type: "invalid_request_error", Code: "context_length_exceeded", Status: 400},
		},
		{
			name: "openai rate limit with null code",
			data: `{"error":{"message":"slow down","type":"rate_limit_exceeded","code":null}}`,
			want: InbandError{Message: "slow down", Type: "rate_limit_exceeded", Status: 429},
		},
		{
			name: "vllm nested with numeric code",
			data: `{"error":{"object":"error","message":"bad","type":"BadRequestError","param":null,"code":400}}`,
			want: InbandError{Message: "bad", Type: "BadRequestError", Code: "400", Status: 400},
		},
		{
			name: "vllm top-level with numeric code",
			data: `{"object":"error","message":"engine dead","type":"InternalServerError","param":null,"code":500}`,
			want: InbandError{Message: "engine dead", Type: "InternalServerError", Code: "500", Status: 500},
		},
		{
			name: "numeric string code",
			data: `{"error":{"message":"busy","type":"x","code":"503"}}`,
			want: InbandError{Message: "busy", Type: "x", Code: "503", Status: 503},
		},
		{
			name: "numeric code wins over type",
			data: `{"error":{"message":"m","type":"invalid_request_error","code":502}}`,
			want: InbandError{Message: "m", Type: "invalid_request_error", Code: "502", Status: 502},
		},
		{
			name: "numeric code outside 400..599 falls back to type",
			data: `{"error":{"message":"m","type":"BadRequestError","code":200}}`,
			want: InbandError{Message: "m", Type: "BadRequestError", Code: "200", Status: 400},
		},
		{
			name: "too many requests in type",
			data: `{"error":{"message":"m","type":"Too Many Requests"}}`,
			want: InbandError{Message: "m", Type: "Too Many Requests", Status: 429},
		},
		{
			name: "tgi string error",
			data: `{"error":"Input validation error: max_new_tokens too big","error_type":"validation"}`,
			want: InbandError{Message: "Input validation error: max_new_tokens too big", Type: "validation", Status: 400},
		},
		{
			name: "unknown error is 500",
			data: `{"error":{"message":"\u00e9\n"}}`,
			want: InbandError{Message: "é\n", Status: 500},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := parseChatError([]byte(tt.data))
			if !ok || got != tt.want {
				t.Errorf("ParseInbandError = %+v, %v; want %+v, true", got, ok, tt.want)
			}
		})
	}
}

func TestChatErrorRejectsNonErrors(t *testing.T) {
	for _, data := range []string{
		``, `[DONE]`, `null`, `[]`, `{}`, `{"error":null}`, `{"error":42}`,
		`{"object":"chat.completion.chunk","choices":[]}`, `{"object":"ERROR"}`,
		`{"error":{"message":"truncated"`,
	} {
		if e, ok := parseChatError([]byte(data)); ok {
			t.Errorf("ParseInbandError(%q) = %+v, true; want not an error", data, e)
		}
	}
}

func TestChatErrorEventIsOneLineOfValidJSON(t *testing.T) {
	tests := []struct{ message, typ, code string }{
		{"upstream stream cut", "server_error", "upstream_error"},
		{`quotes " and \ backslash`, "type", ""},
		{"new\nline\r\nand\ttab and \x00\x1f control", "t", "502"},
		{"unicode é 世界 🙂 \u2028\u2029", "t", "c"},
		{"invalid utf-8 \xff\xfe end", "t", "c"},
		{"</script>&", "", ""},
	}
	for _, tt := range tests {
		prefix := []byte("data: previous\n\n")
		out := appendChatErrorEvent(prefix, tt.message, tt.typ, tt.code)
		ev, ok := strings.CutPrefix(string(out), "data: previous\n\ndata: ")
		if !ok {
			t.Fatalf("%q: prefix not kept: %q", tt.message, out)
		}
		payload, ok := strings.CutSuffix(ev, "\n\n")
		if !ok || strings.ContainsAny(payload, "\r\n") {
			t.Fatalf("%q: not a one-line event: %q", tt.message, ev)
		}
		var got struct {
			Error struct {
				Message string  `json:"message"`
				Type    string  `json:"type"`
				Code    *string `json:"code"`
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(payload), &got); err != nil {
			t.Fatalf("%q: invalid JSON %s: %v", tt.message, payload, err)
		}
		wantMsg := viaEncodingJSON(t, tt.message) // invalid UTF-8 becomes U+FFFD per byte
		if got.Error.Message != wantMsg || got.Error.Type != tt.typ || got.Error.Code == nil || *got.Error.Code != tt.code {
			t.Errorf("round trip of %q gave %+v", tt.message, got.Error)
		}
		e, ok := parseChatError([]byte(payload))
		if !ok || e.Message != wantMsg {
			t.Errorf("ParseInbandError of our own event = %+v, %v", e, ok)
		}
		evt := sse.Event{Data: []byte(payload), HasData: true}
		if evt.Kind() != sse.KindError {
			t.Errorf("our own error event is %v, want error", evt.Kind())
		}
	}
}

func viaEncodingJSON(t *testing.T, s string) string {
	t.Helper()
	b, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	var out string
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

var benchChunk = []byte(`{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1718000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":" the quick brown fox"},"logprobs":null,"finish_reason":null}],"usage":null}`)

func BenchmarkInspectChatChunk(b *testing.B) {
	b.SetBytes(int64(len(benchChunk)))
	b.ReportAllocs()
	for b.Loop() {
		_ = inspectChunk(benchChunk)
	}
}

var benchUsageChunk = []byte(`{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1718000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[],"usage":{"prompt_tokens":1234,"total_tokens":1500,"completion_tokens":266}}`)

// BenchmarkInspectUsageChunk measures the final usage chunk of a stream.
func BenchmarkInspectChatUsageChunk(b *testing.B) {
	b.SetBytes(int64(len(benchUsageChunk)))
	b.ReportAllocs()
	for b.Loop() {
		if inspectChunk(benchUsageChunk).completionTokens != 266 {
			b.Fatal("usage not read")
		}
	}
}

// TestChunkGenerated: a chunk that carries only a role and empty content
// (vLLM's first chunk) is not generated; content, tool calls, reasoning,
// a legacy text or a finish_reason are.
func TestChatChunkGenerated(t *testing.T) {
	for data, want := range map[string]bool{
		`{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`: false,
		`{"choices":[{"index":0,"delta":{"role":"assistant","content":null,"tool_calls":[]}}]}`:                    false,
		`{"choices":[{"index":0,"delta":{}}]}`:                                                                    false,
		`{"choices":[{"index":0,"text":"","finish_reason":null}]}`:                                                false,
		`{"choices":[],"usage":{"prompt_tokens":1}}`:                                                              false,
		`{"choices":[{"index":0,"delta":{"content":"Hi"}}]}`:                                                      true,
		`{"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"}}]}`:                                   true,
		`{"choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}`:                                            true,
		`{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","function":{"name":"f"}}]}}]}`:    true,
		`{"choices":[{"index":0,"text":" world"}]}`:                                                               true,
		`{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`:                                             true,
		`{"choices":[{"index":0,"delta":{"role":"assistant","content":""}},{"index":1,"delta":{"content":"x"}}]}`: true,
		`{"choices":[{"delta":{"role":"assistant"`:                                                                true,
	} {
		if got := chunkGenerated([]byte(data)); got != want {
			t.Errorf("ChunkGenerated(%s) = %v, want %v", data, got, want)
		}
	}
}
