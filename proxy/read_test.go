package proxy

import (
	"bytes"
	"encoding/json"
	"math"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestParseRequest(t *testing.T) {
	cases := []struct {
		body string
		want RequestInfo
		err  bool
	}{
		{``, RequestInfo{N: 1}, false},
		{`{"model":"llama","stream":true,"max_tokens":128}`, RequestInfo{Model: "llama", Stream: true, MaxTokens: 128, MaxTokensSet: true, N: 1}, false},
		{`{"max_tokens":10,"max_completion_tokens":20}`, RequestInfo{MaxTokens: 20, MaxTokensSet: true, N: 1}, false},
		{`{"max_tokens":null}`, RequestInfo{N: 1}, false},
		{`{"max_tokens":0}`, RequestInfo{MaxTokensSet: true, N: 1}, false},
		{`{"n":3}`, RequestInfo{N: 3}, false},
		{`{"stream":true,"stream_options":{"include_usage":true}}`, RequestInfo{Stream: true, IncludeUsage: true, StreamOptions: true, N: 1}, false},
		{`{"stream":true,"stream_options":{}}`, RequestInfo{Stream: true, StreamOptions: true, N: 1}, false},
		{`{"stream":true,"stream_options":null}`, RequestInfo{Stream: true, N: 1}, false},
		{` {"messages":[{"role":"user","content":"hé 🙂"}]} `, RequestInfo{N: 1, PromptTokens: 1}, false},
		{`{"model":`, RequestInfo{}, true},
		{`null`, RequestInfo{}, true},
		{`[]`, RequestInfo{}, true},
		{`{"stream":"yes"}`, RequestInfo{}, true},
		{`{"max_tokens":-1}`, RequestInfo{}, true},
		{`{"a":1} {"b":2}`, RequestInfo{}, true},
		{`{"n":0}`, RequestInfo{}, true},
		{`{"n":"2"}`, RequestInfo{}, true},
		{`{"stream_options":true}`, RequestInfo{}, true},
		{`{"messages":"hi"}`, RequestInfo{}, true},
		{`{"messages":["hi"]}`, RequestInfo{}, true},
		{`{"messages":[{"content":7}]}`, RequestInfo{}, true},
		{`{"messages":[{"content":[{"type":"text","text":5}]}]}`, RequestInfo{}, true},
		{`{"messages":[{"content":["hi"]}]}`, RequestInfo{}, true},
		{`{"prompt":{"text":"hi"}}`, RequestInfo{}, true},
		{`{"prompt":[["a"]]}`, RequestInfo{}, true},
		{`{"prompt":[-1]}`, RequestInfo{}, true},
	}
	for _, tc := range cases {
		got, err := ParseRequest([]byte(tc.body))
		got.Layout = nil // where the fields are: the api package's tests
		if (err != nil) != tc.err || got != tc.want {
			t.Errorf("ParseRequest(%q) = %+v, %v; want %+v, error %v", tc.body, got, err, tc.want, tc.err)
		}
	}
}

// The prompt estimate is ⌈code points of all text content ÷ 4⌉, with no
// per-message overhead.
func TestPromptEstimate(t *testing.T) {
	cases := []struct {
		name string
		body string
		want int
	}{
		{"no text", `{"model":"m"}`, 0},
		{"one string, exact", `{"messages":[{"role":"user","content":"12345678"}]}`, 2},
		{"rounded up", `{"messages":[{"role":"user","content":"123456789"}]}`, 3},
		{"one character", `{"messages":[{"role":"user","content":"x"}]}`, 1},
		{"empty content", `{"messages":[{"role":"user","content":""}]}`, 0},
		{"summed over messages before rounding", `{"messages":[{"role":"system","content":"ab"},{"role":"user","content":"cd"}]}`, 1},
		{"null content (tool calls)", `{"messages":[{"role":"assistant","content":null,"tool_calls":[{"function":{"arguments":"xxxxxxxx"}}]},{"role":"user","content":"abcd"}]}`, 1},
		{"text parts", `{"messages":[{"role":"user","content":[{"type":"text","text":"abcd"},{"type":"image_url","image_url":{"url":"data:xxxxxxxxxxxxxxxx"}},{"type":"text","text":"efgh"}]}]}`, 2},
		{"parts and strings together", `{"messages":[{"content":"abcd"},{"content":[{"type":"text","text":"e"}]}]}`, 2},
		{"completions prompt string", `{"prompt":"abcdefgh"}`, 2},
		{"completions prompt array", `{"prompt":["abc","def","gh"]}`, 2},
		{"completions prompt token ids", `{"prompt":[1,2,3]}`, 3},
		{"completions prompt arrays of token ids", `{"prompt":[[1,2],[3]]}`, 3},
		{"code points, not bytes", `{"messages":[{"content":"héllo wörld 世界!"}]}`, 4},              // 15 code points
		{"an emoji is one code point", `{"messages":[{"content":"🙂🙂🙂🙂🙂"}]}`, 2},                    // 5
		{"escapes are one code point", `{"messages":[{"content":"\n\t\"\\\u00e9"}]}`, 2},           // 5
		{"a surrogate pair is one code point", `{"messages":[{"content":"\ud83d\ude42abcd"}]}`, 2}, // 5
		{"a lone surrogate is one code point", `{"messages":[{"content":"\ud83dabc"}]}`, 1},        // 4
		{"fields named like content elsewhere do not count", `{"content":"xxxxxxxx","text":"xxxx","messages":[{"name":"xxxxxxxx","content":"ab"}]}`, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			info, err := ParseRequest([]byte(tc.body))
			if err != nil || info.PromptTokens != tc.want {
				t.Fatalf("PromptTokens = %d, %v; want %d", info.PromptTokens, err, tc.want)
			}
		})
	}
}

