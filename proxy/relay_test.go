package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// readsTransport answers with an SSE body that returns reads[i] from its
// i-th Read, as a network connection delivers what the upstream flushed.
type readsTransport struct{ reads []string }

func (t readsTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	return &http.Response{
		StatusCode: 200,
		Header:     http.Header{"Content-Type": {"text/event-stream"}},
		Body:       io.NopCloser(&readsBody{reads: t.reads}),
		Request:    r,
	}, nil
}

type readsBody struct {
	reads []string
	next  int
	rest  string
}

func (b *readsBody) Read(p []byte) (int, error) {
	if b.rest == "" {
		if b.next == len(b.reads) {
			return 0, io.EOF
		}
		b.rest = b.reads[b.next]
		b.next++
	}
	n := copy(p, b.rest)
	b.rest = b.rest[n:]
	return n, nil
}

// flushRecorder records what each flush sent to the client.
type flushRecorder struct {
	h       http.Header
	pending strings.Builder
	flushes []string
}

func (w *flushRecorder) Header() http.Header { return w.h }
func (w *flushRecorder) WriteHeader(int)     {}
func (w *flushRecorder) Write(p []byte) (int, error) {
	return w.pending.Write(p)
}
func (w *flushRecorder) Flush() {
	w.flushes = append(w.flushes, w.pending.String())
	w.pending.Reset()
}

const chunkC = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"!\"},\"finish_reason\":null}]}\n\n"

func relayFlushes(t *testing.T, cfg Config, body string, reads ...string) ([]string, *Result) {
	t.Helper()
	cfg.Transport, cfg.Balancer = readsTransport{reads}, oneBalancer{}
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	w := &flushRecorder{h: http.Header{}}
	res := p.ServeHTTP(w, post(body))
	if w.pending.Len() > 0 {
		t.Fatalf("%q written but never flushed", w.pending.String())
	}
	return w.flushes, res
}

// Events that arrive together reach the client together, with one flush;
// an event is never held back to wait for the next one.
func TestRelayFlushesEventsThatArriveTogetherOnce(t *testing.T) {
	for _, tc := range []struct {
		name  string
		reads []string
		want  []string
	}{
		{"one event per read", []string{chunkA, chunkB, chunkEnd, done},
			[]string{chunkA, chunkB, chunkEnd, done}},
		{"a burst after the first event", []string{chunkA + chunkB + chunkC, chunkEnd + done},
			[]string{chunkA, chunkB + chunkC, chunkEnd + done}},
		{"an incomplete event is not waited for", []string{chunkA, chunkB + chunkC[:20], chunkC[20:] + done},
			[]string{chunkA, chunkB, chunkC + done}},
		{"nothing after [DONE]", []string{chunkA, chunkB + done + chunkC},
			[]string{chunkA, chunkB + done}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			flushes, res := relayFlushes(t, Config{}, `{"model":"m","stream":true}`, tc.reads...)
			if !slices.Equal(flushes, tc.want) {
				t.Fatalf("flushes\n got %q\nwant %q", flushes, tc.want)
			}
			if res.Outcome != OutcomeSuccess || res.Events != strings.Count(strings.Join(tc.want, ""), "\n\n") {
				t.Fatalf("outcome %v, %d events counted", res.Outcome, res.Events)
			}
		})
	}
}

// A usage chunk asked for on the client's behalf is dropped from a burst
// without splitting it, and its usage is read.
func TestRelayDropsRequestedUsageFromABurst(t *testing.T) {
	usage := "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n"
	flushes, res := relayFlushes(t, Config{RequestUsage: true}, `{"model":"m","stream":true}`,
		chunkA, chunkB+usage+chunkC+done)
	if want := []string{chunkA, chunkB + chunkC + done}; !slices.Equal(flushes, want) {
		t.Fatalf("flushes\n got %q\nwant %q", flushes, want)
	}
	if !res.Usage.Reported || res.Usage.CompletionTokens != 2 || res.ContentEvents != 3 {
		t.Fatalf("usage %+v, %d content events", res.Usage, res.ContentEvents)
	}
}

