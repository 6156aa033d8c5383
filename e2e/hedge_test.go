package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// The tests of this file run hedged requests through the real gateway with
// lb_policy first, so that the primary always goes to replica 0 and the
// backup to replica 1; each replica's Behavior makes one of them slow.
// Unless a test is about the hedge-rate cap, it sets max_ratio 1: the
// default 0.1 grants a hedge only once ten requests are in the window.

// hedgeMetrics reads caddy_llm_proxy_hedges_total by outcome; with
// mustExist, the test fails unless the family is exposed (see
// metricValueOrZero), so that a zero outcome cannot stand for a renamed
// metric.
func hedgeMetrics(gw *gateway, mustExist bool) map[string]float64 {
	gw.t.Helper()
	samples := gw.scrapeMetrics()
	if mustExist {
		mustMetricFamily(gw.t, samples, "caddy_llm_proxy_hedges_total")
	}
	out := map[string]float64{}
	for _, o := range []string{"fired", "won", "lost", "suppressed"} {
		out[o], _ = metricValue(samples, "caddy_llm_proxy_hedges_total", map[string]string{"outcome": o})
	}
	return out
}

// checkHedges fails the test unless the hedge counters are as given. When
// any of them is above 0 the family must be exposed. When all are 0 it may
// be absent (nothing was counted in this process yet, and client_golang
// exposes no empty counter vector): a test that checks all zeros must
// check exact non-zero counts later, which proves the metric's name.
func checkHedges(t *testing.T, gw *gateway, fired, won, lost, suppressed float64) {
	t.Helper()
	got := hedgeMetrics(gw, fired+won+lost+suppressed > 0)
	want := map[string]float64{"fired": fired, "won": won, "lost": lost, "suppressed": suppressed}
	for o, w := range want {
		if got[o] != w {
			t.Errorf("caddy_llm_proxy_hedges_total{outcome=%q} = %v, want %v (all: %v)", o, got[o], w, got)
		}
	}
}

// onlyRecord waits until the replica has exactly one request record that
// has ended, and returns it.
func onlyRecord(t *testing.T, r *mockllm.Replica, d time.Duration) mockllm.RequestRecord {
	t.Helper()
	var rec mockllm.RequestRecord
	var n int
	if !waitFor(d, func() bool {
		recent := r.Stats().Recent
		n = len(recent)
		if n == 1 {
			rec = recent[0]
		}
		return n == 1 && !rec.Ended.IsZero()
	}) {
		t.Fatalf("replica %d: %d request records, the only one %+v; want exactly one, ended within %v", r.Index(), n, rec, d)
	}
	return rec
}

