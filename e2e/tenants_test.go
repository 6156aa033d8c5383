package e2e

// End-to-end tests of tenants (issue 8): identity from credentials,
// per-tenant concurrency, request and token limits with reservations,
// streamed usage, tenant breakers, the 429s and their x-ratelimit-*
// headers. Every test also checks, when it ends, that no key it used
// appears in caddy's log, the metrics or the admin API (startTenantGateway).

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// TestTenantConcurrencySlotIsFreedOnAbortAndTimeout asserts that a tenant
// with max_concurrent 1 gets its slot back on every exit path, and that a
// concurrency refusal costs it nothing: while its stream runs, a second
// request gets 429 tenant_concurrency with Retry-After, zero upstream calls
// and x-ratelimit-remaining-requests unchanged; after it aborts the stream
// mid-way, its next request is admitted within a second; after an upstream
// first-byte timeout (504) its next request is admitted at once; its rpm
// counts exactly the admitted requests (x-ratelimit-remaining-requests and
// the admin API), and the fleet sees exactly those.
func TestTenantConcurrencySlotIsFreedOnAbortAndTimeout(t *testing.T) {
	t.Parallel()
	key := newKey("solo")
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	gw := startTenantGateway(t, gatewayOptions{
		Globals: fmt.Sprintf(`	llm_proxy {
		tenants {
			key %s solo tier one
		}
		tier one {
			max_concurrent 1
			rpm 10
		}
	}`, key),
		Site: fmt.Sprintf(`	llm_proxy %s {
		first_byte_timeout 400ms
		max_attempts 1
	}`, upstreams(fleet)),
	}, key)
	c := newClient(t)
	ctx := testContext(t, 25*time.Second)
	url := gw.URL + "/v1/chat/completions"
	quick := chatOf("quick one", false, nil)

	// A long stream (100 tokens 50ms apart), read a few events, then abort.
	sctx, abort := context.WithCancel(ctx)
	defer abort()
	req, err := newRequest(sctx, url, chatOf("a long stream", true, nil), bearer(key), "X-Mock-Tokens: 100", "X-Mock-Token-Interval: 50ms")
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("the stream: %v", err)
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		t.Fatalf("the stream: status %d, want 200", resp.StatusCode)
	}
	checkRateHeaders(t, "the stream (1st admitted request)", resp.Header, rateHeaders{ReqLimit: 10, ReqRemaining: 9})
	got := 0
	readEvents(resp.Body, func(e event, n int) bool { got = n; return n < 3 })
	if got < 3 {
		t.Fatalf("the stream ended after %d events, want at least 3 before the abort", got)
	}

	// While it runs: refused for concurrency, nothing consumed.
	r := mustSend(ctx, t, c, url, quick, bearer(key))
	checkRefusal(t, "a 2nd request while the stream runs", r, http.StatusTooManyRequests, "tenant_concurrency", true, 60)
	checkRateHeaders(t, "the concurrency refusal", r.Header, rateHeaders{ReqLimit: 10, ReqRemaining: 9})
	if r.Took > 500*time.Millisecond {
		t.Errorf("the concurrency refusal took %v, want it at once", r.Took)
	}
	if n := fleetRequests(fleet); n != 1 {
		t.Errorf("the fleet received %d requests, want 1: the refused request reached an upstream", n)
	}

	// Abort mid-way; the next request must be admitted within a second.
	abort()
	resp.Body.Close()
	aborted := time.Now()
	refusedAfterAbort := 0
	var admitted reply
	for {
		admitted = mustSend(ctx, t, c, url, quick, bearer(key))
		if admitted.Status == http.StatusOK {
			break
		}
		if code := errorCode(admitted.Body); admitted.Status != http.StatusTooManyRequests || code != "tenant_concurrency" {
			t.Fatalf("after the abort: status %d code %q, want 200 (or 429 tenant_concurrency until the slot is back): %s", admitted.Status, code, admitted.Body)
		}
		refusedAfterAbort++
		if time.Since(aborted) > time.Second {
			t.Fatalf("the tenant's slot was not released within 1s of its client aborting the stream (%d refusals since)", refusedAfterAbort)
		}
		time.Sleep(25 * time.Millisecond)
	}
	t.Logf("admitted %v after the abort, %d concurrency refusals in between", time.Since(aborted).Round(time.Millisecond), refusedAfterAbort)
	checkRateHeaders(t, "the first request admitted after the abort (2nd admitted; refusals must not count)", admitted.Header, rateHeaders{ReqLimit: 10, ReqRemaining: 8})

	// An upstream first-byte timeout: 504; the next request is admitted at once.
	r = mustSend(ctx, t, c, url, quick, bearer(key), "X-Mock-TTFT: 3s")
	if r.Status != http.StatusGatewayTimeout {
		t.Fatalf("a request whose upstream stalls past first_byte_timeout: status %d, want 504: %s", r.Status, r.Body)
	}
	checkRateHeaders(t, "the 504 (3rd admitted)", r.Header, rateHeaders{ReqLimit: 10, ReqRemaining: 7})
	r = mustSend(ctx, t, c, url, quick, bearer(key))
	if r.Status != http.StatusOK {
		t.Fatalf("the request right after the 504: status %d code %q, want 200 (the timed-out request's slot must be released): %s",
			r.Status, errorCode(r.Body), r.Body)
	}
	checkRateHeaders(t, "the request after the 504 (4th admitted)", r.Header, rateHeaders{ReqLimit: 10, ReqRemaining: 6})

	if n := fleetRequests(fleet); n != 4 {
		t.Errorf("the fleet received %d requests, want 4 (the admitted ones only)", n)
	}
	v := gw.waitTenantIdle("solo", 2*time.Second)
	if v.RequestsInWindow != 4 || v.Tier != "one" || v.MaxConcurrent != 1 || v.RPM != 10 {
		t.Errorf("admin API tenant solo: requests_in_window %d tier %q max_concurrent %d rpm %d; want 4, one, 1, 10 (refusals consume nothing)",
			v.RequestsInWindow, v.Tier, v.MaxConcurrent, v.RPM)
	}
	samples := gw.scrapeMetrics()
	if got := metricValueOrZero(t, samples, "caddy_llm_proxy_admission_total", map[string]string{"tier": "one", "decision": "tenant_concurrency"}); got != float64(1+refusedAfterAbort) {
		t.Errorf("caddy_llm_proxy_admission_total{tier=one,decision=tenant_concurrency} = %v, want %d", got, 1+refusedAfterAbort)
	}
	if got := metricValueOrZero(t, samples, "caddy_llm_proxy_admission_total", map[string]string{"tier": "one", "decision": "admitted"}); got != 4 {
		t.Errorf("caddy_llm_proxy_admission_total{tier=one,decision=admitted} = %v, want 4", got)
	}
	if got := metricValueOrZero(t, samples, "caddy_llm_proxy_inflight", map[string]string{"tier": "one"}); got != 0 {
		t.Errorf("caddy_llm_proxy_inflight{tier=one} = %v at the end, want 0", got)
	}
}

