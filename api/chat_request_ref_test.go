package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/tidwall/gjson"
)

// requestFields mirrors the JSON parseChatReference reads; unknown fields
// are ignored.
type requestFields struct {
	Model               string `json:"model"`
	Stream              bool   `json:"stream"`
	MaxTokens           *int   `json:"max_tokens"`
	MaxCompletionTokens *int   `json:"max_completion_tokens"`
	N                   *int   `json:"n"`
	BestOf              *int   `json:"best_of"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	Messages []message  `json:"messages"`
	Prompt   promptText `json:"prompt"`
	Tools    rawChars   `json:"tools"`
	Funcs    rawChars   `json:"functions"`
}

// parseChatReference is the parser parseChat replaced (encoding/json into
// requestFields), kept as the reference the fuzz target compares with.
// It validates body as one JSON object and extracts Request.
// An empty body yields a zero Request (N 1). Invalid JSON, a non-object,
// or a listed field of the wrong type (messages not an array of objects,
// content neither a string nor an array of parts, prompt neither a string
// nor an array of strings or token ids, a negative max_tokens, n below 1)
// is an error suitable for a 400 response. It decodes in one pass, and the
// text it counts is measured in place, never copied.
func parseChatReference(body []byte) (Request, error) {
	info := Request{N: 1}
	if len(body) == 0 {
		return info, nil
	}
	var f requestFields
	if err := json.Unmarshal(body, &f); err != nil {
		return Request{}, fmt.Errorf("invalid JSON body: %w", err)
	}
	// json.Unmarshal accepts "null" into a struct; a request must be an object.
	if first := firstNonSpace(body); first != '{' {
		return Request{}, errors.New("invalid JSON body: expected a JSON object")
	}
	if key := ambiguousField(body); key != "" {
		return Request{}, fmt.Errorf("invalid JSON body: field %q repeats or differs only in case from a field the gateway reads; send each of %s once, in lower case",
			key, strings.Join(readFields[:], ", "))
	}
	info.Model = f.Model
	info.Stream = f.Stream
	switch {
	case f.MaxCompletionTokens != nil && (*f.MaxCompletionTokens != 0 || f.MaxTokens == nil):
		// vLLM takes max_completion_tokens, else (absent or 0) max_tokens.
		info.MaxTokens, info.MaxTokensSet = *f.MaxCompletionTokens, true
	case f.MaxTokens != nil:
		info.MaxTokens, info.MaxTokensSet = *f.MaxTokens, true
	}
	if info.MaxTokens < 0 {
		return Request{}, fmt.Errorf("invalid max_tokens %d: must not be negative", info.MaxTokens)
	}
	if f.N != nil {
		if *f.N < 1 {
			return Request{}, fmt.Errorf("invalid n %d: must be at least 1", *f.N)
		}
		info.N = *f.N
	}
	if f.BestOf != nil {
		// /v1/completions' best_of: the server generates that many
		// sequences and returns n of them; reserve for what it generates.
		if *f.BestOf < 1 {
			return Request{}, fmt.Errorf("invalid best_of %d: must be at least 1", *f.BestOf)
		}
		info.N = max(info.N, *f.BestOf)
	}
	info.StreamOptions = f.StreamOptions != nil
	info.IncludeUsage = f.StreamOptions != nil && f.StreamOptions.IncludeUsage
	chars := f.Prompt.chars + f.Tools.chars + f.Funcs.chars
	for i := range f.Messages {
		chars += f.Messages[i].Content.chars
	}
	info.PromptTokens = (chars+3)/4 + f.Prompt.tokens
	return info, nil
}

// FuzzValidMatchesEncodingJSON checks that gjson.ValidBytes, with which the
// parsers validate a body, accepts exactly what json.Valid accepts.
func FuzzValidMatchesEncodingJSON(f *testing.F) {
	for _, s := range []string{``, ` `, `{}`, `[]`, `null`, `1`, `-0`, `01`, `1.`, `.5`, `1e`, `1E+2`, `"\u12"`, `"\ud800"`,
		"\"\x01\"", "\"\xff\"", `{"a":1,}`, `[1,]`, `{"a" 1}`, `{"a":1} {}`, `  {"a":[1,{"b":null}]}  `, `tru`, `nul`, `"\q"`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if got, want := gjson.ValidBytes(b), json.Valid(b); got != want {
			t.Fatalf("%q: gjson.ValidBytes %v, json.Valid %v", b, got, want)
		}
	})
}

// FuzzParseChatMatchesEncodingJSON checks the one-pass parser against the
// encoding/json one it replaced: the same Request for every body, and an
// error for exactly the same bodies.
func FuzzParseChatMatchesEncodingJSON(f *testing.F) {
	for _, s := range []string{
		``, `null`, `[]`, `{}`, ` { } `, `{"model":"m","stream":true}`,
		`{"model":"m","stream":true,"messages":[{"role":"user","content":"hello"}]}`,
		`{"model":"m\u00e9\n","stream":false,"max_tokens":10,"max_completion_tokens":0,"n":2,"best_of":3}`,
		`{"max_tokens":null,"max_completion_tokens":5,"n":null,"stream":null,"model":null}`,
		`{"max_tokens":1.5}`, `{"max_tokens":1e2}`, `{"max_tokens":-0}`, `{"max_tokens":-3}`, `{"n":0}`,
		`{"max_tokens":99999999999999999999}`, `{"model":5}`, `{"stream":"yes"}`, `{"stream":1}`,
		`{"stream_options":{"include_usage":true}}`, `{"stream_options":{"Include_Usage":true,"include_usage":false}}`,
		`{"stream_options":null}`, `{"stream_options":{}}`, `{"stream_options":"x"}`, `{"stream_options":{"include_usage":"x"}}`,
		`{"stream_options":{"include_usage":null}}`, `{"stream_options":[]}`,
		`{"messages":null}`, `{"messages":{}}`, `{"messages":[null]}`, `{"messages":["x"]}`, `{"messages":[1]}`,
		`{"messages":[{"content":null},{"content":[{"type":"text","text":"ab"},{"type":"image_url","image_url":{"url":"x"}}]}]}`,
		`{"messages":[{"content":5}]}`, `{"messages":[{"content":[{"text":5}]}]}`, `{"messages":[{"Content":"abc"}]}`,
		`{"prompt":"hello"}`, `{"prompt":["a","bc"]}`, `{"prompt":[1,2,3]}`, `{"prompt":[[1,2],[3]]}`, `{"prompt":{}}`, `{"prompt":null}`,
		`{"tools":[{"type":"function","function":{"name":"f"}}],"functions":null,"TOOLS":[1]}`,
		`{"model":"a","model":"b"}`, `{"MODEL":"a"}`, `{"Max_Tokens":3}`, `{"m\u006fdel":"a"}`,
		`{"model":"\ud83d\ude00 \u00"}`, `{"model":"a"} x`, `{"model":"a",}`, "{\"model\":\"\xff\"}",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		got, gotErr := parseChat(body)
		want, wantErr := parseChatReference(body)
		if (gotErr != nil) != (wantErr != nil) {
			t.Fatalf("%q: error %v, the encoding/json parser's %v", body, gotErr, wantErr)
		}
		if gotErr == nil && got != want {
			t.Fatalf("%q:\n got %+v\nwant %+v", body, got, want)
		}
	})
}

// BenchmarkParseChat parses Chat request bodies of 1, 8 and 64 messages of
// about 500 characters (0.6, 4.2 and 33 KB) with the one-pass parser and
// with the encoding/json one it replaced, in the same run.
func BenchmarkParseChat(b *testing.B) {
	for _, n := range []int{1, 8, 64} {
		var sb strings.Builder
		sb.WriteString(`{"model":"llama","stream":true,"max_tokens":256,"messages":[`)
		for i := range n {
			if i > 0 {
				sb.WriteByte(',')
			}
			sb.WriteString(`{"role":"user","content":"` + strings.Repeat("lorem ipsum dolor sit amet ", 18) + `"}`)
		}
		sb.WriteString(`]}`)
		body := []byte(sb.String())
		for _, p := range []struct {
			name  string
			parse func([]byte) (Request, error)
		}{{"one-pass", parseChat}, {"encoding-json", parseChatReference}} {
			b.Run(fmt.Sprintf("messages=%d/%s", n, p.name), func(b *testing.B) {
				b.SetBytes(int64(len(body)))
				b.ReportAllocs()
				for b.Loop() {
					if _, err := p.parse(body); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
