package e2e

import (
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// Event gaps that count as "arrived one by one, at the upstream's pace"
// for events 200ms apart upstream, on a loaded 2-core machine.
const (
	paceInterval = 200 * time.Millisecond
	paceMinGap   = 120 * time.Millisecond
	paceMaxGap   = 350 * time.Millisecond
)

// bothStreams sends the same streaming request to the replica directly and
// through the gateway at the same moment, so that the two responses are
// comparable byte for byte (and most likely share their "created" second).
func bothStreams(ctx context.Context, t *testing.T, c *http.Client, replicaURL, gatewayURL, path, body string, headers ...string) (direct, viaGateway *stream) {
	t.Helper()
	var directErr error
	var wg sync.WaitGroup
	wg.Go(func() { direct, directErr = doStream(ctx, c, replicaURL+path, body, headers...) })
	viaGateway = streamRequest(ctx, t, c, gatewayURL+path, body, headers...)
	wg.Wait()
	if directErr != nil {
		t.Fatalf("direct request to the mock: %v", directErr)
	}
	return direct, viaGateway
}

// checkSameEvents checks that the gateway relayed the upstream's events
// unchanged, event by event.
func checkSameEvents(t *testing.T, got, want []event) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("got %d events through the gateway, the upstream sent %d", len(got), len(want))
	}
	for i := range min(len(got), len(want)) {
		if ok, _ := sameUpstreamBytes(got[i].Raw, want[i].Raw); !ok {
			t.Errorf("event %d differs from the upstream's: %s", i, firstDiff(got[i].Raw, want[i].Raw))
		}
	}
	if ok, how := sameUpstreamBytes(raw(got), raw(want)); ok {
		t.Logf("gateway stream vs direct stream: %s", how)
	}
}

// checkPace checks that events[from..to] arrived one by one, paceInterval
// apart (each gap within [paceMinGap, paceMaxGap]), and that the whole run
// took as long as upstream's (the mock schedules token i at first+i*interval,
// so delays do not accumulate).
func checkPace(t *testing.T, events []event, from, to int) {
	t.Helper()
	if to >= len(events) {
		t.Fatalf("need events %d..%d, got %d events", from, to, len(events))
	}
	var gaps []time.Duration
	for k := from; k < to; k++ {
		gap := events[k+1].At.Sub(events[k].At)
		gaps = append(gaps, gap.Round(time.Millisecond))
		if gap < paceMinGap || gap > paceMaxGap {
			t.Errorf("gap between events %d and %d is %v, want %v-%v (upstream: %v)",
				k, k+1, gap, paceMinGap, paceMaxGap, paceInterval)
		}
	}
	span := events[to].At.Sub(events[from].At)
	want := time.Duration(to-from) * paceInterval
	if span < want-150*time.Millisecond || span > want+250*time.Millisecond {
		t.Errorf("events %d..%d spanned %v, upstream spaced them over %v", from, to, span, want)
	}
	t.Logf("event gaps: %v (span %v)", gaps, span.Round(time.Millisecond))
}

// eachUpstreamClient runs f as two parallel subtests, one per HTTP/1.1
// client a handler can send http:// upstreams through (upstream_client
// builtin, the default, and net_http): the core streaming cases hold with
// either.
func eachUpstreamClient(t *testing.T, f func(t *testing.T, client string)) {
	for _, client := range []string{"builtin", "net_http"} {
		t.Run(client, func(t *testing.T) {
			t.Parallel()
			f(t, client)
		})
	}
}

// withUpstreamClient adds "upstream_client client" to the llm_proxy
// directive of site, unless client is the default.
func withUpstreamClient(site, client string) string {
	if client == "builtin" {
		return site
	}
	line := "\t\tupstream_client " + client + "\n"
	if i := strings.Index(site, " {\n"); i >= 0 {
		return site[:i+3] + line + site[i+3:]
	}
	return site + " {\n" + line + "\t}"
}