// TestTenantTokenReservationsAdmitOnlyWhatFits asserts that token limits
// reserve at admission: 20 concurrent requests of one tenant with tpm 1000,
// each with a 10-token prompt estimate and max_tokens 200 (a reservation of
// 210), held by a slow upstream: exactly 4 are admitted (4 × 210 ≤ 1000 <
// 5 × 210), the other 16 get 429 tenant_tpm with Retry-After at once (long
// before the admitted ones' first token) and reach no upstream; every
// refusal shows 160 tokens remaining, the admitted ones 790, 580, 370, 160.
func TestTenantTokenReservationsAdmitOnlyWhatFits(t *testing.T) {
	t.Parallel()
	key := newKey("burst")
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(2 * time.Second), Tokens: 3, TokenInterval: mockllm.NoDelay}})
	gw := startTenantGateway(t, gatewayOptions{
		Globals: fmt.Sprintf(`	llm_proxy {
		tenants {
			key %s burst
		}
		tier small {
			tpm 1000
		}
		tenant burst {
			tier small
		}
	}`, key),
		Site: fmt.Sprintf("\tllm_proxy %s", upstreams(fleet)),
	}, key)
	tr := &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 32}
	t.Cleanup(tr.CloseIdleConnections)
	c := &http.Client{Transport: tr}
	ctx := testContext(t, 25*time.Second)
	url := gw.URL + "/v1/chat/completions"
	body := chatOf(content40, false, map[string]any{"max_tokens": 200})

	const n = 20
	replies := make([]reply, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			replies[i] = send(ctx, c, url, body, bearer(key))
		})
	}
	close(start)
	wg.Wait()

	var okRemaining []int
	refused := 0
	for i, r := range replies {
		what := fmt.Sprintf("request %d of %d", i+1, n)
		switch {
		case r.Err != nil:
			t.Errorf("%s: %v", what, r.Err)
		case r.Status == http.StatusOK:
			rem, _ := strconv.Atoi(r.Header.Get("x-ratelimit-remaining-tokens"))
			okRemaining = append(okRemaining, rem)
			checkRateHeaders(t, what+" (admitted)", r.Header, rateHeaders{TokLimit: 1000, TokRemaining: rem})
		default:
			refused++
			msg := checkRefusal(t, what, r, http.StatusTooManyRequests, "tenant_tpm", true, 60)
			checkRateHeaders(t, what+" (refused)", r.Header, rateHeaders{TokLimit: 1000, TokRemaining: 160})
			if r.Took > time.Second {
				t.Errorf("%s: refused after %v, want at once (the admitted requests' upstream takes 2s to its first token)", what, r.Took)
			}
			if msg != "" && (!strings.Contains(msg, "1000") || !minuteWindow.MatchString(msg)) {
				t.Errorf("%s: message %q does not name the limit hit (tpm 1000 per minute)", what, msg)
			}
		}
	}
	if len(okRemaining) != 4 || refused != 16 {
		t.Errorf("%d admitted and %d refused, want 4 and 16: reservations of 210 tokens (10-token prompt estimate + max_tokens 200) on tpm 1000", len(okRemaining), refused)
	}
	want := map[int]bool{790: true, 580: true, 370: true, 160: true}
	for _, rem := range okRemaining {
		if !want[rem] {
			t.Errorf("an admitted request shows x-ratelimit-remaining-tokens %d; the four admitted ones must show 790, 580, 370 and 160 (got %v)", rem, okRemaining)
			break
		}
		delete(want, rem)
	}
	if got := fleetRequests(fleet); got != int64(len(okRemaining)) {
		t.Errorf("the fleet received %d requests, want %d (the admitted ones): refused requests must not reach an upstream", got, len(okRemaining))
	}
	samples := gw.scrapeMetrics()
	if got := metricValueOrZero(t, samples, "caddy_llm_proxy_admission_total", map[string]string{"tier": "small", "decision": "tenant_tpm"}); got != float64(refused) {
		t.Errorf("caddy_llm_proxy_admission_total{tier=small,decision=tenant_tpm} = %v, want %d", got, refused)
	}
}

