package proxy

import (
	"encoding/json"
	"slices"
	"testing"
	"unicode/utf8"
)

func segments(body string) []string {
	var out []string
	PromptSegments([]byte(body), func(s string) bool { out = append(out, s); return true })
	return out
}

func TestPromptSegmentsOfEveryAPI(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		want       []string
	}{
		{"chat", `{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"u"}}]}]}`,
			[]string{"be brief", "hi", `{"type":"image_url","image_url":{"url":"u"}}`}},
		{"chat with tools", `{"messages":[{"role":"user","content":"q"}],"tools":[{"type":"function"}]}`,
			[]string{`{"type":"function"}`, "q"}},
		{"completions", `{"prompt":"once upon"}`, []string{"once upon"}},
		{"completions array", `{"prompt":["a","b"]}`, []string{"a", "b"}},
		{"anthropic", `{"system":[{"type":"text","text":"sys"}],"messages":[{"role":"user","content":"u1"},{"role":"assistant","content":[{"type":"text","text":"a1"}]}]}`,
			[]string{"sys", "u1", "a1"}},
		{"responses string", `{"instructions":"ins","input":"hello"}`, []string{"ins", "hello"}},
		{"responses items", `{"input":[{"role":"user","content":[{"type":"input_text","text":"x"}]},{"type":"function_call_output","output":"42"}]}`,
			[]string{"x", `{"type":"function_call_output","output":"42"}`}},
		{"null content", `{"messages":[{"role":"assistant","content":null}]}`, nil},
		{"not json", `{"messages":`, nil},
		{"empty", ``, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := segments(tc.body); !slices.Equal(got, tc.want) {
				t.Fatalf("segments = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestPromptSegmentsStopWhenAsked(t *testing.T) {
	n := 0
	PromptSegments([]byte(`{"messages":[{"content":"a"},{"content":"b"},{"content":"c"}]}`), func(string) bool { n++; return n < 2 })
	if n != 2 {
		t.Fatalf("yield called %d times after it returned false at 2", n)
	}
}

// FuzzPromptSegments: any body yields without panicking, and a chat
// request's message texts come out in order.
func FuzzPromptSegments(f *testing.F) {
	f.Add([]byte(`{"messages":[{"content":"a"}]}`), "x", "y")
	f.Add([]byte(`{"input":[[[[["deep"]]]]]}`), "", "")
	f.Fuzz(func(t *testing.T, body []byte, a, b string) {
		PromptSegments(body, func(string) bool { return true })
		if !utf8.ValidString(a) || !utf8.ValidString(b) {
			return // json.Marshal would replace the invalid bytes
		}
		msg, _ := json.Marshal(map[string]any{"messages": []map[string]string{{"role": "user", "content": a}, {"role": "user", "content": b}}})
		if got := segments(string(msg)); !slices.Equal(got, []string{a, b}) {
			t.Fatalf("segments %q, want %q", got, []string{a, b})
		}
	})
}
