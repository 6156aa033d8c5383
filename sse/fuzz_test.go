package sse_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/iotest"
	"unsafe"

	"github.com/llmproxy/caddy-llm-proxy/sse"
)

// Seeds are added with f.Add and also kept under testdata/fuzz/FuzzXxx so
// that plain `go test` runs them; `go test -run TestFuzzSeedFiles -update-seeds`
// rewrites those files from the lists below.
var updateSeeds = flag.Bool("update-seeds", false, "rewrite testdata/fuzz seed files from the seed lists")

type scannerSeed struct {
	data  string
	split uint16
	max   uint8
}

var scannerSeeds = []scannerSeed{
	{vllmStream, 40, 255},
	{"data: a\r\n\r\ndata: b\r\n\r\n", 9, 20},
	{"data: a\r\rdata: b\r\r", 8, 10},
	{": ping\n\nevent: e\nid: 1\nretry: 5\ndata: x\ndata:y\n\n", 3, 64},
	{"\n\r\n\rdata: [DONE]\n\n\n", 2, 16},
	{"data: héllo 世界\n\n", 8, 30},
	{"data: truncated", 4, 100},
	{"data: a\n", 1, 100},
	{"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", 7, 8},
	{"data: 12345678\n\n", 0, 15},
	{"data: 1234567\r\r", 0, 14},
	{"data: 1234567\r\r\n", 0, 14},
	{"\r", 0, 0},
}

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

// refScan is a deliberately simple SSE parser over the whole input, used as
// the oracle for FuzzScanner. Its rules: an event is everything up to and
// including the blank line that ends a non-blank line run; an event (or the
// pending tail) longer than max is ErrEventTooLarge.
func refScan(in []byte, max int) ([]rec, error) {
	var out []rec
	start, pos := 0, 0
	pending := false
	var data []string
	var name *string
	for {
		if pos-start > max {
			return out, sse.ErrEventTooLarge
		}
		if pos == len(in) {
			if pending || pos > start && !onlyBlank(in[start:pos]) {
				return out, io.ErrUnexpectedEOF
			}
			return out, io.EOF
		}
		// find the line
		end, next := -1, -1
		for i := pos; i < len(in); i++ {
			if in[i] == '\n' {
				end, next = i, i+1
				break
			}
			if in[i] == '\r' {
				end, next = i, i+1
				if i+1 < len(in) && in[i+1] == '\n' {
					next = i + 2
				}
				break
			}
		}
		if end < 0 {
			if len(in)-start > max {
				return out, sse.ErrEventTooLarge
			}
			return out, io.ErrUnexpectedEOF
		}
		line := in[pos:end]
		pos = next
		if len(line) == 0 {
			if !pending {
				continue
			}
			if pos-start > max {
				return out, sse.ErrEventTooLarge
			}
			r := rec{Raw: string(in[start:pos]), HasData: data != nil}
			for i, d := range data {
				if i > 0 {
					r.Data += "\n"
				}
				r.Data += d
			}
			if name != nil {
				r.Name, r.Named = *name, true
			}
			ev := sse.Event{HasData: r.HasData}
			if r.HasData {
				ev.Data = []byte(r.Data)
			}
			r.Kind = ev.Kind()
			out = append(out, r)
			start, pending, data, name = pos, false, nil, nil
			continue
		}
		pending = true
		if line[0] == ':' {
			continue
		}
		field, value := string(line), ""
		if i := bytes.IndexByte(line, ':'); i >= 0 {
			field, value = string(line[:i]), string(line[i+1:])
			if len(value) > 0 && value[0] == ' ' {
				value = value[1:]
			}
		}
		switch field {
		case "data":
			data = append(data, value)
		case "event":
			v := value
			name = &v
		}
	}
}

func onlyBlank(b []byte) bool {
	return len(bytes.Trim(b, "\r\n")) == 0
}

// sameErr compares errors by what callers test for.
func sameErr(a, b error) bool {
	if errors.Is(a, sse.ErrEventTooLarge) || errors.Is(b, sse.ErrEventTooLarge) {
		return errors.Is(a, sse.ErrEventTooLarge) && errors.Is(b, sse.ErrEventTooLarge)
	}
	return a == b
}