// TestTenantIsChargedByKeyNotByClaims asserts that only the key says who
// pays: a request with alpha's key that names beta in the tenant header
// (from an untrusted peer), in copies of the gateway's own tenant headers
// and in body fields is charged to alpha (its x-ratelimit-remaining and the
// admin API), reaches the upstream with X-LLM-Proxy-Tenant: alpha and
// X-LLM-Proxy-Tier: std only, without the tenant header, and with its body
// unchanged byte for byte; beta's counters are untouched. Then 150
// requests with random tenant headers, 10 of them without a key (401
// invalid_api_key, no upstream call) and 5 with unknown keys (401, the key
// not echoed), create no tenant state: the admin API lists the same tenants.
func TestTenantIsChargedByKeyNotByClaims(t *testing.T) {
	t.Parallel()
	keyA, keyB := newKey("alpha"), newKey("beta")
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(2 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	gw := startTenantGateway(t, gatewayOptions{
		Globals: fmt.Sprintf(`	llm_proxy {
		tenants {
			key %s alpha
			key %s beta
			header X-Tenant-Id trusted_proxies 192.0.2.0/24
		}
		tier std {
			rpm 1000
		}
		tenant alpha {
			tier std
		}
		tenant beta {
			tier std
		}
	}`, keyA, keyB),
		Site: fmt.Sprintf("\tllm_proxy %s", upstreams(fleet)),
	}, keyA, keyB)
	c := newClient(t)
	ctx := testContext(t, 25*time.Second)
	url := gw.URL + "/v1/chat/completions"

	claim := `{"model":"mock-llama", "messages":[{"role":"user","content":"charge beta, not me"}], "user":"beta", "tenant":"beta", "metadata":{"tenant_id":"beta"}}`
	r := mustSend(ctx, t, c, url, claim, bearer(keyA), "X-Tenant-Id: beta", "X-LLM-Proxy-Tenant: beta", "X-LLM-Proxy-Tier: premium")
	if r.Status != http.StatusOK {
		t.Fatalf("alpha's request naming beta: status %d: %s", r.Status, r.Body)
	}
	checkRateHeaders(t, "alpha's request naming beta (alpha's 1st)", r.Header, rateHeaders{ReqLimit: 1000, ReqRemaining: 999})
	_, st := lastRecord(t, fleet)
	h := st.LastHeaders
	if got := h["x-llm-proxy-tenant"]; got != "alpha" {
		t.Errorf("the upstream got X-LLM-Proxy-Tenant %q, want exactly \"alpha\" (the key's tenant; the client's copy stripped)", got)
	}
	if got := h["x-llm-proxy-tier"]; got != "std" {
		t.Errorf("the upstream got X-LLM-Proxy-Tier %q, want exactly \"std\" (the client's copy stripped)", got)
	}
	if got, ok := h["x-tenant-id"]; ok {
		t.Errorf("the upstream got the tenant header X-Tenant-Id %q from an untrusted peer; it must be stripped", got)
	}
	if !bytes.Equal(st.LastBody, []byte(claim)) {
		t.Errorf("the upstream got a body other than the client's: %s", firstDiff(st.LastBody, []byte(claim)))
	}

	r = mustSend(ctx, t, c, url, chatOf("beta's own", false, nil), bearer(keyB))
	if r.Status != http.StatusOK {
		t.Fatalf("beta's request: status %d: %s", r.Status, r.Body)
	}
	checkRateHeaders(t, "beta's 1st request (alpha's claim must not have counted)", r.Header, rateHeaders{ReqLimit: 1000, ReqRemaining: 999})
	gw.waitTenantIdle("alpha", 2*time.Second)
	gw.waitTenantIdle("beta", 2*time.Second)
	before := gw.tenants()
	if before["alpha"].RequestsInWindow != 1 || before["beta"].RequestsInWindow != 1 {
		t.Errorf("admin API: alpha requests_in_window %d, beta %d; want 1 each", before["alpha"].RequestsInWindow, before["beta"].RequestsInWindow)
	}

	rng := rand.New(rand.NewPCG(8, 150))
	randName := func() string { return fmt.Sprintf("rand-%08x", rng.Uint32()) }
	var names []string
	var unknownKeys []string
	for range 5 {
		unknownKeys = append(unknownKeys, newKey("unknown"))
	}
	gw.addKeys(unknownKeys...)
	type job struct {
		headers []string
		want    int
	}
	var jobs []job
	for i := range 150 {
		name := randName()
		names = append(names, name)
		hs := []string{"X-Tenant-Id: " + name, "X-LLM-Proxy-Tenant: " + name}
		switch {
		case i < 10:
			jobs = append(jobs, job{hs, http.StatusUnauthorized})
		case i < 15:
			jobs = append(jobs, job{append(hs, bearer(unknownKeys[i-10])), http.StatusUnauthorized})
		default:
			jobs = append(jobs, job{append(hs, bearer(keyA)), http.StatusOK})
		}
	}
	results := make([]reply, len(jobs))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i, j := range jobs {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			results[i] = send(ctx, c, url, chatOf("random tenant header", false, map[string]any{"user": names[i]}), j.headers...)
		})
	}
	wg.Wait()
	for i, r := range results {
		switch {
		case r.Err != nil:
			t.Errorf("random-header request %d: %v", i, r.Err)
		case jobs[i].want == http.StatusUnauthorized:
			checkRefusal(t, fmt.Sprintf("random-header request %d without a known key", i), r, http.StatusUnauthorized, "invalid_api_key", false, 0)
			if i >= 10 && bytes.Contains(r.Body, []byte(unknownKeys[i-10])) {
				t.Errorf("the 401 for an unknown key echoes the key: %s", r.Body)
			}
		case r.Status != http.StatusOK:
			t.Errorf("random-header request %d with alpha's key: status %d: %s", i, r.Status, r.Body)
		}
	}
	if got := fleetRequests(fleet); got != 2+135 {
		t.Errorf("the fleet received %d requests, want %d: requests without a known key must not reach an upstream", got, 2+135)
	}
	gw.waitTenantIdle("alpha", 2*time.Second)
	after := gw.tenants()
	if len(after) != len(before) {
		var ids []string
		for id := range after {
			ids = append(ids, id)
		}
		t.Errorf("the admin API lists %d tenants after 150 requests with random tenant headers, %d before: %v; client-named tenants must create no state", len(after), len(before), ids)
	}
	for _, n := range names {
		if _, ok := after[n]; ok {
			t.Errorf("the admin API lists tenant %q, a name only a client header carried", n)
			break
		}
	}
	if _, ok := after["unknown"]; ok {
		t.Errorf("the admin API lists tenant \"unknown\" though unknown keys are refused (no unknown tier)")
	}
	if a, b := after["alpha"].RequestsInWindow, after["beta"].RequestsInWindow; a != 136 || b != 1 {
		t.Errorf("admin API: alpha requests_in_window %d, beta %d; want 136 (every request with alpha's key) and 1", a, b)
	}
}

