package sse_test

import (
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/sse"
)

// TestKindTellsCommentsDoneErrorsAndDataApart: an event without data is a
// comment, [DONE] the end marker, a top-level error (any shape) an error,
// anything else data, malformed JSON included.
func TestKindTellsCommentsDoneErrorsAndDataApart(t *testing.T) {
	tests := []struct {
		name   string
		data   string
		noData bool
		want   sse.Kind
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
		})
	}
}

// Kind allocates nothing, whatever the data holds.
func TestKindDoesNotAllocate(t *testing.T) {
	for _, c := range []string{
		`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1718000000,"model":"llama","choices":[{"index":0,"delta":{"content":" Hello \"q\" \u00e9"},"logprobs":null,"finish_reason":null}],"usage":null}`,
		`{"\u0065rror":{"message":"m"}}`,
	} {
		ev := sse.Event{Data: []byte(c), HasData: true}
		if allocs := testing.AllocsPerRun(1000, func() { _ = ev.Kind() }); allocs != 0 {
			t.Errorf("%s: %v allocs, want 0", c, allocs)
		}
	}
}

var benchChunk = []byte(`{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1718000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":" the quick brown fox"},"logprobs":null,"finish_reason":null}],"usage":null}`)

func BenchmarkKind(b *testing.B) {
	ev := sse.Event{Data: benchChunk, HasData: true}
	b.ReportAllocs()
	for b.Loop() {
		_ = ev.Kind()
	}
}
