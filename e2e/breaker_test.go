package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// TestOpenBreakerShortCircuitsWith503: after consecutive_failures 503s in
// a row, the upstream's breaker opens: the next request is not sent to it,
// and with no other upstream the client gets the gateway's own 503 in
// OpenAI's error shape, with Retry-After and X-Circuit-Breaker: open.
func TestOpenBreakerShortCircuitsWith503(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{
		Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503},
	}})
	gw := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		max_attempts 1
		breaker {
			consecutive_failures 3
			open_for 30s
			min_open 30s
		}
	}`, upstreams(fleet)))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	url := gw.URL + "/v1/chat/completions"

	for i := range 3 {
		r, err := doPlain(ctx, c, url, chatBody("Fail me.", true))
		if err != nil {
			t.Fatal(err)
		}
		if r.Status != http.StatusServiceUnavailable || r.Header.Get("X-Circuit-Breaker") != "" {
			t.Fatalf("request %d: status %d, X-Circuit-Breaker %q; want the upstream's 503 passed through",
				i+1, r.Status, r.Header.Get("X-Circuit-Breaker"))
		}
	}
	if n := fleetRequests(fleet); n != 3 {
		t.Fatalf("the upstream got %d requests, want 3", n)
	}

	r, err := doPlain(ctx, c, url, chatBody("Fail me.", true))
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != http.StatusServiceUnavailable {
		t.Fatalf("status %d, want 503: %s", r.Status, r.Body)
	}
	if n := fleetRequests(fleet); n != 3 {
		t.Errorf("the upstream got %d requests, want still 3: an open breaker must keep requests away", n)
	}
	if got := r.Header.Get("X-Circuit-Breaker"); got != "open" {
		t.Errorf("X-Circuit-Breaker %q, want open", got)
	}
	if ra, err := strconv.Atoi(r.Header.Get("Retry-After")); err != nil || ra < 1 || ra > 60 {
		t.Errorf("Retry-After %q, want whole seconds until the breaker may half-open (about 30)", r.Header.Get("Retry-After"))
	}
	if ct := r.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q, want application/json", ct)
	}
	_, typ, code := openAIError(t, r.Body)
	t.Logf("breaker 503: type %q, code %q, Retry-After %s", typ, code, r.Header.Get("Retry-After"))

	samples := gw.scrapeMetrics()
	addr := fleet.Replica(0).Addr()
	if v, _ := metricValue(samples, "caddy_llm_proxy_breaker_state", map[string]string{"upstream": addr}); v != 2 {
		t.Errorf("caddy_llm_proxy_breaker_state{upstream=%s} = %v, want 2 (open)", addr, v)
	}
	if v, _ := metricValue(samples, "caddy_llm_proxy_short_circuited_total", map[string]string{"upstream": addr}); v != 1 {
		t.Errorf("caddy_llm_proxy_short_circuited_total{upstream=%s} = %v, want 1", addr, v)
	}
	if v, _ := metricValue(samples, "caddy_llm_proxy_requests_total", map[string]string{"outcome": "circuit_open"}); v != 1 {
		t.Errorf("caddy_llm_proxy_requests_total{outcome=circuit_open} = %v, want 1", v)
	}
}

// checkBreakersUntouched fails the test unless every upstream's breaker is
// closed with no failure counted and none remembered.
func checkBreakersUntouched(t *testing.T, gw *gateway, fleet *mockllm.Fleet) {
	t.Helper()
	views := gw.breakers()
	for _, addr := range fleet.Addrs() {
		v, ok := views[addr]
		if !ok {
			t.Errorf("the admin API lists no breaker for %s", addr)
			continue
		}
		if v.State != "closed" || v.ConsecutiveFailures != 0 || v.FailuresInWindow != 0 || v.LastFailure != "" {
			t.Errorf("breaker %s: state %s, consecutive_failures %d, failures_in_window %d, last_failure %q; want closed with zero failures",
				addr, v.State, v.ConsecutiveFailures, v.FailuresInWindow, v.LastFailure)
		}
	}
	samples := gw.scrapeMetrics()
	for _, addr := range fleet.Addrs() {
		if v, found := metricValue(samples, "caddy_llm_proxy_breaker_state", map[string]string{"upstream": addr}); !found || v != 0 {
			t.Errorf("caddy_llm_proxy_breaker_state{upstream=%s} = %v (found %v), want 0", addr, v, found)
		}
	}
	const transitions = "caddy_llm_proxy_breaker_transitions_total"
	if metricFamilyExposed(samples, transitions) {
		if n := metricValueOrZero(t, samples, transitions, nil); n != 0 {
			t.Errorf("%s = %v, want 0", transitions, n)
		}
		return
	}
	// No transition was ever counted, so the counter vector has no series
	// and is not exposed: that reads the same as a renamed metric. Prove
	// the name with one transition made on purpose (forced open, then
	// reset to a fresh closed breaker): exactly one closed→open must be
	// counted, so none was counted before.
	t.Logf("no breaker transition counted yet: proving the name of %s with a forced open", transitions)
	addr := fleet.Addrs()[0]
	if status, _ := gw.breakerAction(addr, "open"); status != http.StatusOK {
		t.Fatalf("control: POST %s/open: status %d", addr, status)
	}
	if status, v := gw.breakerAction(addr, "reset"); status != http.StatusOK || v.State != "closed" {
		t.Fatalf("control: POST %s/reset: status %d, state %q", addr, status, v.State)
	}
	samples = gw.scrapeMetrics()
	if n := metricValueOrZero(t, samples, transitions, map[string]string{"from": "closed", "to": "open"}); n != 1 {
		t.Errorf("%s{from=closed,to=open} = %v after one forced open, want 1 (none before it)", transitions, n)
	}
}

// TestClientsLeavingMidStreamLeaveBreakerClosed: six clients that go away
// mid-stream from a healthy upstream (all sent to the same one, twice
// consecutive_failures) leave its breaker closed with zero failures: a
// client disconnect is neutral.
func TestClientsLeavingMidStreamLeaveBreakerClosed(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3})
	gw := startGateway(t, fmt.Sprintf("\tllm_proxy %s {\n\t\tlb_policy first\n\t\tbreaker {\n\t\t\tconsecutive_failures 3\n\t\t}\n\t}", upstreams(fleet)))
	ctx := testContext(t, 30*time.Second)

	const clients = 6
	errs := make(chan error, clients)
	for i := range clients {
		go func() {
			cctx, cancel := context.WithCancel(ctx)
			defer cancel()
			req, err := newRequest(cctx, gw.URL+"/v1/chat/completions", chatBody("Leave me halfway.", true),
				"X-Mock-Tokens: 100", "X-Mock-Token-Interval: 50ms", fmt.Sprintf("X-Request-Id: leaver-%d", i))
			if err != nil {
				errs <- err
				return
			}
			resp, err := newClient(t).Do(req)
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				errs <- fmt.Errorf("client %d: status %d", i, resp.StatusCode)
				return
			}
			events, _, err := readEvents(resp.Body, func(_ event, n int) bool { return n < 3 })
			if err != nil || len(events) != 3 {
				errs <- fmt.Errorf("client %d: read %d events (%v), want 3", i, len(events), err)
				return
			}
			errs <- nil // cancel and Close: the client goes away mid-stream
		}()
	}
	for range clients {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if !waitFor(5*time.Second, func() bool { return fleet.Replica(0).Stats().Cancelled == clients }) {
		st := fleet.Replica(0).Stats()
		t.Fatalf("the upstream saw %d of %d requests cancelled (%d requests) after 5s", st.Cancelled, clients, st.Requests)
	}
	if !waitFor(5*time.Second, func() bool {
		n, _ := metricValue(gw.scrapeMetrics(), "caddy_llm_proxy_upstream_attempts_total", map[string]string{"outcome": "canceled"})
		return n == clients
	}) {
		t.Fatalf("caddy_llm_proxy_upstream_attempts_total{outcome=canceled} did not reach %d", clients)
	}
	checkBreakersUntouched(t, gw, fleet)
	for i := 1; i < 3; i++ {
		if n := fleet.Replica(i).Stats().Requests; n != 0 {
			t.Errorf("upstream %d got %d requests, want 0 (lb_policy first, nothing failed over)", i, n)
		}
	}
	s := streamRequest(ctx, t, newClient(t), gw.URL+"/v1/chat/completions", chatBody("Still there?", true), "X-Mock-Tokens: 2")
	checkCleanStream(t, s)
	if got := s.Header.Get(mockllm.HeaderReplica); got != fleet.Replica(0).Addr() {
		t.Errorf("next request served by %q, want the first upstream %s (its breaker closed)", got, fleet.Replica(0).Addr())
	}
}

// TestUpstream400sLeaveBreakersClosed: five 400s from the upstream (a
// prompt longer than the context) are the client's fault: passed through,
// not retried, and every breaker stays closed with zero failures.
func TestUpstream400sLeaveBreakersClosed(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3})
	gw := startGateway(t, fmt.Sprintf("\tllm_proxy %s {\n\t\tlb_policy first\n\t\tmax_attempts 3\n\t\tbreaker {\n\t\t\tconsecutive_failures 3\n\t\t}\n\t}", upstreams(fleet)))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	for i := range 5 {
		r, err := doPlain(ctx, c, gw.URL+"/v1/chat/completions", chatBody("An enormous prompt.", true), "X-Mock-Fault: status=400")
		if err != nil {
			t.Fatal(err)
		}
		if r.Status != http.StatusBadRequest || r.Header.Get("X-Circuit-Breaker") != "" {
			t.Fatalf("request %d: status %d, X-Circuit-Breaker %q; want the upstream's 400: %s", i+1, r.Status, r.Header.Get("X-Circuit-Breaker"), r.Body)
		}
	}
	if st := fleet.Replica(0).Stats(); st.Requests != 5 || st.Faults["status"] != 5 {
		t.Errorf("the first upstream got %d requests (%d 400s), want 5 and 5", st.Requests, st.Faults["status"])
	}
	if n := fleetRequests(fleet); n != 5 {
		t.Errorf("the fleet got %d requests, want 5: a 400 is not retried", n)
	}
	checkBreakersUntouched(t, gw, fleet)
	s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("A short prompt.", true), "X-Mock-Tokens: 2")
	checkCleanStream(t, s)
	if got := s.Header.Get(mockllm.HeaderReplica); got != fleet.Replica(0).Addr() {
		t.Errorf("next request served by %q, want the first upstream %s", got, fleet.Replica(0).Addr())
	}
}

// TestAdminAPIListsAndControlsBreakers: GET /llm_proxy/breakers lists a
// breaker per upstream with the documented fields; POST …/open (until
// closed, or ?for=) makes the gateway route around the upstream, and with
// every breaker forced open requests get the 503 of an open circuit;
// …/close and …/reset bring the traffic back; an unknown key is 404, a
// wrong method 405, a bad duration 400.
func TestAdminAPIListsAndControlsBreakers(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3})
	gw := startGateway(t, fmt.Sprintf("\tllm_proxy %s {\n\t\tlb_policy round_robin\n\t\tbreaker {\n\t\t\topen_for 5s\n\t\t\tmin_open 5s\n\t\t}\n\t}", upstreams(fleet)))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	a0, a1, a2 := fleet.Replica(0).Addr(), fleet.Replica(1).Addr(), fleet.Replica(2).Addr()

	// The listing, as raw JSON: every documented field is there.
	status, body := gw.admin(http.MethodGet, "/llm_proxy/breakers")
	if status != http.StatusOK {
		t.Fatalf("GET /llm_proxy/breakers: status %d: %s", status, body)
	}
	var listing []map[string]any
	if err := json.Unmarshal(body, &listing); err != nil {
		t.Fatalf("GET /llm_proxy/breakers: %v: %s", err, body)
	}
	if len(listing) != 3 {
		t.Fatalf("listing has %d breakers, want 3 (one per upstream): %s", len(listing), body)
	}
	for _, b := range listing {
		for _, f := range []string{"key", "upstream", "state", "since", "consecutive_failures", "failures_in_window", "probes_in_flight"} {
			if _, ok := b[f]; !ok {
				t.Errorf("breaker %v lacks %q", b["key"], f)
			}
		}
		if b["state"] != "closed" || b["key"] != b["upstream"] {
			t.Errorf("breaker %v: state %v, upstream %v; want closed, keyed by its upstream", b["key"], b["state"], b["upstream"])
		}
	}

	// send makes n requests and returns how many each upstream served.
	send := func(n int, wantStatus int) map[string]int {
		t.Helper()
		served := map[string]int{}
		for range n {
			r, err := doPlain(ctx, c, gw.URL+"/v1/chat/completions", chatBody("Who serves me?", false), "X-Mock-Tokens: 2")
			if err != nil {
				t.Fatal(err)
			}
			if r.Status != wantStatus {
				t.Fatalf("status %d, want %d: %s", r.Status, wantStatus, r.Body)
			}
			served[r.Header.Get(mockllm.HeaderReplica)]++
		}
		return served
	}

	// Drain upstream 0 until closed.
	status, v := gw.breakerAction(a0, "open")
	if status != http.StatusOK || v.State != "open" || !v.Forced || !v.OpenUntil.IsZero() {
		t.Fatalf("POST %s/open: status %d, %+v; want open, forced, no open_until", a0, status, v)
	}
	before := fleet.Replica(0).Stats().Requests
	if served := send(6, http.StatusOK); served[a0] != 0 || served[a1]+served[a2] != 6 {
		t.Errorf("with upstream 0 forced open, requests went to %v; want none to %s", served, a0)
	}
	if n := fleet.Replica(0).Stats().Requests; n != before {
		t.Errorf("upstream 0 got %d requests while forced open", n-before)
	}
	if v := gw.breaker(a0); v.State != "open" || !v.Forced {
		t.Errorf("listing shows %+v for the forced breaker, want open and forced", v)
	}

	// Open the others for 1s: all three refuse, so the gateway answers
	// 503 circuit open without touching an upstream.
	var timedUntil time.Time
	for _, a := range []string{a1, a2} {
		status, v := gw.breakerAction(a, "open?for=1s")
		timedUntil = v.OpenUntil
		if status != http.StatusOK || v.State != "open" || !v.Forced {
			t.Fatalf("POST %s/open?for=1s: status %d, %+v", a, status, v)
		}
		if d := time.Until(v.OpenUntil); d < 500*time.Millisecond || d > 1100*time.Millisecond {
			t.Errorf("POST %s/open?for=1s: open_until in %v, want about 1s", a, d)
		}
	}
	total := fleetRequests(fleet)
	r, err := doPlain(ctx, c, gw.URL+"/v1/chat/completions", chatBody("Anyone?", false))
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != http.StatusServiceUnavailable || r.Header.Get("X-Circuit-Breaker") != "open" {
		t.Errorf("with every breaker open: status %d, X-Circuit-Breaker %q; want 503 and open: %s", r.Status, r.Header.Get("X-Circuit-Breaker"), r.Body)
	}
	if ra, err := strconv.Atoi(r.Header.Get("Retry-After")); err != nil || ra != 1 {
		t.Errorf("Retry-After %q, want 1 (the two timed opens end within a second)", r.Header.Get("Retry-After"))
	}
	if n := fleetRequests(fleet); n != total {
		t.Errorf("the fleet got %d requests while every breaker was open", n-total)
	}

	// After the 1s the timed ones let probes in and close again (user
	// requests are the probes; recovery_successes 2); upstream 0 stays
	// drained.
	time.Sleep(time.Until(timedUntil) + 20*time.Millisecond)
	for _, a := range []string{a1, a2} {
		if v, ok := gw.waitBreaker(a, 5*time.Second, func(v breakerView) bool {
			send(1, http.StatusOK)
			return v.State == "closed"
		}); !ok {
			t.Errorf("breaker %s: %+v 5s after open?for=1s, want closed again", a, v)
		}
	}
	if v := gw.breaker(a0); v.State != "open" {
		t.Errorf("breaker %s forced open without for: %s, want still open", a0, v.State)
	}

	// close brings upstream 0 back.
	if status, v := gw.breakerAction(a0, "close"); status != http.StatusOK || v.State != "closed" || v.Forced {
		t.Errorf("POST %s/close: status %d, %+v; want closed", a0, status, v)
	}
	if served := send(6, http.StatusOK); served[a0] == 0 {
		t.Errorf("after close, requests went to %v; want some to %s", served, a0)
	}

	// reset too, after a forced open.
	gw.breakerAction(a1, "open")
	if served := send(4, http.StatusOK); served[a1] != 0 {
		t.Errorf("with %s forced open, requests went to %v", a1, served)
	}
	if status, v := gw.breakerAction(a1, "reset"); status != http.StatusOK || v.State != "closed" || v.LastFailure != "" || v.ConsecutiveFailures != 0 {
		t.Errorf("POST %s/reset: status %d, %+v; want a fresh closed breaker", a1, status, v)
	}
	if served := send(6, http.StatusOK); served[a1] == 0 {
		t.Errorf("after reset, requests went to %v; want some to %s", served, a1)
	}

	// Errors.
	for _, tc := range []struct {
		method, path string
		want         int
	}{
		{http.MethodPost, "/llm_proxy/breakers/127.0.0.1:1/open", http.StatusNotFound},
		{http.MethodPost, "/llm_proxy/breakers/" + a0 + "/explode", http.StatusNotFound},
		{http.MethodPost, "/llm_proxy/breakers/" + a0 + "/open?for=soon", http.StatusBadRequest},
		{http.MethodGet, "/llm_proxy/breakers/" + a0 + "/open", http.StatusMethodNotAllowed},
		{http.MethodPost, "/llm_proxy/breakers", http.StatusMethodNotAllowed},
		{http.MethodGet, "/llm_proxy/breakers/127.0.0.1:1", http.StatusNotFound},
	} {
		if status, body := gw.admin(tc.method, tc.path); status != tc.want {
			t.Errorf("%s %s: status %d, want %d: %s", tc.method, tc.path, status, tc.want, body)
		}
	}
	if v := gw.breaker(a0); v.State != "closed" {
		t.Errorf("a GET or a bad request changed breaker %s to %s", a0, v.State)
	}
	// One breaker by key.
	if status, body := gw.admin(http.MethodGet, "/llm_proxy/breakers/"+a0); status != http.StatusOK ||
		!strings.Contains(string(body), `"key":"`+a0+`"`) || !strings.Contains(string(body), `"state":"closed"`) {
		t.Errorf("GET one breaker: status %d: %s", status, body)
	}
}

// TestBreakerMetricsFollowTripAndRecovery: along a trip and a recovery,
// caddy_llm_proxy_breaker_state goes 0 → 2 → 1 → 0,
// breaker_transitions_total counts each transition exactly once, and
// short_circuited_total grows by one for every pick that skipped the
// upstream.
func TestBreakerMetricsFollowTripAndRecovery(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3, PerReplica: map[int]mockllm.Behavior{
		0: {Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503}},
	}})
	sick := fleet.Replica(0)
	addr := sick.Addr()
	gw := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		lb_policy first
		max_attempts 1
		breaker {
			consecutive_failures 3
			open_for 1s
			min_open 1s
			recovery_successes 2
		}
	}`, upstreams(fleet)))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	url := gw.URL + "/v1/chat/completions"
	up := map[string]string{"upstream": addr}

	type want struct {
		state                  float64
		shorted                float64
		open, halfOpen, closed float64 // closed→open, open→half_open, half_open→closed
	}
	check := func(when string, w want) {
		t.Helper()
		s := gw.scrapeMetrics()
		// value reads a counter that may be 0. Once something was counted
		// in its family (exposed says so), the family must be in the
		// scrape: a missing family is then a renamed metric, not a zero.
		// Before that (the check at start) a counter vector without series
		// is legitimately absent; the later checks prove the names.
		value := func(name string, labels map[string]string, exposed bool) float64 {
			if exposed {
				return metricValueOrZero(t, s, name, labels)
			}
			v, _ := metricValue(s, name, labels)
			return v
		}
		// The gauge is set when the breaker is created (at provision).
		if v, found := metricValue(s, "caddy_llm_proxy_breaker_state", up); !found || v != w.state {
			t.Errorf("%s: breaker_state = %v (found %v), want a series reading %v", when, v, found, w.state)
		}
		if v := value("caddy_llm_proxy_short_circuited_total", up, w.shorted > 0); v != w.shorted {
			t.Errorf("%s: short_circuited_total = %v, want %v", when, v, w.shorted)
		}
		anyTransition := w.open+w.halfOpen+w.closed > 0
		for _, tr := range []struct {
			from, to string
			want     float64
		}{{"closed", "open", w.open}, {"open", "half_open", w.halfOpen}, {"half_open", "closed", w.closed}, {"half_open", "open", 0}} {
			if v := value("caddy_llm_proxy_breaker_transitions_total",
				map[string]string{"upstream": addr, "from": tr.from, "to": tr.to}, anyTransition); v != tr.want {
				t.Errorf("%s: breaker_transitions_total{%s→%s} = %v, want %v", when, tr.from, tr.to, v, tr.want)
			}
		}
		if v := value("caddy_llm_proxy_breaker_transitions_total", nil, anyTransition); v != w.open+w.halfOpen+w.closed {
			t.Errorf("%s: breaker_transitions_total over all upstreams = %v, want %v", when, v, w.open+w.halfOpen+w.closed)
		}
	}
	get := func(status int, headers ...string) *plainResponse {
		t.Helper()
		r, err := doPlain(ctx, c, url, chatBody("Metrics.", false), append([]string{"X-Mock-Tokens: 2"}, headers...)...)
		if err != nil {
			t.Fatal(err)
		}
		if r.Status != status {
			t.Fatalf("status %d, want %d: %s", r.Status, status, r.Body)
		}
		return r
	}

	check("at start", want{})
	for range 3 {
		get(http.StatusServiceUnavailable)
	}
	opened := gw.breaker(addr)
	check("after the trip", want{state: 2, open: 1})

	// Five requests skip the open upstream: five refused picks.
	for range 5 {
		if r := get(http.StatusOK); r.Header.Get(mockllm.HeaderReplica) == addr {
			t.Fatalf("the open upstream served a request")
		}
	}
	check("after 5 requests around it", want{state: 2, shorted: 5, open: 1})

	// Recovery: after the cooldown the next request is the probe; a slow
	// one, so that the half-open state can be seen.
	sick.SetBehavior(mockllm.Behavior{})
	time.Sleep(time.Until(opened.OpenUntil) + 50*time.Millisecond)
	probe := make(chan *plainResponse, 1)
	go func() {
		r, _ := doPlain(ctx, newClient(t), url, chatBody("Probe.", false), "X-Mock-Tokens: 10", "X-Mock-Token-Interval: 80ms")
		probe <- r
	}()
	if v, ok := gw.waitBreaker(addr, 3*time.Second, func(v breakerView) bool { return v.ProbesInFlight == 1 }); !ok {
		t.Fatalf("no probe in flight 3s after the cooldown: %+v", v)
	}
	check("during the probe", want{state: 1, shorted: 5, open: 1, halfOpen: 1})
	// A request meanwhile is refused by the busy half-open breaker: one
	// more refused pick.
	if r := get(http.StatusOK); r.Header.Get(mockllm.HeaderReplica) == addr {
		t.Errorf("a second request reached the half-open upstream while its probe ran")
	}
	check("during the probe, after one more request", want{state: 1, shorted: 6, open: 1, halfOpen: 1})
	if r := <-probe; r == nil || r.Status != http.StatusOK || r.Header.Get(mockllm.HeaderReplica) != addr {
		t.Fatalf("probe request: %+v; want 200 from %s", r, addr)
	}
	// The second success closes it.
	if r := get(http.StatusOK); r.Header.Get(mockllm.HeaderReplica) != addr {
		t.Errorf("second probe served by %q, want %s", r.Header.Get(mockllm.HeaderReplica), addr)
	}
	if v := gw.breaker(addr); v.State != "closed" {
		t.Fatalf("breaker %+v after two probe successes, want closed", v)
	}
	check("after recovery", want{state: 0, shorted: 6, open: 1, halfOpen: 1, closed: 1})
	get(http.StatusOK)
	check("after one more request", want{state: 0, shorted: 6, open: 1, halfOpen: 1, closed: 1})
}