// TestStreamArrivesByteIdenticalWithUpstreamTiming: every event of a
// streamed chat completion reaches the client exactly as the upstream sent
// it, and at the upstream's pace, not in a burst.
func TestStreamArrivesByteIdenticalWithUpstreamTiming(t *testing.T) {
	t.Parallel()
	eachUpstreamClient(t, func(t *testing.T, client string) {
		fleet := startFleet(t, mockllm.FleetConfig{})
		gw := startGateway(t, withUpstreamClient("\tllm_proxy "+upstreams(fleet), client))
		c := newClient(t)
		ctx := testContext(t, 30*time.Second)

		const tokens = 8
		direct, via := bothStreams(ctx, t, c, fleet.Replica(0).URL(), gw.URL, "/v1/chat/completions",
			chatBody("Relay me byte for byte, and on time.", true),
			"X-Request-Id: e2e-stream-timing", "X-Mock-TTFT: 50ms",
			fmt.Sprintf("X-Mock-Tokens: %d", tokens), "X-Mock-Token-Interval: 200ms")

		if via.Status != http.StatusOK || direct.Status != http.StatusOK {
			t.Fatalf("status: gateway %d, direct %d; want 200", via.Status, direct.Status)
		}
		if got, want := via.Header.Get("Content-Type"), direct.Header.Get("Content-Type"); got != want {
			t.Errorf("Content-Type %q, upstream sent %q", got, want)
		}
		if via.Err != nil || len(via.Tail) > 0 {
			t.Errorf("gateway stream ended with %v (tail %q), want a clean end", via.Err, via.Tail)
		}
		checkSameEvents(t, via.Events, direct.Events)
		// role chunk, 8 token chunks, [DONE]
		if len(via.Events) != tokens+2 || !via.Events[len(via.Events)-1].IsDone() {
			t.Fatalf("got %d events ending with %q, want %d ending with [DONE]",
				len(via.Events), via.Events[len(via.Events)-1].Raw, tokens+2)
		}
		// Token chunks 0..7 are events 1..8, 200ms apart upstream.
		checkPace(t, via.Events, 1, tokens)
	})
}

// TestNonStreamingJSONPassesThrough: a non-streaming completion reaches the
// client with the upstream's status, content type and body.
func TestNonStreamingJSONPassesThrough(t *testing.T) {
	t.Parallel()
	eachUpstreamClient(t, func(t *testing.T, client string) {
		fleet := startFleet(t, mockllm.FleetConfig{})
		gw := startGateway(t, withUpstreamClient("\tllm_proxy "+upstreams(fleet), client))
		c := newClient(t)
		ctx := testContext(t, 30*time.Second)
		body := chatBody("Answer in one piece.", false)
		headers := []string{"X-Request-Id: e2e-json", "X-Mock-Tokens: 12", "X-Mock-Token-Interval: 5ms"}

		var direct *plainResponse
		var directErr error
		var wg sync.WaitGroup
		wg.Go(func() {
			direct, directErr = doPlain(ctx, c, fleet.Replica(0).URL()+"/v1/chat/completions", body, headers...)
		})
		via, err := doPlain(ctx, c, gw.URL+"/v1/chat/completions", body, headers...)
		wg.Wait()
		if err != nil || directErr != nil {
			t.Fatalf("gateway: %v; direct: %v", err, directErr)
		}

		if via.Status != http.StatusOK || via.Status != direct.Status {
			t.Fatalf("status %d, upstream %d; want 200: %s", via.Status, direct.Status, via.Body)
		}
		if got, want := via.Header.Get("Content-Type"), direct.Header.Get("Content-Type"); got != want || got != "application/json" {
			t.Errorf("Content-Type %q, upstream %q; want application/json", got, want)
		}
		if ok, how := sameUpstreamBytes(via.Body, direct.Body); !ok {
			t.Errorf("body differs from the upstream's: %s", firstDiff(via.Body, direct.Body))
		} else {
			t.Logf("gateway body vs direct body: %s", how)
		}
		if cl := via.Header.Get("Content-Length"); cl != fmt.Sprint(len(via.Body)) {
			t.Errorf("Content-Length %q for a %d-byte body", cl, len(via.Body))
		}
		if got := via.Header.Get(mockllm.HeaderReplica); got != fleet.Replica(0).Addr() {
			t.Errorf("%s %q, want the upstream's header %q", mockllm.HeaderReplica, got, fleet.Replica(0).Addr())
		}
	})
}

// plainResponse is a whole non-streamed response.
type plainResponse struct {
	Status int
	Header http.Header
	Body   []byte
}

