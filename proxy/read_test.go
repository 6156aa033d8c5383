package proxy

import (
	"encoding/json"
	"net/http"
	"testing"
)

func TestParseRequest(t *testing.T) {
	cases := []struct {
		body string
		want RequestInfo
		err  bool
	}{
		{``, RequestInfo{}, false},
		{`{"model":"llama","stream":true,"max_tokens":128}`, RequestInfo{Model: "llama", Stream: true, MaxTokens: 128}, false},
		{`{"max_tokens":10,"max_completion_tokens":20}`, RequestInfo{MaxTokens: 20}, false},
		{`{"stream":true,"stream_options":{"include_usage":true}}`, RequestInfo{Stream: true, IncludeUsage: true}, false},
		{` {"messages":[{"role":"user","content":"hé 🙂"}]} `, RequestInfo{}, false},
		{`{"model":`, RequestInfo{}, true},
		{`null`, RequestInfo{}, true},
		{`[]`, RequestInfo{}, true},
		{`{"stream":"yes"}`, RequestInfo{}, true},
		{`{"max_tokens":-1}`, RequestInfo{}, true},
		{`{"a":1} {"b":2}`, RequestInfo{}, true},
	}
	for _, tc := range cases {
		got, err := ParseRequest([]byte(tc.body))
		if (err != nil) != tc.err || got != tc.want {
			t.Errorf("ParseRequest(%q) = %+v, %v; want %+v, error %v", tc.body, got, err, tc.want, tc.err)
		}
	}
}

// FuzzParseRequest: never panics; accepts exactly the JSON objects that
// encoding/json accepts (when the listed fields have the right types).
func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","stream":true,"max_tokens":16,"stream_options":{"include_usage":true}}`,
		`{"messages":[{"role":"user","content":"\u00e9"}],"max_completion_tokens":1}`,
		`{}`, `null`, `[]`, `{"model":1}`, `{"max_tokens":1e3}`, "{\"a\":\"\xff\"}", ``,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		info, err := ParseRequest(body)
		if err != nil || len(body) == 0 {
			return
		}
		var obj map[string]any
		if json.Unmarshal(body, &obj) != nil || obj == nil {
			t.Fatalf("accepted %q, which is not a JSON object", body)
		}
		if m, ok := obj["model"].(string); ok && m != info.Model {
			t.Fatalf("model %q, want %q", info.Model, m)
		}
		if info.MaxTokens < 0 {
			t.Fatalf("negative max tokens from %q", body)
		}
	})
}

func TestWhichBodiesAreParsedAsJSON(t *testing.T) {
	for ct, want := range map[string]bool{
		"":                                  true,
		"application/json":                  true,
		"application/json; charset=utf-8":   true,
		"application/x-www-form-urlencoded": true, // curl -d
		"text/plain":                        true,
		"multipart/form-data; boundary=x":   false,
		"application/octet-stream":          false,
		"audio/wav":                         false,
	} {
		r, _ := http.NewRequest("POST", "/v1/chat/completions", nil)
		if ct != "" {
			r.Header.Set("Content-Type", ct)
		}
		if got := isJSONRequest(r); got != want {
			t.Errorf("Content-Type %q: parsed %v, want %v", ct, got, want)
		}
	}
}
