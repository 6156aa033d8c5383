package sse_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/llmproxy/caddy-llm-proxy/sse"
)

// rec is a copy of an Event that outlives the next call to Next.
type rec struct {
	Raw, Data, Name string
	HasData, Named  bool
	Kind            sse.Kind
}

func (r rec) String() string {
	return fmt.Sprintf("{Raw:%q Data:%q Name:%q HasData:%v Named:%v Kind:%v}", r.Raw, r.Data, r.Name, r.HasData, r.Named, r.Kind)
}

func copyEvent(ev sse.Event) rec {
	return rec{
		Raw: string(ev.Raw), Data: string(ev.Data), Name: string(ev.Name),
		HasData: ev.HasData, Named: ev.Name != nil, Kind: ev.Kind(),
	}
}

// collect reads every event until Next fails, and returns the events and the
// error. It fails the test if the scanner does not stop.
func collect(t testing.TB, r io.Reader, maxEventSize int, limit int) ([]rec, error) {
	t.Helper()
	s := sse.NewScanner(r, maxEventSize)
	var out []rec
	for range limit {
		ev, err := s.Next()
		if err != nil {
			if again, _ := s.Next(); again.Raw != nil {
				t.Fatalf("Next after error %v returned an event", err)
			}
			if _, again := s.Next(); again != err {
				t.Fatalf("Next after error %v returned %v; errors must be sticky", err, again)
			}
			return out, err
		}
		if ev.HasData && ev.Data == nil {
			t.Fatalf("event %q: HasData with nil Data", ev.Raw)
		}
		if !ev.HasData && ev.Data != nil {
			t.Fatalf("event %q: Data %q without HasData", ev.Raw, ev.Data)
		}
		out = append(out, copyEvent(ev))
	}
	t.Fatalf("scanner did not stop after %d events", limit)
	return nil, nil
}

// splitReader returns its data in two reads, split at off.
type splitReader struct {
	parts [][]byte
}

func newSplitReader(data []byte, off int) *splitReader {
	return &splitReader{parts: [][]byte{data[:off], data[off:]}}
}

func (r *splitReader) Read(p []byte) (int, error) {
	for len(r.parts) > 0 && len(r.parts[0]) == 0 {
		r.parts = r.parts[1:]
	}
	if len(r.parts) == 0 {
		return 0, io.EOF
	}
	n := copy(p, r.parts[0])
	r.parts[0] = r.parts[0][n:]
	return n, nil
}

// A typical vLLM stream: role chunk, content chunks (one with multi-byte
// UTF-8), finish chunk, usage chunk, [DONE]; with a keep-alive comment.
const vllmStream = `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1718000000,"model":"llama","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}

: ping

data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1718000000,"model":"llama","choices":[{"index":0,"delta":{"content":"héllo 世界 🙂"},"logprobs":null,"finish_reason":null}]}

data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1718000000,"model":"llama","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop","stop_reason":null}]}

data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1718000000,"model":"llama","choices":[],"usage":{"prompt_tokens":12,"total_tokens":40,"completion_tokens":28}}

data: [DONE]

`

func TestNextIsIdenticalForEverySplit(t *testing.T) {
	streams := map[string]string{
		"lf":   vllmStream,
		"crlf": strings.ReplaceAll(vllmStream, "\n", "\r\n"),
		"cr":   strings.ReplaceAll(vllmStream, "\n", "\r"),
		"multiline event with name and id": "event: message\r\nid: 7\r\ndata: {\"a\":\r\ndata:\"ü\"}\r\nretry: 10\r\n\r\n" +
			"data:[DONE]\n\n",
	}
	for name, stream := range streams {
		t.Run(name, func(t *testing.T) {
			data := []byte(stream)
			want, wantErr := collect(t, bytes.NewReader(data), 0, 100)
			if wantErr != io.EOF {
				t.Fatalf("one read: error %v, want io.EOF", wantErr)
			}
			if len(want) < 2 {
				t.Fatalf("one read: %d events, want several", len(want))
			}
			check := func(how string, r io.Reader) {
				t.Helper()
				got, err := collect(t, r, 0, 100)
				if err != wantErr {
					t.Fatalf("%s: error %v, want %v", how, err, wantErr)
				}
				if fmt.Sprint(got) != fmt.Sprint(want) {
					t.Fatalf("%s: events differ\n got %v\nwant %v", how, got, want)
				}
			}
			for off := 0; off <= len(data); off++ {
				check(fmt.Sprintf("split at %d", off), newSplitReader(data, off))
			}
			check("one byte per read", iotest.OneByteReader(bytes.NewReader(data)))
			check("half reads", iotest.HalfReader(bytes.NewReader(data)))
			check("data with EOF", iotest.DataErrReader(bytes.NewReader(data)))
		})
	}
}