// TestTwoSitesBreakerPoliciesSurviveReload: two handlers of one site in
// front of one dead server (connection refused), A with
// consecutive_failures 2 and B with 10. After A's breaker opens, a reload
// that changes neither handler (POST /load) keeps it open: A's requests get
// 503 circuit_open at once, B's still reach the server (502). The admin
// API lists a breaker per policy, each with its pools.
func TestTwoSitesBreakerPoliciesSurviveReload(t *testing.T) {
	t.Parallel()
	dead := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	handler := func(path string, n int) string {
		return fmt.Sprintf("\thandle_path %s {\n\t\tllm_proxy %s {\n\t\t\tmax_attempts 1\n\t\t\tbreaker {\n\t\t\t\tconsecutive_failures %d\n"+
			"\t\t\t\topen_for 1m\n\t\t\t\tmin_open 1m\n\t\t\t}\n\t\t}\n\t}\n", path, dead, n)
	}
	site := handler("/a/*", 2) + handler("/b/*", 10)
	gw := startGateway(t, site)
	c := newClient(t)
	send := func(path string) int {
		t.Helper()
		ctx := testContext(t, 10*time.Second)
		return postAcrossReload(ctx, t, c, gw.URL+path+"/v1/chat/completions", chatBody("hi", false))
	}
	send("/a")
	send("/a")
	if code := send("/a"); code != http.StatusServiceUnavailable {
		t.Fatalf("site A after 2 refused connections: status %d, want 503", code)
	}
	for i := 1; i <= 2; i++ {
		// Caddy skips a reload whose config is unchanged: change an
		// unrelated header, as an operator's edit of another directive does.
		gw.reload(fmt.Sprintf("\theader X-Config %d\n", i) + site)
		if code := send("/a"); code != http.StatusServiceUnavailable {
			t.Fatalf("site A after reload %d that changed neither handler: status %d, want 503 (its breaker was open)", i, code)
		}
		if code := send("/b"); code != http.StatusBadGateway {
			t.Fatalf("site B after reload %d: status %d, want 502 (its own breaker is closed)", i, code)
		}
	}
	status, body := gw.admin(http.MethodGet, "/llm_proxy/breakers")
	if status != http.StatusOK {
		t.Fatalf("GET /llm_proxy/breakers: %d %s", status, body)
	}
	var views []struct {
		Key   string   `json:"key"`
		State string   `json:"state"`
		Pools []string `json:"pools"`
	}
	if err := json.Unmarshal(body, &views); err != nil {
		t.Fatalf("%v: %s", err, body)
	}
	states := map[string]int{}
	for _, v := range views {
		states[v.State]++
		if len(v.Pools) == 0 {
			t.Errorf("breaker %s lists no pools", v.Key)
		}
	}
	if len(views) != 2 || states["open"] != 1 || states["closed"] != 1 {
		t.Fatalf("breakers %s, want one open (A's) and one closed (B's)", body)
	}
}

