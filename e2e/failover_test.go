package e2e

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// checkCleanStream checks a streamed response that should be a complete,
// error-free stream: 200, data chunks only, [DONE] last, a clean end.
func checkCleanStream(t *testing.T, s *stream) {
	t.Helper()
	if s.Status != http.StatusOK {
		t.Fatalf("status %d, want 200; events %q", s.Status, raw(s.Events))
	}
	if s.Err != nil || len(s.Tail) > 0 {
		t.Errorf("stream ended with %v (tail %q), want a clean end", s.Err, s.Tail)
	}
	if len(s.Events) < 2 || !s.Events[len(s.Events)-1].IsDone() {
		t.Fatalf("stream does not end with [DONE]: %q", raw(s.Events))
	}
	for i, e := range s.Events {
		if _, isErr := e.ErrorObject(); isErr || e.IsComment() {
			t.Errorf("event %d is not a data chunk: %q", i, e.Raw)
		}
	}
}

// bodyOfSize is a streaming chat request of exactly size bytes, its prompt
// a varied printable pattern.
func bodyOfSize(t *testing.T, size int) []byte {
	t.Helper()
	const prefix = `{"model":"mock-llama","stream":true,"messages":[{"role":"user","content":"`
	const suffix = `"}]}`
	n := size - len(prefix) - len(suffix)
	if n < 0 {
		t.Fatalf("size %d too small", size)
	}
	const pattern = "The quick brown fox jumps over the lazy dog 0123456789. "
	content := strings.Repeat(pattern, n/len(pattern)+1)[:n]
	return []byte(prefix + content + suffix)
}

// TestFailoverPastRefusedAndResetUpstreamsKeepsBody: the first upstream
// refuses connections, the second resets them before answering, the third
// serves; the client gets a clean stream, and every upstream that read the
// 256 KiB body read exactly the client's bytes.
func TestFailoverPastRefusedAndResetUpstreamsKeepsBody(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, PerReplica: map[int]mockllm.Behavior{
		0: {Fault: mockllm.Fault{Kind: mockllm.FaultReset}},
	}})
	refused := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	gw := startGateway(t, fmt.Sprintf("\tllm_proxy %s %s %s {\n\t\tlb_policy first\n\t\tmax_attempts 3\n\t}",
		refused, fleet.Replica(0).Addr(), fleet.Replica(1).Addr()))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	body := bodyOfSize(t, 256<<10)
	sum := sha256Hex(body)
	s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", string(body), "X-Mock-Tokens: 6", "X-Mock-Token-Interval: 5ms")
	checkCleanStream(t, s)
	if got := s.Header.Get(mockllm.HeaderReplica); got != fleet.Replica(1).Addr() {
		t.Errorf("served by %q, want the third upstream %s", got, fleet.Replica(1).Addr())
	}

	reset, served := fleet.Replica(0).Stats(), fleet.Replica(1).Stats()
	if reset.Requests != 1 || reset.Faults["reset"] != 1 {
		t.Errorf("resetting upstream: %d requests, %d resets; want 1 and 1", reset.Requests, reset.Faults["reset"])
	}
	if served.Requests != 1 {
		t.Fatalf("serving upstream got %d requests, want 1", served.Requests)
	}
	if len(served.BodySHA256) != 1 || served.BodySHA256[0] != sum {
		t.Errorf("serving upstream received body SHA-256 %v, the client sent %s (%d bytes)", served.BodySHA256, sum, len(body))
	}
	if len(reset.BodySHA256) != 1 || reset.BodySHA256[0] != sum {
		t.Errorf("resetting upstream received body SHA-256 %v, the client sent %s", reset.BodySHA256, sum)
	}
}

// TestErrorEventBeforeFirstTokenFailsOver: an in-band error event before
// any data event (with a 5xx code) is a retryable failure: the client gets
// a clean stream from another upstream and never sees the error.
func TestErrorEventBeforeFirstTokenFailsOver(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, PerReplica: map[int]mockllm.Behavior{
		0: {Fault: mockllm.Fault{Kind: mockllm.FaultErrorEvent, After: 0}},
	}})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet)+" {\n\t\tlb_policy first\n\t\tmax_attempts 3\n\t}")
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	body := chatBody("Fail first, then succeed.", true)
	headers := []string{"X-Request-Id: e2e-error-event-0", "X-Mock-Tokens: 6", "X-Mock-Token-Interval: 5ms"}
	s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", body, headers...)
	checkCleanStream(t, s)

	bad, good := fleet.Replica(0).Stats(), fleet.Replica(1).Stats()
	if bad.Requests != 1 || bad.Faults["error_event"] != 1 {
		t.Errorf("first upstream: %d requests, %d error events; want 1 and 1", bad.Requests, bad.Faults["error_event"])
	}
	if good.Requests != 1 {
		t.Errorf("second upstream: %d requests, want 1", good.Requests)
	}
	// The stream is the healthy upstream's own, unchanged.
	direct := streamRequest(ctx, t, c, fleet.Replica(1).URL()+"/v1/chat/completions", body, headers...)
	checkSameEvents(t, s.Events, direct.Events)
}

