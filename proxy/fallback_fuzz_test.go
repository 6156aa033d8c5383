package proxy

import (
	"encoding/json"
	"testing"
	"unicode/utf8"

	"github.com/tidwall/gjson"
)

// FuzzRewriteBody: whatever JSON object a client sends, the fallback's body
// is valid JSON with the fallback's model and max_tokens, and every other
// top-level field as it was.
func FuzzRewriteBody(f *testing.F) {
	for _, s := range []string{
		`{"model":"big","max_tokens":64000,"messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"big","max_completion_tokens":9000,"stream":true}` + "\n",
		`{"max_tokens":null}`,
		`{}`,
		`  {"model":"a\"b","n":2,"best_of":3}  `,
		`{"model":{"nested":true},"max_tokens":"x"}`,
	} {
		f.Add(s, "small", 4096, true)
	}
	f.Fuzz(func(t *testing.T, body, model string, maxTokens int, setMax bool) {
		if !utf8.ValidString(model) {
			return // a model name comes from the config, in UTF-8
		}
		var before map[string]json.RawMessage
		if json.Unmarshal([]byte(body), &before) != nil || before == nil {
			return // read refuses what is not one JSON object
		}
		if _, err := ParseRequest([]byte(body)); err != nil {
			return
		}
		out, err := rewriteBody([]byte(body), model, maxTokens, setMax)
		if err != nil {
			return // the fallback is passed over, the client's body untouched
		}
		var after map[string]json.RawMessage
		if err := json.Unmarshal(out, &after); err != nil {
			t.Fatalf("rewritten body is not JSON: %v\nin:  %s\nout: %s", err, body, out)
		}
		if model != "" && gjson.GetBytes(out, "model").String() != model {
			t.Fatalf("model %q not set: %s", model, out)
		}
		if setMax {
			_, mct := before["max_completion_tokens"]
			key := "max_tokens"
			if mct && string(before["max_completion_tokens"]) != "null" {
				key = "max_completion_tokens"
			}
			if got := gjson.GetBytes(out, key); got.Int() != int64(maxTokens) {
				t.Fatalf("%s = %s, want %d: %s", key, got.Raw, maxTokens, out)
			}
		}
		for k, v := range before {
			if k == "model" || k == "max_tokens" || k == "max_completion_tokens" {
				continue
			}
			if string(after[k]) != string(v) {
				t.Fatalf("field %q changed: %s -> %s", k, v, after[k])
			}
		}
	})
}
