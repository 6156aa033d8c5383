package sse_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/sse"
)

func TestKind(t *testing.T) {
	tests := []struct {
		name    string
		data    string
		noData  bool
		want    sse.Kind
		wantErr bool // ParseInbandError must agree with KindError
	}{
		{name: "no data lines is a comment", noData: true, want: sse.KindComment},
		{name: "openai chunk", data: `{"choices":[{"delta":{"content":"hi"}}]}`, want: sse.KindData},
		{name: "done", data: "[DONE]", want: sse.KindDone},
		{name: "done with whitespace", data: " \t[DONE]\n", want: sse.KindDone},
		{name: "done lowercase is data", data: "[done]", want: sse.KindData},
		{name: "empty data", data: "", want: sse.KindData},
		{name: "openai error", data: `{"error":{"message":"m","type":"server_error","code":null}}`, want: sse.KindError},
		{name: "vllm nested error", data: `{"error":{"object":"error","message":"m","type":"BadRequestError","param":null,"code":400}}`, want: sse.KindError},
		{name: "vllm top-level error", data: `{"object":"error","message":"m","type":"InternalServerError","param":null,"code":500}`, want: sse.KindError},
		{name: "tgi string error", data: `{"error":"Input validation error","error_type":"validation"}`, want: sse.KindError},
		{name: "error key with whitespace", data: " { \"error\" :\n {\"message\":\"m\"} }", want: sse.KindError},
		{name: "escaped error key", data: `{"\u0065rror":{"message":"m"}}`, want: sse.KindError},
		{name: "null error is data", data: `{"error":null,"choices":[]}`, want: sse.KindData},
		{name: "error inside content is data", data: `{"choices":[{"delta":{"content":"{\"error\":{\"message\":\"x\"}}"}}]}`, want: sse.KindData},
		{name: "nested error key is data", data: `{"choices":[{"error":{"message":"x"}}]}`, want: sse.KindData},
		{name: "chunk object is data", data: `{"object":"chat.completion.chunk","choices":[]}`, want: sse.KindData},
		{name: "last duplicate key wins", data: `{"error":{"message":"m"},"error":null}`, want: sse.KindData},
		{name: "truncated error is data", data: `{"error":{"message":"m"`, want: sse.KindData},
		{name: "array is data", data: `[{"error":{}}]`, want: sse.KindData},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ev := sse.Event{HasData: !tt.noData}
			if !tt.noData {
				ev.Data = []byte(tt.data)
			}
			if got := ev.Kind(); got != tt.want {
				t.Errorf("Kind() = %v, want %v", got, tt.want)
			}
			if _, ok := sse.ParseInbandError(ev.Data); ok != (tt.want == sse.KindError) {
				t.Errorf("ParseInbandError ok = %v, disagrees with Kind %v", ok, tt.want)
			}
		})
	}
}

