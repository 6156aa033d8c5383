package api_test

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/api"
	"github.com/llmproxy/caddy-llm-proxy/sse"
)

// replay inspects every event of a transcript with a, as the relay does,
// and returns the classes in order and the final state.
func replay(t testing.TB, a api.API, transcript string) ([]api.Class, api.Stream) {
	t.Helper()
	var st api.Stream
	var classes []api.Class
	sc := sse.NewScanner(strings.NewReader(transcript), 0)
	for {
		ev, err := sc.Next()
		if errors.Is(err, io.EOF) {
			return classes, st
		}
		if err != nil {
			t.Fatalf("transcript: %v", err)
		}
		classes = append(classes, a.Inspect(&st, ev))
	}
}

func readTranscript(t testing.TB, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "transcripts", name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

const (
	L = api.Lifecycle
	G = api.Generated
	E = api.End
	X = api.ErrorEvent
	U = api.UsageOnly
)

// TestServerTranscriptsAreClassedFinishedAndSettled replays each API's
// transcripts (written from OpenAI's and Anthropic's streaming references
// and vLLM's serving code) and checks what the gateway learns from each: which events are held until commit
// (lifecycle) and which commits, whether the stream finished normally, the
// in-band error's class, and the usage that settles the tenant.
func TestServerTranscriptsAreClassedFinishedAndSettled(t *testing.T) {
	tests := []struct {
		file     string
		api      api.API
		classes  []api.Class
		finished bool
		usage    api.Usage
		status   int // the in-band error's status, 0 for none
	}{
		{"chat_vllm_complete.sse", api.Chat, []api.Class{L, G, G, U, E}, true,
			api.Usage{PromptTokens: 9, CompletionTokens: 2, Reported: true}, 0},
		{"chat_role_then_error.sse", api.Chat, []api.Class{L, L, X}, false, api.Usage{}, 503},
		{"completions_complete.sse", api.Completions, []api.Class{L, G, G, E}, true,
			api.Usage{PromptTokens: 3, CompletionTokens: 1, Reported: true}, 0},
		{"responses_complete.sse", api.Responses, []api.Class{L, L, L, L, G, G, G, G, G, E}, true,
			api.Usage{PromptTokens: 37, CompletionTokens: 11, Reported: true}, 0},
		{"responses_incomplete.sse", api.Responses, []api.Class{L, L, G, E}, true,
			api.Usage{PromptTokens: 12, CompletionTokens: 16, Reported: true}, 0},
		{"responses_function_call.sse", api.Responses, []api.Class{L, L, G, G, G, G, E}, true,
			api.Usage{PromptTokens: 80, CompletionTokens: 9, Reported: true}, 0},
		{"responses_lifecycle_error.sse", api.Responses, []api.Class{L, L, X}, false, api.Usage{}, 500},
		{"responses_failed.sse", api.Responses, []api.Class{L, X}, false, api.Usage{}, 400},
		{"responses_rate_limited.sse", api.Responses, []api.Class{L, X}, false, api.Usage{}, 429},
		{"responses_cut.sse", api.Responses, []api.Class{L, G, G}, false, api.Usage{}, 0},
		{"messages_complete.sse", api.Messages, []api.Class{L, L, L, G, G, G, G, G, E}, true,
			api.Usage{PromptTokens: 30, CompletionTokens: 15, Reported: true}, 0},
		{"messages_tool_use.sse", api.Messages, []api.Class{L, G, G, G, G, E}, true,
			api.Usage{PromptTokens: 472, CompletionTokens: 89, Reported: true}, 0},
		{"messages_thinking_max_tokens.sse", api.Messages, []api.Class{L, L, G, G, G, G, E}, true,
			api.Usage{PromptTokens: 10, CompletionTokens: 32, Reported: true}, 0},
		{"messages_lifecycle_overloaded.sse", api.Messages, []api.Class{L, L, X}, false,
			api.Usage{PromptTokens: 10, CompletionTokens: 1}, 529},
		{"messages_invalid_request.sse", api.Messages, []api.Class{L, X}, false,
			api.Usage{PromptTokens: 10, CompletionTokens: 1}, 400},
		{"messages_stop_without_stop_reason.sse", api.Messages, []api.Class{L, L, G, E}, false,
			api.Usage{PromptTokens: 4, CompletionTokens: 1}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			classes, st := replay(t, tt.api, readTranscript(t, tt.file))
			if !equalClasses(classes, tt.classes) {
				t.Errorf("classes = %v, want %v", classes, tt.classes)
			}
			if st.Finished != tt.finished {
				t.Errorf("Finished = %v, want %v", st.Finished, tt.finished)
			}
			if st.Usage != tt.usage {
				t.Errorf("Usage = %+v, want %+v", st.Usage, tt.usage)
			}
			if st.Err.Status != tt.status {
				t.Errorf("in-band error status = %d (%+v), want %d", st.Err.Status, st.Err, tt.status)
			}
		})
	}
}