func TestNextFraming(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		want    []rec
		wantErr error
	}{
		{
			name: "lf data event",
			in:   "data: {\"x\":1}\n\n",
			want: []rec{{Raw: "data: {\"x\":1}\n\n", Data: `{"x":1}`, HasData: true, Kind: sse.KindData}},
		},
		{
			name: "crlf framing kept in raw",
			in:   "data: a\r\n\r\ndata: b\r\n\r\n",
			want: []rec{
				{Raw: "data: a\r\n\r\n", Data: "a", HasData: true, Kind: sse.KindData},
				{Raw: "data: b\r\n\r\n", Data: "b", HasData: true, Kind: sse.KindData},
			},
		},
		{
			name: "lone cr framing",
			in:   "data: a\r\rdata: b\r\r",
			want: []rec{
				{Raw: "data: a\r\r", Data: "a", HasData: true, Kind: sse.KindData},
				{Raw: "data: b\r\r", Data: "b", HasData: true, Kind: sse.KindData},
			},
		},
		{
			name: "mixed line endings in one event",
			in:   "data: a\rdata: b\r\ndata: c\n\r\n",
			want: []rec{{Raw: "data: a\rdata: b\r\ndata: c\n\r\n", Data: "a\nb\nc", HasData: true, Kind: sse.KindData}},
		},
		{
			name: "comment is its own event",
			in:   ": ping\n\ndata: x\n\n",
			want: []rec{
				{Raw: ": ping\n\n", Kind: sse.KindComment},
				{Raw: "data: x\n\n", Data: "x", HasData: true, Kind: sse.KindData},
			},
		},
		{
			name: "comment inside a data event is dropped from data",
			in:   "data: a\n: note\ndata: b\n\n",
			want: []rec{{Raw: "data: a\n: note\ndata: b\n\n", Data: "a\nb", HasData: true, Kind: sse.KindData}},
		},
		{
			name: "event name, last one wins",
			in:   "event: first\nevent: error\ndata: {}\n\n",
			want: []rec{{Raw: "event: first\nevent: error\ndata: {}\n\n", Data: "{}", Name: "error", Named: true, HasData: true, Kind: sse.KindData}},
		},
		{
			name: "event name without data is a comment",
			in:   "event: ping\n\n",
			want: []rec{{Raw: "event: ping\n\n", Name: "ping", Named: true, Kind: sse.KindComment}},
		},
		{
			name: "multi-line data joined with lf",
			in:   "data: line one\ndata: line two\ndata:\ndata: four\n\n",
			want: []rec{{Raw: "data: line one\ndata: line two\ndata:\ndata: four\n\n", Data: "line one\nline two\n\nfour", HasData: true, Kind: sse.KindData}},
		},
		{
			name: "data without space",
			in:   "data:[DONE]\n\n",
			want: []rec{{Raw: "data:[DONE]\n\n", Data: "[DONE]", HasData: true, Kind: sse.KindDone}},
		},
		{
			name: "only one leading space is removed",
			in:   "data:  two spaces\n\n",
			want: []rec{{Raw: "data:  two spaces\n\n", Data: " two spaces", HasData: true, Kind: sse.KindData}},
		},
		{
			name: "data field without colon is an empty data line",
			in:   "data\n\n",
			want: []rec{{Raw: "data\n\n", Data: "", HasData: true, Kind: sse.KindData}},
		},
		{
			name: "id and retry ignored for data but kept in raw",
			in:   "id: 42\nretry: 3000\ndata: x\nfoo: bar\n\n",
			want: []rec{{Raw: "id: 42\nretry: 3000\ndata: x\nfoo: bar\n\n", Data: "x", HasData: true, Kind: sse.KindData}},
		},
		{
			name: "field names are case sensitive",
			in:   "Data: x\nEVENT: y\n\n",
			want: []rec{{Raw: "Data: x\nEVENT: y\n\n", Kind: sse.KindComment}},
		},
		{
			name: "extra blank lines belong to the next event",
			in:   "\n\ndata: a\n\n\r\n\rdata: b\n\n\n\n",
			want: []rec{
				{Raw: "\n\ndata: a\n\n", Data: "a", HasData: true, Kind: sse.KindData},
				{Raw: "\r\n\rdata: b\n\n", Data: "b", HasData: true, Kind: sse.KindData},
			},
		},
		{
			name: "done with whitespace",
			in:   "data:  [DONE] \n\n",
			want: []rec{{Raw: "data:  [DONE] \n\n", Data: " [DONE] ", HasData: true, Kind: sse.KindDone}},
		},
		{
			name: "in-band error event",
			in:   "data: {\"error\":{\"message\":\"boom\",\"type\":\"server_error\",\"code\":500}}\n\n",
			want: []rec{{Raw: "data: {\"error\":{\"message\":\"boom\",\"type\":\"server_error\",\"code\":500}}\n\n", Data: `{"error":{"message":"boom","type":"server_error","code":500}}`, HasData: true, Kind: sse.KindError}},
		},
		{
			name: "lone cr at the end of the stream ends the event",
			in:   "data: a\r\r",
			want: []rec{{Raw: "data: a\r\r", Data: "a", HasData: true, Kind: sse.KindData}},
		},
		{
			name: "empty stream",
			in:   "",
		},
		{
			name: "only blank lines",
			in:   "\n\r\n\r",
		},
		{
			name:    "ends after a data line without the blank line",
			in:      "data: a\n\ndata: b\n",
			want:    []rec{{Raw: "data: a\n\n", Data: "a", HasData: true, Kind: sse.KindData}},
			wantErr: io.ErrUnexpectedEOF,
		},
		{
			name:    "ends inside a line",
			in:      "data: {\"choices\":[",
			wantErr: io.ErrUnexpectedEOF,
		},
		{
			name:    "ends inside [DONE]",
			in:      "data: [DO",
			wantErr: io.ErrUnexpectedEOF,
		},
		{
			name:    "ends after a comment line",
			in:      ": ping\n",
			wantErr: io.ErrUnexpectedEOF,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.wantErr == nil {
				tt.wantErr = io.EOF
			}
			got, err := collect(t, strings.NewReader(tt.in), 0, 100)
			if err != tt.wantErr {
				t.Errorf("error %v, want %v", err, tt.wantErr)
			}
			if fmt.Sprint(got) != fmt.Sprint(tt.want) {
				t.Errorf("events\n got %v\nwant %v", got, tt.want)
			}
		})
	}
}

