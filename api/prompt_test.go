package api

import (
	"encoding/json"
	"slices"
	"testing"
	"unicode/utf8"
)

func promptOf(a API, body string) []string {
	var out []string
	PromptText(a, []byte(body), func(s string) bool { out = append(out, s); return true })
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
	PromptText(Chat, []byte(`{"messages":[{"content":"a"},{"content":"b"},{"content":"c"}]}`), func(string) bool { n++; return n < 2 })
	if n != 2 {
		t.Fatalf("yield called %d times after it returned false at 2", n)
	}
}

// FuzzPromptText: any body yields without panicking, and a chat request's
// message texts come out in order.
func FuzzPromptText(f *testing.F) {
	f.Add([]byte(`{"messages":[{"content":"a"}]}`), "x", "y")
	f.Add([]byte(`{"input":[[[[["deep"]]]]]}`), "", "")
	f.Fuzz(func(t *testing.T, body []byte, a, b string) {
		for _, x := range []API{Chat, Completions, Responses, Messages, None} {
			PromptText(x, body, func(string) bool { return true })
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
