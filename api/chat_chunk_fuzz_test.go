package api

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"strings"
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/internal/fuzzseed"
	"github.com/llmproxy/caddy-llm-proxy/sse"
)

// Seeds are added with f.Add and also kept under testdata/fuzz/FuzzXxx so
// that plain `go test` runs them; `go test -run TestFuzzSeedFiles -update-seeds`
// rewrites those files from the lists below.
var updateSeeds = flag.Bool("update-seeds", false, "rewrite testdata/fuzz seed files from the seed lists")

var chunkSeeds = []string{
	`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1718000000,"model":"llama","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`,
	`{"choices":[{"index":0,"delta":{},"finish_reason":"stop","stop_reason":null}]}`,
	`{"choices":[],"usage":{"prompt_tokens":12,"total_tokens":40,"completion_tokens":28}}`,
	`{"choices":[{"delta":{"content":"x"},"finish_reason":null}],"usage":null}`,
	`{"choices":[{"delta":{"content":"\"finish_reason\":\"stop\" C:\\"},"finish_reason":"length"}]}`,
	"{ \"choices\" : [ { \"finish_reason\" :\n\"length\" } ] , \"usage\" : { } }",
	`{"\u0075sage":{},"choices":[1,"a",{"finish_reason":null,"finish_reason":"stop"}],"choices":[]}`,
	`[DONE]`,
	`{"choices":[{"finish_reason":"st`,
	`{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}`,
	`{"usage":{"prompt_tokens":7,"completion_tokens":3},"usage":{"prompt_tokens":9,"completion_tokens":5}}`,
	`{"usage":{"prompt_tokens":1.0,"completion_tokens":-1,"prompt_tokens":"2","completion_tokens":1e2}}`,
	`{"usage":{"prompt_\u0074okens":123456789012345678,"completion_tokens":1234567890123456789}}`,
	`{"object":"chat.completion","choices":[{"message":{"content":"x"},"finish_reason":"stop"}],"usage":{"completion_tokens":1,"prompt_tokens_details":{"prompt_tokens":4}}}`,
	`{"choices":null,"usage":{"prompt_tokens":2,"completion_tokens":3}}`,
	`{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}],"usage":{"prompt_tokens":2,"completion_tokens":1}}`,
	`{"choices":[{"delta":{}}],"usage":{},"choices":"x"}`,
	// The plain-chunk shortcut: null values it may skip, and near misses.
	`{"choices":[{"finish_reason":nullx}]}`,
	`{"choices":[{"finish_reason" :	null }],"usage" : null}`,
	`{"choices":[{"finish_reason":null}],"xusage":{"prompt_tokens":1}}`,
	`{"choices":[{"finish_reason":null,"finish_reason":"stop"}]}`,
	`{"choices":[{"finish_reason":null}]}trailing"usage":{"prompt_tokens":1}`,
	`{"choices":[{"delta":{"content":"usage\":{}"},"finish_reason":null}]}`,
	`{"choices":[{"finish_reason":`,
}

var errorSeeds = []string{
	`{"error":{"message":"m","type":"server_error","code":"server_error"}}`,
	`{"error":{"object":"error","message":"bad","type":"BadRequestError","param":null,"code":400}}`,
	`{"object":"error","message":"dead","type":"InternalServerError","param":null,"code":"500"}`,
	`{"error":"Input validation error","error_type":"validation"}`,
	`{"error":{"message":"m","type":"rate_limit_exceeded","code":429.0}}`,
	`{"error":null,"object":"error"}`,
	`{"\u0065rror":{"message":"m"},"error":7}`,
	`{"choices":[]}`,
}

func FuzzInspectChatChunk(f *testing.F) {
	for _, s := range chunkSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got := inspectChunk(data)
		if walk := walkChunk(data); got != walk {
			t.Fatalf("InspectChunk(%q) = %+v, the JSON walk says %+v", data, got, walk)
		}
		ev := sse.Event{Data: data, HasData: true}
		_ = ev.Kind()
		if !json.Valid(data) {
			return
		}
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.UseNumber()
		var v any
		if err := dec.Decode(&v); err != nil {
			return
		}
		var want chunkInfo
		if m, ok := v.(map[string]any); ok {
			choices, _ := m["choices"].([]any)
			if choices != nil {
				for _, c := range choices {
					if c, ok := c.(map[string]any); ok {
						if fr, ok := c["finish_reason"]; ok && fr != nil {
							want.finishReason = true
						}
					}
				}
			}
			var usage map[string]any
			usage, want.usage = m["usage"].(map[string]any)
			want.promptTokens = refCount(usage["prompt_tokens"])
			want.completionTokens = refCount(usage["completion_tokens"])
			want.usageOnly = want.usage && len(choices) == 0
		}
		if got != want {
			t.Fatalf("InspectChunk(%q) = %+v, encoding/json says %+v", data, got, want)
		}
	})
}

// refCount is the oracle for token counts: a JSON number of 1 to 18 decimal
// digits, else 0.
func refCount(v any) int {
	n, ok := v.(json.Number)
	if !ok || len(n) == 0 || len(n) > 18 || strings.Trim(string(n), "0123456789") != "" {
		return 0
	}
	i, err := n.Int64()
	if err != nil {
		return 0
	}
	return int(i)
}

func FuzzChatError(f *testing.F) {
	for _, s := range errorSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		e, ok := parseChatError(data)
		if !ok {
			if e != (InbandError{}) {
				t.Fatalf("not ok but returned %+v", e)
			}
		} else if e.Status < 400 || e.Status > 599 {
			t.Fatalf("status %d outside 400..599 for %q", e.Status, data)
		}
		if json.Valid(data) {
			ev := sse.Event{Data: data, HasData: true}
			if isErr := ev.Kind() == sse.KindError; isErr != ok {
				t.Fatalf("Kind says error=%v, ParseInbandError ok=%v for %q", isErr, ok, data)
			}
		}
		// Our own event for the parsed error must parse back to it.
		if ok {
			out := appendChatErrorEvent(nil, e.Message, e.Type, e.Code)
			payload := bytes.TrimSuffix(bytes.TrimPrefix(out, []byte("data: ")), []byte("\n\n"))
			back, ok := parseChatError(payload)
			if !ok || back.Message != e.Message || back.Type != e.Type || back.Code != e.Code {
				t.Fatalf("re-encoded %+v parsed back as %+v, %v (%s)", e, back, ok, payload)
			}
		}
	})
}

// TestFuzzSeedFiles checks that every seed list has its corpus files under
// testdata/fuzz (written with -update-seeds).
func TestFuzzSeedFiles(t *testing.T) {
	corpora := map[string][]string{}
	for _, s := range chunkSeeds {
		corpora["FuzzInspectChatChunk"] = append(corpora["FuzzInspectChatChunk"], fuzzseed.File(fmt.Sprintf("[]byte(%q)", s)))
	}
	for _, s := range errorSeeds {
		corpora["FuzzChatError"] = append(corpora["FuzzChatError"], fuzzseed.File(fmt.Sprintf("[]byte(%q)", s)))
	}
	fuzzseed.Check(t, corpora, *updateSeeds, "./api/")
}
