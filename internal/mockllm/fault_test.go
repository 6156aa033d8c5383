package mockllm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestStatusFaultAlwaysWithRetryAfter(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	c := client(t)
	for _, tc := range []struct {
		spec, retryAfter, typ string
		status                int
	}{
		{"status=503,retry_after=2", "2", "ServiceUnavailableError", 503},
		{"status=400", "", "BadRequestError", 400},
		{"status=429,retry_after=7", "7", "RateLimitError", 429},
	} {
		resp, err := post(t, c, context.Background(), f.Replica(0).URL()+"/v1/chat/completions", chatBody, "X-Mock-Fault: "+tc.spec)
		if err != nil {
			t.Fatal(err)
		}
		var got errorBody
		err = json.NewDecoder(resp.Body).Decode(&got)
		resp.Body.Close()
		if err != nil || resp.StatusCode != tc.status || resp.Header.Get("Retry-After") != tc.retryAfter ||
			got.Error.Type != tc.typ || got.Error.Code != tc.status || got.Error.Message == "" || got.Error.Object != "" {
			t.Errorf("%s: status %d, Retry-After %q, body %+v, err %v", tc.spec, resp.StatusCode, resp.Header.Get("Retry-After"), got, err)
		}
		if resp.Header.Get("Content-Type") != "application/json" || resp.Header.Get(HeaderReplica) == "" {
			t.Errorf("%s: headers %v", tc.spec, resp.Header)
		}
	}
	// The replica records a request's end after the client has its answer.
	s := f.Replica(0).Stats()
	for deadline := time.Now().Add(5 * time.Second); s.InFlight != 0 && time.Now().Before(deadline); s = f.Replica(0).Stats() {
		time.Sleep(time.Millisecond)
	}
	if s.Faults["status"] != 3 || s.Recent[0].Outcome != "fault:status" || s.Recent[0].Status != 503 {
		t.Errorf("stats %+v", s)
	}
}

func TestStatusFaultEveryThirdRequest(t *testing.T) {
	b := fast
	b.Fault = Fault{Kind: FaultStatus, Status: 503, Every: 3}
	f := startFleet(t, FleetConfig{Behavior: b})
	c := client(t)
	var got []int
	for range 7 {
		resp, err := post(t, c, context.Background(), f.Replica(0).URL()+"/v1/chat/completions", `{"messages":[]}`)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		got = append(got, resp.StatusCode)
	}
	want := []int{200, 200, 503, 200, 200, 503, 200}
	if !slices.Equal(got, want) {
		t.Errorf("statuses %v, want %v", got, want)
	}
	// A reset restarts the count.
	f.ResetStats()
	for i := range 3 {
		resp, _ := post(t, c, context.Background(), f.Replica(0).URL()+"/v1/chat/completions", `{"messages":[]}`)
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if (resp.StatusCode == 503) != (i == 2) {
			t.Errorf("after reset, request %d: status %d", i+1, resp.StatusCode)
		}
	}
}

func TestStatusFaultFractionIsSeeded(t *testing.T) {
	run := func() []int {
		b := Behavior{TTFT: Fixed(0), Tokens: 1, Fault: Fault{Kind: FaultStatus, Status: 502, Fraction: 0.5}}
		f := startFleet(t, FleetConfig{Behavior: b, Seed: 42})
		c := client(t)
		var got []int
		for range 40 {
			resp, err := post(t, c, context.Background(), f.Replica(0).URL()+"/v1/chat/completions", `{"messages":[]}`)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			got = append(got, resp.StatusCode)
		}
		return got
	}
	a, b := run(), run()
	if !slices.Equal(a, b) {
		t.Errorf("same seed, different faults:\n%v\n%v", a, b)
	}
	n := 0
	for _, s := range a {
		if s == 502 {
			n++
		}
	}
	if n < 8 || n > 32 {
		t.Errorf("%d of 40 failed with fraction 0.5", n)
	}
}

func TestHangSendsNothingAndRecordsCancellation(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	c := client(t)
	c.Timeout = 100 * time.Millisecond
	start := time.Now()
	_, err := post(t, c, context.Background(), f.Replica(0).URL()+"/v1/chat/completions", chatBody, "X-Mock-Fault: hang")
	gaveUp := time.Now()
	if err == nil || time.Since(start) < 90*time.Millisecond {
		t.Fatalf("err %v after %s, want a client timeout", err, time.Since(start))
	}
	r := f.Replica(0)
	waitFor(t, time.Second, "cancellation", func() bool { return r.Stats().Cancelled == 1 })
	rec := lastRecord(t, r)
	if rec.Outcome != OutcomeCancelled || rec.Fault != "hang" || rec.Status != 0 || rec.Ended.Sub(gaveUp) > 100*time.Millisecond {
		t.Errorf("record %+v (client gave up at %s)", rec, gaveUp.Format(time.RFC3339Nano))
	}
	if s := r.Stats(); s.Faults["hang"] != 1 || s.InFlight != 0 {
		t.Errorf("stats %+v", s)
	}
}