// TestDrainReachesEverySite: two handlers in front of one server with
// different breaker settings (A consecutive_failures 2, B 10). POST
// /llm_proxy/breakers/<addr>/open drains the server for both: the answer
// lists both breakers, open and forced, and neither site's requests reach
// the server (503); close brings both back. Before, the plain address
// named the newest handler's breaker alone, and site A kept sending to the
// drained server.
func TestDrainReachesEverySite(t *testing.T) {
	t.Parallel()
	fl := startFleet(t, mockllm.FleetConfig{Replicas: 1})
	addr := fl.Replica(0).Addr()
	handler := func(path string, n int) string {
		return fmt.Sprintf("\thandle_path %s {\n\t\tllm_proxy %s {\n\t\t\tmax_attempts 1\n\t\t\tbreaker {\n\t\t\t\tconsecutive_failures %d\n"+
			"\t\t\t}\n\t\t}\n\t}\n", path, addr, n)
	}
	gw := startGateway(t, handler("/a/*", 2)+handler("/b/*", 10))
	c := newClient(t)
	send := func(path string) int {
		t.Helper()
		ctx := testContext(t, 10*time.Second)
		resp := post(ctx, t, c, gw.URL+path+"/v1/chat/completions", chatBody("hi", false))
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, p := range []string{"/a", "/b"} {
		if code := send(p); code != http.StatusOK {
			t.Fatalf("site %s before the drain: status %d, want 200", p, code)
		}
	}
	status, vs := gw.breakerActions(addr, "open")
	if status != http.StatusOK || len(vs) != 2 {
		t.Fatalf("POST %s/open: status %d, %+v; want 200 and both sites' breakers", addr, status, vs)
	}
	for _, v := range vs {
		if v.State != "open" || !v.Forced {
			t.Errorf("POST %s/open lists %+v, want open and forced", addr, v)
		}
	}
	before := fl.Replica(0).Stats().Requests
	for _, p := range []string{"/a", "/b"} {
		if code := send(p); code != http.StatusServiceUnavailable {
			t.Errorf("site %s with the server drained: status %d, want 503", p, code)
		}
	}
	if n := fl.Replica(0).Stats().Requests - before; n != 0 {
		t.Errorf("the drained server got %d requests", n)
	}
	if status, vs := gw.breakerActions(addr, "close"); status != http.StatusOK || len(vs) != 2 || vs[0].State != "closed" || vs[1].State != "closed" {
		t.Fatalf("POST %s/close: status %d, %+v; want both breakers closed", addr, status, vs)
	}
	for _, p := range []string{"/a", "/b"} {
		if code := send(p); code != http.StatusOK {
			t.Errorf("site %s after close: status %d, want 200", p, code)
		}
	}
}