// doPlain sends a POST and reads the whole response.
func doPlain(ctx context.Context, c *http.Client, url, body string, headers ...string) (*plainResponse, error) {
	req, err := newRequest(ctx, url, body, headers...)
	if err != nil {
		return nil, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, fmt.Errorf("POST %s: %w", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("POST %s: reading body: %w", url, err)
	}
	return &plainResponse{Status: resp.StatusCode, Header: resp.Header, Body: b}, nil
}

// TestEncodeGzipKeepsEventsIncremental: with `encode gzip zstd` in front of
// llm_proxy and an upstream that sends "text/event-stream; charset=utf-8",
// a client that asks for gzip and decodes as it reads still gets the
// events one by one at the upstream's pace, and the same bytes.
func TestEncodeGzipKeepsEventsIncremental(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{})
	gw := startGateway(t, "\tencode gzip zstd\n\tllm_proxy "+upstreams(fleet))
	c := newClient(t) // DisableCompression: we ask for gzip and decode ourselves
	ctx := testContext(t, 30*time.Second)

	const tokens = 8
	body := chatBody("Compress me, but do not hold me back.", true)
	headers := []string{"X-Request-Id: e2e-gzip", "X-Mock-TTFT: 50ms",
		fmt.Sprintf("X-Mock-Tokens: %d", tokens), "X-Mock-Token-Interval: 200ms"}

	var direct *stream
	var directErr error
	var wg sync.WaitGroup
	wg.Go(func() {
		direct, directErr = doStream(ctx, c, fleet.Replica(0).URL()+"/v1/chat/completions", body, headers...)
	})

	resp := post(ctx, t, c, gw.URL+"/v1/chat/completions", body, append(headers, "Accept-Encoding: gzip")...)
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	if ce := resp.Header.Get("Content-Encoding"); ce != "gzip" {
		t.Fatalf("Content-Encoding %q, want gzip (encode should compress the stream)", ce)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream; charset=utf-8" {
		t.Errorf("Content-Type %q, want the upstream's text/event-stream; charset=utf-8", ct)
	}
	zr, err := gzip.NewReader(resp.Body)
	if err != nil {
		t.Fatalf("gzip header: %v", err)
	}
	events, tail, err := readEvents(zr, nil)
	if err != nil || len(tail) > 0 {
		t.Errorf("decoded stream ended with %v (tail %q), want a clean end", err, tail)
	}
	wg.Wait()
	if directErr != nil {
		t.Fatalf("direct request: %v", directErr)
	}
	if got, want := resp.Header.Get("Content-Type"), direct.Header.Get("Content-Type"); got != want {
		t.Errorf("Content-Type %q, upstream sent %q", got, want)
	}
	checkSameEvents(t, events, direct.Events)
	if len(events) != tokens+2 || !events[len(events)-1].IsDone() {
		t.Fatalf("got %d events, want %d ending with [DONE]", len(events), tokens+2)
	}
	checkPace(t, events, 1, tokens)
}

// TestStreamCutAfterCommitEndsWithErrorEvent: an upstream that closes the
// stream after 40 events without finishing it (FIN or RST): the client
// gets those 40 events unchanged, then a terminal error event, no [DONE],
// and no other upstream is tried.
func TestStreamCutAfterCommitEndsWithErrorEvent(t *testing.T) {
	t.Parallel()
	eachUpstreamClient(t, func(t *testing.T, client string) {
		for _, fault := range []string{"cut=40", "cut_rst=40"} {
			t.Run(fault, func(t *testing.T) {
				fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2})
				gw := startGateway(t, withUpstreamClient("\tllm_proxy "+upstreams(fleet)+" {\n\t\tlb_policy first\n\t\tmax_attempts 3\n\t}", client))
				c := newClient(t)
				ctx := testContext(t, 30*time.Second)

				// /v1/completions streams token events only (no role chunk), so
				// the 40 content events before the cut are the stream's first 40.
				direct, via := bothStreams(ctx, t, c, fleet.Replica(0).URL(), gw.URL, "/v1/completions",
					completionBody("Cut me off after forty.", true),
					"X-Request-Id: e2e-cut", "X-Mock-Tokens: 100", "X-Mock-Token-Interval: 5ms", "X-Mock-Fault: "+fault)

				if len(direct.Events) != 40 {
					t.Fatalf("the mock sent %d events before the cut, want 40 (err %v)", len(direct.Events), direct.Err)
				}
				if via.Status != http.StatusOK {
					t.Fatalf("status %d, want 200 (the stream committed)", via.Status)
				}
				if via.Err != nil || len(via.Tail) > 0 {
					t.Errorf("gateway stream ended with %v (tail %q), want the error event then a clean end", via.Err, via.Tail)
				}
				if len(via.Events) != 41 {
					t.Fatalf("got %d events, want the 40 upstream events and one error event", len(via.Events))
				}
				checkSameEvents(t, via.Events[:40], direct.Events)
				obj := checkTerminalError(t, via.Events)
				t.Logf("terminal error: %v", obj)
				if r0, r1 := fleet.Replica(0).Stats().Requests, fleet.Replica(1).Stats().Requests; r0 != 2 || r1 != 0 {
					t.Errorf("replicas got %d and %d requests, want 2 (one direct, one via the gateway) and 0: no retry after commit", r0, r1)
				}
			})
		}
	})
}

