package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// step is one action of a fake SSE upstream: wait, then write.
type step struct {
	wait  time.Duration
	write string
}

func chunk(content string) string {
	return fmt.Sprintf(`data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":%q},"finish_reason":null}]}`+"\n\n", content)
}

const finishChunk = `data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}` + "\n\n"

// fakeSSE serves the steps as an SSE stream, flushing after each write.
func fakeSSE(t *testing.T, status int, steps ...step) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(UpstreamHeader, "replica-1")
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(status)
		w.(http.Flusher).Flush()
		for _, s := range steps {
			select {
			case <-time.After(s.wait):
			case <-r.Context().Done():
				return
			}
			if s.write == "hijack-close" {
				conn, _, _ := http.NewResponseController(w).Hijack()
				conn.Close()
				return
			}
			fmt.Fprint(w, s.write)
			w.(http.Flusher).Flush()
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

func doOnce(t *testing.T, url string, timeout time.Duration) Result {
	t.Helper()
	q := &Requester{Client: newHTTPClient(1), URL: url, Body: chatBody("m", true, 0, 0), Timeout: timeout}
	return q.Do(context.Background())
}

func TestStreamTimingMeasuresTTFTAndGaps(t *testing.T) {
	const ttft, gap = 60 * time.Millisecond, 25 * time.Millisecond
	srv := fakeSSE(t, 200,
		step{0, ": ping\n\n"}, // a comment is not the first token
		step{ttft, chunk("a")},
		step{gap, chunk("b")},
		step{gap, finishChunk},
		step{0, "data: [DONE]\n\n"},
	)
	r := doOnce(t, srv.URL, 5*time.Second)
	if r.Outcome != OutcomeOK || r.FinishReason != "stop" {
		t.Fatalf("outcome %q (%s), finish %q; want ok, stop", r.Outcome, r.Detail, r.FinishReason)
	}
	if r.Upstream != "replica-1" || r.Status != 200 {
		t.Errorf("upstream %q status %d", r.Upstream, r.Status)
	}
	if !r.HasTTFT || r.TTFT < ttft || r.TTFT > ttft+time.Second {
		t.Errorf("ttft = %v, want about %v", r.TTFT, ttft)
	}
	if r.Events != 4 || len(r.Gaps) != 3 {
		t.Fatalf("events %d gaps %v; want 4 events, 3 gaps", r.Events, r.Gaps)
	}
	// A busy machine can delay reading one event and so shorten the next
	// gap, but no event can be read before it was sent.
	if at := r.TTFT + r.Gaps[0] + r.Gaps[1]; at < ttft+2*gap || at > ttft+2*gap+time.Second {
		t.Errorf("finish event read at %v (ttft %v, gaps %v), want about %v", at, r.TTFT, r.Gaps, ttft+2*gap)
	}
	if r.Total < r.TTFT || r.Bytes == 0 {
		t.Errorf("total %v bytes %d", r.Total, r.Bytes)
	}
}

func TestStreamOutcomes(t *testing.T) {
	tests := []struct {
		name    string
		status  int
		steps   []step
		timeout time.Duration
		want    string
		events  int
	}{
		{"done without finish_reason is ok", 200, []step{{0, chunk("a")}, {0, "data: [DONE]\n\n"}}, 0, OutcomeOK, 2},
		{"finish_reason without done is ok", 200, []step{{0, chunk("a")}, {0, finishChunk}}, 0, OutcomeOK, 2},
		{"crlf framing", 200, []step{{0, "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\r\n\r\n"}, {0, "data: [DONE]\r\n\r\n"}}, 0, OutcomeOK, 2},
		{"eof without finish is truncated", 200, []step{{0, chunk("a")}, {0, chunk("b")}}, 0, OutcomeTruncated, 2},
		{"reset mid-stream is truncated", 200, []step{{0, chunk("a")}, {0, "hijack-close"}}, 0, OutcomeTruncated, 1},
		{"in-band error event", 200, []step{{0, chunk("a")}, {0, `data: {"error":{"message":"upstream died","type":"server_error","code":"502"}}` + "\n\n"}}, 0, OutcomeErrorEvent, 2},
		{"vllm-style error event", 200, []step{{0, `data: {"object":"error","message":"boom","code":500}` + "\n\n"}}, 0, OutcomeErrorEvent, 1},
		{"http status", 503, []step{{0, `{"error":{"message":"overloaded"}}`}}, 0, "http_503", 0},
		{"stall past timeout", 200, []step{{0, chunk("a")}, {2 * time.Second, finishChunk}}, 100 * time.Millisecond, OutcomeTimeout, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := fakeSSE(t, tt.status, tt.steps...)
			r := doOnce(t, srv.URL, tt.timeout)
			if r.Outcome != tt.want || r.Events != tt.events {
				t.Fatalf("outcome %q events %d (%s); want %q, %d events", r.Outcome, r.Events, r.Detail, tt.want, tt.events)
			}
			if tt.want != OutcomeOK && r.Detail == "" {
				t.Errorf("no detail for outcome %q", r.Outcome)
			}
		})
	}
}