// removeStreamOptions removes the "stream_options" member that the gateway
// adds to a JSON object (first or last member, with its comma), so that
// what is left can be compared with the client's bytes.
var streamOptionsMember = []*regexp.Regexp{
	regexp.MustCompile(`,\s*"stream_options"\s*:\s*\{\s*"include_usage"\s*:\s*true\s*\}`),
	regexp.MustCompile(`"stream_options"\s*:\s*\{\s*"include_usage"\s*:\s*true\s*\}\s*,\s*`),
}

func removeStreamOptions(b []byte) ([]byte, bool) {
	for _, re := range streamOptionsMember {
		if loc := re.FindIndex(b); loc != nil {
			return append(append([]byte{}, b[:loc[0]]...), b[loc[1]:]...), true
		}
	}
	return b, false
}

// directStream is the mock's own stream for a body, sent to the replica
// directly with the same X-Request-Id, to compare with the gateway's.
func directStream(ctx context.Context, t *testing.T, c *http.Client, f *mockllm.Fleet, body, id string) []byte {
	t.Helper()
	s := streamRequest(ctx, t, c, f.Replica(0).URL()+"/v1/chat/completions", body, "X-Request-Id: "+id)
	if s.Status != http.StatusOK {
		t.Fatalf("direct request to the mock: status %d", s.Status)
	}
	return raw(s.Events)
}

// tokensTotal reads caddy_llm_proxy_tokens_total for a tier, kind and
// source; found is false when no such series exists yet.
func tokensTotal(samples []metricSample, tier, kind, source string) float64 {
	v, _ := metricValue(samples, "caddy_llm_proxy_tokens_total", map[string]string{"tier": tier, "kind": kind, "source": source})
	return v
}

// TestTenantStreamUsageIsCountedWithoutChangingWhatClientsSee asserts the
// streamed-usage rule. A client that did not ask for usage: the upstream
// gets its body with stream_options.include_usage added and every other
// byte unchanged (unusual spacing and \u escapes kept); the client's
// stream holds no usage chunk and is otherwise byte for byte the mock's
// stream without usage; tokens_total{source=usage} rises by exactly the
// usage the mock reported (prompt and completion), {source=estimate} not
// at all. A client that asked: the upstream gets its body unchanged, the
// client gets the mock's stream (usage chunk included) byte for byte, and
// the counters rise by exactly that usage.
func TestTenantStreamUsageIsCountedWithoutChangingWhatClientsSee(t *testing.T) {
	t.Parallel()
	key := newKey("metered")
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(2 * time.Millisecond), Tokens: 7, TokenInterval: mockllm.NoDelay}})
	gw := startTenantGateway(t, gatewayOptions{
		Globals: fmt.Sprintf(`	llm_proxy {
		tenants {
			key %s meter tier metered
		}
		tier metered {
			tpm 100000
		}
	}`, key),
		Site: fmt.Sprintf("\tllm_proxy %s", upstreams(fleet)),
	}, key)
	c := newClient(t)
	ctx := testContext(t, 25*time.Second)
	url := gw.URL + "/v1/chat/completions"

	// A body that re-marshalling would change in many places.
	noUsage := "{ \"model\" : \"mock-llama\",\n  \"messages\": [ {\"role\":\"user\", \"content\":\"caf\\u00e9 \\u65e5\\u672c, count me\"} ],\n  \"temperature\": 0.50, \"top_p\":1e0, \"stream\": true , \"n\" : 1 }"
	asked := "{\"model\":\"mock-llama\",  \"stream\":true, \"stream_options\": { \"include_usage\" : true },\"messages\":[{\"role\":\"user\",\"content\":\"\\u00fcber usage\"}] }"

	check := func(name, body string, wantUsageChunk bool) {
		t.Helper()
		before := gw.scrapeMetrics()
		id := "usage-" + name
		s := streamRequest(ctx, t, c, url, body, bearer(key), "X-Request-Id: "+id)
		if s.Status != http.StatusOK || s.Err != nil || len(s.Events) == 0 || !s.Events[len(s.Events)-1].IsDone() {
			t.Fatalf("%s: status %d, %d events, ended with %v; want a complete stream", name, s.Status, len(s.Events), s.Err)
		}
		rec, ok := endedRecordByID(fleet, id)
		_, st := lastRecord(t, fleet)
		if !ok || rec.Usage == nil {
			t.Fatalf("%s: the mock reported no usage for the request (record found %v): the gateway did not ask the upstream for it", name, ok)
		}
		sawUsage := false
		for _, e := range s.dataEvents() {
			if e.IsDone() {
				continue
			}
			var ch struct {
				Usage   json.RawMessage `json:"usage"`
				Choices []any           `json:"choices"`
			}
			if err := json.Unmarshal([]byte(e.Data()), &ch); err != nil {
				t.Errorf("%s: event %q is not JSON: %v", name, e.Data(), err)
				continue
			}
			if len(ch.Usage) > 0 && string(ch.Usage) != "null" {
				sawUsage = true
			}
		}
		if sawUsage != wantUsageChunk {
			t.Errorf("%s: the client saw a usage chunk: %v, want %v", name, sawUsage, wantUsageChunk)
		}
		// The upstream's body.
		if wantUsageChunk {
			if !bytes.Equal(st.LastBody, []byte(body)) {
				t.Errorf("%s: the upstream got a body other than the client's (which asked for usage itself): %s", name, firstDiff(st.LastBody, []byte(body)))
			}
		} else {
			var up struct {
				StreamOptions struct {
					IncludeUsage bool `json:"include_usage"`
				} `json:"stream_options"`
			}
			if err := json.Unmarshal(st.LastBody, &up); err != nil || !up.StreamOptions.IncludeUsage {
				t.Errorf("%s: the upstream's body has no stream_options.include_usage true (%v): %s", name, err, st.LastBody)
			}
			rest, found := removeStreamOptions(st.LastBody)
			switch {
			case !found:
				t.Errorf("%s: cannot find the added \"stream_options\":{\"include_usage\":true} member in the upstream's body %s", name, st.LastBody)
			case !bytes.Equal(rest, []byte(body)):
				t.Errorf("%s: apart from the added stream_options, the upstream's body differs from the client's: %s", name, firstDiff(rest, []byte(body)))
			}
		}
		// The client's bytes: the mock's own stream for the client's body.
		want := directStream(ctx, t, c, fleet, body, id)
		if same, how := sameUpstreamBytes(raw(s.Events), want); !same {
			t.Errorf("%s: the client's stream differs from the mock's stream for its body: %s", name, firstDiff(raw(s.Events), want))
		} else {
			t.Logf("%s: client stream and the mock's: %s", name, how)
		}
		// The counters: exactly the reported usage, settled after the response.
		wantPrompt := tokensTotal(before, "metered", "prompt", "usage") + float64(rec.Usage.PromptTokens)
		wantCompl := tokensTotal(before, "metered", "completion", "usage") + float64(rec.Usage.CompletionTokens)
		var after []metricSample
		waitFor(2*time.Second, func() bool {
			after = gw.scrapeMetrics()
			return metricFamilyExposed(after, "caddy_llm_proxy_tokens_total") &&
				tokensTotal(after, "metered", "prompt", "usage") >= wantPrompt && tokensTotal(after, "metered", "completion", "usage") >= wantCompl
		})
		time.Sleep(100 * time.Millisecond)
		after = gw.scrapeMetrics()
		if mustMetricFamily(t, after, "caddy_llm_proxy_tokens_total") {
			if got := tokensTotal(after, "metered", "prompt", "usage"); got != wantPrompt {
				t.Errorf("%s: tokens_total{tier=metered,kind=prompt,source=usage} = %v, want %v (before + the mock's prompt_tokens %d)", name, got, wantPrompt, rec.Usage.PromptTokens)
			}
			if got := tokensTotal(after, "metered", "completion", "usage"); got != wantCompl {
				t.Errorf("%s: tokens_total{tier=metered,kind=completion,source=usage} = %v, want %v (before + the mock's completion_tokens %d)", name, got, wantCompl, rec.Usage.CompletionTokens)
			}
			for _, kind := range []string{"prompt", "completion"} {
				if b, a := tokensTotal(before, "metered", kind, "estimate"), tokensTotal(after, "metered", kind, "estimate"); a != b {
					t.Errorf("%s: tokens_total{kind=%s,source=estimate} rose from %v to %v though the upstream reported usage", name, kind, b, a)
				}
			}
		}
	}
	check("client-without-usage", noUsage, false)
	check("client-asked-usage", asked, true)
}