// TestErrorEventAfterCommitEndsStreamWithoutRetry: an in-band error event
// after 3 tokens comes after commit: the client gets the role chunk and
// the 3 token chunks, then the error event as the last event, no [DONE],
// and no other upstream is tried.
func TestErrorEventAfterCommitEndsStreamWithoutRetry(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet)+" {\n\t\tlb_policy first\n\t\tmax_attempts 3\n\t}")
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	body := chatBody("Fail after three.", true)
	headers := []string{"X-Request-Id: e2e-error-event-3", "X-Mock-Tokens: 10", "X-Mock-Token-Interval: 5ms", "X-Mock-Fault: error_event=3"}
	s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", body, headers...)
	if s.Status != http.StatusOK || s.Err != nil {
		t.Fatalf("status %d, err %v; want a committed 200 stream that ends cleanly", s.Status, s.Err)
	}
	if n := fleetRequests(fleet); n != 1 {
		t.Errorf("the fleet got %d requests, want exactly 1 (no retry after commit)", n)
	}
	// role chunk + 3 token chunks + the error event
	if len(s.Events) != 5 {
		t.Fatalf("got %d events %q, want role chunk, 3 token chunks, error event", len(s.Events), raw(s.Events))
	}
	for _, e := range s.Events[:4] {
		if _, isErr := e.ErrorObject(); isErr || e.IsDone() {
			t.Errorf("event before the error is not a data chunk: %q", e.Raw)
		}
	}
	if _, ok := s.Events[4].ErrorObject(); !ok {
		t.Errorf("last event %q is not an error event", s.Events[4].Raw)
	}
	for _, e := range s.Events {
		if e.IsDone() {
			t.Error("got [DONE] after an error event")
		}
	}
	direct := streamRequest(ctx, t, c, fleet.Replica(0).URL()+"/v1/chat/completions", body, headers...)
	checkSameEvents(t, s.Events, direct.Events)
}

// TestUpstream400PassesThroughWithoutRetry: an upstream 400 is the
// client's fault: the same status and body reach the client, and no other
// upstream is tried even with attempts and upstreams to spare.
func TestUpstream400PassesThroughWithoutRetry(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet)+" {\n\t\tmax_attempts 3\n\t}")
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	body := chatBody("This prompt is far too long.", true)
	via, err := doPlain(ctx, c, gw.URL+"/v1/chat/completions", body, "X-Mock-Fault: status=400")
	if err != nil {
		t.Fatal(err)
	}
	if n := fleetRequests(fleet); n != 1 {
		t.Errorf("the fleet got %d requests, want exactly 1 (a 400 is not retried)", n)
	}
	direct, err := doPlain(ctx, c, fleet.Replica(0).URL()+"/v1/chat/completions", body, "X-Mock-Fault: status=400")
	if err != nil {
		t.Fatal(err)
	}
	if via.Status != http.StatusBadRequest {
		t.Fatalf("status %d, want the upstream's 400: %s", via.Status, via.Body)
	}
	if string(via.Body) != string(direct.Body) {
		t.Errorf("body %q, upstream sent %q", via.Body, direct.Body)
	}
	if got, want := via.Header.Get("Content-Type"), direct.Header.Get("Content-Type"); got != want {
		t.Errorf("Content-Type %q, upstream sent %q", got, want)
	}
}