// checkTerminalError checks that the last event is an OpenAI-shaped error
// event written by the gateway and that no [DONE] was sent.
func checkTerminalError(t *testing.T, events []event) map[string]any {
	t.Helper()
	if len(events) == 0 {
		t.Fatal("no events")
	}
	for _, e := range events {
		if e.IsDone() {
			t.Errorf("got [DONE] in a stream that did not finish")
		}
	}
	last := events[len(events)-1]
	obj, ok := last.ErrorObject()
	if !ok {
		t.Fatalf("last event %q is not an error event data: {\"error\":{...}}", last.Raw)
	}
	for _, k := range []string{"message", "type", "code"} {
		if s, _ := obj[k].(string); s == "" {
			t.Errorf("terminal error event lacks a string %q: %s", k, last.Raw)
		}
	}
	if obj["type"] != "server_error" {
		t.Errorf("terminal error type %v, want server_error", obj["type"])
	}
	return obj
}

// TestSteadyStreamOutlivesIdleTimeout: stream_idle_timeout bounds the gap
// between events, not the stream: events every 400ms for 2.8s pass a 1s
// idle timeout.
func TestSteadyStreamOutlivesIdleTimeout(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet)+" {\n\t\tstream_idle_timeout 1s\n\t}")
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("Slow and steady.", true),
		"X-Mock-Tokens: 8", "X-Mock-Token-Interval: 400ms")
	if s.Status != http.StatusOK || s.Err != nil {
		t.Fatalf("status %d, err %v", s.Status, s.Err)
	}
	if len(s.Events) != 10 || !s.Events[9].IsDone() {
		t.Fatalf("got %d events ending with %q, want 10 ending with [DONE]", len(s.Events), s.Events[len(s.Events)-1].Raw)
	}
	for _, e := range s.Events {
		if _, isErr := e.ErrorObject(); isErr {
			t.Errorf("unexpected error event %q", e.Raw)
		}
	}
	if d := s.Events[9].At.Sub(s.Events[0].At); d < 2*time.Second {
		t.Errorf("stream lasted %v, want more than twice the 1s idle timeout", d)
	}
}

// TestIdleGapEndsStreamWithErrorEvent: a committed stream that goes quiet
// for longer than stream_idle_timeout ends with a terminal error event
// about one timeout after the last event, and the upstream is cancelled.
func TestIdleGapEndsStreamWithErrorEvent(t *testing.T) {
	t.Parallel()
	eachUpstreamClient(t, func(t *testing.T, client string) {
		fleet := startFleet(t, mockllm.FleetConfig{})
		gw := startGateway(t, withUpstreamClient("\tllm_proxy "+upstreams(fleet)+" {\n\t\tstream_idle_timeout 1s\n\t}", client))
		c := newClient(t)
		ctx := testContext(t, 30*time.Second)

		// Role chunk and token 0 at once, token 1 only after 3s.
		s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("Then silence.", true),
			"X-Mock-Tokens: 4", "X-Mock-Token-Interval: 3s")
		if s.Status != http.StatusOK || s.Err != nil {
			t.Fatalf("status %d, err %v (tail %q)", s.Status, s.Err, s.Tail)
		}
		if len(s.Events) != 3 {
			t.Fatalf("got %d events %q, want role chunk, token 0, error event", len(s.Events), raw(s.Events))
		}
		obj := checkTerminalError(t, s.Events)
		t.Logf("terminal error: %v", obj)
		gap := s.Events[2].At.Sub(s.Events[1].At)
		if gap < 900*time.Millisecond || gap > 2500*time.Millisecond {
			t.Errorf("error event came %v after the last event, want about the 1s idle timeout", gap)
		}
		var rec mockllm.RequestRecord
		if !waitFor(2*time.Second, func() bool {
			recent := fleet.Replica(0).Stats().Recent
			if len(recent) == 1 {
				rec = recent[0]
			}
			return rec.Outcome == mockllm.OutcomeCancelled
		}) {
			t.Errorf("upstream request outcome %q, want %q: the gateway should cancel it", rec.Outcome, mockllm.OutcomeCancelled)
		}
	})
}