// TestTenant429sCarryRetryAfterAndExactRateLimitHeaders asserts the
// x-ratelimit-* headers and 429s of DESIGN §5: a tenant with rpm 3 sees
// limit 3 and remaining 2, 1, 0 on its three requests and no -tokens
// headers, then 429 tenant_rpm with Retry-After, remaining 0 and a message
// naming the limit and its window; a tenant with no limits gets no
// x-ratelimit-* header at all; a tenant with tpm 500 only: max_tokens 600
// gets 429 request_exceeds_limit without Retry-After and with the untouched
// remaining 500; a request naming no max_tokens reserves what is left
// (remaining 0) and is admitted; while it runs, another default request
// and one with an explicit max_tokens that does not fit get 429 tenant_tpm
// with Retry-After; after it settles with the mock's usage, remaining is
// 500 − that usage − the next reservation.
func TestTenant429sCarryRetryAfterAndExactRateLimitHeaders(t *testing.T) {
	t.Parallel()
	keyR, keyT, keyF := newKey("counted"), newKey("tokens"), newKey("free")
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(2 * time.Millisecond), Tokens: 5, TokenInterval: mockllm.NoDelay}})
	gw := startTenantGateway(t, gatewayOptions{
		Globals: fmt.Sprintf(`	llm_proxy {
		tenants {
			key %s counted tier rpm3
			key %s tokens tier tpm500
			key %s free tier unlimited
		}
		tier rpm3 {
			rpm 3
		}
		tier tpm500 {
			tpm 500
		}
		tier unlimited {
			priority 1
		}
	}`, keyR, keyT, keyF),
		Site: fmt.Sprintf("\tllm_proxy %s", upstreams(fleet)),
	}, keyR, keyT, keyF)
	c := newClient(t)
	ctx := testContext(t, 25*time.Second)
	url := gw.URL + "/v1/chat/completions"
	plain := chatOf(content40, false, nil)

	for i := range 3 {
		r := mustSend(ctx, t, c, url, plain, bearer(keyR))
		if r.Status != http.StatusOK {
			t.Fatalf("rpm-3 tenant, request %d: status %d: %s", i+1, r.Status, r.Body)
		}
		checkRateHeaders(t, fmt.Sprintf("rpm-3 tenant, request %d", i+1), r.Header, rateHeaders{ReqLimit: 3, ReqRemaining: 2 - i})
	}
	r := mustSend(ctx, t, c, url, plain, bearer(keyR))
	msg := checkRefusal(t, "rpm-3 tenant, request 4", r, http.StatusTooManyRequests, "tenant_rpm", true, 60)
	checkRateHeaders(t, "rpm-3 tenant, request 4 (refused)", r.Header, rateHeaders{ReqLimit: 3, ReqRemaining: 0})
	if msg != "" && (!regexp.MustCompile(`\b3\b`).MatchString(msg) || !minuteWindow.MatchString(msg)) {
		t.Errorf("the tenant_rpm message %q does not name the limit hit, its value (3) and its window (a minute)", msg)
	}

	r = mustSend(ctx, t, c, url, plain, bearer(keyF))
	if r.Status != http.StatusOK {
		t.Fatalf("tenant without limits: status %d: %s", r.Status, r.Body)
	}
	checkRateHeaders(t, "tenant without limits", r.Header, rateHeaders{})

	// tpm 500 only. A request that can never fit.
	requestsBefore := fleetRequests(fleet)
	r = mustSend(ctx, t, c, url, chatOf(content40, false, map[string]any{"max_tokens": 600}), bearer(keyT))
	checkRefusal(t, "tpm-500 tenant, max_tokens 600", r, http.StatusTooManyRequests, "request_exceeds_limit", false, 0)
	checkRateHeaders(t, "tpm-500 tenant, max_tokens 600 (can never fit)", r.Header, rateHeaders{TokLimit: 500, TokRemaining: 500})

	// A default reservation is capped at what is left: admitted, remaining 0.
	// The mock counts a finished request in flight until its handler has
	// returned, a moment after the client has the answer: wait for the
	// earlier ones to be gone, so that the count of 1 below is the held one.
	waitInFlight(t, fleet, 0, 3*time.Second)
	hold := asyncSend(ctx, c, url, chatOf(content40, false, nil), bearer(keyT), "X-Request-Id: held", "X-Mock-TTFT: 1500ms")
	waitInFlight(t, fleet, 1, 3*time.Second)
	r = mustSend(ctx, t, c, url, chatOf(content40, false, nil), bearer(keyT))
	checkRefusal(t, "tpm-500 tenant, a default request while the capped one holds everything", r, http.StatusTooManyRequests, "tenant_tpm", true, 60)
	checkRateHeaders(t, "tpm-500 tenant, default request refused", r.Header, rateHeaders{TokLimit: 500, TokRemaining: 0})
	r = mustSend(ctx, t, c, url, chatOf(content40, false, map[string]any{"max_tokens": 100}), bearer(keyT))
	checkRefusal(t, "tpm-500 tenant, max_tokens 100 while the capped one holds everything", r, http.StatusTooManyRequests, "tenant_tpm", true, 60)
	checkRateHeaders(t, "tpm-500 tenant, max_tokens 100 refused", r.Header, rateHeaders{TokLimit: 500, TokRemaining: 0})
	held := hold()
	if held.Err != nil || held.Status != http.StatusOK {
		t.Fatalf("the default request of the tpm-500 tenant: status %d, %v: %s", held.Status, held.Err, held.Body)
	}
	checkRateHeaders(t, "tpm-500 tenant, default request (reservation capped at what is left)", held.Header, rateHeaders{TokLimit: 500, TokRemaining: 0})
	if got := fleetRequests(fleet) - requestsBefore; got != 1 {
		t.Errorf("the tpm-500 tenant's requests reached the fleet %d times, want 1 (refusals reach no upstream)", got)
	}

	// Settled with the mock's usage; the next reservation is 10 + 50.
	rec, ok := endedRecordByID(fleet, "held")
	if !ok || rec.Usage == nil {
		t.Fatalf("the mock has no usage for the held request")
	}
	used := rec.Usage.PromptTokens + rec.Usage.CompletionTokens
	gw.waitTenantIdle("tokens", 2*time.Second)
	r = mustSend(ctx, t, c, url, chatOf(content40, false, map[string]any{"max_tokens": 50}), bearer(keyT))
	if r.Status != http.StatusOK {
		t.Fatalf("tpm-500 tenant after settlement, max_tokens 50: status %d: %s", r.Status, r.Body)
	}
	checkRateHeaders(t, fmt.Sprintf("tpm-500 tenant after settling %d used tokens, max_tokens 50 (reserves 60)", used), r.Header,
		rateHeaders{TokLimit: 500, TokRemaining: max(0, 500-used-60)})
}