// An upstream error event in a burst ends the stream with it; nothing after
// it is relayed and the stream is not a success.
func TestRelayEndsABurstAtAnErrorEvent(t *testing.T) {
	errEv := "data: {\"error\":{\"message\":\"boom\",\"type\":\"server_error\",\"code\":\"500\"}}\n\n"
	flushes, res := relayFlushes(t, Config{}, `{"model":"m","stream":true}`, chunkA, chunkB+errEv+chunkC+done)
	if want := []string{chunkA, chunkB + errEv}; !slices.Equal(flushes, want) {
		t.Fatalf("flushes\n got %q\nwant %q", flushes, want)
	}
	if res.Outcome != OutcomeInbandError {
		t.Fatalf("outcome %v", res.Outcome)
	}
}

// relayStream is one API's stream for relayAllocs: its path, the event
// that repeats, and the events before and after the repeats.
type relayStream struct {
	path       string
	head, tail []string
	delta      string
}

// relayStreams are the streams of every API whose relay must not allocate
// per event.
var relayStreams = []relayStream{
	{path: "/v1/chat/completions", delta: chunkA, tail: []string{chunkEnd, done}},
	{path: "/v1/responses",
		head:  []string{"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"r\",\"status\":\"in_progress\"}}\n\n"},
		delta: "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":1,\"item_id\":\"m\",\"output_index\":0,\"content_index\":0,\"delta\":\"Hi\"}\n\n",
		tail:  []string{"event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":2,\"response\":{\"id\":\"r\",\"status\":\"completed\",\"usage\":{\"input_tokens\":3,\"output_tokens\":9}}}\n\n"}},
	{path: "/v1/messages",
		head:  []string{"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":3,\"output_tokens\":1}}}\n\n"},
		delta: "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n",
		tail: []string{"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":9}}\n\n",
			"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"}},
}

// relayAllocs returns the allocations of one request whose upstream sends
// events generated events of stream s, one per read or all in one read.
func relayAllocs(t *testing.T, s relayStream, events int, together bool) float64 {
	t.Helper()
	reads := append([]string(nil), s.head...)
	for range events {
		reads = append(reads, s.delta)
	}
	reads = append(reads, s.tail...)
	if together {
		reads = []string{strings.Join(reads, "")}
	}
	// With the gap histogram's path on: a stream's recorder costs nothing
	// per event either.
	p, err := New(Config{Transport: readsTransport{reads}, Balancer: oneBalancer{}, Observer: &gapCounter{}})
	if err != nil {
		t.Fatal(err)
	}
	body := `{"model":"m","stream":true}`
	return testing.AllocsPerRun(50, func() {
		r, _ := http.NewRequest(http.MethodPost, "http://gw"+s.path, strings.NewReader(body))
		w := &discardWriter{h: http.Header{}}
		if res := p.ServeHTTP(w, r); res.Outcome != OutcomeSuccess || res.Events != events+len(s.head)+len(s.tail) {
			t.Fatalf("%s: outcome %v, %d events", s.path, res.Outcome, res.Events)
		}
	})
}

// The relay allocates nothing per event in steady state, in every API: a
// stream of 1,000 events costs the same allocations as one of 10, whether
// the upstream's events arrive one per read or in bursts. Each count is the least of a few
// runs: goroutines that outlive a request (the drain of a finished body)
// allocate now and then, never less. A regression of one allocation per
// 200 events fails.
func TestRelayAllocatesNothingPerEvent(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are meaningless under the race detector")
	}
	for _, s := range relayStreams {
		least := func(events int, together bool) float64 {
			n := relayAllocs(t, s, events, together)
			for range 4 {
				n = min(n, relayAllocs(t, s, events, together))
			}
			return n
		}
		for _, together := range []bool{false, true} {
			short, long := least(10, together), least(1000, together)
			if perEvent := (long - short) / 990; perEvent >= 0.005 {
				t.Errorf("%s together=%v: %.0f allocations for 10 events, %.0f for 1,000: %.4f per event, want 0",
					s.path, together, short, long, perEvent)
			}
		}
	}
}

// watched returns an attempt whose idle watch runs on clk, and its context.
func watched(clk clock.Clock, idle time.Duration) (*attempt, context.Context) {
	ctx, cancel := context.WithCancelCause(context.Background())
	x := &exchange{p: &Proxy{clock: clk}, start: clk.Now()}
	a := &attempt{x: x, ctx: ctx, cancel: cancel}
	a.idle.start(idle, a)
	return a, ctx
}

