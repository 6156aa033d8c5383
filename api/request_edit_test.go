package api

import (
	"bytes"
	"encoding/json"
	"reflect"
	"slices"
	"testing"
	"unicode/utf8"

	"github.com/llmproxy/caddy-llm-proxy/internal/jsonscan"
)

// promptOf parses body as a's request and returns its PromptText.
func promptOf(a API, body string) []string {
	r, _ := a.ParseRequest([]byte(body))
	return promptIn(&r, []byte(body))
}

func promptIn(r *Request, body []byte) []string {
	var out []string
	r.PromptText(body, func(s string) bool { out = append(out, s); return true })
	return out
}

func TestPromptTextOfEveryAPI(t *testing.T) {
	for _, tc := range []struct {
		name string
		a    API
		body string
		want []string
	}{
		{"chat", Chat, `{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"u"}}]}]}`,
			[]string{"be brief", "hi"}},
		{"chat tools first", Chat, `{"messages":[{"role":"user","content":"q"}],"tools":[{"type":"function"}]}`,
			[]string{`[{"type":"function"}]`, "q"}},
		{"completions", Completions, `{"prompt":"once upon"}`, []string{"once upon"}},
		{"completions array", Completions, `{"prompt":["a","b"]}`, []string{"a", "b"}},
		{"completions token ids", Completions, `{"prompt":[[1,2],[3]]}`, []string{`[[1,2],[3]]`}},
		{"messages", Messages, `{"system":[{"type":"text","text":"sys","cache_control":{"type":"ephemeral"}}],"messages":[{"role":"user","content":"u1"},{"role":"assistant","content":[{"type":"text","text":"a1"}]}]}`,
			[]string{"sys", "u1", "a1"}},
		{"responses string", Responses, `{"instructions":"ins","input":"hello"}`, []string{"ins", "hello"}},
		{"responses items", Responses, `{"input":[{"role":"user","content":[{"type":"input_text","text":"x"}]},{"type":"function_call_output","call_id":"c1","output":"42"}]}`,
			[]string{"x", "42"}},
		{"null content", Chat, `{"messages":[{"role":"assistant","content":null}]}`, nil},
		{"none", None, `{"input":"embed me"}`, nil},
		{"not json", Chat, `{"messages":`, nil},
		{"empty", Chat, ``, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := promptOf(tc.a, tc.body); !slices.Equal(got, tc.want) {
				t.Fatalf("segments = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestPromptTextStopsWhenAsked(t *testing.T) {
	n := 0
	body := []byte(`{"messages":[{"content":"a"},{"content":"b"},{"content":"c"}]}`)
	r, _ := Chat.ParseRequest(body)
	r.PromptText(body, func(string) bool { n++; return n < 2 })
	if n != 2 {
		t.Fatalf("yield called %d times after it returned false at 2", n)
	}
}

// FuzzPromptText: any body yields without panicking, the same text after
// the usage edit as before it (the edit keeps the layout true), and a
// chat request's message texts come out in order.
func FuzzPromptText(f *testing.F) {
	f.Add([]byte(`{"messages":[{"content":"a"}]}`), "x", "y")
	f.Add([]byte(`{"input":[[[[["deep"]]]]]}`), "", "")
	f.Add([]byte(`{"stream_options":{"include_usage":false},"tools":[1],"messages":[{"content":"a"}]}`), "", "")
	f.Add([]byte(`{"stream_options":null,"messages":[{"content":"a"}],"functions":{}}`), "", "")
	f.Fuzz(func(t *testing.T, body []byte, a, b string) {
		for _, x := range []API{Chat, Completions, Responses, Messages, None} {
			r, err := x.ParseRequest(body)
			before := promptIn(&r, body)
			if err != nil || (x != Chat && x != Completions) {
				continue
			}
			edited, ok := r.SetIncludeUsage(bytes.Clone(body))
			if !ok {
				continue
			}
			if after := promptIn(&r, edited); !slices.Equal(after, before) {
				t.Fatalf("%s %q: after the usage edit %q yields %q, before %q", x.Name(), body, edited, after, before)
			}
		}
		if !utf8.ValidString(a) || !utf8.ValidString(b) {
			return // json.Marshal would replace the invalid bytes
		}
		msg, _ := json.Marshal(map[string]any{"messages": []map[string]string{{"role": "user", "content": a}, {"role": "user", "content": b}}})
		if got := promptOf(Chat, string(msg)); !slices.Equal(got, []string{a, b}) {
			t.Fatalf("segments %q, want %q", got, []string{a, b})
		}
	})
}

// FuzzSetIncludeUsage: the usage edit of a Chat request's body decodes, as
// encoding/json (and the servers) read it, as the body did with
// stream_options.include_usage true (the last one, which they read), with
// or without room after the body; the bytes before the edit stay.
func FuzzSetIncludeUsage(f *testing.F) {
	for _, s := range []string{
		"{ \"model\" : \"m\",\n  \"stream\": true, \"messages\":[{\"role\":\"user\",\"content\":\"h\\u00e9 🙂\"}] }\n",
		`{"stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":false},"n":1}`,
		`{"stream_options":{ },"stream":true}`,
		`{"stream":true,"stream_options":null,"x":[1, 2]}`,
		`{"stream":true}`, `{}`, `{"stream":true,"stream_options":{"a":{"include_usage":1}}}`,
		`{"s":"stream_options","stream":true}`, `{"stream_options":{"include_usage":null}} `,
		`{"stream_options":{"include_usage":false,"include_usage":false}}`,
		`{"stream_options":{"Include_Usage":false,"include_usage":null}}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		if _, err := Chat.ParseRequest(body); err != nil || len(body) == 0 {
			return
		}
		var want map[string]any
		if json.Unmarshal(body, &want) != nil {
			t.Fatalf("parsed %q, which encoding/json refuses", body)
		}
		so, _ := want["stream_options"].(map[string]any)
		if so == nil {
			so = map[string]any{}
		}
		so["include_usage"] = true
		want["stream_options"] = so
		for _, room := range []int{0, 64} {
			in := make([]byte, len(body), len(body)+room)
			copy(in, body)
			rr, _ := Chat.ParseRequest(body) // each edit on a layout of its own
			got, ok := rr.SetIncludeUsage(in)
			if !ok {
				t.Fatalf("%q not edited", body)
			}
			var m map[string]any
			if err := json.Unmarshal(got, &m); err != nil || !reflect.DeepEqual(m, want) {
				t.Fatalf("room %d: edit of %q is %q (%v)", room, body, got, err)
			}
			if first := jsonscan.SkipSpace(body, 0); !bytes.HasPrefix(got, body[:first+1]) {
				t.Fatalf("room %d: edit of %q moved its start: %q", room, body, got)
			}
		}
	})
}