func TestNextReturnsReadErrorAfterCompleteEvents(t *testing.T) {
	boom := errors.New("connection reset")
	r := io.MultiReader(strings.NewReader("data: a\n\ndata: b"), iotest.ErrReader(boom))
	got, err := collect(t, r, 0, 10)
	if err != boom {
		t.Fatalf("error %v, want the reader's error as is", err)
	}
	if len(got) != 1 || got[0].Data != "a" {
		t.Fatalf("events %v, want the one complete event", got)
	}
}

func TestNextGivesUpOnAReaderThatNeverProgresses(t *testing.T) {
	s := sse.NewScanner(readerFunc(func([]byte) (int, error) { return 0, nil }), 0)
	if _, err := s.Next(); err != io.ErrNoProgress {
		t.Fatalf("error %v, want io.ErrNoProgress", err)
	}
}

type readerFunc func([]byte) (int, error)

func (f readerFunc) Read(p []byte) (int, error) { return f(p) }

func TestNextPassesA256KiBEventWithTheDefaultLimit(t *testing.T) {
	content := strings.Repeat("é", 128<<10) // 256 KiB of two-byte runes
	in := "data: " + content + "\n\ndata: [DONE]\n\n"
	s := sse.NewScanner(iotest.HalfReader(strings.NewReader(in)), 1<<20)
	ev, err := s.Next()
	if err != nil {
		t.Fatal(err)
	}
	if string(ev.Data) != content {
		t.Fatalf("data of %d bytes, want %d", len(ev.Data), len(content))
	}
	if ev, err = s.Next(); err != nil || ev.Kind() != sse.KindDone {
		t.Fatalf("second event %q, %v; want [DONE]", ev.Raw, err)
	}
	if _, err = s.Next(); err != io.EOF {
		t.Fatalf("error %v, want io.EOF", err)
	}
}

func TestNextAcceptsAnEventOfExactlyTheLimit(t *testing.T) {
	for _, nl := range []string{"\n", "\r\n", "\r"} {
		ev := "data: " + strings.Repeat("x", 100) + nl + nl
		for _, next := range []string{"", "data: y" + nl + nl} {
			got, err := collect(t, iotest.OneByteReader(strings.NewReader(ev+next)), len(ev), 10)
			if err != io.EOF || len(got) == 0 || got[0].Raw != ev {
				t.Errorf("%q+%q at limit %d: %v, %v; want the event then io.EOF", ev, next, len(ev), got, err)
			}
			_, err = collect(t, strings.NewReader(ev+next), len(ev)-1, 10)
			if !errors.Is(err, sse.ErrEventTooLarge) {
				t.Errorf("%q at limit %d: error %v, want ErrEventTooLarge", ev, len(ev)-1, err)
			}
		}
	}
}

