package api_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/api"
)

// Transcripts written from the servers' own code, as a reviewer read it:
// vLLM's vllm/entrypoints/openai/responses/streaming_events.py
// (emit_reasoning_delta_events) and the Anthropic SDK's message
// accumulator (src/anthropic/lib/streaming/_messages.py), which updates
// each usage field of a message_delta only when it is not null.

// vllmReasoning is how vLLM streams a reasoning model's answer on
// /v1/responses: the reasoning item and its empty reasoning_text part are
// announced (response.reasoning_part.added, vLLM's own event) before the
// first reasoning delta.
const vllmReasoning = `event: response.created
data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_r","status":"in_progress","output":[]}}

event: response.in_progress
data: {"type":"response.in_progress","sequence_number":1,"response":{"id":"resp_r","status":"in_progress","output":[]}}

event: response.output_item.added
data: {"type":"response.output_item.added","sequence_number":2,"output_index":0,"item":{"id":"msg_1","type":"reasoning","summary":[],"status":"in_progress"}}

event: response.reasoning_part.added
data: {"type":"response.reasoning_part.added","sequence_number":3,"output_index":0,"item_id":"msg_1","content_index":0,"part":{"text":"","type":"reasoning_text"}}

event: response.reasoning_text.delta
data: {"type":"response.reasoning_text.delta","sequence_number":4,"item_id":"msg_1","output_index":0,"content_index":0,"delta":"Let"}

`

// TestVLLMReasoningPartIsLifecycle: vLLM's response.reasoning_part.added
// carries an empty part, nothing generated: it is held like
// response.content_part.added, and the first reasoning delta commits.
func TestVLLMReasoningPartIsLifecycle(t *testing.T) {
	classes, _ := replay(t, api.Responses, vllmReasoning)
	if want := []api.Class{L, L, L, L, G}; !equalClasses(classes, want) {
		t.Fatalf("classes = %v, want %v", classes, want)
	}
}

// TestMessageDeltaUsageUpdatesOnlyTheFieldsItCarries: a message_delta
// that repeats input_tokens but not the cache counts keeps message_start's
// cache tokens, as the Anthropic SDK's accumulator does (each field of
// MessageDeltaUsage is updated only when present and not null).
func TestMessageDeltaUsageUpdatesOnlyTheFieldsItCarries(t *testing.T) {
	tr := `event: message_start
data: {"type":"message_start","message":{"usage":{"input_tokens":100,"cache_creation_input_tokens":30,"cache_read_input_tokens":20,"output_tokens":1}}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a"}}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"input_tokens":100,"cache_read_input_tokens":null,"output_tokens":12}}

event: message_stop
data: {"type":"message_stop"}

`
	_, st := replay(t, api.Messages, tr)
	want := api.Usage{PromptTokens: 150, CompletionTokens: 12, Reported: true}
	if st.Usage != want {
		t.Fatalf("usage %+v, want %+v", st.Usage, want)
	}
}

// TestMessageStartAloneIsNotTheStreamsUsage: message_start's usage counts
// the prompt but not the output (output_tokens 0 or 1): a stream that
// ends before its message_delta (cut, or the client gone) has not
// reported what it generated, so its usage is not Reported and the
// tenant is settled with an estimate of the events relayed. The prompt
// count message_start gave is kept.
func TestMessageStartAloneIsNotTheStreamsUsage(t *testing.T) {
	tr := `event: message_start
data: {"type":"message_start","message":{"usage":{"input_tokens":100,"cache_read_input_tokens":20,"output_tokens":1}}}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a"}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"b"}}

`
	_, st := replay(t, api.Messages, tr)
	if st.Usage.Reported || st.Usage.PromptTokens != 120 || st.Finished {
		t.Fatalf("usage %+v finished %v: want the prompt count of message_start, not Reported", st.Usage, st.Finished)
	}
}

// TestDoneInResponsesAndMessagesStreamsEndsThem: a [DONE] in a Responses
// or Messages stream (servers that end every stream with it) carries
// nothing generated: it ends the stream, and finishes it only when the
// API's own end came first (a [DONE] before response.completed, or
// instead of message_stop, is a cut). Responses events without event:
// lines and without sequence_number (data-only servers) are read by their
// type, and the terminal error event is numbered by the events counted.
func TestDoneInResponsesAndMessagesStreamsEndsThem(t *testing.T) {
	created := `data: {"type":"response.created","response":{"id":"resp_d","status":"in_progress"}}` + "\n\n"
	delta := `data: {"type":"response.output_text.delta","delta":"Hi"}` + "\n\n"
	done := "data: [DONE]\n\n"
	classes, st := replay(t, api.Responses, created+done)
	if want := []api.Class{L, E}; !equalClasses(classes, want) || st.Finished {
		t.Fatalf("responses lifecycle then [DONE]: classes %v finished %v, want %v unfinished", classes, st.Finished, want)
	}
	classes, st = replay(t, api.Responses, created+delta+done)
	if want := []api.Class{L, G, E}; !equalClasses(classes, want) || st.Finished {
		t.Fatalf("responses cut by [DONE]: classes %v finished %v, want %v unfinished", classes, st.Finished, want)
	}
	if got, want := string(api.Responses.AppendStreamError(nil, &st, api.Error{Status: 502, Code: "c", Message: "m"})),
		"event: error\n"+`data: {"type":"error","code":"c","message":"m","param":null,"sequence_number":2}`+"\n\n"; got != want {
		t.Fatalf("terminal event %q, want %q", got, want)
	}
	start := `data: {"type":"message_start","message":{"usage":{"input_tokens":3,"output_tokens":1}}}` + "\n\n"
	classes, st = replay(t, api.Messages, start+done)
	if want := []api.Class{L, E}; !equalClasses(classes, want) || st.Finished {
		t.Fatalf("messages lifecycle then [DONE]: classes %v finished %v, want %v unfinished", classes, st.Finished, want)
	}
}

