package proxy

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/tidwall/gjson"

	"github.com/llmproxy/caddy-llm-proxy/api"
)

// rewriteAPIs are the APIs FuzzRewriteBody picks from.
var rewriteAPIs = []api.API{api.Chat, api.Completions, api.Responses, api.Messages, api.None}

// FuzzRewriteBody: whatever JSON object a client sends, in whichever API,
// the fallback's body is valid JSON with the fallback's model and the
// API's output limit, and every other top-level field as it was.
func FuzzRewriteBody(f *testing.F) {
	for _, s := range []string{
		`{"model":"big","max_tokens":64000,"messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"big","max_completion_tokens":9000,"stream":true}` + "\n",
		`{"max_tokens":null}`,
		`{}`,
		`  {"model":"a\"b","n":2,"best_of":3}  `,
		`{"model":{"nested":true},"max_tokens":"x"}`,
	} {
		for which := range uint8(len(rewriteAPIs)) {
			f.Add(s, "small", 4096, true, which)
		}
	}
	f.Add(`{"model":"big","max_output_tokens":64000,"input":"hi"}`, "small", 100, true, uint8(2))
	f.Add(`{"model":"big","max_tokens":64000,"system":"s","messages":[]}`, "small", 100, true, uint8(3))
	f.Add(`{"max_tokens":64000,"thinking":{"type":"enabled","budget_tokens":8000}}`, "small", 4096, true, uint8(3))
	f.Add(`{"max_tokens":64000,"thinking":{"type":"enabled","budget_tokens":8000}}`, "", 1000, true, uint8(3))
	f.Add(`{"max_tokens":64000,"thinking":{"type":"enabled","budget_tokens":8000,"budget_tokens":9000,"x":[1]}}`, "", 2000, true, uint8(3))
	f.Add(`{"max_tokens":64000,"thinking":{"type":"enabled","budget_tokens":1e4}}`, "", -5, true, uint8(3))
	f.Fuzz(func(t *testing.T, body, model string, maxTokens int, setMax bool, which uint8) {
		a := rewriteAPIs[int(which)%len(rewriteAPIs)]
		if !utf8.ValidString(model) {
			return // a model name comes from the config, in UTF-8
		}
		var before map[string]json.RawMessage
		if json.Unmarshal([]byte(body), &before) != nil || before == nil {
			return // read refuses what is not one JSON object
		}
		info, err := a.ParseRequest([]byte(body))
		if err != nil {
			return
		}
		out, rinfo, note, err := rewriteBody([]byte(body), info, a, model, maxTokens, setMax)
		if err != nil {
			return // the fallback is passed over, the client's body untouched
		}
		// The Request that describes the rewritten body finds its prompt
		// where a parse of that body finds it (one that parses: a fuzzed
		// maxTokens may be negative).
		if again, err := a.ParseRequest(out); err == nil && !slices.Equal(promptOf(&rinfo, out), promptOf(&again, out)) {
			t.Fatalf("rewritten %s: prompt %q, a new parse's %q", out, promptOf(&rinfo, out), promptOf(&again, out))
		}
		var after map[string]json.RawMessage
		if err := json.Unmarshal(out, &after); err != nil {
			t.Fatalf("rewritten body is not JSON: %v\nin:  %s\nout: %s", err, body, out)
		}
		if model != "" && gjson.GetBytes(out, "model").String() != model {
			t.Fatalf("model %q not set: %s", model, out)
		}
		fields := a.OutputLimitFields()
		if setMax && len(fields) > 0 {
			key := fields[len(fields)-1]
			for _, k := range fields {
				if v, ok := before[k]; ok && string(v) != "null" {
					key = k
					break
				}
			}
			if got := gjson.GetBytes(out, key); got.Int() != int64(maxTokens) {
				t.Fatalf("%s = %s, want %d: %s", key, got.Raw, maxTokens, out)
			}
		}
		thinkingCut := a == api.Messages && setMax && len(fields) > 0 && strings.Contains(note, "thinking")
		if thinkingCut {
			// Anthropic's rule: thinking fits the clamped max_tokens, and
			// a budget the clamp lowered stays at least 1024.
			if th, ok := after["thinking"]; ok {
				var v struct {
					Budget json.Number `json:"budget_tokens"`
				}
				if err := json.Unmarshal(th, &v); err != nil {
					t.Fatalf("thinking %s: %v", th, err)
				}
				if b, err := v.Budget.Int64(); err != nil || b >= int64(maxTokens) || b < 1024 { // Anthropic's least budget_tokens
					t.Fatalf("budget_tokens %s with max_tokens %d: %s", v.Budget, maxTokens, out)
				}
			}
		} else if a == api.Messages && setMax {
			if b := gjson.GetBytes(out, "thinking.budget_tokens"); gjson.GetBytes(out, "thinking.type").Str == "enabled" &&
				b.Type == gjson.Number && b.Num >= float64(maxTokens) {
				t.Fatalf("thinking left above max_tokens %d: %s (note %q)", maxTokens, out, note)
			}
		}
		for k, v := range before {
			if k == "model" || (setMax && slices.Contains(fields, k)) || (thinkingCut && k == "thinking") {
				continue
			}
			if string(after[k]) != string(v) {
				t.Fatalf("field %q changed: %s -> %s", k, v, after[k])
			}
		}
	})
}

// promptOf returns info's PromptText of body.
func promptOf(info *RequestInfo, body []byte) []string {
	var out []string
	info.PromptText(body, func(s string) bool { out = append(out, s); return true })
	return out
}