// TestTenantBreakerOpensOnItsOwnSlowRequestsOnly asserts that a tenant's
// slow requests open its own breaker and nobody else's: two tenants of a
// tier with ttft_slo 150ms and consecutive_failures 3 share two upstreams;
// after three of noisy's requests with a 400ms TTFT, noisy gets 429
// tenant_circuit_open with X-Circuit-Breaker: open and a Retry-After within
// the open time, without an upstream call, and the admin API and
// tenant_breaker_state show it open, while victim's requests, interleaved
// and after, are all served without X-Circuit-Breaker, its breaker is not
// open and both upstream breakers stay closed. POST …/noisy/close lets
// noisy in again, and with per_1k_prompt_tokens 500ms, 400ms TTFTs of
// 1000-token prompts are within the objective and open nothing.
func TestTenantBreakerOpensOnItsOwnSlowRequestsOnly(t *testing.T) {
	t.Parallel()
	keyN, keyV := newKey("noisy"), newKey("victim")
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	gw := startTenantGateway(t, gatewayOptions{
		Globals: fmt.Sprintf(`	llm_proxy {
		tenants {
			key %s noisy tier guarded
			key %s victim tier guarded
		}
		tier guarded {
			ttft_slo 150ms per_1k_prompt_tokens 500ms
			breaker {
				consecutive_failures 3
				open_for 20s
			}
		}
	}`, keyN, keyV),
		Site: fmt.Sprintf(`	llm_proxy %s {
		lb_policy round_robin
	}`, upstreams(fleet)),
	}, keyN, keyV)
	c := newClient(t)
	ctx := testContext(t, 25*time.Second)
	url := gw.URL + "/v1/chat/completions"
	short := chatOf("short prompt", true, nil)

	victim := func(what string) {
		t.Helper()
		s := streamRequest(ctx, t, c, url, short, bearer(keyV))
		if s.Status != http.StatusOK || len(s.Events) == 0 || !s.Events[len(s.Events)-1].IsDone() {
			t.Errorf("victim's request %s: status %d, %d events; want a complete stream", what, s.Status, len(s.Events))
		}
		if v := s.Header.Get("X-Circuit-Breaker"); v != "" {
			t.Errorf("victim's request %s carries X-Circuit-Breaker: %s", what, v)
		}
	}
	for i := range 3 {
		s := streamRequest(ctx, t, c, url, short, bearer(keyN), "X-Mock-TTFT: 400ms")
		if s.Status != http.StatusOK {
			t.Fatalf("noisy's slow request %d: status %d, want 200 (slow is served, then counted)", i+1, s.Status)
		}
		victim(fmt.Sprintf("after noisy's slow request %d", i+1))
	}
	var before int64
	var r reply
	if !waitFor(time.Second, func() bool {
		before = fleetRequests(fleet)
		r = mustSend(ctx, t, c, url, chatOf("let me in", false, nil), bearer(keyN))
		return r.Status != http.StatusOK
	}) {
		t.Fatalf("noisy is still served after 3 requests with TTFT 400ms over its 150ms objective (consecutive_failures 3): its breaker did not open")
	}
	checkRefusal(t, "noisy after its breaker opened", r, http.StatusTooManyRequests, "tenant_circuit_open", true, 28) // open_for 20s with its upward jitter of up to 40%
	if v := r.Header.Get("X-Circuit-Breaker"); v != "open" {
		t.Errorf("noisy's tenant_circuit_open refusal: X-Circuit-Breaker %q, want open", v)
	}
	if got := fleetRequests(fleet) - before; got != 0 {
		t.Errorf("noisy's refused request reached an upstream (%d new upstream requests)", got)
	}
	for i := range 5 {
		victim(fmt.Sprintf("%d while noisy's breaker is open", i+1))
	}
	if v := gw.tenant("noisy"); v.breakerState() != "open" {
		t.Errorf("admin API: noisy's breaker is %s, want open", v.breakerState())
	}
	if v := gw.tenant("victim"); v.breakerState() == "open" || v.breakerState() == "half-open" {
		t.Errorf("admin API: victim's breaker is %s; another tenant's slow requests must not touch it", v.breakerState())
	}
	for _, a := range fleet.Addrs() {
		if v := gw.breaker(a); v.State != "closed" {
			t.Errorf("the upstream breaker of %s is %s; a tenant's slow requests are not the upstream's failure", a, v.State)
		}
	}
	samples := gw.scrapeMetrics()
	if got := metricValueOrZero(t, samples, "caddy_llm_proxy_tenant_breaker_state", map[string]string{"tier": "guarded"}); got != 1 {
		t.Errorf("caddy_llm_proxy_tenant_breaker_state{tier=guarded} = %v, want 1 (one open tenant breaker)", got)
	}

	// The operator closes it; then long prompts get a longer budget.
	if status, body := gw.admin(http.MethodPost, "/llm_proxy/tenants/noisy/close"); status != http.StatusOK {
		t.Fatalf("POST /llm_proxy/tenants/noisy/close: status %d: %s", status, body)
	}
	if status, body := gw.admin(http.MethodPost, "/llm_proxy/tenants/noisy/reset"); status != http.StatusOK {
		t.Fatalf("POST /llm_proxy/tenants/noisy/reset: status %d: %s", status, body)
	}
	long := chatOf(strings.Repeat("long prompt ", 334)[:4000], true, nil) // 1000 tokens: budget 150ms + 500ms
	for i := range 4 {
		s := streamRequest(ctx, t, c, url, long, bearer(keyN), "X-Mock-TTFT: 400ms")
		if s.Status != http.StatusOK {
			t.Fatalf("noisy's long-prompt request %d after close and reset: status %d, want 200 (400ms is within 150ms + 1000/1000 × 500ms)", i+1, s.Status)
		}
	}
	if v := gw.tenant("noisy"); v.breakerState() == "open" {
		t.Errorf("noisy's breaker opened on 1000-token prompts with a 400ms TTFT, within ttft_slo 150ms per_1k_prompt_tokens 500ms")
	}
	if got := metricValueOrZero(t, gw.scrapeMetrics(), "caddy_llm_proxy_tenant_breaker_state", map[string]string{"tier": "guarded"}); got != 0 {
		t.Errorf("caddy_llm_proxy_tenant_breaker_state{tier=guarded} = %v after close, want 0", got)
	}
}