// TestHedgeBackupStreamWinsByteForByteAndPrimaryIsCancelled: the primary
// holds its response (no header, no byte) for 5 s; after the 200ms hedge
// delay a backup goes to the other upstream, which streams a ~520 KB answer
// in 400 token events. The client receives exactly the backup's bytes
// (SHA-256 of the body equals that of the same request sent to the backup
// directly) and nothing from the primary; the primary's request is
// cancelled as the backup commits, not when the stream ends, and that
// cancellation is neutral: canceled in the attempt metrics, the primary's
// breaker closed with no failure.
func TestHedgeBackupStreamWinsByteForByteAndPrimaryIsCancelled(t *testing.T) {
	t.Parallel()
	// 400 tokens 1ms apart: the backup's stream lasts at least 400ms after
	// the commit, so a primary cancelled only when the request ends would
	// be seen late.
	answer := mockllm.Behavior{Tokens: 400, TokenBytes: 1300, TokenInterval: time.Millisecond}
	slow := answer
	slow.TTFT = mockllm.Fixed(5 * time.Second)
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, PerReplica: map[int]mockllm.Behavior{0: slow, 1: answer}})
	primary, backup := fleet.Replica(0), fleet.Replica(1)
	gw := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		lb_policy first
		hedge {
			after 200ms
			max_ratio 1
		}
	}`, upstreams(fleet)))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	body := chatBody("Race two servers for a long answer.", true)
	const id = "X-Request-Id: e2e-hedge-stream"
	s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", body, id)
	checkCleanStream(t, s)
	if got := s.Header.Get(mockllm.HeaderReplica); got != backup.Addr() {
		t.Errorf("served by %q, want the backup %s", got, backup.Addr())
	}
	// role chunk, 400 token chunks, [DONE]
	if len(s.Events) != 402 {
		t.Errorf("got %d events, want 402 (role, 400 tokens, [DONE])", len(s.Events))
	}
	got := raw(s.Events)
	clientFirst := s.Events[0].At
	if ttft := clientFirst.Sub(s.Sent); ttft < 200*time.Millisecond || ttft > 3*time.Second {
		t.Errorf("first event after %v, want after the 200ms hedge delay and long before the primary's 5s", ttft)
	}

	// The primary sent nothing and was cancelled within 50ms of the commit
	// (the client's first event comes right after the commit).
	p := onlyRecord(t, primary, 5*time.Second)
	b := onlyRecord(t, backup, 5*time.Second)
	if p.Outcome != mockllm.OutcomeCancelled || p.EventsSent != 0 || p.TokensSent != 0 || p.Status != 0 {
		t.Errorf("primary: outcome %s, status %d, %d events, %d tokens; want cancelled before sending anything",
			p.Outcome, p.Status, p.EventsSent, p.TokensSent)
	}
	if lag := p.Ended.Sub(clientFirst); lag > 50*time.Millisecond {
		t.Errorf("the primary's request ended %v after the client got the first event (the backup's first event left the backup %v before it ended); want within 50ms of the commit",
			lag.Round(time.Millisecond), p.Ended.Sub(b.FirstEvent).Round(time.Millisecond))
	} else {
		t.Logf("primary cancelled %v after the client's first event, %v after the backup sent it",
			lag.Round(time.Millisecond), p.Ended.Sub(b.FirstEvent).Round(time.Millisecond))
	}
	if p.Ended.Before(b.FirstEvent) {
		t.Errorf("the primary ended at %s, before the backup's first event at %s: cancelled before anything committed",
			p.Ended.Format("15:04:05.000"), b.FirstEvent.Format("15:04:05.000"))
	}
	if b.Outcome != mockllm.OutcomeCompleted || b.TokensSent != 400 {
		t.Errorf("backup: outcome %s, %d tokens; want completed with 400", b.Outcome, b.TokensSent)
	}
	if sub := b.Started.Sub(p.Started); sub < 190*time.Millisecond || sub > 1500*time.Millisecond {
		t.Errorf("the backup started %v after the primary, want about the hedge delay (200ms)", sub.Round(time.Millisecond))
	}

	// The client's bytes are the backup's own: the same request sent to it
	// directly gives the same stream (the mock is deterministic given the
	// prompt and X-Request-Id, except "created", which is the second the
	// request arrived).
	direct := streamRequest(ctx, t, c, backup.URL()+"/v1/chat/completions", body, id)
	want := raw(direct.Events)
	if len(got) < 512<<10 {
		t.Errorf("the client received %d bytes, want over 512 KiB", len(got))
	}
	gotSum, wantSum := sha256Hex(got), sha256Hex(want)
	if gotSum != wantSum {
		// The two requests straddled a second: compare with "created"
		// normalised, the one field that depends on the arrival time.
		norm := func(b []byte) []byte { return createdField.ReplaceAll(b, []byte(`"created":0`)) }
		gotSum, wantSum = sha256Hex(norm(got)), sha256Hex(norm(want))
		t.Logf(`the direct request arrived in another second: comparing with "created" normalised`)
	}
	if gotSum != wantSum {
		t.Errorf("the client's body (SHA-256 %s) is not the backup's (SHA-256 %s): %s", gotSum, wantSum, firstDiff(got, want))
	} else {
		t.Logf("client body: %d bytes in %d events, SHA-256 %s, the backup's own", len(got), len(s.Events), gotSum)
	}

	checkHedges(t, gw, 1, 1, 0, 0)
	if !waitFor(2*time.Second, func() bool {
		return metricSum(gw, "caddy_llm_proxy_upstream_attempts_total", map[string]string{"upstream": primary.Addr(), "outcome": "canceled"}) == 1
	}) {
		t.Errorf("caddy_llm_proxy_upstream_attempts_total{upstream=primary,outcome=canceled} did not reach 1")
	}
	samples := gw.scrapeMetrics()
	if v, _ := metricValue(samples, "caddy_llm_proxy_upstream_attempts_total", map[string]string{"upstream": primary.Addr()}); v != 1 {
		t.Errorf("the primary has %v attempts in the metrics, want 1 (canceled)", v)
	}
	if v, _ := metricValue(samples, "caddy_llm_proxy_upstream_attempts_total", map[string]string{"upstream": backup.Addr(), "outcome": "success"}); v != 1 {
		t.Errorf("caddy_llm_proxy_upstream_attempts_total{upstream=backup,outcome=success} = %v, want 1", v)
	}
	if v := gw.breaker(primary.Addr()); v.State != "closed" || v.ConsecutiveFailures != 0 || v.FailuresInWindow != 0 || v.LastFailure != "" {
		t.Errorf("primary's breaker: state %s, consecutive_failures %d, failures_in_window %d, last_failure %q; want closed with no failure",
			v.State, v.ConsecutiveFailures, v.FailuresInWindow, v.LastFailure)
	}
}

// TestHedgeCapExhaustedLeavesSlowRequestsToTheirPrimary: with max_ratio
// 0.1 and the low-traffic floor off (min_per_sec 0), ten fast requests earn
// the pool one hedge. Of six slow requests
// that follow (primary TTFT 400ms, hedge after 100ms) the first is hedged
// and won by the backup; the other five find the cap spent: their hedge is
// suppressed, and each still completes from its primary.
func TestHedgeCapExhaustedLeavesSlowRequestsToTheirPrimary(t *testing.T) {
	t.Parallel()
	quick := mockllm.Behavior{Tokens: 3, TokenInterval: mockllm.NoDelay}
	slow := quick
	slow.TTFT = mockllm.Fixed(400 * time.Millisecond)
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, PerReplica: map[int]mockllm.Behavior{0: slow, 1: quick}})
	primary, backup := fleet.Replica(0), fleet.Replica(1)
	gw := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		lb_policy first
		hedge {
			after 100ms
			max_ratio 0.1
			min_per_sec 0
		}
	}`, upstreams(fleet)))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	url := gw.URL + "/v1/chat/completions"

	// Ten fast requests (the header overrides the primary's TTFT): none
	// reaches the hedge delay.
	for i := range 10 {
		s := streamRequest(ctx, t, c, url, chatBody("Quick.", true), "X-Mock-TTFT: 0", fmt.Sprintf("X-Request-Id: cap-fast-%d", i))
		checkCleanStream(t, s)
	}
	checkHedges(t, gw, 0, 0, 0, 0) // the exact counts below prove the name

	for i := range 6 {
		s := streamRequest(ctx, t, c, url, chatBody("Slow.", true), fmt.Sprintf("X-Request-Id: cap-slow-%d", i))
		checkCleanStream(t, s)
		servedBy, ttft := s.Header.Get(mockllm.HeaderReplica), s.Events[0].At.Sub(s.Sent)
		if i == 0 {
			if servedBy != backup.Addr() {
				t.Errorf("slow request 1 served by %s, want the backup %s (it earned the one hedge)", servedBy, backup.Addr())
			}
			continue
		}
		if servedBy != primary.Addr() {
			t.Errorf("slow request %d served by %s, want its primary %s (the cap is spent)", i+1, servedBy, primary.Addr())
		}
		if ttft < 380*time.Millisecond {
			t.Errorf("slow request %d: first event after %v, want the primary's 400ms", i+1, ttft)
		}
	}
	checkHedges(t, gw, 1, 1, 0, 5)
	if n := backup.Stats().Requests; n != 1 {
		t.Errorf("the backup received %d requests, want 1 (one hedge)", n)
	}
	samples := gw.scrapeMetrics()
	if v, _ := metricValue(samples, "caddy_llm_proxy_requests_total", map[string]string{"outcome": "success"}); v != 16 {
		t.Errorf("caddy_llm_proxy_requests_total{outcome=success} = %v, want 16", v)
	}
	if v, _ := metricValue(samples, "caddy_llm_proxy_hedge_delay_seconds", map[string]string{"model": "mock-llama", "mode": "stream"}); v != 0.1 {
		t.Errorf("caddy_llm_proxy_hedge_delay_seconds{model=mock-llama} = %v, want 0.1", v)
	}
}