func TestHangAfterHeaders(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	resp, err := post(t, client(t), ctx, f.Replica(0).URL()+"/v1/chat/completions", chatBody, "X-Mock-Fault: hang_after_headers")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("status %d, headers %v", resp.StatusCode, resp.Header)
	}
	read := make(chan int, 1)
	go func() {
		n, _ := resp.Body.Read(make([]byte, 1))
		read <- n
	}()
	select {
	case n := <-read:
		t.Fatalf("read %d bytes from a hanging stream", n)
	case <-time.After(50 * time.Millisecond):
	}
	cancel()
	r := f.Replica(0)
	waitFor(t, time.Second, "cancellation", func() bool { return r.Stats().Cancelled == 1 })
	if rec := lastRecord(t, r); rec.Fault != "hang_after_headers" || rec.EventsSent != 0 || rec.Status != 200 {
		t.Errorf("record %+v", rec)
	}
}

func TestResetBeforeResponse(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	_, err := post(t, client(t), context.Background(), f.Replica(0).URL()+"/v1/chat/completions", chatBody, "X-Mock-Fault: reset")
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("err %v, want connection reset", err)
	}
	if rec := lastRecord(t, f.Replica(0)); rec.Outcome != "fault:reset" || rec.Status != 0 {
		t.Errorf("record %+v", rec)
	}
}

func TestCutTruncatesChunkedBody(t *testing.T) {
	for _, tc := range []struct {
		fault string
		check func(error) bool
	}{
		{"cut=40", func(err error) bool { return errors.Is(err, io.ErrUnexpectedEOF) }},
		{"cut_rst=40", func(err error) bool { return errors.Is(err, syscall.ECONNRESET) }},
	} {
		t.Run(tc.fault, func(t *testing.T) {
			f := startFleet(t, FleetConfig{Behavior: fast})
			resp, err := post(t, client(t), context.Background(), f.Replica(0).URL()+"/v1/chat/completions", chatBody,
				"X-Mock-Fault: "+tc.fault, "X-Mock-Tokens: 50", "X-Mock-Token-Interval: 1ms")
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			s := readSSE(resp.Body)
			if !tc.check(s.err) {
				t.Errorf("stream ended with %v", s.err)
			}
			n := contentEvents(t, s)
			// An RST may drop bytes the client has not read yet.
			if n != 40 && !(tc.fault == "cut_rst=40" && n >= 35 && n <= 40) {
				t.Errorf("%d content events, want 40", n)
			}
			for _, d := range s.data {
				if d == "[DONE]" || strings.Contains(d, `"finish_reason":"`) {
					t.Errorf("truncated stream has %s", d)
				}
			}
			kind := strings.Split(tc.fault, "=")[0]
			if rec := lastRecord(t, f.Replica(0)); rec.Outcome != "fault:"+kind || rec.TokensSent != 40 {
				t.Errorf("record %+v", rec)
			}
		})
	}
}

func TestCutNonStreaming(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	resp, err := post(t, client(t), context.Background(), f.Replica(0).URL()+"/v1/chat/completions", `{"messages":[]}`, "X-Mock-Fault: cut=1")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := io.ReadAll(resp.Body); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("read body: %v, want unexpected EOF", err)
	}
}

func TestErrorEvent(t *testing.T) {
	for _, tc := range []struct {
		fault      string
		tokens     int
		code       float64
		typ        string
		wantEvents int // data events before the error
	}{
		{"error_event=0", 0, 500, "InternalServerError", 0},
		{"error_event=3", 3, 500, "InternalServerError", 4}, // role + 3 tokens
		{"error_event=2,error_code=400", 2, 400, "BadRequestError", 3},
	} {
		t.Run(tc.fault, func(t *testing.T) {
			f := startFleet(t, FleetConfig{Behavior: fast})
			resp, err := post(t, client(t), context.Background(), f.Replica(0).URL()+"/v1/chat/completions", chatBody,
				"X-Mock-Fault: "+tc.fault, "X-Mock-Tokens: 10")
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			s := readSSE(resp.Body)
			if s.err != nil || resp.StatusCode != 200 {
				t.Fatalf("status %d, stream error %v", resp.StatusCode, s.err)
			}
			if len(s.data) != tc.wantEvents+1 {
				t.Fatalf("events %q", s.data)
			}
			if n := contentEvents(t, s); n != tc.tokens {
				t.Errorf("%d content events, want %d", n, tc.tokens)
			}
			last := s.data[len(s.data)-1]
			if !strings.HasPrefix(last, `{"error":{"object":"error","message":`) {
				t.Errorf("error event %s", last)
			}
			e := chunkOf(t, last)["error"].(map[string]any)
			if e["code"] != tc.code || e["type"] != tc.typ || e["param"] != nil {
				t.Errorf("error event %s", last)
			}
			if rec := lastRecord(t, f.Replica(0)); rec.Outcome != "fault:error_event" {
				t.Errorf("record %+v", rec)
			}
		})
	}
}