// infiniteReader yields an endless line of 'a' bytes.
type infiniteReader struct{ n int }

func (r *infiniteReader) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = 'a'
	}
	r.n += len(p)
	return len(p), nil
}

func TestNextRejectsAnEndlessLineWithBoundedMemory(t *testing.T) {
	for _, max := range []int{1, 100, 64 << 10, 1 << 20} {
		t.Run(fmt.Sprint(max), func(t *testing.T) {
			r := &infiniteReader{}
			s := sse.NewScanner(r, max)
			_, err := s.Next()
			if !errors.Is(err, sse.ErrEventTooLarge) {
				t.Fatalf("error %v, want ErrEventTooLarge", err)
			}
			if got := s.BufCap(); got > max+1 {
				t.Errorf("buffer grew to %d bytes for a limit of %d", got, max)
			}
			if r.n > max+1 {
				t.Errorf("read %d bytes before giving up, want at most %d", r.n, max+1)
			}
		})
	}
}

func TestNextRejectsAnEventOfManyShortLines(t *testing.T) {
	const max = 4 << 10
	in := "data: x\n" + strings.Repeat(": pad\n", max) + "\n"
	s := sse.NewScanner(strings.NewReader(in), max)
	if _, err := s.Next(); !errors.Is(err, sse.ErrEventTooLarge) {
		t.Fatalf("error %v, want ErrEventTooLarge", err)
	}
	if s.BufCap() > max+1 {
		t.Errorf("buffer grew to %d bytes for a limit of %d", s.BufCap(), max)
	}
}

func TestNextDefaultsTheLimit(t *testing.T) {
	s := sse.NewScanner(&infiniteReader{}, 0)
	if _, err := s.Next(); !errors.Is(err, sse.ErrEventTooLarge) {
		t.Fatalf("error %v, want ErrEventTooLarge", err)
	}
	if s.BufCap() != sse.DefaultMaxEventSize+1 {
		t.Errorf("buffer %d bytes, want DefaultMaxEventSize+1", s.BufCap())
	}
}

// loopReader serves the same stream forever, in reads of at most chunk bytes,
// the way a chunked HTTP body does.
type loopReader struct {
	data  []byte
	off   int
	chunk int
}

func (r *loopReader) Read(p []byte) (int, error) {
	if len(p) > r.chunk {
		p = p[:r.chunk]
	}
	n := copy(p, r.data[r.off:])
	r.off = (r.off + n) % len(r.data)
	return n, nil
}

// steadyStream is the content part of a stream, repeated forever by benchmarks.
var steadyStream = func() []byte {
	var b bytes.Buffer
	for i := range 8 {
		fmt.Fprintf(&b, `data: {"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1718000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":" token%d"},"logprobs":null,"finish_reason":null}]}`+"\n\n", i)
	}
	b.WriteString(": ping\r\n\r\n")
	b.WriteString("data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\r\n\r\n")
	return b.Bytes()
}()

func TestNextDoesNotAllocateInSteadyState(t *testing.T) {
	for _, chunk := range []int{1 << 10, 32 << 10, 7} {
		s := sse.NewScanner(&loopReader{data: steadyStream, chunk: chunk}, 0)
		for range 100 { // warm up: buffers reach their working size
			if _, err := s.Next(); err != nil {
				t.Fatal(err)
			}
		}
		allocs := testing.AllocsPerRun(1000, func() {
			ev, err := s.Next()
			if err != nil || ev.Kind() == sse.KindError {
				t.Fatal(ev, err)
			}
		})
		if allocs != 0 {
			t.Errorf("reads of %d bytes: %v allocs per event, want 0", chunk, allocs)
		}
	}
}