// refPromptChars is the oracle of the prompt estimate: decode with
// encoding/json and count code points.
func refPromptChars(obj map[string]any) (chars, tokens int, ok bool) {
	if msgs, present := obj["messages"]; present && msgs != nil {
		list, isList := msgs.([]any)
		if !isList {
			return 0, 0, false
		}
		for _, m := range list {
			mm, isObj := m.(map[string]any)
			if !isObj {
				return 0, 0, false
			}
			switch c := mm["content"].(type) {
			case nil:
			case string:
				chars += utf8.RuneCountInString(c)
			case []any:
				for _, p := range c {
					pm, isObj := p.(map[string]any)
					if !isObj {
						return 0, 0, false
					}
					switch tx := pm["text"].(type) {
					case nil:
					case string:
						chars += utf8.RuneCountInString(tx)
					default:
						return 0, 0, false
					}
				}
			default:
				return 0, 0, false
			}
		}
	}
	isID := func(v any) bool {
		n, isNum := v.(json.Number)
		if !isNum {
			return false
		}
		i, err := strconv.ParseUint(string(n), 10, 32)
		return err == nil && i <= math.MaxUint32
	}
	switch p := obj["prompt"].(type) {
	case nil:
	case string:
		chars += utf8.RuneCountInString(p)
	case []any:
		for _, e := range p {
			switch e := e.(type) {
			case string:
				chars += utf8.RuneCountInString(e)
			case []any:
				for _, id := range e {
					if !isID(id) {
						return 0, 0, false
					}
				}
				tokens += len(e)
			default:
				if !isID(e) {
					return 0, 0, false
				}
				tokens++
			}
		}
	default:
		return 0, 0, false
	}
	return chars, tokens, true
}