// TestFragmentedStreamWithCommentsIsRelayedUnchanged: an upstream that
// writes its stream a few bytes at a time (splitting events and UTF-8
// characters across writes) and sends ": ping" comments between tokens
// still reaches the client byte for byte, event by event.
func TestFragmentedStreamWithCommentsIsRelayedUnchanged(t *testing.T) {
	t.Parallel()
	eachUpstreamClient(t, func(t *testing.T, client string) {
		fleet := startFleet(t, mockllm.FleetConfig{})
		gw := startGateway(t, withUpstreamClient("\tllm_proxy "+upstreams(fleet), client))
		c := newClient(t)
		ctx := testContext(t, 30*time.Second)

		direct, via := bothStreams(ctx, t, c, fleet.Replica(0).URL(), gw.URL, "/v1/chat/completions",
			chatBody("Arrive in pieces: é日本🙂.", true),
			"X-Request-Id: e2e-fragments", "X-Mock-Tokens: 12", "X-Mock-Token-Interval: 5ms",
			"X-Mock-Token-Bytes: 40", "X-Mock-Fault: fragment=7,comment_every=2")
		if via.Status != http.StatusOK || via.Err != nil {
			t.Fatalf("status %d, err %v", via.Status, via.Err)
		}
		comments := 0
		for _, e := range direct.Events {
			if e.IsComment() {
				comments++
			}
		}
		if comments == 0 {
			t.Fatalf("the mock sent no comments: %q", raw(direct.Events))
		}
		checkSameEvents(t, via.Events, direct.Events)
		if !via.Events[len(via.Events)-1].IsDone() {
			t.Errorf("stream does not end with [DONE]")
		}
	})
}

// TestStreamTimeoutBoundsWholeResponse: stream_timeout bounds the response
// from the request's arrival: before commit it is a 504 in OpenAI's error
// shape, after commit a terminal error event.
func TestStreamTimeoutBoundsWholeResponse(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet)+" {\n\t\tstream_timeout 1s\n\t}")
	c := newClient(t)

	t.Run("before-commit", func(t *testing.T) {
		ctx := testContext(t, 30*time.Second)
		start := time.Now()
		r, err := doPlain(ctx, c, gw.URL+"/v1/chat/completions", chatBody("Too slow to start.", true), "X-Mock-TTFT: 3s")
		if err != nil {
			t.Fatal(err)
		}
		if r.Status != http.StatusGatewayTimeout {
			t.Fatalf("status %d, want 504: %s", r.Status, r.Body)
		}
		openAIError(t, r.Body)
		if d := time.Since(start); d < 900*time.Millisecond || d > 2500*time.Millisecond {
			t.Errorf("504 after %v, want about the 1s stream_timeout", d)
		}
	})
	t.Run("after-commit", func(t *testing.T) {
		ctx := testContext(t, 30*time.Second)
		s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("Too long to finish.", true),
			"X-Mock-TTFT: 0", "X-Mock-Tokens: 20", "X-Mock-Token-Interval: 100ms")
		if s.Status != http.StatusOK || s.Err != nil {
			t.Fatalf("status %d, err %v", s.Status, s.Err)
		}
		obj := checkTerminalError(t, s.Events)
		t.Logf("terminal error: %v", obj)
		if d := s.Events[len(s.Events)-1].At.Sub(s.Sent); d < 900*time.Millisecond || d > 2500*time.Millisecond {
			t.Errorf("error event %v after the request, want about the 1s stream_timeout", d)
		}
	})
}