func equalClasses(a, b []api.Class) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestMessagesUsageKeepsTheLastCumulativeDelta: message_delta's
// output_tokens is cumulative; three deltas of 5, 9 and 12 are 12, never
// 26, and the input counts of message_start stay when a delta repeats
// none.
func TestMessagesUsageKeepsTheLastCumulativeDelta(t *testing.T) {
	tr := `event: message_start
data: {"type":"message_start","message":{"usage":{"input_tokens":100,"cache_read_input_tokens":20,"output_tokens":1}}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a"}}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":null},"usage":{"output_tokens":5}}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":null},"usage":{"output_tokens":9}}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":12}}

event: message_stop
data: {"type":"message_stop"}

`
	_, st := replay(t, api.Messages, tr)
	want := api.Usage{PromptTokens: 120, CompletionTokens: 12, Reported: true}
	if st.Usage != want || !st.Finished {
		t.Fatalf("usage %+v finished %v, want %+v finished", st.Usage, st.Finished, want)
	}
}

// TestEventsWithoutNamesAreClassedByTheirType: a server that sends only
// data lines is read by the data's "type".
func TestEventsWithoutNamesAreClassedByTheirType(t *testing.T) {
	var b strings.Builder
	for _, line := range strings.Split(readTranscript(t, "messages_complete.sse"), "\n") {
		if !strings.HasPrefix(line, "event:") {
			b.WriteString(line + "\n")
		}
	}
	classes, st := replay(t, api.Messages, b.String())
	if want := []api.Class{L, L, L, G, G, G, G, G, E}; !equalClasses(classes, want) || !st.Finished {
		t.Fatalf("classes = %v finished %v, want %v finished", classes, st.Finished, want)
	}
}

// TestCommittedStreamEndsWithItsOwnAPIsErrorEvent: after commit a failed
// stream ends with the client's own API's error event.
func TestCommittedStreamEndsWithItsOwnAPIsErrorEvent(t *testing.T) {
	cut := api.Error{Status: 502, Type: "server_error", Code: "upstream_stream_truncated", Message: "upstream stream ended before completion"}
	_, rst := replay(t, api.Responses, readTranscript(t, "responses_cut.sse"))
	tests := []struct {
		name string
		api  api.API
		st   api.Stream
		e    api.Error
		want string
	}{
		{"chat", api.Chat, api.Stream{}, cut,
			`data: {"error":{"message":"upstream stream ended before completion","type":"server_error","code":"upstream_stream_truncated"}}` + "\n\n"},
		{"responses numbers the next event", api.Responses, rst, cut,
			"event: error\n" + `data: {"type":"error","code":"upstream_stream_truncated","message":"upstream stream ended before completion","param":null,"sequence_number":3}` + "\n\n"},
		{"messages api_error", api.Messages, api.Stream{}, cut,
			"event: error\n" + `data: {"type":"error","error":{"type":"api_error","message":"upstream stream ended before completion"}}` + "\n\n"},
		{"messages overloaded", api.Messages, api.Stream{}, api.Error{Status: 503, Message: "no upstream"},
			"event: error\n" + `data: {"type":"error","error":{"type":"overloaded_error","message":"no upstream"}}` + "\n\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := string(tt.api.AppendStreamError(nil, &tt.st, tt.e))
			if got != tt.want {
				t.Fatalf("got  %q\nwant %q", got, tt.want)
			}
			// The event is one well-formed SSE event with JSON data.
			ev, err := sse.NewScanner(strings.NewReader(got), 0).Next()
			if err != nil || !json.Valid(ev.Data) {
				t.Fatalf("not one SSE event with JSON data: %v %q", err, ev.Data)
			}
		})
	}
}

// TestGatewayErrorBodyIsAnthropicsOnMessagesAndOpenAIsElsewhere: before
// commit the gateway's own error body is Anthropic's on Messages (its type
// from the status) and OpenAI's on every other API.
func TestGatewayErrorBodyIsAnthropicsOnMessagesAndOpenAIsElsewhere(t *testing.T) {
	for _, tt := range []struct {
		status int
		typ    string
	}{
		{503, "overloaded_error"}, {529, "overloaded_error"}, {429, "rate_limit_error"},
		{401, "authentication_error"}, {400, "invalid_request_error"}, {413, "invalid_request_error"},
		{502, "api_error"}, {504, "api_error"}, {500, "api_error"},
	} {
		body := api.Messages.AppendErrorBody(nil, api.Error{Status: tt.status, Type: "server_error", Code: "x", Message: "m \"q\""})
		var got struct {
			Type  string
			Error struct{ Type, Message string }
		}
		if err := json.Unmarshal(body, &got); err != nil {
			t.Fatalf("%d: %v: %s", tt.status, err, body)
		}
		if got.Type != "error" || got.Error.Type != tt.typ || got.Error.Message != `m "q"` {
			t.Errorf("%d: %s, want type %s", tt.status, body, tt.typ)
		}
	}
	for _, a := range []api.API{api.Chat, api.Completions, api.Responses, api.None} {
		body := a.AppendErrorBody(nil, api.Error{Status: 503, Type: "server_error", Code: "no_upstream", Message: "m"})
		if want := `{"error":{"message":"m","type":"server_error","code":"no_upstream"}}`; string(body) != want {
			t.Errorf("%s: %s, want %s", a.Name(), body, want)
		}
	}
}