func TestFragmentKeepsBytesIdentical(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	c := client(t)
	created := regexp.MustCompile(`"created":\d+`)
	get := func(headers ...string) []byte {
		headers = append(headers, "X-Request-Id: same", "X-Mock-Token-Bytes: 20")
		body := `{"model":"m1","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}`
		resp, err := post(t, c, context.Background(), f.Replica(0).URL()+"/v1/chat/completions", body, headers...)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		return created.ReplaceAll(readAll(t, resp.Body), []byte(`"created":0`))
	}
	plain := get()
	for _, fault := range []string{"fragment=1", "fragment=7"} {
		if got := get("X-Mock-Fault: " + fault); !bytes.Equal(got, plain) {
			t.Errorf("%s: stream differs:\n%s\nwant\n%s", fault, got, plain)
		}
	}
	if !bytes.Contains(plain, []byte("data: [DONE]\n\n")) {
		t.Errorf("stream %s", plain)
	}
}

func TestFragmentSplitsWritesIntoChunks(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	conn, err := net.Dial("tcp", f.Addrs()[0])
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	body := `{"prompt":"x","stream":true}`
	fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Mock-Fault: fragment=1\r\nX-Mock-Tokens: 3\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	raw, err := io.ReadAll(conn)
	if err != nil {
		t.Fatal(err)
	}
	_, chunked, ok := bytes.Cut(raw, []byte("\r\n\r\n"))
	if !ok || !bytes.Contains(raw, []byte("Transfer-Encoding: chunked")) {
		t.Fatalf("response %q", raw)
	}
	// Every chunk of the body is one byte: "1\r\n<byte>\r\n".
	n := 0
	for len(chunked) > 0 && !bytes.HasPrefix(chunked, []byte("0\r\n")) {
		if !bytes.HasPrefix(chunked, []byte("1\r\n")) || len(chunked) < 6 || string(chunked[4:6]) != "\r\n" {
			t.Fatalf("chunk %d: %q", n, chunked[:min(len(chunked), 20)])
		}
		chunked = chunked[6:]
		n++
	}
	if n < 100 {
		t.Errorf("%d one-byte chunks", n)
	}
}

func TestCommentIntervalSendsHeadersAndPingsBeforeFirstEvent(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	start := time.Now()
	resp, err := post(t, client(t), context.Background(), f.Replica(0).URL()+"/v1/chat/completions", chatBody,
		"X-Mock-Fault: comment_every=10ms", "X-Mock-TTFT: 250ms", "X-Mock-Tokens: 1")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if time.Since(start) > 150*time.Millisecond {
		t.Errorf("headers after %s, want them before the TTFT", time.Since(start))
	}
	s := readSSE(resp.Body)
	if s.comments < 5 || len(s.data) != 3 {
		t.Errorf("%d comments, events %q", s.comments, s.data)
	}
}

func TestCommentEveryNEvents(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	resp, err := post(t, client(t), context.Background(), f.Replica(0).URL()+"/v1/chat/completions", chatBody,
		"X-Mock-Fault: comment_every=2", "X-Mock-Tokens: 6")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if s := readSSE(resp.Body); s.comments != 3 || contentEvents(t, s) != 6 {
		t.Errorf("%d comments, events %q", s.comments, s.data)
	}
}

func TestReplicaFaultFromBehaviorAndHeaderOverride(t *testing.T) {
	f := startFleet(t, FleetConfig{
		Replicas:   2,
		Behavior:   fast,
		PerReplica: map[int]Behavior{1: {Tokens: 1, Fault: Fault{Kind: FaultStatus, Status: 503}}},
	})
	c := client(t)
	status := func(i int, headers ...string) int {
		resp, err := post(t, c, context.Background(), f.Replica(i).URL()+"/v1/chat/completions", `{"messages":[]}`, headers...)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	if s0, s1 := status(0), status(1); s0 != 200 || s1 != 503 {
		t.Fatalf("statuses %d %d", s0, s1)
	}
	if s := status(1, "X-Mock-Fault: none"); s != 200 {
		t.Errorf("with X-Mock-Fault: none, status %d", s)
	}
	f.Replica(1).SetBehavior(fast)
	if s := status(1); s != 200 {
		t.Errorf("after SetBehavior, status %d", s)
	}
	if s := status(0); s != 200 {
		t.Errorf("replica 0 status %d", s)
	}
}