func BenchmarkScannerNext(b *testing.B) {
	s := sse.NewScanner(&loopReader{data: steadyStream, chunk: 16 << 10}, 0)
	b.SetBytes(int64(len(steadyStream)) / 10) // 10 events per loop of the stream
	b.ReportAllocs()
	for b.Loop() {
		if _, err := s.Next(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "events/s")
}

// countingReader counts the reads made through it.
type countingReader struct {
	r     io.Reader
	reads int
}

func (c *countingReader) Read(p []byte) (int, error) {
	c.reads++
	return c.r.Read(p)
}

// NextBuffered hands out the events already complete in the buffer and
// never reads; an event that is not complete yet stays for Next, whole.
func TestNextBufferedNeverReads(t *testing.T) {
	in := "data: a\n\n: ping\n\ndata: b\r\n\r\ndata: c\nda"
	r := &countingReader{r: newSplitReader([]byte(in+"ta: d\n\n"), len(in))}
	s := sse.NewScanner(r, 0)
	ev, err := s.Next()
	if err != nil || string(ev.Data) != "a" {
		t.Fatalf("Next: %q, %v", ev.Data, err)
	}
	reads := r.reads
	var got []string
	for {
		ev, ok := s.NextBuffered()
		if !ok {
			break
		}
		got = append(got, string(ev.Raw))
	}
	if want := []string{": ping\n\n", "data: b\r\n\r\n"}; !slices.Equal(got, want) || r.reads != reads {
		t.Fatalf("NextBuffered gave %q with %d more reads, want %q and none", got, r.reads-reads, want)
	}
	ev, err = s.Next()
	if err != nil || string(ev.Raw) != "data: c\ndata: d\n\n" || string(ev.Data) != "c\nd" {
		t.Fatalf("Next after NextBuffered: %q (data %q), %v", ev.Raw, ev.Data, err)
	}
}

// A released scanner's buffer serves the next scanner: a stream costs the
// Scanner itself, not another buffer.
func TestReleaseReusesTheBuffer(t *testing.T) {
	r := strings.NewReader("")
	allocs := testing.AllocsPerRun(100, func() {
		r.Reset("data: x\n\n")
		s := sse.NewScanner(r, 0)
		if ev, err := s.Next(); err != nil || string(ev.Data) != "x" {
			t.Fatal(ev, err)
		}
		s.Release()
	})
	if allocs > 1 {
		t.Fatalf("%v allocations per scanner with Release, want 1 (the Scanner)", allocs)
	}
	s := sse.NewScanner(strings.NewReader("data: x\n\n"), 0)
	s.Release()
	s.Release()
	if _, err := s.Next(); err == nil {
		t.Fatal("Next after Release returned no error")
	}
	if _, ok := s.NextBuffered(); ok {
		t.Fatal("NextBuffered after Release returned an event")
	}
}

// waitingReader is a reader with WaitReadable, as internal/h1's body is:
// the Scanner gives its buffer back and waits before reading for a new
// event.
type waitingReader struct {
	io.Reader
	waits int
	err   error // returned by WaitReadable once set
}

func (w *waitingReader) WaitReadable() error {
	w.waits++
	return w.err
}

// TestNextOverAReadableWaiter: the path that gives the buffer back between
// events yields the same events, however the input is split, with no
// allocation per event once warm, and WaitReadable's error is Next's.
func TestNextOverAReadableWaiter(t *testing.T) {
	for name, stream := range map[string]string{
		"lf":   vllmStream,
		"crlf": strings.ReplaceAll(vllmStream, "\n", "\r\n"),
		"cr":   strings.ReplaceAll(vllmStream, "\n", "\r"),
	} {
		data := []byte(stream)
		want, _ := collect(t, bytes.NewReader(data), 0, 100)
		check := func(how string, r io.Reader) {
			t.Helper()
			w := &waitingReader{Reader: r}
			got, err := collect(t, w, 0, 100)
			if err != io.EOF || fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("%s %s: %v\n got %v\nwant %v", name, how, err, got, want)
			}
			if w.waits == 0 {
				t.Fatalf("%s %s: WaitReadable never called", name, how)
			}
		}
		for off := 0; off <= len(data); off++ {
			check(fmt.Sprintf("split at %d", off), newSplitReader(data, off))
		}
		check("one byte per read", iotest.OneByteReader(bytes.NewReader(data)))
		check("half reads", iotest.HalfReader(bytes.NewReader(data)))
		check("data with EOF", iotest.DataErrReader(bytes.NewReader(data)))
	}

	for _, chunk := range []int{1 << 10, 32 << 10, 7} {
		s := sse.NewScanner(&waitingReader{Reader: &loopReader{data: steadyStream, chunk: chunk}}, 0)
		for range 100 {
			if _, err := s.Next(); err != nil {
				t.Fatal(err)
			}
		}
		allocs := testing.AllocsPerRun(1000, func() {
			if _, err := s.Next(); err != nil {
				t.Fatal(err)
			}
		})
		if allocs != 0 {
			t.Errorf("reads of %d bytes: %v allocs per event, want 0", chunk, allocs)
		}
	}

	cut := errors.New("cut")
	w := &waitingReader{Reader: strings.NewReader("data: 1\n\n"), err: cut}
	if _, err := collect(t, w, 0, 10); err != cut {
		t.Fatalf("error %v, want WaitReadable's", err)
	}
}