// TestFirstByteTimeoutFailsOver: an upstream that accepts the request and
// never answers is abandoned after first_byte_timeout, and the next one
// serves the stream.
func TestFirstByteTimeoutFailsOver(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, PerReplica: map[int]mockllm.Behavior{
		0: {Fault: mockllm.Fault{Kind: mockllm.FaultHang}},
	}})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet)+
		" {\n\t\tlb_policy first\n\t\tmax_attempts 2\n\t\tfirst_byte_timeout 500ms\n\t}")
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("Anyone there?", true),
		"X-Mock-TTFT: 20ms", "X-Mock-Tokens: 4", "X-Mock-Token-Interval: 5ms")
	checkCleanStream(t, s)
	ttft := s.Events[0].At.Sub(s.Sent)
	if ttft < 450*time.Millisecond || ttft > 2500*time.Millisecond {
		t.Errorf("first event after %v, want about first_byte_timeout (500ms) plus the second upstream's TTFT", ttft)
	}
	if got := s.Header.Get(mockllm.HeaderReplica); got != fleet.Replica(1).Addr() {
		t.Errorf("served by %q, want %s", got, fleet.Replica(1).Addr())
	}
	var rec mockllm.RequestRecord
	if !waitFor(time.Second, func() bool {
		if r := fleet.Replica(0).Stats().Recent; len(r) == 1 {
			rec = r[0]
		}
		return rec.Outcome == mockllm.OutcomeCancelled
	}) {
		t.Errorf("hanging upstream's request: outcome %q, want %q (the gateway should cancel it)", rec.Outcome, mockllm.OutcomeCancelled)
	}
}

// TestFirstByteTimeoutOnAllUpstreamsIs504: when every attempt times out
// before its first event, the client gets a 504 in OpenAI's error shape
// once the attempts are spent.
func TestFirstByteTimeoutOnAllUpstreamsIs504(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet)+" {\n\t\tmax_attempts 3\n\t\tfirst_byte_timeout 500ms\n\t}")
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	start := time.Now()
	via, err := doPlain(ctx, c, gw.URL+"/v1/chat/completions", chatBody("Nobody answers.", true), "X-Mock-Fault: hang")
	if err != nil {
		t.Fatal(err)
	}
	elapsed := time.Since(start)
	if via.Status != http.StatusGatewayTimeout {
		t.Fatalf("status %d, want 504: %s", via.Status, via.Body)
	}
	if ct := via.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q, want application/json", ct)
	}
	_, typ, code := openAIError(t, via.Body)
	t.Logf("504 body: type %q, code %q", typ, code)
	if elapsed < 1400*time.Millisecond || elapsed > 5*time.Second {
		t.Errorf("504 after %v, want about 3 x first_byte_timeout (1.5s)", elapsed)
	}
	for i, r := range fleet.Stats().Replicas {
		if r.Requests != 1 {
			t.Errorf("replica %d got %d requests, want 1 (each upstream tried once)", i, r.Requests)
		}
	}
	if !waitFor(time.Second, func() bool {
		for _, r := range fleet.Stats().Replicas {
			if r.Cancelled != 1 {
				return false
			}
		}
		return true
	}) {
		t.Errorf("not every timed-out upstream request was cancelled: %+v", fleet.Stats().Replicas)
	}
}

// TestHeadersAndPingsBeforeFirstEventDoNotCommit: an upstream that sends
// 200 and its headers, then only ": ping" comments, has not committed: it
// is abandoned at first_byte_timeout, the next upstream serves, and none
// of the first upstream's pings reach the client.
func TestHeadersAndPingsBeforeFirstEventDoNotCommit(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, PerReplica: map[int]mockllm.Behavior{
		0: {Fault: mockllm.Fault{Kind: mockllm.FaultHangAfterHeaders, CommentInterval: 100 * time.Millisecond}},
	}})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet)+
		" {\n\t\tlb_policy first\n\t\tmax_attempts 2\n\t\tfirst_byte_timeout 500ms\n\t}")
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("Ping is not an answer.", true),
		"X-Mock-Tokens: 4", "X-Mock-Token-Interval: 5ms")
	checkCleanStream(t, s) // also fails on comment events
	if got := s.Header.Get(mockllm.HeaderReplica); got != fleet.Replica(1).Addr() {
		t.Errorf("served by %q, want %s", got, fleet.Replica(1).Addr())
	}
	if d := s.Events[0].At.Sub(s.Sent); d < 450*time.Millisecond {
		t.Errorf("first event after %v: headers or pings committed the hanging upstream", d)
	}
}