// The idle watch fires idle after the relay last started waiting, however
// often events came before; writing to the client does not count.
func TestIdleWatchCountsFromTheLastWait(t *testing.T) {
	const idle = 50 * time.Millisecond
	t.Run("a quiet upstream", func(t *testing.T) {
		clk := clocktest.New(time.Time{})
		a, ctx := watched(clk, idle)
		defer a.idle.stop()
		clk.Advance(idle - time.Millisecond)
		if ctx.Err() != nil {
			t.Fatal("cancelled before the idle timeout")
		}
		clk.Advance(time.Millisecond)
		if !errors.Is(context.Cause(ctx), errIdleTimeout) {
			t.Fatalf("cause %v after %v of silence", context.Cause(ctx), idle)
		}
	})
	t.Run("an event re-arms it for the rest", func(t *testing.T) {
		clk := clocktest.New(time.Time{})
		a, ctx := watched(clk, idle)
		defer a.idle.stop()
		clk.Advance(30 * time.Millisecond)
		a.idle.busy()
		a.idle.wait() // an event at 30ms
		clk.Advance(20 * time.Millisecond)
		clk.Advance(29 * time.Millisecond)
		if ctx.Err() != nil {
			t.Fatal("cancelled 49ms after the last event")
		}
		clk.Advance(time.Millisecond)
		if !errors.Is(context.Cause(ctx), errIdleTimeout) {
			t.Fatalf("cause %v 50ms after the last event", context.Cause(ctx))
		}
	})
	t.Run("a slow write", func(t *testing.T) {
		clk := clocktest.New(time.Time{})
		a, ctx := watched(clk, idle)
		defer a.idle.stop()
		a.idle.busy()
		clk.Advance(time.Minute) // the client takes a minute
		a.idle.wait()
		clk.Advance(idle - time.Millisecond)
		if ctx.Err() != nil {
			t.Fatal("a slow client was counted as upstream silence")
		}
		clk.Advance(time.Millisecond)
		if !errors.Is(context.Cause(ctx), errIdleTimeout) {
			t.Fatalf("cause %v %v after the write", context.Cause(ctx), idle)
		}
	})
	t.Run("stopped", func(t *testing.T) {
		clk := clocktest.New(time.Time{})
		a, ctx := watched(clk, idle)
		a.idle.stop()
		clk.Advance(time.Hour)
		if ctx.Err() != nil {
			t.Fatal("a stopped watch cancelled the attempt")
		}
	})
}

// gapCounter is an Observer that counts the inter-event gaps recorded.
type gapCounter struct {
	nopObserver
	n       atomic.Int64
	streams atomic.Int64
	last    atomic.Value // "upstream model" of the last stream
}

func (g *gapCounter) StreamGaps(upstream, model string) GapRecorder {
	g.streams.Add(1)
	g.last.Store(upstream + " " + model)
	return (*gapRecorder)(g)
}

type gapRecorder gapCounter

func (r *gapRecorder) Observe(float64) { r.n.Add(1) }

// A committed stream records one gap per read of events from the upstream,
// under its upstream and model; a non-streamed answer records none.
func TestRelayRecordsInterEventGaps(t *testing.T) {
	g := &gapCounter{}
	p, err := New(Config{Transport: readsTransport{[]string{chunkA, chunkB, chunkB, chunkEnd, done}}, Balancer: oneBalancer{}, Observer: g})
	if err != nil {
		t.Fatal(err)
	}
	r, _ := http.NewRequest(http.MethodPost, "http://gw/v1/chat/completions", strings.NewReader(`{"model":"m","stream":true}`))
	if res := p.ServeHTTP(&discardWriter{h: http.Header{}}, r); res.Outcome != OutcomeSuccess {
		t.Fatalf("outcome %v", res.Outcome)
	}
	// chunkA commits; the relay reads the other four one by one.
	if g.streams.Load() != 1 || g.n.Load() != 4 || g.last.Load() != "mem:1 m" {
		t.Fatalf("%d streams, %d gaps, last %v; want 1 stream of 4 gaps on mem:1 m", g.streams.Load(), g.n.Load(), g.last.Load())
	}
}
