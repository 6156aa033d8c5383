package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/llmproxy/caddy-llm-proxy/internal/jsonscan"
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
	Messages []refMessage    `json:"messages"`
	Prompt   refPrompt       `json:"prompt"`
	Tools    json.RawMessage `json:"tools"`
	Funcs    json.RawMessage `json:"functions"`
}

// refMessage is a chat message decoded by encoding/json: an object whose
// "content" (its exact name, the last one counting) is measured.
type refMessage struct{ chars int }

func (m *refMessage) UnmarshalJSON(b []byte) error {
	var obj map[string]json.RawMessage
	if json.Unmarshal(b, &obj) != nil || obj == nil {
		return errMessage
	}
	c, ok := obj["content"]
	if !ok || string(c) == "null" {
		return nil
	}
	var s string
	if json.Unmarshal(c, &s) == nil {
		m.chars = utf8.RuneCountInString(s)
		return nil
	}
	var parts []json.RawMessage
	if json.Unmarshal(c, &parts) != nil {
		return errors.New("content must be a string or an array of parts")
	}
	for _, p := range parts {
		var part map[string]json.RawMessage
		if json.Unmarshal(p, &part) != nil || part == nil {
			return errParts
		}
		t, ok := part["text"]
		if !ok || string(t) == "null" {
			continue
		}
		if json.Unmarshal(t, &s) != nil {
			return errParts
		}
		m.chars += utf8.RuneCountInString(s)
	}
	return nil
}

// refPrompt is a completions prompt decoded by encoding/json: a string, an
// array of strings, or token ids (uint32s, or arrays of them).
type refPrompt struct{ chars, tokens int }

func (p *refPrompt) UnmarshalJSON(b []byte) error {
	*p = refPrompt{}
	var s string
	switch {
	case string(b) == "null":
		return nil
	case json.Unmarshal(b, &s) == nil:
		p.chars = utf8.RuneCountInString(s)
		return nil
	}
	var elems []json.RawMessage
	if json.Unmarshal(b, &elems) != nil || b[0] != '[' {
		return errPrompt
	}
	for _, e := range elems {
		var id uint32
		var ids []uint32
		switch {
		case e[0] == '"' && json.Unmarshal(e, &s) == nil:
			p.chars += utf8.RuneCountInString(s)
		case e[0] == '[' && json.Unmarshal(e, &ids) == nil:
			p.tokens += len(ids)
		case e[0] != '"' && e[0] != '[' && json.Unmarshal(e, &id) == nil:
			p.tokens++
		default:
			return errPrompt
		}
	}
	return nil
}

// refAmbiguous returns the first top-level key of the valid JSON object
// body that repeats one of fields or differs from it only in case, read
// with encoding/json's token stream.
func refAmbiguous(body []byte, fields []string) string {
	dec := json.NewDecoder(bytes.NewReader(body))
	if _, err := dec.Token(); err != nil {
		return ""
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return ""
		}
		key := tok.(string)
		var v json.RawMessage
		if dec.Decode(&v) != nil {
			return ""
		}
		for _, f := range fields {
			if strings.EqualFold(key, f) {
				if key != f || seen[f] {
					return key
				}
				seen[f] = true
			}
		}
	}
	return ""
}

// parseChatReference is a Chat request parser made of encoding/json
// (requestFields), the reference the one-walk parser is compared with:
// the same Request for every body, an error for exactly the same bodies.
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
	if first := jsonscan.TrimSpace(body)[0]; first != '{' {
		return Request{}, errors.New("invalid JSON body: expected a JSON object")
	}
	if key := refAmbiguous(body, chatFields); key != "" {
		return Request{}, fmt.Errorf("invalid JSON body: field %q is ambiguous", key)
	}
	info.Model = f.Model
	info.Stream = f.Stream
	switch {
	case f.MaxCompletionTokens != nil && (*f.MaxCompletionTokens != 0 || f.MaxTokens == nil):
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
		if *f.BestOf < 1 {
			return Request{}, fmt.Errorf("invalid best_of %d: must be at least 1", *f.BestOf)
		}
		info.N = max(info.N, *f.BestOf)
	}
	info.StreamOptions = f.StreamOptions != nil
	info.IncludeUsage = f.StreamOptions != nil && f.StreamOptions.IncludeUsage
	chars := f.Prompt.chars
	for _, raw := range []json.RawMessage{f.Tools, f.Funcs} {
		if len(raw) > 0 && string(raw) != "null" {
			chars += utf8.RuneCount(raw)
		}
	}
	for i := range f.Messages {
		chars += f.Messages[i].chars
	}
	info.PromptTokens = (chars+3)/4 + f.Prompt.tokens
	return info, nil
}

// FuzzParseChatMatchesEncodingJSON: the one-walk parser reads what
// encoding/json reads (parseChatReference): the same Request for every
// body, and an error for exactly the same bodies.
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
		got, gotErr := Chat.ParseRequest(body)
		got.Layout = nil
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
// about 500 characters (0.6, 4.2 and 33 KB) with the one-walk parser and
// with the encoding/json reference, in the same run.
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
		}{{"one-walk", Chat.ParseRequest}, {"encoding-json", parseChatReference}} {
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