// FuzzParseRequest: never panics; accepts exactly the JSON objects that
// encoding/json accepts (when the listed fields have the right types), and
// its prompt estimate agrees with decoding and counting code points.
func FuzzParseRequest(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","stream":true,"max_tokens":16,"stream_options":{"include_usage":true}}`,
		`{"messages":[{"role":"user","content":"\u00e9"}],"max_completion_tokens":1}`,
		`{}`, `null`, `[]`, `{"model":1}`, `{"max_tokens":1e3}`, "{\"a\":\"\xff\"}", ``,
		`{"n":2,"max_tokens":null,"stream_options":null}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"h\u00e9 \ud83d\ude42"},{"type":"image_url","image_url":{"url":"x"}}]},{"role":"assistant","content":null}]}`,
		`{"prompt":["abc","d\u00e9f"]}`, `{"prompt":"\ud800x"}`, `{"prompt":[[1,2],3,"x"]}`,
		"{\"messages\":[{\"content\":\"\xff\xfe\xe4\xb8\"}]}",
		`{"messages":[{"content":7}]}`, `{"n":0}`, `{"prompt":[-1]}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		info, err := ParseRequest(body)
		if err != nil || len(body) == 0 {
			return
		}
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.UseNumber()
		var obj map[string]any
		if dec.Decode(&obj) != nil || obj == nil {
			t.Fatalf("accepted %q, which is not a JSON object", body)
		}
		if m, ok := obj["model"].(string); ok && m != info.Model {
			t.Fatalf("model %q, want %q", info.Model, m)
		}
		if info.MaxTokens < 0 || info.N < 1 {
			t.Fatalf("negative max tokens or n from %q: %+v", body, info)
		}
		chars, tokens, ok := refPromptChars(obj)
		if !ok {
			t.Fatalf("accepted %q, whose text content has an invalid shape", body)
		}
		if want := (chars+3)/4 + tokens; info.PromptTokens != want {
			t.Fatalf("PromptTokens %d for %q, want %d", info.PromptTokens, body, want)
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

// BenchmarkParseRequest parses a typical chat request: a system prompt, a
// few turns and a 4 KiB user message.
func BenchmarkParseRequest(b *testing.B) {
	body := []byte(`{"model":"llama-3-70b","stream":true,"max_tokens":512,"temperature":0.7,"messages":[` +
		`{"role":"system","content":"You are a helpful assistant. Answer briefly."},` +
		`{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello! How can I help?"},` +
		`{"role":"user","content":[{"type":"text","text":"` + strings.Repeat("Summarise this text, please. ", 140) + `"}]}]}`)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := ParseRequest(body); err != nil {
			b.Fatal(err)
		}
	}
}

// TestFieldsThatDifferOnlyInCaseAreRefused: Go's JSON decoder matches names
// case-insensitively and keeps the last duplicate; Python servers read the
// exact key. A client could otherwise reserve 1 token and generate 100,000.
func TestFieldsThatDifferOnlyInCaseAreRefused(t *testing.T) {
	for _, body := range []string{
		`{"max_tokens":100000,"MAX_TOKENS":1}`,
		`{"messages":[{"role":"user","content":"long"}],"Messages":[]}`,
		`{"n":64,"N":1}`,
		`{"max_tokens":100000,"max_to\u212aens":1}`, // the Kelvin sign folds to k
		`{"max_tokens":5,"max_tokens":1}`,
	} {
		if _, err := ParseRequest([]byte(body)); err == nil {
			t.Errorf("ParseRequest(%s) accepted an ambiguous field", body)
		}
	}
	info, err := ParseRequest([]byte(`{"max_completion_tokens":0,"max_tokens":300,"Model_name":"x","Temperature":1}`))
	if err != nil || info.MaxTokens != 300 || !info.MaxTokensSet {
		t.Fatalf("max_completion_tokens 0 with max_tokens 300: %+v, %v; want 300, as vLLM reads it", info, err)
	}
}

// TestBestOfIsReserved: best_of generates that many sequences, so the
// reservation counts them (n alone under-reserved best_of requests).
func TestBestOfIsReserved(t *testing.T) {
	info, err := ParseRequest([]byte(`{"prompt":"x","n":2,"best_of":5,"max_tokens":10}`))
	if err != nil || info.N != 5 {
		t.Fatalf("n 2, best_of 5: N %d, %v; want 5", info.N, err)
	}
	if _, err := ParseRequest([]byte(`{"best_of":0}`)); err == nil {
		t.Fatal("best_of 0 accepted")
	}
}
