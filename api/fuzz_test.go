package api_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/api"
	"github.com/llmproxy/caddy-llm-proxy/sse"
)

// seedStreams adds every transcript whose name starts with prefix, and a
// few malformed streams, to f's corpus.
func seedStreams(f *testing.F, prefix string) {
	files, _ := filepath.Glob(filepath.Join("testdata", "transcripts", prefix+"*.sse"))
	if len(files) == 0 {
		f.Fatalf("no %s transcripts", prefix)
	}
	for _, p := range files {
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	for _, s := range []string{
		"event: error\ndata: {\"type\":\"error\"}\n\n",
		"event: error\ndata: not json\n\n",
		"data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":-3}}\n\n",
		"event: response.completed\ndata: {\"response\":{\"usage\":{\"input_tokens\":1e9}}}\n\n",
		"data: {\"type\":\"response.created\",\"sequence_number\":99999999999999999999}\n\n",
		"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[]}}]}\n\n",
		"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"\n\n",
		": c\n\ndata: [DONE]\n\n",
	} {
		f.Add([]byte(s))
	}
}

// fuzzInspect: whatever a stream holds, inspecting it never panics, its
// classes keep their promises (an error event describes a 4xx or 5xx, a
// stream is generated once a Generated event was seen, usage is never
// negative), and the terminal error event the gateway would append is one
// SSE event with JSON data.
func fuzzInspect(f *testing.F, a api.API, prefix string) {
	seedStreams(f, prefix)
	f.Fuzz(func(t *testing.T, stream []byte) {
		var st api.Stream
		sc := sse.NewScanner(strings.NewReader(string(stream)), 1<<16)
		for {
			ev, err := sc.Next()
			if err != nil {
				break
			}
			c := a.Inspect(&st, ev)
			switch c {
			case api.ErrorEvent:
				if st.Err.Status < 400 || st.Err.Status > 599 {
					t.Fatalf("error event %q classed %d", ev.Data, st.Err.Status)
				}
			case api.Generated:
				if !st.Generated {
					t.Fatalf("generated event %q left the stream ungenerated", ev.Data)
				}
			case api.Lifecycle:
				if st.Generated && ev.HasData && a != api.Chat && a != api.Completions && !(a == api.Messages && isPing(ev)) {
					t.Fatalf("lifecycle event %q after the first generated one", ev.Data)
				}
			}
			if !ev.HasData && c != api.Lifecycle {
				t.Fatalf("a comment classed %s", c)
			}
			if st.Usage.PromptTokens < 0 || st.Usage.CompletionTokens < 0 {
				t.Fatalf("negative usage %+v", st.Usage)
			}
		}
		out := a.AppendStreamError(nil, &st, api.Error{Status: 502, Type: "server_error", Code: "c\n", Message: string(stream)})
		ev, err := sse.NewScanner(strings.NewReader(string(out)), 0).Next()
		if err != nil || !json.Valid(ev.Data) {
			t.Fatalf("terminal error event %q: %v", out, err)
		}
	})
}

// isPing reports whether ev is a Messages ping (named, or by its data's
// type when it has no name).
func isPing(ev sse.Event) bool {
	if len(ev.Name) > 0 {
		return string(ev.Name) == "ping"
	}
	var v struct {
		Type string `json:"type"`
	}
	return json.Unmarshal(ev.Data, &v) == nil && v.Type == "ping"
}

func FuzzInspectChat(f *testing.F)        { fuzzInspect(f, api.Chat, "chat") }
func FuzzInspectCompletions(f *testing.F) { fuzzInspect(f, api.Completions, "completions") }
func FuzzInspectResponses(f *testing.F)   { fuzzInspect(f, api.Responses, "responses") }
func FuzzInspectMessages(f *testing.F)    { fuzzInspect(f, api.Messages, "messages") }

// fuzzParse: an accepted request is one JSON object, with a non-negative
// output limit and estimate; a refused one is never a panic.
func fuzzParse(f *testing.F, a api.API, seeds ...string) {
	for _, s := range seeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, err := a.ParseRequest(body)
		if err != nil || len(body) == 0 {
			return
		}
		var obj map[string]json.RawMessage
		if json.Unmarshal(body, &obj) != nil || obj == nil {
			t.Fatalf("accepted %q, which is not one JSON object", body)
		}
		if req.MaxTokens < 0 || req.PromptTokens < 0 || req.N != 1 {
			t.Fatalf("%q: %+v", body, req)
		}
		if req.PromptTokens > len(body) {
			t.Fatalf("%q: estimate %d over the body's %d bytes", body, req.PromptTokens, len(body))
		}
	})
}

func FuzzParseResponses(f *testing.F) {
	fuzzParse(f, api.Responses,
		`{"model":"m","stream":true,"max_output_tokens":256,"input":"abcdefgh","instructions":"abcd"}`,
		`{"model":"m","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"x"}]}],"tools":[]}`,
		`{"max_output_tokens":-0}`, `{"max_output_tokens":1e3}`, `{"model":null,"stream":null}`, `[]`, `{"input":[[[[]]]]}`)
}

func FuzzParseMessages(f *testing.F) {
	fuzzParse(f, api.Messages,
		`{"model":"c","max_tokens":1024,"system":[{"type":"text","text":"abcd"}],"messages":[{"role":"user","content":"hi"}]}`,
		`{"max_tokens":99999999999999999999}`, `{"messages":[{"content":[{"type":"tool_result","content":[{"type":"text","text":"\u00e9"}]}]}]}`)
}