func TestNonStreamingJSON(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"object":"chat.completion","choices":[{"message":{"content":"hi"},"finish_reason":"length"}]}`)
	}))
	defer srv.Close()
	r := doOnce(t, srv.URL, time.Second)
	if r.Outcome != OutcomeOK || r.FinishReason != "length" || !r.HasTTFT {
		t.Fatalf("result %+v", r)
	}
}

func TestTransportErrorWhenNothingListens(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	url := srv.URL
	srv.Close()
	if r := doOnce(t, url, time.Second); r.Outcome != OutcomeTransport {
		t.Fatalf("outcome %q (%s), want transport", r.Outcome, r.Detail)
	}
}

func TestCancelledWhenContextEnds(t *testing.T) {
	srv := fakeSSE(t, 200, step{0, chunk("a")}, step{5 * time.Second, finishChunk})
	q := &Requester{Client: newHTTPClient(1), URL: srv.URL, Body: []byte("{}")}
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	if r := q.Do(ctx); r.Outcome != OutcomeCancelled {
		t.Fatalf("outcome %q (%s), want cancelled", r.Outcome, r.Detail)
	}
}

func TestFinishReason(t *testing.T) {
	tests := map[string]string{
		`{"choices":[{"finish_reason":null}]}`:                                         "",
		`{"choices":[{"finish_reason": "stop"}]}`:                                      "stop",
		`{"choices":[{"delta":{"content":"finish_reason"},"finish_reason":"length"}]}`: "length",
		`{"x":1}`: "",
	}
	for in, want := range tests {
		if got := finishReason([]byte(in)); got != want {
			t.Errorf("finishReason(%s) = %q, want %q", in, got, want)
		}
	}
}

func TestRunLoadStopsAtRequestLimit(t *testing.T) {
	srv := fakeSSE(t, 200, step{0, chunk("a")}, step{time.Millisecond, "data: [DONE]\n\n"})
	q := &Requester{Client: newHTTPClient(4), URL: srv.URL, Body: []byte("{}")}
	col := NewCollector(0)
	var inflight atomic.Int64
	cfg := RunConfig{Concurrency: 4, Duration: 10 * time.Second, Requests: 25}
	start := time.Now()
	runLoad(context.Background(), q, cfg, col, &inflight)
	if s := col.Summary(); s.Requests != 25 || s.OK != 25 {
		t.Fatalf("requests/ok = %d/%d, want 25/25", s.Requests, s.OK)
	}
	if time.Since(start) > 5*time.Second {
		t.Fatalf("did not stop at the request limit")
	}
}

func TestRunLoadStopsAtDuration(t *testing.T) {
	srv := fakeSSE(t, 200, step{0, chunk("a")}, step{20 * time.Millisecond, "data: [DONE]\n\n"})
	q := &Requester{Client: newHTTPClient(2), URL: srv.URL, Body: []byte("{}")}
	col := NewCollector(0)
	var inflight atomic.Int64
	start := time.Now()
	runLoad(context.Background(), q, RunConfig{Concurrency: 2, Duration: 200 * time.Millisecond, Grace: time.Second}, col, &inflight)
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("ran %v, want about 200ms", el)
	}
	if s := col.Summary(); s.Requests == 0 || s.OK != s.Requests {
		t.Fatalf("summary %+v: want only ok requests (in-flight ones finish within the grace)", s.Outcomes)
	}
	if inflight.Load() != 0 {
		t.Fatalf("in flight %d after the run", inflight.Load())
	}
}

func TestCheckTargetRefusesRemote(t *testing.T) {
	for _, ok := range []string{"http://127.0.0.1:8089/v1", "http://[::1]:80", "http://localhost:1", "http://127.3.4.5"} {
		if _, err := checkTarget(ok, false); err != nil {
			t.Errorf("checkTarget(%s): %v", ok, err)
		}
	}
	for _, bad := range []string{"http://10.0.0.1:8089", "http://example.com", "https://api.openai.com/v1", "ftp://127.0.0.1", "127.0.0.1:80"} {
		if _, err := checkTarget(bad, false); err == nil {
			t.Errorf("checkTarget(%s) accepted a non-loopback target", bad)
		}
	}
	if _, err := checkTarget("http://example.com", true); err != nil {
		t.Errorf("--allow-remote: %v", err)
	}
	if !strings.Contains(func() string { _, err := checkTarget("http://10.1.1.1", false); return err.Error() }(), "--allow-remote") {
		t.Errorf("error does not mention --allow-remote")
	}
}