func FuzzScanner(f *testing.F) {
	for _, s := range scannerSeeds {
		f.Add([]byte(s.data), s.split, s.max)
	}
	f.Fuzz(func(t *testing.T, data []byte, split uint16, maxByte uint8) {
		max := 1 + int(maxByte) // 1..256: small enough to hit the limit often
		limit := len(data) + 2  // every event consumes at least one byte

		want, wantErr := refScan(data, max)
		readers := map[string]io.Reader{
			"one read":   bytes.NewReader(data),
			"split":      newSplitReader(data, int(split)%(len(data)+1)),
			"byte-wise":  iotest.OneByteReader(bytes.NewReader(data)),
			"half reads": iotest.HalfReader(bytes.NewReader(data)),
		}
		for how, r := range readers {
			s := sse.NewScanner(r, max)
			var got []rec
			var raw []byte
			var err error
			for range limit {
				var ev sse.Event
				ev, err = s.Next()
				if err != nil {
					break
				}
				if len(ev.Raw) > max {
					t.Fatalf("%s: event of %d bytes over the limit %d", how, len(ev.Raw), max)
				}
				raw = append(raw, ev.Raw...)
				got = append(got, copyEvent(ev))
			}
			if err == nil {
				t.Fatalf("%s: scanner did not stop", how)
			}
			if !bytes.HasPrefix(data, raw) {
				t.Fatalf("%s: concatenated Raw %q is not a prefix of the input", how, raw)
			}
			if s.BufCap() > max+1 {
				t.Fatalf("%s: buffer of %d bytes for a limit of %d", how, s.BufCap(), max)
			}
			if !sameErr(err, wantErr) {
				t.Fatalf("%s: error %v, reference %v", how, err, wantErr)
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("%s: events differ from the reference\n got %v\nwant %v", how, got, want)
			}
		}
		// Next followed by NextBuffered until it says no: the same events,
		// and the Raw of a run of buffered events adjacent in memory.
		for how, r := range map[string]io.Reader{
			"buffered, one read":   bytes.NewReader(data),
			"buffered, half reads": iotest.HalfReader(bytes.NewReader(data)),
			"buffered, split":      newSplitReader(data, int(split)%(len(data)+1)),
		} {
			s := sse.NewScanner(r, max)
			var got []rec
			var err error
			for range limit {
				var ev sse.Event
				if ev, err = s.Next(); err != nil {
					break
				}
				got = append(got, copyEvent(ev))
				prev := ev.Raw
				for {
					ev, ok := s.NextBuffered()
					if !ok {
						break
					}
					if len(prev) > 0 && len(ev.Raw) > 0 && uintptr(unsafe.Pointer(unsafe.SliceData(prev)))+uintptr(len(prev)) != uintptr(unsafe.Pointer(unsafe.SliceData(ev.Raw))) {
						t.Fatalf("%s: buffered event %q is not adjacent to the one before", how, ev.Raw)
					}
					prev = ev.Raw
					got = append(got, copyEvent(ev))
				}
			}
			s.Release()
			if !sameErr(err, wantErr) {
				t.Fatalf("%s: error %v, reference %v", how, err, wantErr)
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("%s: events differ from the reference\n got %v\nwant %v", how, got, want)
			}
		}
	})
}

func FuzzInspectChunk(f *testing.F) {
	for _, s := range chunkSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got := sse.InspectChunk(data)
		if walk := sse.InspectChunkWalk(data); got != walk {
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
		var want sse.ChunkInfo
		if m, ok := v.(map[string]any); ok {
			choices, _ := m["choices"].([]any)
			if choices != nil {
				for _, c := range choices {
					if c, ok := c.(map[string]any); ok {
						if fr, ok := c["finish_reason"]; ok && fr != nil {
							want.FinishReason = true
						}
					}
				}
			}
			var usage map[string]any
			usage, want.Usage = m["usage"].(map[string]any)
			want.PromptTokens = refCount(usage["prompt_tokens"])
			want.CompletionTokens = refCount(usage["completion_tokens"])
			want.UsageOnly = want.Usage && len(choices) == 0
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

func FuzzParseInbandError(f *testing.F) {
	for _, s := range errorSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		e, ok := sse.ParseInbandError(data)
		if !ok {
			if e != (sse.InbandError{}) {
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
			out := sse.AppendErrorEvent(nil, e.Message, e.Type, e.Code)
			payload := bytes.TrimSuffix(bytes.TrimPrefix(out, []byte("data: ")), []byte("\n\n"))
			back, ok := sse.ParseInbandError(payload)
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
	for _, s := range scannerSeeds {
		corpora["FuzzScanner"] = append(corpora["FuzzScanner"], corpusFile(
			fmt.Sprintf("[]byte(%q)", s.data), fmt.Sprintf("uint16(%d)", s.split), fmt.Sprintf("byte(%q)", s.max)))
	}
	for _, s := range chunkSeeds {
		corpora["FuzzInspectChunk"] = append(corpora["FuzzInspectChunk"], corpusFile(fmt.Sprintf("[]byte(%q)", s)))
	}
	for _, s := range errorSeeds {
		corpora["FuzzParseInbandError"] = append(corpora["FuzzParseInbandError"], corpusFile(fmt.Sprintf("[]byte(%q)", s)))
	}
	for fuzzer, files := range corpora {
		for i, content := range files {
			path := filepath.Join("testdata", "fuzz", fuzzer, fmt.Sprintf("seed-%02d", i))
			if *updateSeeds {
				if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
					t.Fatal(err)
				}
				continue
			}
			got, err := os.ReadFile(path)
			if err != nil || string(got) != content {
				t.Errorf("%s is missing or stale; run go test -run TestFuzzSeedFiles ./sse/ -update-seeds", path)
			}
		}
	}
}

func corpusFile(args ...string) string {
	s := "go test fuzz v1\n"
	for _, a := range args {
		s += a + "\n"
	}
	return s
}