// TestTenantKeysInEveryFormNeverAppear asserts identity from every key form
// and that no key is ever shown: keys given literally, as {env.X}, as
// sha256:<hex> and in a keys file (a literal line and a sha256 line), each
// presented as Authorization: Bearer, api-key or x-api-key, name their
// tenants (X-LLM-Proxy-Tenant upstream, the admin API); an unknown key and
// no key get 401 invalid_api_key without the key in the body; the access
// log's placeholders {http.llm_proxy.tenant}, {http.llm_proxy.tier},
// {http.llm_proxy.queue_ms} and {http.llm_proxy.tokens} carry the tenant,
// its tier, a number and the settled tokens; and (the cleanup's check)
// no key appears in the log, the metrics or the admin API.
func TestTenantKeysInEveryFormNeverAppear(t *testing.T) {
	t.Parallel()
	kLit, kEnv, kSHA, kFile, kFileSHA, kUnknown := newKey("lit"), newKey("env"), newKey("sha"), newKey("file"), newKey("filesha"), newKey("unknown")
	dir := t.TempDir()
	keysFile := filepath.Join(dir, "keys.txt")
	if err := os.WriteFile(keysFile, []byte(fmt.Sprintf("# tenants from a file\n%s t-file gold\nsha256:%s t-filesha\n", kFile, sha256Hex([]byte(kFileSHA)))), 0o600); err != nil {
		t.Fatal(err)
	}
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(2 * time.Millisecond), Tokens: 4, TokenInterval: mockllm.NoDelay}})
	gw := startTenantGateway(t, gatewayOptions{
		Env: []string{"E2E_TENANT_KEY=" + kEnv},
		Globals: fmt.Sprintf(`	llm_proxy {
		tenants {
			key %s t-lit tier silver
			key {env.E2E_TENANT_KEY} t-env tier silver
			key sha256:%s t-sha tier silver
			keys_file %s
		}
		tier silver {
			rpm 100
			tpm 100000
		}
		tier gold {
			priority 5
			rpm 100
		}
		tenant t-filesha {
			tier silver
		}
	}`, kLit, sha256Hex([]byte(kSHA)), keysFile),
		// Caddy's access log prints request headers as they arrived; it
		// redacts Authorization itself, the operator deletes the other key
		// headers.
		Site: fmt.Sprintf(`	log {
		output stderr
		format filter {
			wrap json
			fields {
				request>headers>Api-Key delete
				request>headers>X-Api-Key delete
			}
		}
	}
	log_append llm_tenant {http.llm_proxy.tenant}
	log_append llm_tier {http.llm_proxy.tier}
	log_append llm_queue_ms {http.llm_proxy.queue_ms}
	log_append llm_tokens {http.llm_proxy.tokens}
	llm_proxy %s`, upstreams(fleet)),
	}, kLit, kEnv, kSHA, kFile, kFileSHA, kUnknown)
	c := newClient(t)
	ctx := testContext(t, 25*time.Second)
	url := gw.URL + "/v1/chat/completions"

	cases := []struct {
		header, tenant, tier string
	}{
		{bearer(kLit), "t-lit", "silver"},
		{"x-api-key: " + kEnv, "t-env", "silver"},
		{"api-key: " + kSHA, "t-sha", "silver"},
		{bearer(kFile), "t-file", "gold"},
		{"X-Api-Key: " + kFileSHA, "t-filesha", "silver"},
	}
	for i, tc := range cases {
		id := fmt.Sprintf("keyform-%d", i)
		r := mustSend(ctx, t, c, url, chatOf("who am I", false, nil), tc.header, "X-Request-Id: "+id)
		if r.Status != http.StatusOK {
			t.Errorf("tenant %s: status %d: %s", tc.tenant, r.Status, r.Body)
			continue
		}
		rec, ok := recordByID(fleet, id)
		if !ok {
			t.Errorf("tenant %s: the mock has no record of the request", tc.tenant)
			continue
		}
		if got := rec.Headers["x-llm-proxy-tenant"]; got != tc.tenant {
			t.Errorf("key form %d: the upstream got X-LLM-Proxy-Tenant %q, want %q", i, got, tc.tenant)
		}
		if got := rec.Headers["x-llm-proxy-tier"]; got != tc.tier {
			t.Errorf("key form %d: the upstream got X-LLM-Proxy-Tier %q, want %q", i, got, tc.tier)
		}
	}
	for _, h := range [][]string{{bearer(kUnknown)}, {"x-api-key: " + kUnknown}, nil} {
		r := mustSend(ctx, t, c, url, chatOf("let me in", false, nil), h...)
		checkRefusal(t, fmt.Sprintf("request with %v", len(h) > 0), r, http.StatusUnauthorized, "invalid_api_key", false, 0)
		if bytes.Contains(r.Body, []byte(kUnknown)) {
			t.Errorf("the 401 echoes the presented key: %s", r.Body)
		}
	}
	views := gw.tenants()
	for _, tc := range cases {
		if v, ok := views[tc.tenant]; !ok || v.RequestsInWindow != 1 || v.Tier != tc.tier {
			t.Errorf("admin API: tenant %s listed %v, requests_in_window %d, tier %q; want listed, 1, %q", tc.tenant, ok, v.RequestsInWindow, v.Tier, tc.tier)
		}
	}

	// The access log's placeholders (the log is written when the handler returns).
	var line map[string]any
	if !waitFor(2*time.Second, func() bool {
		for _, l := range strings.Split(gw.logs.String(), "\n") {
			if !strings.Contains(l, `"llm_tenant":"t-lit"`) {
				continue
			}
			if json.Unmarshal([]byte(l[strings.IndexByte(l, '{'):]), &line) == nil {
				return true
			}
		}
		return false
	}) {
		t.Fatalf("no access log line with llm_tenant t-lit: {http.llm_proxy.tenant} is not set (or not by the time the access log is written)")
	}
	if got := fmt.Sprint(line["llm_tier"]); got != "silver" {
		t.Errorf("access log: llm_tier (from {http.llm_proxy.tier}) = %q, want silver", got)
	}
	if q := fmt.Sprint(line["llm_queue_ms"]); !regexp.MustCompile(`^\d+(\.\d+)?$`).MatchString(q) {
		t.Errorf("access log: llm_queue_ms (from {http.llm_proxy.queue_ms}) = %q, want a number of milliseconds", q)
	}
	rec, _ := recordByID(fleet, "keyform-0")
	if rec.Usage != nil {
		if want := strconv.Itoa(rec.Usage.PromptTokens + rec.Usage.CompletionTokens); fmt.Sprint(line["llm_tokens"]) != want {
			t.Errorf("access log: llm_tokens (from {http.llm_proxy.tokens}) = %v, want %s (the mock's usage, settled)", line["llm_tokens"], want)
		}
	}
}