// TestResponseFailedCodesAreClassed: every code OpenAI documents for a
// Responses error (openai-node's ResponseError.code) gets the class of
// what it means: server_error and vector_store_timeout are the server's
// (5xx-like: failed over, an upstream failure), rate_limit_exceeded is a
// 429, and the rest describe the request (its prompt, its images, a
// policy): 4xx-like, the tenant's fault, never retried on another
// upstream nor counted against a healthy one.
func TestResponseFailedCodesAreClassed(t *testing.T) {
	for code, want := range map[string]int{
		"server_error": 500, "vector_store_timeout": 500, "rate_limit_exceeded": 429,
		"invalid_prompt": 400, "data_residency_mismatch": 400, "bio_policy": 400,
		"invalid_image": 400, "invalid_image_format": 400, "invalid_base64_image": 400,
		"invalid_image_url": 400, "image_too_large": 400, "image_too_small": 400,
		"image_parse_error": 400, "image_content_policy_violation": 400, "invalid_image_mode": 400,
		"image_file_too_large": 400, "unsupported_image_media_type": 400, "empty_image_file": 400,
		"failed_to_download_image": 400, "image_file_not_found": 400,
	} {
		tr := "event: response.failed\n" + `data: {"type":"response.failed","sequence_number":1,"response":{"status":"failed","error":{"code":"` + code + `","message":"m"}}}` + "\n\n"
		classes, st := replay(t, api.Responses, tr)
		if len(classes) != 1 || classes[0] != X || st.Err.Status != want {
			t.Errorf("%s: classes %v status %d, want %d", code, classes, st.Err.Status, want)
		}
	}
}

// TestOtherMessagesPathsAreAnthropicShaped: /v1/messages/count_tokens is
// "none" (no stream semantics) but its gateway errors are Anthropic's;
// other paths, OpenAI's Assistants messages included, are not.
func TestOtherMessagesPathsAreAnthropicShaped(t *testing.T) {
	for path, want := range map[string]bool{
		"/v1/messages": true, "/anthropic/v1/messages/count_tokens": true, "/v1/messages/batches/b_1": true,
		"/v1/threads/t_1/messages/m_1": false, "/v1/embeddings": false, "/v1/responses": false,
	} {
		a := api.ForPath(path)
		if got := api.AnthropicShaped(a); got != want {
			t.Errorf("%s (%s): AnthropicShaped %v, want %v", path, a.Name(), got, want)
		}
		body := string(a.AppendErrorBody(nil, api.Error{Status: 503, Message: "m"}))
		if anthropic := body == `{"type":"error","error":{"type":"overloaded_error","message":"m"}}`; anthropic != want {
			t.Errorf("%s: error body %s", path, body)
		}
	}
	if api.ForPath("/v1/messages/count_tokens").Name() != "none" {
		t.Error("count_tokens has stream semantics")
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

// TestOpenAIMessagesListsAreNotAnthropicMessages: OpenAI's Assistants
// (/v1/threads/{id}/messages) and stored completions
// (/v1/chat/completions/{id}/messages) end in /messages too, but are
// OpenAI's JSON lists: no stream semantics and OpenAI's error shape.
func TestOpenAIMessagesListsAreNotAnthropicMessages(t *testing.T) {
	for _, tc := range []struct {
		path, want string
		anthropic  bool
	}{
		{"/v1/threads/thread_abc123/messages", "none", false},
		{"/v1/threads/thread_abc123/messages/", "none", false},
		{"/openai/v1/threads/thread_abc123/messages", "none", false},
		{"/v1/chat/completions/chatcmpl-abc123/messages", "none", false},
		{"/v1/completions/cmpl-1/messages", "none", false},
		{"/v1/threads/thread_abc123/messages/msg_1", "none", false},
		{"/v1/messages", "messages", true},
		{"/anthropic/v1/messages", "messages", true},
		{"/v1/threads/messages", "messages", true},
		{"/v1/messages/count_tokens", "none", true},
	} {
		a := api.ForPath(tc.path)
		if a.Name() != tc.want || api.AnthropicShaped(a) != tc.anthropic {
			t.Errorf("ForPath(%q) = %s (Anthropic-shaped %v), want %s (%v)", tc.path, a.Name(), api.AnthropicShaped(a), tc.want, tc.anthropic)
		}
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
			api.PromptText(api.Messages, []byte(body), func(s string) bool { got = append(got, s); return true })
			if want := append([]string{"abcd"}, tc.segments...); !slices.Equal(got, want) {
				t.Fatalf("prompt segments %d %.20q, want %d", len(got), got, len(want))
			}
		})
	}
}
