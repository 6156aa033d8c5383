package e2e

// End-to-end regression tests for defects found in review. Each comment
// says what the test asserts, then what the defect was; each test failed
// against the gateway built before its fix.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// TestHedgeRescuesStalledPrimaryAtLowTraffic asserts that hedging works
// for a fresh gateway at low traffic: with `hedge { after 200ms }` (no other
// hedge setting) in front of one upstream that stalls 5s before its first
// token and one healthy upstream, nine requests sent one at a time about a
// second apart are each answered in full within 1.5s, the stalled ones
// through a backup, and hedges_total{outcome=fired} counts at least one
// hedge per request that reached the stalled upstream.
//
// The defect: the hedge-rate cap (max_ratio 0.1 of the requests in a 10s
// window) rounded down to zero hedges while fewer than ten requests were in
// the window, so at low traffic every hedge was suppressed and a request on
// the stalled upstream waited its full 5s.
func TestHedgeRescuesStalledPrimaryAtLowTraffic(t *testing.T) {
	t.Parallel()
	stalled := mockllm.Behavior{TTFT: mockllm.Fixed(5 * time.Second), Tokens: 3, TokenInterval: mockllm.NoDelay}
	healthy := mockllm.Behavior{Tokens: 3, TokenInterval: mockllm.NoDelay}
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, PerReplica: map[int]mockllm.Behavior{0: stalled, 1: healthy}})
	slow := fleet.Replica(0)
	// round_robin: the stalled upstream is the primary of some requests.
	gw := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		lb_policy round_robin
		hedge {
			after 200ms
		}
	}`, upstreams(fleet)))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	url := gw.URL + "/v1/chat/completions"

	const requests = 9
	// Each request gets 2s: far more than a hedged answer needs (~250ms),
	// far less than the stall, so an unhedged request fails quickly.
	const deadline = 2 * time.Second
	for i := range requests {
		if i > 0 {
			time.Sleep(time.Second) // low traffic: about one request a second
		}
		rctx, cancel := context.WithTimeout(ctx, deadline)
		start := time.Now()
		s, err := doStream(rctx, c, url, chatBody("Hedge me at low traffic.", true), fmt.Sprintf("X-Request-Id: low-traffic-%d", i))
		took := time.Since(start)
		cancel()
		switch {
		case err != nil:
			t.Errorf("request %d: no response within %v: %v (a stalled primary not hedged waits 5s)", i+1, deadline, err)
		case s.Status != http.StatusOK || s.Err != nil || len(s.Events) == 0 || !s.Events[len(s.Events)-1].IsDone():
			t.Errorf("request %d: status %d, %d events, ended with %v after %v; want a complete stream (a stalled primary not hedged waits 5s)",
				i+1, s.Status, len(s.Events), s.Err, took.Round(time.Millisecond))
		case took > 1500*time.Millisecond:
			t.Errorf("request %d took %v, want under 1.5s", i+1, took.Round(time.Millisecond))
		case s.Header.Get(mockllm.HeaderReplica) == slow.Addr():
			t.Errorf("request %d was served by the stalled upstream in %v", i+1, took.Round(time.Millisecond))
		}
	}
	stalledHits := slow.Stats().Requests
	if stalledHits == 0 {
		t.Fatalf("no request reached the stalled upstream: the test did not exercise hedging")
	}
	var fired float64
	if !waitFor(2*time.Second, func() bool {
		fired, _ = metricValue(gw.scrapeMetrics(), "caddy_llm_proxy_hedges_total", map[string]string{"outcome": "fired"})
		return fired >= float64(stalledHits)
	}) {
		samples := gw.scrapeMetrics()
		suppressed, _ := metricValue(samples, "caddy_llm_proxy_hedges_total", map[string]string{"outcome": "suppressed"})
		t.Errorf("caddy_llm_proxy_hedges_total{outcome=fired} = %v (found %v), suppressed %v; want at least %d, one per request that reached the stalled upstream",
			fired, metricFamilyExposed(samples, "caddy_llm_proxy_hedges_total"), suppressed, stalledHits)
	}
	t.Logf("%d of %d requests reached the stalled upstream; hedges fired %v", stalledHits, requests, fired)
}

// TestStaleKeepAliveConnectionsAreNotBlamedOnUpstream asserts that a
// server closing idle keep-alive connections costs clients nothing and is
// not held against the upstream: through a gateway with default transport
// settings, 40 sequential requests, 200–500ms apart, to an upstream that
// closes connections idle for 400ms (as uvicorn does after 5s) and drops a
// request that arrives on a connection idle for over 300ms (its close
// crossing the request on the wire) all succeed; no attempt is counted as
// connect_error, and the upstream's breaker stays closed without a failure.
//
// The defect: a request written to a pooled connection that the server had
// just closed failed as a connect_error before any response byte: the
// client got the retry's answer at best, or a 502 when attempts ran out,
// and the healthy upstream's breaker counted a failure each time. The fix
// retries such a request at once on a fresh connection, and the default
// idle timeout to upstreams is below common servers' keep-alive.
func TestStaleKeepAliveConnectionsAreNotBlamedOnUpstream(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{
		Behavior:      mockllm.Behavior{TTFT: mockllm.Fixed(10 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay},
		IdleTimeout:   400 * time.Millisecond,
		IdleCloseRace: 100 * time.Millisecond,
	})
	up := fleet.Replica(0)
	gw := startGateway(t, fmt.Sprintf("\tllm_proxy %s", up.Addr()))
	c := newClient(t)
	ctx := testContext(t, 40*time.Second)
	url := gw.URL + "/v1/chat/completions"

	const requests = 40
	rng := rand.New(rand.NewPCG(7, 11))
	failed := 0
	for i := range requests {
		if i > 0 {
			// Around the server's timeout: some gaps reuse the connection
			// safely, some fall in the race, some find it closed.
			time.Sleep(200*time.Millisecond + time.Duration(rng.Int64N(int64(300*time.Millisecond))))
		}
		s, err := doStream(ctx, c, url, chatBody("Keep me alive.", true), fmt.Sprintf("X-Request-Id: stale-%d", i))
		switch {
		case err != nil:
			t.Errorf("request %d: %v", i+1, err)
			failed++
		case s.Status != http.StatusOK || s.Err != nil || len(s.Events) == 0 || !s.Events[len(s.Events)-1].IsDone():
			t.Errorf("request %d: status %d, %d events, ended with %v; want a complete stream", i+1, s.Status, len(s.Events), s.Err)
			failed++
		}
	}
	st := up.Stats()
	t.Logf("%d requests, %d failed; the upstream dropped %d requests on connections it was closing as idle, served %d",
		requests, failed, st.IdleDrops, st.Completed)
	if st.IdleDrops == 0 {
		// Not a failure of the gateway (it may close idle connections
		// before any server would), but the stale-connection path was not
		// exercised.
		t.Logf("no request arrived on a connection inside the server's close race")
	}
	samples := gw.scrapeMetrics()
	if v := metricValueOrZero(t, samples, "caddy_llm_proxy_upstream_attempts_total", map[string]string{"outcome": "connect_error"}); v != 0 {
		t.Errorf("caddy_llm_proxy_upstream_attempts_total{outcome=connect_error} = %v, want 0: a stale pooled connection is not the upstream's failure", v)
	}
	if v := metricValueOrZero(t, samples, "caddy_llm_proxy_requests_total", map[string]string{"outcome": "success"}); v != requests {
		t.Errorf("caddy_llm_proxy_requests_total{outcome=success} = %v, want %d", v, requests)
	}
	if v := gw.breaker(up.Addr()); v.State != "closed" || v.ConsecutiveFailures != 0 || v.FailuresInWindow != 0 || v.LastFailure != "" {
		t.Errorf("the upstream's breaker: state %s, consecutive_failures %d, failures_in_window %d, last_failure %q; want closed with no failure",
			v.State, v.ConsecutiveFailures, v.FailuresInWindow, v.LastFailure)
	}
}

// loadWithMaxRequests runs site with max_requests set on the upstreams of
// its llm_proxy handler (the Caddyfile has no per-upstream max_requests),
// through POST /load with the adapted JSON; limits maps a dial address to
// its max_requests.
func loadWithMaxRequests(t *testing.T, gw *gateway, site string, limits map[string]int) {
	t.Helper()
	cfg := gw.adapt(site)
	hs := llmProxyHandlers(cfg)
	if len(hs) != 1 {
		t.Fatalf("adapted config has %d llm_proxy handlers, want 1", len(hs))
	}
	ups, _ := hs[0]["upstreams"].([]any)
	set := 0
	for _, u := range ups {
		u, _ := u.(map[string]any)
		if n, ok := limits[fmt.Sprint(u["dial"])]; ok {
			u["max_requests"] = n
			set++
		}
	}
	if set != len(limits) {
		t.Fatalf("set max_requests on %d upstreams of %v, want %d", set, ups, len(limits))
	}
	if status, body := gw.loadJSON(cfg); status != http.StatusOK {
		t.Fatalf("loading the config with max_requests: status %d: %s", status, body)
	}
}

// TestFullUpstreamsAreNotAnOpenCircuit asserts that upstreams at their
// max_requests limit are reported as busy, not as an open circuit: with
// max_requests 1 on both upstreams and both held by a slow stream, a third
// request gets 503 with error code upstreams_busy and Retry-After, without
// X-Circuit-Breaker; no request is counted with outcome circuit_open, and
// both breakers stay closed.
//
// The defect: a pick that found every upstream full answered like one that
// found every breaker open or no upstream at all, so clients and dashboards
// read a saturated pool as an outage.
func TestFullUpstreamsAreNotAnOpenCircuit(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2})
	a, b := fleet.Replica(0).Addr(), fleet.Replica(1).Addr()
	gw := startGateway(t, fmt.Sprintf("\tllm_proxy %s {\n\t\tlb_policy round_robin\n\t}", upstreams(fleet)))
	loadWithMaxRequests(t, gw, fmt.Sprintf("\tllm_proxy %s {\n\t\tlb_policy round_robin\n\t}", upstreams(fleet)), map[string]int{a: 1, b: 1})
	ctx := testContext(t, 30*time.Second)
	url := gw.URL + "/v1/chat/completions"

	// Hold both upstreams: two streams of 3s, each read to its first event.
	type held struct {
		resp *http.Response
		body *bufio.Reader // one reader for both reads: it buffers ahead
		via  string
	}
	var holds []held
	for i := range 2 {
		resp := post(ctx, t, newClient(t), url, chatBody("Hold the line.", true),
			"X-Mock-Tokens: 30", "X-Mock-Token-Interval: 100ms", fmt.Sprintf("X-Request-Id: hold-%d", i))
		if resp.StatusCode != http.StatusOK {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			t.Fatalf("holding stream %d: status %d: %s", i+1, resp.StatusCode, body)
		}
		br := bufio.NewReader(resp.Body)
		if _, _, err := readEvents(br, func(_ event, n int) bool { return n < 1 }); err != nil {
			t.Fatalf("holding stream %d: %v", i+1, err)
		}
		holds = append(holds, held{resp, br, resp.Header.Get(mockllm.HeaderReplica)})
	}
	if holds[0].via == holds[1].via {
		t.Fatalf("both holding streams went to %s, want one per upstream (max_requests 1)", holds[0].via)
	}

	r, err := doPlain(ctx, newClient(t), url, chatBody("Is anyone free?", true), "X-Request-Id: busy")
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != http.StatusServiceUnavailable {
		t.Errorf("with both upstreams full: status %d, want 503: %s", r.Status, r.Body)
	}
	if r.Header.Get("Retry-After") == "" {
		t.Errorf("with both upstreams full: no Retry-After")
	}
	if v := r.Header.Get("X-Circuit-Breaker"); v != "" {
		t.Errorf("with both upstreams full: X-Circuit-Breaker %q, want none (no breaker is open)", v)
	}
	if r.Status == http.StatusServiceUnavailable {
		if _, _, code := openAIError(t, r.Body); code != "upstreams_busy" {
			t.Errorf("with both upstreams full: error code %q, want upstreams_busy: %s", code, r.Body)
		}
	}
	if n := fleetRequests(fleet); n != 2 {
		t.Errorf("the fleet got %d requests, want the 2 holding streams only", n)
	}

	for i, h := range holds {
		_, tail, err := readEvents(h.body, nil)
		h.resp.Body.Close()
		if err != nil || len(tail) > 0 {
			t.Errorf("holding stream %d ended with %v (tail %q)", i+1, err, tail)
		}
	}
	var samples []metricSample
	waitFor(3*time.Second, func() bool {
		samples = gw.scrapeMetrics()
		v, _ := metricValue(samples, "caddy_llm_proxy_requests_total", nil)
		return v >= 3
	})
	if v := metricValueOrZero(t, samples, "caddy_llm_proxy_requests_total", map[string]string{"outcome": "circuit_open"}); v != 0 {
		t.Errorf("caddy_llm_proxy_requests_total{outcome=circuit_open} = %v, want 0: no breaker was open", v)
	}
	if v := metricValueOrZero(t, samples, "caddy_llm_proxy_requests_total", map[string]string{"outcome": "success"}); v != 2 {
		t.Errorf("caddy_llm_proxy_requests_total{outcome=success} = %v, want 2", v)
	}
	for _, addr := range []string{a, b} {
		if v := gw.breaker(addr); v.State != "closed" || v.ConsecutiveFailures != 0 {
			t.Errorf("breaker %s: %s with %d consecutive failures, want closed with none", addr, v.State, v.ConsecutiveFailures)
		}
	}
}

// TestMaxRequestsBoundsAttemptsInFlight asserts that max_requests is a hard
// bound: with max_requests 1 on one of two upstreams, rounds of 20
// concurrent streams (sent at once on warm connections) all succeed and
// that upstream never has more than one of them in flight at once (the
// mock's own count).
//
// The defect: the limit was checked against the in-flight count before
// the selection policy ran and the attempt was counted, so picks made at
// the same moment could all see the free slot and send several requests at
// once to the limited upstream.
func TestMaxRequestsBoundsAttemptsInFlight(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2,
		Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(20 * time.Millisecond), Tokens: 10, TokenInterval: 20 * time.Millisecond}})
	limited := fleet.Replica(0)
	site := fmt.Sprintf("\tllm_proxy %s", upstreams(fleet))
	gw := startGateway(t, site)
	loadWithMaxRequests(t, gw, site, map[string]int{limited.Addr(): 1})
	ctx := testContext(t, 30*time.Second)
	url := gw.URL + "/v1/chat/completions"

	const clients, rounds = 20, 8
	cs := make([]*http.Client, clients)
	for i := range cs {
		cs[i] = newClient(t)
		// A warm keep-alive connection, so that a round's requests reach
		// the gateway together rather than one TCP handshake apart.
		r, err := doPlain(ctx, cs[i], url, chatBody("Warm up.", false), "X-Mock-Tokens: 1", "X-Mock-TTFT: 0")
		if errors.Is(err, io.EOF) {
			// The config was just reloaded: a connection accepted as the
			// old server hands over can be closed unanswered (seen once in
			// a loaded CI run). The warm-up is not what is tested.
			r, err = doPlain(ctx, cs[i], url, chatBody("Warm up.", false), "X-Mock-Tokens: 1", "X-Mock-TTFT: 0")
		}
		if err != nil || r.Status != http.StatusOK {
			t.Fatalf("warm-up %d: %v %v", i, err, r)
		}
	}
	limited.ResetStats()
	fleet.Replica(1).ResetStats()
	for round := range rounds {
		start := make(chan struct{})
		var wg sync.WaitGroup
		errs := make(chan error, clients)
		for i, c := range cs {
			wg.Go(func() {
				<-start
				s, err := doStream(ctx, c, url, chatBody("All at once.", true), fmt.Sprintf("X-Request-Id: bound-%d-%d", round, i))
				switch {
				case err != nil:
					errs <- fmt.Errorf("round %d, request %d: %v", round+1, i, err)
				case s.Status != http.StatusOK || s.Err != nil || len(s.Events) == 0 || !s.Events[len(s.Events)-1].IsDone():
					errs <- fmt.Errorf("round %d, request %d: status %d, %d events, ended with %v; want a complete stream", round+1, i, s.Status, len(s.Events), s.Err)
				}
			})
		}
		close(start)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
	}
	st := limited.Stats()
	if st.MaxInFlight > 1 {
		t.Errorf("the upstream with max_requests 1 had %d requests in flight at once, want at most 1", st.MaxInFlight)
	}
	if st.Requests == 0 {
		t.Errorf("the upstream with max_requests 1 served nothing: the test did not exercise the limit")
	}
	t.Logf("limited upstream: %d requests, at most %d at once; the other: %d", st.Requests, st.MaxInFlight, fleet.Replica(1).Stats().Requests)
}

// TestFailedConfigLoadChangesNoLiveBreaker asserts that a config that
// fails to load leaves the running breakers alone: the gateway runs config
// A (consecutive_failures 3, max_attempts 1); a config B with
// consecutive_failures 1 for the same upstream, whose provisioning fails
// after llm_proxy's (a later route names a handler module that does not
// exist), is refused by /load; then a 503 from the upstream leaves its
// breaker closed with one failure, and only the third failure in a row
// opens it, as A says.
//
// The defect: Provision applied B's thresholds to the shared breaker
// before the load failed, so A kept running with B's consecutive_failures 1
// and the first failure opened the breaker.
func TestFailedConfigLoadChangesNoLiveBreaker(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{})
	addr := fleet.Replica(0).Addr()
	site := func(n int) string {
		return fmt.Sprintf(`	llm_proxy %s {
		max_attempts 1
		breaker {
			consecutive_failures %d
		}
	}`, addr, n)
	}
	gw := startGateway(t, site(3))
	ctx := testContext(t, 30*time.Second)
	url := gw.URL + "/v1/chat/completions"

	bad := gw.adapt(site(1))
	servers, _ := bad["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)
	appended := false
	for _, srv := range servers {
		srv := srv.(map[string]any)
		if len(llmProxyHandlers(srv["routes"])) == 0 {
			continue
		}
		routes, _ := srv["routes"].([]any)
		srv["routes"] = append(routes, map[string]any{
			"handle": []any{map[string]any{"handler": "e2e_no_such_handler"}},
		})
		appended = true
	}
	if !appended {
		t.Fatalf("no server with an llm_proxy route in the adapted config: %v", bad)
	}
	status, body := gw.loadJSON(bad)
	if status == http.StatusOK {
		t.Fatalf("a config with an unknown handler module loaded (status 200); the test needs it refused")
	}
	t.Logf("config B refused: status %d: %.200s", status, body)

	c := newClient(t)
	fail := func(n int) breakerView {
		t.Helper()
		r, err := doPlain(ctx, c, url, chatBody("Fail once.", false), "X-Mock-Fault: status=503", fmt.Sprintf("X-Request-Id: fail-%d", n))
		if err != nil {
			t.Fatal(err)
		}
		if r.Status != http.StatusServiceUnavailable || r.Header.Get("X-Circuit-Breaker") != "" {
			t.Fatalf("failing request %d: status %d, X-Circuit-Breaker %q; want the upstream's own 503: %s", n, r.Status, r.Header.Get("X-Circuit-Breaker"), r.Body)
		}
		return gw.breaker(addr)
	}
	if v := fail(1); v.State != "closed" || v.ConsecutiveFailures != 1 {
		t.Errorf("after one failure: breaker %s with %d consecutive failures; want closed with 1 (config A's consecutive_failures 3, not the refused config's 1)",
			v.State, v.ConsecutiveFailures)
	}
	if v := fail(2); v.State != "closed" {
		t.Errorf("after two failures: breaker %s, want closed (consecutive_failures 3)", v.State)
	}
	if v := fail(3); v.State != "open" {
		t.Errorf("after three failures: breaker %s, want open (consecutive_failures 3)", v.State)
	}
}

// TestOldConfigRequestForModelNewPoolLacksDoesNotCrash asserts that
// requests still running on a replaced config finish cleanly under
// `breaker { scope model }` when the new config's pool holds other
// upstreams: a stream for model e2e-model-x that started before the reload
// runs to [DONE]; a request for model e2e-model-y, which no config has a
// breaker for, whose body was still arriving during the reload (so it picks
// its upstream on the old config after that config's Cleanup) is answered
// in full; the access log has a line for each, with
// {http.llm_proxy.breaker_state}; and the gateway logs no panic.
//
// The defect: after Cleanup an old handler takes no new breaker
// references, so for e2e-model-y on its old upstreams it found no breaker
// (none existed, and the live config does not use those upstreams), served
// the request without one, and then the breaker_state placeholder
// dereferenced the missing breaker: a nil-pointer panic at the end of the
// request, which cut the client's stream before its end (no closing
// chunk) and left the access log line without the llm_proxy fields.
func TestOldConfigRequestForModelNewPoolLacksDoesNotCrash(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3})
	logFile := fmt.Sprintf("%s/access.log", t.TempDir())
	site := func(pool string) string {
		return fmt.Sprintf(`	log {
		output file %s
		format json
	}
	log_append llm_breaker_state {http.llm_proxy.breaker_state}
	log_append llm_upstream {http.llm_proxy.upstream}
	llm_proxy %s {
		lb_policy first
		breaker {
			scope model
		}
	}`, logFile, pool)
	}
	old := fleet.Replica(0).Addr() + " " + fleet.Replica(1).Addr()
	gw := startGateway(t, site(old))
	ctx := testContext(t, 30*time.Second)
	url := gw.URL + "/v1/chat/completions"
	body := func(model, prompt string) string {
		b, _ := json.Marshal(map[string]any{
			"model":    model,
			"messages": []map[string]string{{"role": "user", "content": prompt}},
			"stream":   true,
		})
		return string(b)
	}

	// 1: a long stream, committed before the reload.
	const tokens = 25
	long := post(ctx, t, newClient(t), url, body("e2e-model-x", "Outlive my config."),
		fmt.Sprintf("X-Mock-Tokens: %d", tokens), "X-Mock-Token-Interval: 100ms", "X-Request-Id: old-stream")
	defer long.Body.Close()
	if long.StatusCode != http.StatusOK {
		t.Fatalf("long stream: status %d", long.StatusCode)
	}
	longBody := bufio.NewReader(long.Body) // one reader for both reads: it buffers ahead
	first, _, err := readEvents(longBody, func(_ event, n int) bool { return n < 1 })
	if err != nil || len(first) != 1 {
		t.Fatalf("long stream: first event: %v", err)
	}

	// 2: a request for a model no breaker exists for, whose body is still
	// arriving: its handler is the old config's, but it picks an upstream
	// only once the body is complete, after the reload.
	late := body("e2e-model-y", "Pick after the reload.")
	pr, pw := io.Pipe()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, pr)
	if err != nil {
		t.Fatal(err)
	}
	req.ContentLength = int64(len(late))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Mock-Tokens", "3")
	req.Header.Set("X-Request-Id", "late-pick")
	type result struct {
		s   *stream
		err error
	}
	lateDone := make(chan result, 1)
	go func() {
		resp, err := newClient(t).Do(req)
		if err != nil {
			lateDone <- result{err: err}
			return
		}
		defer resp.Body.Close()
		s := &stream{Status: resp.StatusCode, Header: resp.Header}
		s.Events, s.Tail, s.Err = readEvents(resp.Body, nil)
		lateDone <- result{s: s}
	}()
	half := len(late) / 2
	if _, err := io.WriteString(pw, late[:half]); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // the old handler is reading the body

	gw.reload(site(fleet.Replica(2).Addr())) // returns after the old config's Cleanup
	time.Sleep(100 * time.Millisecond)
	if _, err := io.WriteString(pw, late[half:]); err != nil {
		t.Fatal(err)
	}
	pw.Close()

	var lr result
	select {
	case lr = <-lateDone:
	case <-time.After(10 * time.Second):
		t.Fatal("the request picked after the reload got no answer within 10s")
	}
	switch {
	case lr.err != nil:
		t.Errorf("the request picked after the reload: %v (did the gateway panic?)", lr.err)
	case lr.s.Status == http.StatusOK:
		if lr.s.Err != nil || len(lr.s.Tail) > 0 || len(lr.s.Events) == 0 || !lr.s.Events[len(lr.s.Events)-1].IsDone() {
			t.Errorf("the request picked after the reload: %d events, ended with %v (tail %q); want a complete stream", len(lr.s.Events), lr.s.Err, lr.s.Tail)
		}
	default:
		t.Errorf("the request picked after the reload: status %d: %q; want a complete stream", lr.s.Status, raw(lr.s.Events))
	}

	rest, tail, err := readEvents(longBody, nil)
	if err != nil || len(tail) > 0 || len(rest) == 0 || !rest[len(rest)-1].IsDone() {
		t.Errorf("the long stream ended with %v (tail %q) after %d more events; want a clean end with [DONE]", err, tail, len(rest))
	} else if n := 1 + len(rest); n != tokens+2 {
		t.Errorf("the long stream carried %d events, want %d", n, tokens+2)
	}

	// The access log has a line for each request with the breaker_state
	// placeholder (a panic in the handler leaves the line without it).
	byID := map[string]map[string]any{}
	waitFor(3*time.Second, func() bool {
		for _, e := range readJSONLines(t, logFile) {
			if id := requestHeader(e, "X-Request-Id"); id != "" {
				byID[id] = e
			}
		}
		return byID["old-stream"] != nil && byID["late-pick"] != nil
	})
	for _, id := range []string{"old-stream", "late-pick"} {
		e, ok := byID[id]
		if !ok {
			t.Errorf("no access log line for request %s", id)
			continue
		}
		if _, ok := e["llm_breaker_state"]; !ok {
			t.Errorf("access log line of %s has no llm_breaker_state", id)
		}
		t.Logf("request %s: status %v, llm_upstream %v, llm_breaker_state %q", id, e["status"], e["llm_upstream"], e["llm_breaker_state"])
	}
	if log := gw.logs.String(); strings.Contains(log, "panic") {
		i := strings.Index(log, "panic")
		t.Errorf("the gateway logged a panic: %.300s", log[max(0, i-100):])
	}
}

// requestHeader returns a request header of an access log entry.
func requestHeader(e map[string]any, name string) string {
	req, _ := e["request"].(map[string]any)
	h, _ := req["headers"].(map[string]any)
	vs, _ := h[name].([]any)
	if len(vs) == 0 {
		return ""
	}
	s, _ := vs[0].(string)
	return s
}