// TestErrorEventWith4xxCodeBeforeFirstTokenIsReturnedAsStatus: an in-band
// error event with a 4xx code before any data event is the request's
// fault: the client gets that status in OpenAI's error shape, and no
// other upstream is tried.
func TestErrorEventWith4xxCodeBeforeFirstTokenIsReturnedAsStatus(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet)+" {\n\t\tmax_attempts 3\n\t}")
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	via, err := doPlain(ctx, c, gw.URL+"/v1/chat/completions", chatBody("Too long, in-band.", true),
		"X-Mock-Fault: error_event=0,error_code=400")
	if err != nil {
		t.Fatal(err)
	}
	if via.Status != http.StatusBadRequest {
		t.Fatalf("status %d, want 400: %s", via.Status, via.Body)
	}
	if ct := via.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q, want application/json", ct)
	}
	msg, typ, code := openAIError(t, via.Body)
	t.Logf("400 from in-band error: type %q, code %q, message %q", typ, code, msg)
	if !strings.Contains(msg, "maximum context length") {
		t.Errorf("message %q, want the upstream's", msg)
	}
	if n := fleetRequests(fleet); n != 1 {
		t.Errorf("the fleet got %d requests, want 1", n)
	}
}

// TestRetryableFailuresBeforeCommitFailOver: each failure that DESIGN §3
// classifies as retryable before commit (5xx, 429 without Retry-After, a
// stream closed or reset before its first event) sends the request to the
// next upstream, and the client gets a clean stream.
func TestRetryableFailuresBeforeCommitFailOver(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2})
	// breaker off: seven failures in a row on replica 0 would open its
	// breaker, and this test is about each failure's own classification.
	// min_per_sec 50: seven retries within a second are over the default
	// floor (3 at once, 3 a second), which is not what this test is about.
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet)+" {\n\t\tlb_policy first\n\t\tmax_attempts 2\n\t\tbreaker off\n\t\tretries {\n\t\t\tmin_per_sec 50\n\t\t}\n\t}")
	c := newClient(t)
	for _, spec := range []string{"status=500", "status=502", "status=503", "status=504", "status=429", "cut=0", "cut_rst=0"} {
		t.Run(spec, func(t *testing.T) {
			f, err := mockllm.ParseFault(spec)
			if err != nil {
				t.Fatal(err)
			}
			fleet.Replica(0).SetBehavior(mockllm.Behavior{Fault: f})
			fleet.ResetStats()
			ctx := testContext(t, 30*time.Second)
			s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("Try again elsewhere.", true),
				"X-Mock-Tokens: 3", "X-Mock-Token-Interval: 0")
			checkCleanStream(t, s)
			if got := s.Header.Get(mockllm.HeaderReplica); got != fleet.Replica(1).Addr() {
				t.Errorf("served by %q, want %s", got, fleet.Replica(1).Addr())
			}
			if r0, r1 := fleet.Replica(0).Stats(), fleet.Replica(1).Stats(); r0.Requests != 1 || r1.Requests != 1 {
				t.Errorf("replicas got %d and %d requests, want 1 and 1", r0.Requests, r1.Requests)
			}
		})
	}
}

// TestForwardedAndHopByHopHeaders: the upstream gets the client's
// end-to-end headers (Authorization included, for vLLM's API key) but not
// its hop-by-hop ones, and X-Forwarded-For names the real peer rather than
// what an untrusted client claims.
func TestForwardedAndHopByHopHeaders(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("Who is asking?", true),
		"X-Mock-Tokens: 2", "X-Mock-Token-Interval: 0",
		"Authorization: Bearer sk-e2e-upstream-key",
		"X-Forwarded-For: 203.0.113.66",
		"Connection: keep-alive, X-Hop-Secret",
		"X-Hop-Secret: do-not-forward",
		"Proxy-Authorization: Basic Zm9vOmJhcg==",
		"X-End-To-End: keep-me")
	checkCleanStream(t, s)
	recent := fleet.Replica(0).Stats().Recent
	if len(recent) != 1 {
		t.Fatalf("upstream got %d requests", len(recent))
	}
	rec := recent[0]
	if !rec.Authorization {
		t.Error("Authorization was not forwarded")
	}
	if rec.XForwardedFor != "127.0.0.1" {
		t.Errorf("X-Forwarded-For %q, want the peer 127.0.0.1 only (the client is not a trusted proxy)", rec.XForwardedFor)
	}
	if v, ok := rec.Headers["x-hop-secret"]; ok {
		t.Errorf("a header named in Connection reached the upstream: %q", v)
	}
	if v := rec.Headers["x-end-to-end"]; v != "keep-me" {
		t.Errorf("X-End-To-End %q, want keep-me", v)
	}
	if v := rec.Headers["x-forwarded-proto"]; v != "http" {
		t.Errorf("X-Forwarded-Proto %q, want http", v)
	}
	if v, want := rec.Headers["x-forwarded-host"], strings.TrimPrefix(gw.URL, "http://"); v != want {
		t.Errorf("X-Forwarded-Host %q, want %q", v, want)
	}
}