func TestInspectChunk(t *testing.T) {
	tests := []struct {
		name string
		data string
		want sse.ChunkInfo
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
			want: sse.ChunkInfo{FinishReason: true},
		},
		{
			name: "final chunk with length",
			data: `{"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"."},"finish_reason":"length"}]}`,
			want: sse.ChunkInfo{FinishReason: true},
		},
		{
			name: "tool_calls on the second choice",
			data: `{"choices":[{"index":0,"delta":{},"finish_reason":null},{"index":1,"delta":{},"finish_reason":"tool_calls"}]}`,
			want: sse.ChunkInfo{FinishReason: true},
		},
		{
			name: "usage chunk with empty choices",
			data: `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1718000000,"model":"llama","choices":[],"usage":{"prompt_tokens":12,"total_tokens":40,"completion_tokens":28}}`,
			want: sse.ChunkInfo{UsageOnly: true, Usage: true, PromptTokens: 12, CompletionTokens: 28},
		},
		{
			name: "openai include_usage chunk with usage null",
			data: `{"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}],"usage":null}`,
		},
		{
			name: "finish and usage together",
			data: `{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}`,
			want: sse.ChunkInfo{FinishReason: true, Usage: true, PromptTokens: 1, CompletionTokens: 2},
		},
		{
			name: "field names inside content do not count",
			data: `{"choices":[{"index":0,"delta":{"content":"\"finish_reason\":\"stop\", \"usage\":{\"prompt_tokens\":1}"},"finish_reason":null}],"usage":null}`,
		},
		{
			name: "content ending in an escaped backslash",
			data: `{"choices":[{"delta":{"content":"C:\\"},"finish_reason":"stop"}]}`,
			want: sse.ChunkInfo{FinishReason: true},
		},
		{
			name: "content with an escaped quote before the field",
			data: `{"choices":[{"delta":{"content":"say \\\" then \" ,\"finish_reason\":\"stop\"},"finish_reason":null}]}`,
		},
		{
			name: "whitespace around colons and commas",
			data: "{ \"choices\" : [ { \"finish_reason\" :\n\t\"length\" } ] ,\r\n \"usage\" : { } }",
			want: sse.ChunkInfo{FinishReason: true, Usage: true},
		},
		{
			name: "leading whitespace",
			data: "  \n{\"usage\":{}}",
			want: sse.ChunkInfo{UsageOnly: true, Usage: true},
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
			want: sse.ChunkInfo{FinishReason: true, Usage: true, PromptTokens: 9, CompletionTokens: 1},
		},
		{
			name: "last usage wins, null resets the counts",
			data: `{"usage":{"prompt_tokens":3,"completion_tokens":4},"usage":null}`,
		},
		{
			name: "last count key wins",
			data: `{"usage":{"completion_tokens":4,"completion_tokens":7,"prompt_tokens":"5"}}`,
			want: sse.ChunkInfo{UsageOnly: true, Usage: true, CompletionTokens: 7},
		},
		{
			name: "counts that are not plain integers read as 0",
			data: `{"usage":{"prompt_tokens":1.5,"completion_tokens":-2}}`,
			want: sse.ChunkInfo{UsageOnly: true, Usage: true},
		},
		{
			name: "escaped count key",
			data: `{"usage":{"prompt_\u0074okens":8}}`,
			want: sse.ChunkInfo{UsageOnly: true, Usage: true, PromptTokens: 8},
		},
		{
			name: "counts in a nested usage do not count",
			data: `{"choices":[{"usage":{"prompt_tokens":1}}],"x":{"usage":{"completion_tokens":2}}}`,
		},
		{
			name: "unicode content",
			data: `{"choices":[{"delta":{"content":"世界 🙂 \u00e9"},"finish_reason":"stop"}]}`,
			want: sse.ChunkInfo{FinishReason: true},
		},
		{
			name: "usage with choices null or absent is usage-only",
			data: `{"choices":null,"usage":{"prompt_tokens":2,"completion_tokens":3}}`,
			want: sse.ChunkInfo{Usage: true, UsageOnly: true, PromptTokens: 2, CompletionTokens: 3},
		},
		{
			name: "usage on a content chunk (TGI, continuous_usage_stats) is not usage-only",
			data: `{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}],"usage":{"prompt_tokens":2,"completion_tokens":1}}`,
			want: sse.ChunkInfo{Usage: true, PromptTokens: 2, CompletionTokens: 1},
		},
		{
			name: "the last choices counts for usage-only",
			data: `{"choices":[{"delta":{}}],"usage":{},"choices":[]}`,
			want: sse.ChunkInfo{Usage: true, UsageOnly: true},
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
			want: sse.ChunkInfo{UsageOnly: true, Usage: true},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := sse.InspectChunk([]byte(tt.data)); got != tt.want {
				t.Errorf("InspectChunk = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestInspectChunkAndKindDoNotAllocate(t *testing.T) {
	chunks := [][]byte{
		[]byte(`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1718000000,"model":"llama","choices":[{"index":0,"delta":{"content":" Hello \"q\" \u00e9"},"logprobs":null,"finish_reason":null}],"usage":null}`),
		[]byte(`{"choices":[],"usage":{"prompt_tokens":12,"total_tokens":40,"completion_tokens":28}}`),
		[]byte(`{"\u0065rror":{"message":"m"}}`),
	}
	for _, c := range chunks {
		ev := sse.Event{Data: c, HasData: true}
		allocs := testing.AllocsPerRun(1000, func() {
			_ = sse.InspectChunk(c)
			_ = ev.Kind()
		})
		if allocs != 0 {
			t.Errorf("%s: %v allocs, want 0", c, allocs)
		}
	}
}

func TestParseInbandError(t *testing.T) {
	tests := []struct {
		name string
		data string
		want sse.InbandError
	}{
		{
			name: "openai shape with string code",
			data: `{"error":{"message":"The server had an error","type":"server_error","param":null,"code":"server_error"}}`,
			want: sse.InbandError{Message: "The server had an error", Type: "server_error", Code: "server_error", Status: 500},
		},
		{
			name: "openai context length",
			data: `{"error":{"message":"too long","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}`,
			want: sse.InbandError{Message: "too long", Type: "invalid_request_error", Code: "context_length_exceeded", Status: 400},
		},
		{
			name: "openai rate limit with null code",
			data: `{"error":{"message":"slow down","type":"rate_limit_exceeded","code":null}}`,
			want: sse.InbandError{Message: "slow down", Type: "rate_limit_exceeded", Status: 429},
		},
		{
			name: "vllm nested with numeric code",
			data: `{"error":{"object":"error","message":"bad","type":"BadRequestError","param":null,"code":400}}`,
			want: sse.InbandError{Message: "bad", Type: "BadRequestError", Code: "400", Status: 400},
		},
		{
			name: "vllm top-level with numeric code",
			data: `{"object":"error","message":"engine dead","type":"InternalServerError","param":null,"code":500}`,
			want: sse.InbandError{Message: "engine dead", Type: "InternalServerError", Code: "500", Status: 500},
		},
		{
			name: "numeric string code",
			data: `{"error":{"message":"busy","type":"x","code":"503"}}`,
			want: sse.InbandError{Message: "busy", Type: "x", Code: "503", Status: 503},
		},
		{
			name: "numeric code wins over type",
			data: `{"error":{"message":"m","type":"invalid_request_error","code":502}}`,
			want: sse.InbandError{Message: "m", Type: "invalid_request_error", Code: "502", Status: 502},
		},
		{
			name: "numeric code outside 400..599 falls back to type",
			data: `{"error":{"message":"m","type":"BadRequestError","code":200}}`,
			want: sse.InbandError{Message: "m", Type: "BadRequestError", Code: "200", Status: 400},
		},
		{
			name: "too many requests in type",
			data: `{"error":{"message":"m","type":"Too Many Requests"}}`,
			want: sse.InbandError{Message: "m", Type: "Too Many Requests", Status: 429},
		},
		{
			name: "tgi string error",
			data: `{"error":"Input validation error: max_new_tokens too big","error_type":"validation"}`,
			want: sse.InbandError{Message: "Input validation error: max_new_tokens too big", Type: "validation", Status: 400},
		},
		{
			name: "unknown error is 500",
			data: `{"error":{"message":"\u00e9\n"}}`,
			want: sse.InbandError{Message: "é\n", Status: 500},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := sse.ParseInbandError([]byte(tt.data))
			if !ok || got != tt.want {
				t.Errorf("ParseInbandError = %+v, %v; want %+v, true", got, ok, tt.want)
			}
		})
	}
}

func TestParseInbandErrorRejectsNonErrors(t *testing.T) {
	for _, data := range []string{
		``, `[DONE]`, `null`, `[]`, `{}`, `{"error":null}`, `{"error":42}`,
		`{"object":"chat.completion.chunk","choices":[]}`, `{"object":"ERROR"}`,
		`{"error":{"message":"truncated"`,
	} {
		if e, ok := sse.ParseInbandError([]byte(data)); ok {
			t.Errorf("ParseInbandError(%q) = %+v, true; want not an error", data, e)
		}
	}
}

func TestAppendErrorEventIsValidJSON(t *testing.T) {
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
		out := sse.AppendErrorEvent(prefix, tt.message, tt.typ, tt.code)
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
		e, ok := sse.ParseInbandError([]byte(payload))
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

func BenchmarkInspectChunk(b *testing.B) {
	b.SetBytes(int64(len(benchChunk)))
	b.ReportAllocs()
	for b.Loop() {
		_ = sse.InspectChunk(benchChunk)
	}
}

var benchUsageChunk = []byte(`{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1718000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[],"usage":{"prompt_tokens":1234,"total_tokens":1500,"completion_tokens":266}}`)

// BenchmarkInspectUsageChunk measures the final usage chunk of a stream.
func BenchmarkInspectUsageChunk(b *testing.B) {
	b.SetBytes(int64(len(benchUsageChunk)))
	b.ReportAllocs()
	for b.Loop() {
		if sse.InspectChunk(benchUsageChunk).CompletionTokens != 266 {
			b.Fatal("usage not read")
		}
	}
}

func BenchmarkKind(b *testing.B) {
	ev := sse.Event{Data: benchChunk, HasData: true}
	b.ReportAllocs()
	for b.Loop() {
		_ = ev.Kind()
	}
}

// TestChunkGenerated: a chunk that carries only a role and empty content
// (vLLM's first chunk) is not generated; content, tool calls, reasoning,
// a legacy text or a finish_reason are.
func TestChunkGenerated(t *testing.T) {
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
		if got := sse.ChunkGenerated([]byte(data)); got != want {
			t.Errorf("ChunkGenerated(%s) = %v, want %v", data, got, want)
		}
	}
}
