package sse_test

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"testing"
	"testing/iotest"
	"unsafe"

	"github.com/llmproxy/caddy-llm-proxy/internal/fuzzseed"
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

// TestFuzzSeedFiles checks that every seed list has its corpus files under
// testdata/fuzz (written with -update-seeds).
func TestFuzzSeedFiles(t *testing.T) {
	corpora := map[string][]string{}
	for _, s := range scannerSeeds {
		corpora["FuzzScanner"] = append(corpora["FuzzScanner"], fuzzseed.File(
			fmt.Sprintf("[]byte(%q)", s.data), fmt.Sprintf("uint16(%d)", s.split), fmt.Sprintf("byte(%q)", s.max)))
	}
	fuzzseed.Check(t, corpora, *updateSeeds, "./sse/")
}