// TestAPIIsChosenByPathSuffixOrName: ForPath picks the API by the path's
// suffix, ByName by its name ("auto" is no API).
func TestAPIIsChosenByPathSuffixOrName(t *testing.T) {
	for path, want := range map[string]string{
		"/v1/chat/completions":        "chat",
		"/openai/v1/chat/completions": "chat",
		"/v1/completions":             "completions",
		"/v1/responses":               "responses",
		"/openai/v1/responses/":       "responses",
		"/v1/messages":                "messages",
		"/anthropic/v1/messages":      "messages",
		"/v1/messages/count_tokens":   "none",
		"/v1/embeddings":              "none",
		"/v1/audio/transcriptions":    "none",
		"/v1/responses/resp_1":        "none",
		"/":                           "none",
	} {
		if got := api.ForPath(path).Name(); got != want {
			t.Errorf("ForPath(%q) = %s, want %s", path, got, want)
		}
	}
	for _, n := range []string{"chat", "completions", "responses", "messages", "none"} {
		if a, ok := api.ByName(n); !ok || a.Name() != n {
			t.Errorf("ByName(%q) = %v, %v", n, a, ok)
		}
	}
	if _, ok := api.ByName("auto"); ok {
		t.Error(`ByName("auto") is a choice by path, not an API`)
	}
}

// TestJSONBodyUsageIsReadInEachAPIsShape: a non-streaming answer's usage
// is read where each API puts it; a body without one reports none.
func TestJSONBodyUsageIsReadInEachAPIsShape(t *testing.T) {
	for _, tt := range []struct {
		api  api.API
		body string
		want api.Usage
	}{
		{api.Chat, `{"choices":[{"message":{"content":"x"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":2}}`, api.Usage{PromptTokens: 5, CompletionTokens: 2, Reported: true}},
		{api.Responses, `{"id":"resp_1","object":"response","status":"completed","output":[],"usage":{"input_tokens":7,"output_tokens":3,"total_tokens":10}}`, api.Usage{PromptTokens: 7, CompletionTokens: 3, Reported: true}},
		{api.Messages, `{"id":"msg_1","type":"message","content":[{"type":"text","text":"x"}],"stop_reason":"end_turn","usage":{"input_tokens":7,"cache_read_input_tokens":1,"output_tokens":3}}`, api.Usage{PromptTokens: 8, CompletionTokens: 3, Reported: true}},
		{api.Messages, `{"input_tokens":12}`, api.Usage{}},
		{api.None, `{"object":"list","data":[],"usage":{"prompt_tokens":5,"total_tokens":5}}`, api.Usage{PromptTokens: 5, Reported: true}},
		{api.None, `{"input_tokens":12}`, api.Usage{}},
	} {
		if got := tt.api.InspectBody([]byte(tt.body)); got != tt.want {
			t.Errorf("%s %s: %+v, want %+v", tt.api.Name(), tt.body, got, tt.want)
		}
	}
}

// TestInspectDoesNotAllocate: the per-event hot path of every API (a
// delta, the usage and end events) allocates nothing.
func TestInspectDoesNotAllocate(t *testing.T) {
	for _, tt := range []struct {
		api  api.API
		file string
	}{
		{api.Chat, "chat_vllm_complete.sse"},
		{api.Completions, "completions_complete.sse"},
		{api.Responses, "responses_complete.sse"},
		{api.Responses, "responses_function_call.sse"},
		{api.Messages, "messages_complete.sse"},
		{api.Messages, "messages_tool_use.sse"},
	} {
		var events []sse.Event
		sc := sse.NewScanner(strings.NewReader(readTranscript(t, tt.file)), 0)
		for {
			ev, err := sc.Next()
			if err != nil {
				break
			}
			c := ev
			c.Raw, c.Data, c.Name = append([]byte(nil), ev.Raw...), append([]byte(nil), ev.Data...), append([]byte(nil), ev.Name...)
			if ev.Name == nil {
				c.Name = nil
			}
			events = append(events, c)
		}
		for i := range events {
			ev := &events[i]
			var st api.Stream
			if n := testing.AllocsPerRun(200, func() { tt.api.Inspect(&st, *ev) }); n != 0 {
				t.Errorf("%s %s event %d: %v allocs, want 0", tt.api.Name(), tt.file, i, n)
			}
			st = api.Stream{Generated: true}
			if n := testing.AllocsPerRun(200, func() { tt.api.Inspect(&st, *ev) }); n != 0 {
				t.Errorf("%s %s event %d after commit: %v allocs, want 0", tt.api.Name(), tt.file, i, n)
			}
		}
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
