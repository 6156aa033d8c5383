package api_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/api"
)

// TestEachAPIsOutputLimitAndPromptEstimate: each API's output limit, and
// the prompt estimate over all the text its model reads.
func TestEachAPIsOutputLimitAndPromptEstimate(t *testing.T) {
	tests := []struct {
		name string
		api  api.API
		body string
		want api.Request
	}{
		{"responses string input", api.Responses,
			`{"model":"m","stream":true,"max_output_tokens":256,"input":"abcdefgh","instructions":"abcd"}`,
			api.Request{Model: "m", Stream: true, MaxTokens: 256, MaxTokensSet: true, N: 1, PromptTokens: 3}},
		{"responses items and tools", api.Responses,
			`{"model":"m","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"abcdefgh"},{"type":"input_image","image_url":"data:image/png;base64,AAAAAAAAAAAAAAAA"}]},{"type":"function_call_output","call_id":"call_1","output":"abcd"}],"tools":[{"type":"function","name":"f"}]}`,
			api.Request{Model: "m", N: 1, PromptTokens: (8 + 4 + len(`[{"type":"function","name":"f"}]`) + 3) / 4}},
		{"responses without a limit", api.Responses, `{"model":"m","input":"hi"}`,
			api.Request{Model: "m", N: 1, PromptTokens: 1}},
		{"messages system blocks and tool use", api.Messages,
			`{"model":"claude","max_tokens":1024,"stream":true,"system":[{"type":"text","text":"abcd","cache_control":{"type":"ephemeral"}}],"messages":[{"role":"user","content":"abcdefgh"},{"role":"assistant","content":[{"type":"tool_use","id":"toolu_1","name":"f","input":{"q":"abc"}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"abcd"},{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AAAAAAAAAAAAAAAAAAAA"}}]}]}`,
			api.Request{Model: "claude", Stream: true, MaxTokens: 1024, MaxTokensSet: true, N: 1, PromptTokens: (4 + 8 + 1 + 3 + 4 + 3) / 4}},
		{"messages string system", api.Messages, `{"model":"c","max_tokens":0,"system":"abcdefgh","messages":[]}`,
			api.Request{Model: "c", MaxTokensSet: true, N: 1, PromptTokens: 2}},
		{"chat counts tools", api.Chat, `{"model":"m","messages":[{"role":"user","content":"abcd"}],"tools":[{"a":1}]}`,
			api.Request{Model: "m", N: 1, PromptTokens: (4 + len(`[{"a":1}]`) + 3) / 4}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.api.ParseRequest([]byte(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			got.Layout = nil
			if got != tt.want {
				t.Fatalf("got %+v\nwant %+v", got, tt.want)
			}
		})
	}
	for _, bad := range []string{`[1]`, `{"max_output_tokens":-1}`, `{"max_output_tokens":1.5}`, `{"model":3}`,
		`{"stream":"yes"}`, `{"model":"a","MODEL":"b"}`, `{`} {
		if _, err := api.Responses.ParseRequest([]byte(bad)); err == nil {
			t.Errorf("Responses accepted %s", bad)
		}
	}
	if _, err := api.Messages.ParseRequest([]byte(`{"max_tokens":"many"}`)); err == nil {
		t.Error("Messages accepted a string max_tokens")
	}
}

// TestMessagesRepeatedThinkingIsRefused: the ladder rewrites "thinking"
// when it clamps max_tokens, so a body that repeats it (a server may read
// the other copy) is refused as ambiguous, like the other fields read.
func TestMessagesRepeatedThinkingIsRefused(t *testing.T) {
	for _, body := range []string{
		`{"max_tokens":9000,"thinking":{"type":"disabled"},"thinking":{"type":"enabled","budget_tokens":8000}}`,
		`{"max_tokens":9000,"Thinking":{"type":"enabled","budget_tokens":8000}}`,
	} {
		if _, err := api.Messages.ParseRequest([]byte(body)); err == nil {
			t.Fatalf("%s accepted", body)
		}
	}
	if _, err := api.Messages.ParseRequest([]byte(`{"max_tokens":9000,"thinking":{"type":"enabled","budget_tokens":8000}}`)); err != nil {
		t.Fatal(err)
	}
}

// TestMessagesDocumentTextIsInThePromptEstimate: a Messages document block
// whose source is plain text (source.type "text", its "data") or content
// blocks (source.type "content") is text the model reads: counted in the
// prompt estimate and yielded for prefix routing, while a base64 PDF's
// data and a URL source count nothing.
func TestMessagesDocumentTextIsInThePromptEstimate(t *testing.T) {
	text := strings.Repeat("x", 4000)
	for _, tc := range []struct {
		name, block string
		chars       int
		segments    []string
	}{
		{"text source", `{"type":"document","source":{"type":"text","media_type":"text/plain","data":"` + text + `"},"title":"abcd"}`,
			4 + 4000, []string{text, "abcd"}},
		{"content source", `{"type":"document","source":{"type":"content","content":[{"type":"text","text":"` + text + `"},{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AAAA"}}]}}`,
			4000, []string{text}},
		{"content source string", `{"type":"document","source":{"type":"content","content":"` + text + `"}}`,
			4000, []string{text}},
		{"base64 pdf", `{"type":"document","source":{"type":"base64","media_type":"application/pdf","data":"` + text + `"}}`,
			0, nil},
		{"url", `{"type":"document","source":{"type":"url","url":"https://example.com/a.pdf"}}`, 0, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := `{"model":"c","max_tokens":10,"messages":[{"role":"user","content":[{"type":"text","text":"abcd"},` + tc.block + `]}]}`
			req, err := api.Messages.ParseRequest([]byte(body))
			if err != nil {
				t.Fatal(err)
			}
			if want := (4 + tc.chars + 3) / 4; req.PromptTokens != want {
				t.Fatalf("prompt estimate %d, want %d", req.PromptTokens, want)
			}
			var got []string
			req.PromptText([]byte(body), func(s string) bool { got = append(got, s); return true })
			if want := append([]string{"abcd"}, tc.segments...); !slices.Equal(got, want) {
				t.Fatalf("prompt segments %d %.20q, want %d", len(got), got, len(want))
			}
		})
	}
}