// TestHedgeNonStreamingReturnsFasterJSONWhole: without streaming, the
// commit point is the complete body: the backup's JSON completion, ready
// long before the primary's, reaches the client whole and unchanged.
func TestHedgeNonStreamingReturnsFasterJSONWhole(t *testing.T) {
	t.Parallel()
	answer := mockllm.Behavior{Tokens: 64, TokenBytes: 200, TokenInterval: mockllm.NoDelay}
	slow := answer
	slow.TTFT = mockllm.Fixed(3 * time.Second)
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, PerReplica: map[int]mockllm.Behavior{0: slow, 1: answer}})
	primary, backup := fleet.Replica(0), fleet.Replica(1)
	gw := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		lb_policy first
		hedge {
			after 100ms
			max_ratio 1
		}
	}`, upstreams(fleet)))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	body := chatBody("Answer in one piece.", false)
	const id = "X-Request-Id: e2e-hedge-json"
	start := time.Now()
	via, err := doPlain(ctx, c, gw.URL+"/v1/chat/completions", body, id)
	elapsed := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if via.Status != http.StatusOK {
		t.Fatalf("status %d, want 200: %s", via.Status, via.Body)
	}
	if elapsed > 2*time.Second {
		t.Errorf("the response took %v, want the backup's (well under the primary's 3s)", elapsed.Round(time.Millisecond))
	}
	if got := via.Header.Get(mockllm.HeaderReplica); got != backup.Addr() {
		t.Errorf("served by %q, want the backup %s", got, backup.Addr())
	}
	if ct := via.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q, want application/json", ct)
	}
	if cl, err := strconv.Atoi(via.Header.Get("Content-Length")); err != nil || cl != len(via.Body) {
		t.Errorf("Content-Length %q for a %d-byte body", via.Header.Get("Content-Length"), len(via.Body))
	}
	var completion struct {
		Object  string `json:"object"`
		Choices []struct {
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(via.Body, &completion); err != nil || completion.Object != "chat.completion" ||
		len(completion.Choices) != 1 || completion.Choices[0].FinishReason != "stop" || len(completion.Choices[0].Message.Content) < 64*100 {
		t.Errorf("body is not a whole chat.completion (%v): %.200s", err, via.Body)
	}
	direct, err := doPlain(ctx, c, backup.URL()+"/v1/chat/completions", body, id)
	if err != nil {
		t.Fatal(err)
	}
	if ok, how := sameUpstreamBytes(via.Body, direct.Body); !ok {
		t.Errorf("the client's body is not the backup's: %s", firstDiff(via.Body, direct.Body))
	} else {
		t.Logf("client body (%d bytes) vs the backup's: %s", len(via.Body), how)
	}

	p := onlyRecord(t, primary, 5*time.Second)
	if p.Outcome != mockllm.OutcomeCancelled || p.Status != 0 {
		t.Errorf("primary: outcome %s, status %d; want cancelled before answering", p.Outcome, p.Status)
	}
	checkHedges(t, gw, 1, 1, 0, 0)
}

// goroutines reads the number of goroutines of the caddy process from the
// admin endpoint's pprof handler (the "goroutine profile: total N" line).
func (g *gateway) goroutines() int {
	g.t.Helper()
	status, body := g.admin(http.MethodGet, "/debug/pprof/goroutine?debug=1")
	if status != http.StatusOK {
		g.t.Fatalf("GET /debug/pprof/goroutine: status %d: %.200s", status, body)
	}
	line, _, _ := bufio.NewReader(strings.NewReader(string(body))).ReadLine()
	n, err := strconv.Atoi(strings.TrimPrefix(string(line), "goroutine profile: total "))
	if err != nil {
		g.t.Fatalf("GET /debug/pprof/goroutine: first line %q: %v", line, err)
	}
	return n
}

// TestHedgedRequestsLeaveNoGoroutinesBehind: after 100 hedged requests, 10
// at a time, whose primaries are all abandoned, the caddy process runs no
// more goroutines than after a warm-up round once the streams have ended
// and the connections settled: no loser, timer, drain or relay is left.
func TestHedgedRequestsLeaveNoGoroutinesBehind(t *testing.T) {
	t.Parallel()
	answer := mockllm.Behavior{TTFT: mockllm.Fixed(10 * time.Millisecond), Tokens: 4, TokenInterval: time.Millisecond}
	slow := answer
	slow.TTFT = mockllm.Fixed(2 * time.Second)
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, PerReplica: map[int]mockllm.Behavior{0: slow, 1: answer}})
	primary := fleet.Replica(0)
	// retries { ratio 1 }: every hedge is charged to the retry budget, whose
	// default (10% of requests plus 30) would suppress most of these.
	gw := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		lb_policy first
		hedge {
			after 30ms
			max_ratio 1
		}
		retries {
			ratio 1
		}
	}`, upstreams(fleet)))
	ctx := testContext(t, 60*time.Second)
	c := newClient(t)

	round := func(name string, n, concurrency int) {
		t.Helper()
		var wg sync.WaitGroup
		errs := make(chan string, n)
		next := make(chan int, n)
		for i := range n {
			next <- i
		}
		close(next)
		for range concurrency {
			wg.Go(func() {
				for i := range next {
					s, err := doStream(ctx, c, gw.URL+"/v1/chat/completions", chatBody("Hedge me.", true),
						fmt.Sprintf("X-Request-Id: %s-%d", name, i))
					switch {
					case err != nil:
						errs <- err.Error()
					case s.Status != http.StatusOK || s.Err != nil || len(s.Events) != 6:
						errs <- fmt.Sprintf("request %s-%d: status %d, err %v, %d events", name, i, s.Status, s.Err, len(s.Events))
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for e := range errs {
			t.Error(e)
		}
	}
	// settle waits until no primary is in flight at the mock, drops the
	// client's keep-alive connections (and so the server's goroutines for
	// them) and lets the gateway's background work end.
	settle := func() {
		t.Helper()
		if !waitFor(5*time.Second, func() bool { return primary.Stats().InFlight == 0 }) {
			t.Fatalf("%d primaries still in flight at the mock 5s after the last response", primary.Stats().InFlight)
		}
		c.CloseIdleConnections()
		time.Sleep(300 * time.Millisecond)
	}

	round("warmup", 10, 10)
	settle()
	before := gw.goroutines()

	round("hedged", 100, 10)
	checkHedges(t, gw, 110, 110, 0, 0)
	settle()
	const slack = 8
	after := gw.goroutines()
	if after > before+slack {
		// Give slow exits (a drain bounded at 2s) a chance before failing.
		waitFor(3*time.Second, func() bool { after = gw.goroutines(); return after <= before+slack })
	}
	t.Logf("caddy goroutines: %d after the warm-up, %d after 100 hedged requests", before, after)
	if after > before+slack {
		_, dump := gw.admin(http.MethodGet, "/debug/pprof/goroutine?debug=1")
		t.Errorf("caddy runs %d goroutines after 100 hedged requests, %d before: more than %d left behind\n%s",
			after, before, slack, dump)
	}
}
