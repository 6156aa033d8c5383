package e2e

// End-to-end tests of issue 18: the gateway in front of servers that speak
// OpenAI Responses and Anthropic Messages beside Chat Completions, with
// the official SDKs (@anthropic-ai/sdk, openai, the Vercel AI SDK) as
// clients.

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// TestSDKsStreamEveryAPIThroughTheGateway: each official SDK streams
// through the gateway exactly what it gets from the server directly — the
// whole text, the stop reason, one beginning — and the usage it reports
// is the upstream's: @anthropic-ai/sdk messages.stream (usage.output_tokens
// from the last message_delta), openai responses.create({stream:true})
// (response.completed usage) and responses.stream(), openai chat, and the
// Vercel AI SDK's streamText over Responses and over Chat.
func TestSDKsStreamEveryAPIThroughTheGateway(t *testing.T) {
	t.Parallel()
	requireNode(t)
	const tokens = 9
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{
		TTFT: mockllm.Fixed(20 * time.Millisecond), Tokens: tokens, TokenInterval: 15 * time.Millisecond}})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet))
	direct := fleet.Replica(0).URL()

	for _, c := range []struct {
		mode, stop, idPrefix string
		starts               int // beginnings the SDK reports; -1 when it has no such notion
	}{
		{"anthropic-stream", "end_turn", "msg_", 1},
		{"openai-responses", "response.completed", "resp_", 1},
		{"openai-responses-helper", "completed", "resp_", 1},
		{"openai-chat", "stop", "chatcmpl-", -1},
		{"ai-responses", "stop", "resp_", 1},
		{"ai-chat", "stop", "chatcmpl-", 1},
	} {
		t.Run(c.mode, func(t *testing.T) {
			want := runSDK(t, c.mode, direct, nil, nil)
			if !want.OK || want.Text == "" || want.stop() != c.stop {
				t.Fatalf("straight at the mock, the SDK got %+v; want ok with text and stop %s (a mockllm defect)", want, c.stop)
			}
			id := "sdk-" + c.mode
			got := runSDK(t, c.mode, gw.URL, map[string]string{"X-Request-Id": id}, nil)
			if !got.OK {
				t.Fatalf("through the gateway the SDK threw %s", got.thrown())
			}
			if got.Text != want.Text {
				t.Errorf("text %q, want the server's %q", got.Text, want.Text)
			}
			if got.stop() != c.stop {
				t.Errorf("stop reason %q, want %q", got.stop(), c.stop)
			}
			if c.starts >= 0 && got.Starts != c.starts {
				t.Errorf("the SDK saw %d beginnings, want %d", got.Starts, c.starts)
			}
			rec, ok := fleetRecord(fleet, c.idPrefix+id)
			if !ok || rec.Usage == nil {
				t.Fatalf("the mock has no record with usage of request %s%s", c.idPrefix, id)
			}
			out := got.usageInt("output_tokens")
			switch {
			case strings.HasPrefix(c.mode, "ai-"):
				out = got.usageInt("outputTokens")
			case c.mode == "openai-chat":
				out = got.usageInt("completion_tokens")
			}
			if out != rec.Usage.CompletionTokens || out != tokens {
				t.Errorf("the SDK reports %d output tokens, want the upstream's %d (%d generated)", out, rec.Usage.CompletionTokens, tokens)
			}
		})
	}
}

// fleetRecord returns the mock's record of the response id.
func fleetRecord(f *mockllm.Fleet, id string) (mockllm.RequestRecord, bool) {
	for _, r := range f.Stats().Replicas {
		for _, rec := range r.Recent {
			if rec.ID == id {
				return rec, true
			}
		}
	}
	return mockllm.RequestRecord{}, false
}

// TestCompleteStreamsOfEachAPILeaveTheBreakerClean: ten complete
// Responses streams (ending with response.completed) and ten complete
// Messages streams (ending with message_stop) reach the client whole,
// without an error event appended, and leave the upstream's breaker with
// zero failures (admin API) and every request and attempt counted a
// success (metrics, which must exist); an eleventh request is served, not
// refused by an open breaker.
func TestCompleteStreamsOfEachAPILeaveTheBreakerClean(t *testing.T) {
	t.Parallel()
	for _, c := range streamingAPIs {
		t.Run(string(c.api), func(t *testing.T) {
			t.Parallel()
			fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{
				TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 6, TokenInterval: 2 * time.Millisecond}})
			gw := startGateway(t, "\tllm_proxy "+upstreams(fleet))
			cl := newClient(t)
			ctx := testContext(t, 60*time.Second)
			url := gw.URL + c.api.Path()
			for i := range 10 {
				s := streamRequest(ctx, t, cl, url, c.body(fmt.Sprintf("complete stream %d", i), 0, true))
				checkCompleteAPIStream(t, fmt.Sprintf("stream %d", i+1), c, s)
			}
			addr := fleet.Replica(0).Addr()
			b := gw.breaker(addr)
			if b.State != "closed" || b.ConsecutiveFailures != 0 || b.FailuresInWindow != 0 || b.LastFailure != "" {
				t.Errorf("after 10 complete streams the breaker is %s with %d consecutive failures, %d in the window, last failure %q; want closed and no failure",
					b.State, b.ConsecutiveFailures, b.FailuresInWindow, b.LastFailure)
			}
			samples := gw.scrapeMetrics()
			if mustMetricFamily(t, samples, "caddy_llm_proxy_requests_total") {
				if v, found := metricValue(samples, "caddy_llm_proxy_requests_total", map[string]string{"outcome": "success"}); !found || v != 10 {
					t.Errorf("requests_total{outcome=success} = %v (found %v), want 10", v, found)
				}
				all, _ := metricValue(samples, "caddy_llm_proxy_requests_total", nil)
				if all != 10 {
					t.Errorf("requests_total over every outcome = %v, want 10 (all successes)", all)
				}
				if v, found := metricValue(samples, "caddy_llm_proxy_requests_total", map[string]string{"outcome": "success", "api": string(c.api)}); !found || v != 10 {
					t.Errorf("requests_total{outcome=success,api=%s} = %v (found %v), want 10 (issue 18: an api label)", c.api, v, found)
				}
			}
			if mustMetricFamily(t, samples, "caddy_llm_proxy_upstream_attempts_total") {
				ok, _ := metricValue(samples, "caddy_llm_proxy_upstream_attempts_total", map[string]string{"upstream": addr, "outcome": "success"})
				all, _ := metricValue(samples, "caddy_llm_proxy_upstream_attempts_total", map[string]string{"upstream": addr})
				if ok != 10 || all != 10 {
					t.Errorf("upstream_attempts_total{upstream=%s}: %v successes of %v attempts, want 10 of 10", addr, ok, all)
				}
			}
			if v, found := metricValue(samples, "caddy_llm_proxy_breaker_state", map[string]string{"upstream": addr}); !found || v != 0 {
				t.Errorf("breaker_state{upstream=%s} = %v (found %v), want 0 (closed)", addr, v, found)
			}
			s := streamRequest(ctx, t, cl, url, c.body("the eleventh", 0, true))
			checkCompleteAPIStream(t, "stream 11", c, s)
		})
	}
}

// TestLifecycleThenErrorFailsOverWithOneBeginning: the first upstream
// (lb_policy first) sends only its beginning (response.created +
// response.in_progress, message_start + ping) and then an in-band
// 5xx-like error (Responses event: error or response.failed; Messages
// overloaded_error or api_error); nothing was generated, so the gateway fails over to
// the second, and the client — raw HTTP and the API's SDK alike — sees
// one beginning (the winner's), the whole text and no error; the first
// upstream's breaker records the failure.
func TestLifecycleThenErrorFailsOverWithOneBeginning(t *testing.T) {
	t.Parallel()
	requireNode(t)
	for _, tc := range []struct {
		name  string
		c     apiCase
		fault string
	}{
		{"responses/error", streamingAPIs[0], "error_event=0,error_code=503"},
		{"responses/response.failed", streamingAPIs[0], "error_event=0,error_code=500,response_failed"},
		{"messages/overloaded_error", streamingAPIs[1], "error_event=0,error_code=529"},
		{"messages/api_error", streamingAPIs[1], "error_event=0,error_code=500"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := tc.c
			fault, err := mockllm.ParseFault(tc.fault)
			if err != nil {
				t.Fatal(err)
			}
			fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2,
				Behavior:   mockllm.Behavior{TTFT: mockllm.Fixed(20 * time.Millisecond), Tokens: 6, TokenInterval: 5 * time.Millisecond},
				PerReplica: map[int]mockllm.Behavior{0: {TTFT: mockllm.Fixed(20 * time.Millisecond), Fault: fault}}})
			gw := startGateway(t, fmt.Sprintf("\tllm_proxy %s {\n\t\tlb_policy first\n\t}", upstreams(fleet)))
			cl := newClient(t)
			ctx := testContext(t, 60*time.Second)

			s := streamRequest(ctx, t, cl, gw.URL+c.api.Path(), c.body("fail me over", 0, true))
			checkCompleteAPIStream(t, "lifecycle-then-error on the first upstream", c, s)
			if got := s.Header.Get(mockllm.HeaderReplica); got != fleet.Replica(1).Addr() {
				t.Errorf("served by %q, want the second upstream %s", got, fleet.Replica(1).Addr())
			}
			st := fleet.Stats().Replicas
			if st[0].Requests != 1 || st[0].Faults["error_event"] != 1 || st[1].Requests != 1 {
				t.Errorf("upstream requests %d (%d error events) and %d; want 1 (1) and 1", st[0].Requests, st[0].Faults["error_event"], st[1].Requests)
			}
			// The winner's beginning, not the loser's.
			if first := s.dataEvents(); len(first) > 0 {
				m := first[0].object()
				id := ""
				inner, _ := m["response"].(map[string]any)
				if c.api == mockllm.APIMessages {
					inner, _ = m["message"].(map[string]any)
				}
				id, _ = inner["id"].(string)
				if rec, ok := fleetRecord(fleet, id); !ok || rec.Fault != "" {
					t.Errorf("the client's %s (id %q) is not the second upstream's (record found %v, fault %q)", c.begin, id, ok, rec.Fault)
				}
			}
			if b := gw.breaker(fleet.Replica(0).Addr()); b.LastFailure == "" || b.ConsecutiveFailures == 0 {
				t.Errorf("the first upstream's breaker recorded no failure (%+v): an in-band 5xx-like error before commit is an upstream failure", b)
			}

			r := runSDK(t, c.sdkStream, gw.URL, nil, nil)
			if !r.OK || r.Starts != 1 || r.Text == "" {
				t.Errorf("the SDK through the failover: ok %v, %d beginnings, text %q (threw %s); want ok, 1, the text", r.OK, r.Starts, r.Text, r.thrown())
			}
			if st := fleet.Stats().Replicas; st[0].Requests != 2 || st[1].Requests != 2 {
				t.Errorf("after the SDK's request: upstream requests %d and %d, want 2 and 2", st[0].Requests, st[1].Requests)
			}
		})
	}
}

// TestCutAfterContentMakesEachSDKRaise: an upstream that closes the
// connection after three tokens leaves the client a stream that ends with
// the API's own terminal error event (Responses event: error with the
// next sequence_number; Messages event: error with an Anthropic error
// object), never the API's normal end; every SDK raises on it
// (@anthropic-ai/sdk messages.stream, openai responses.stream(), the
// Vercel AI SDK; openai's raw responses.create iterator yields the error
// event); the upstream's breaker records the cut.
func TestCutAfterContentMakesEachSDKRaise(t *testing.T) {
	t.Parallel()
	requireNode(t)
	for _, c := range streamingAPIs {
		t.Run(string(c.api), func(t *testing.T) {
			t.Parallel()
			fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{
				TTFT: mockllm.Fixed(10 * time.Millisecond), Tokens: 8, TokenInterval: 10 * time.Millisecond,
				Fault: mockllm.Fault{Kind: mockllm.FaultCut, After: 3}}})
			// Every request here is cut: a breaker that opens after three
			// would refuse the later SDKs' requests.
			gw := startGateway(t, "\tllm_proxy "+upstreams(fleet)+" {\n\t\tbreaker {\n\t\t\tconsecutive_failures 10\n\t\t}\n\t}")
			cl := newClient(t)
			ctx := testContext(t, 60*time.Second)

			s := streamRequest(ctx, t, cl, gw.URL+c.api.Path(), c.body("cut me", 0, true))
			if s.Status != 200 {
				t.Fatalf("status %d: %s", s.Status, raw(s.Events))
			}
			if n := s.count(c.delta); n != 3 {
				t.Errorf("%d %s events before the cut, want 3: %v", n, c.delta, s.names())
			}
			if n := s.count(c.end); n != 0 {
				t.Errorf("the cut stream carries %s: %v", c.end, s.names())
			}
			last := s.lastData()
			m := last.object()
			if last.name() != "error" || m == nil || m["type"] != "error" {
				t.Fatalf("last event %q, want the API's terminal event: error", last.Raw)
			}
			switch c.api {
			case mockllm.APIResponses:
				code, _ := m["code"].(string)
				msg, _ := m["message"].(string)
				if code == "" || msg == "" {
					t.Errorf("the terminal error event has no code or message: %s", last.Data())
				}
				d := s.dataEvents()
				if len(d) >= 2 {
					prev, _ := d[len(d)-2].object()["sequence_number"].(float64)
					if seq, ok := m["sequence_number"].(float64); !ok || seq != prev+1 {
						t.Errorf("the terminal error's sequence_number %v, want %v (the next)", m["sequence_number"], prev+1)
					}
				}
			case mockllm.APIMessages:
				e, _ := m["error"].(map[string]any)
				if typ, _ := e["type"].(string); typ != "api_error" && typ != "overloaded_error" {
					t.Errorf("the terminal error's error.type %v, want api_error or overloaded_error: %s", e["type"], last.Data())
				}
			}
			if b := gw.breaker(fleet.Replica(0).Addr()); b.LastFailure == "" || b.ConsecutiveFailures != 1 {
				t.Errorf("the upstream's breaker shows %d consecutive failures (last %q) after one stream cut after commit, want 1", b.ConsecutiveFailures, b.LastFailure)
			}

			for _, mode := range c.sdkRaise {
				r := runSDK(t, mode, gw.URL, nil, nil)
				if r.OK {
					t.Errorf("%s did not raise on the cut stream: %+v", mode, r)
					continue
				}
				if r.Text == "" && mode != "openai-responses-helper" {
					t.Errorf("%s raised %s before any text reached it; want the three tokens first", mode, r.ErrorClass)
				}
				if mode == "anthropic-stream" && (!r.APIError || r.Type == nil) {
					t.Errorf("%s raised %s (APIError %v, type %v); want an APIError with the error event's type", mode, r.ErrorClass, r.APIError, r.Type)
				}
			}
			if c.api == mockllm.APIResponses {
				r := runSDK(t, "openai-responses", gw.URL, nil, nil)
				if r.ErrorEvents != 1 || r.stop() == "response.completed" {
					t.Errorf("openai responses.create stream: %d error events, last event %q; want the error event and no response.completed", r.ErrorEvents, r.stop())
				}
			}
		})
	}
}

// TestGatewayErrorsOnMessagesAreAnthropicTyped: on /v1/messages the
// gateway's own refusals have Anthropic's error body, so the Anthropic SDK
// raises its typed errors: a tenant over its rpm gets 429 RateLimitError
// with error.type rate_limit_error, Retry-After, the x-ratelimit-* and
// anthropic-ratelimit-requests-* headers (reset an RFC 3339 time); with
// the only upstream's breaker open, 503 ServiceUnavailableError with
// error.type overloaded_error, Retry-After and X-Circuit-Breaker: open.
func TestGatewayErrorsOnMessagesAreAnthropicTyped(t *testing.T) {
	t.Parallel()
	requireNode(t)
	limited, free := newKey("limited"), newKey("free")
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 4, TokenInterval: mockllm.NoDelay}})
	gw := startTenantGateway(t, gatewayOptions{
		Globals: fmt.Sprintf(`	llm_proxy {
		tenants {
			key %s limited tier one
			key %s free tier open
		}
		tier one {
			rpm 1
		}
		tier open {
			priority 1
		}
	}`, limited, free),
		Site: "\tllm_proxy " + upstreams(fleet),
	}, limited, free)
	cl := newClient(t)
	ctx := testContext(t, 60*time.Second)
	msgs := streamingAPIs[1]
	url := gw.URL + "/v1/messages"

	// 429: the tenant's one request a minute is spent.
	if r := runSDK(t, "anthropic-create", gw.URL, nil, map[string]any{"apiKey": limited}); !r.OK {
		t.Fatalf("the limited tenant's first request: %s", r.thrown())
	}
	r := runSDK(t, "anthropic-stream", gw.URL, nil, map[string]any{"apiKey": limited})
	checkAnthropicError(t, "tenant over rpm, messages.stream", r, 429, "RateLimitError", "rate_limit_error")
	raw429 := mustSend(ctx, t, cl, url, msgs.body("again", 10, false), "x-api-key: "+limited, "anthropic-version: 2023-06-01")
	checkAnthropicBody(t, "tenant over rpm", raw429, 429, "rate_limit_error")
	if ra := raw429.Header.Get("Retry-After"); ra == "" {
		t.Errorf("429: no Retry-After")
	}
	if v := raw429.Header.Get("x-ratelimit-limit-requests"); v != "1" {
		t.Errorf("429: x-ratelimit-limit-requests %q, want 1", v)
	}
	if v := raw429.Header.Get("anthropic-ratelimit-requests-limit"); v != "1" {
		t.Errorf("429: anthropic-ratelimit-requests-limit %q, want 1", v)
	}
	if v := raw429.Header.Get("anthropic-ratelimit-requests-remaining"); v != "0" {
		t.Errorf("429: anthropic-ratelimit-requests-remaining %q, want 0", v)
	}
	if v := raw429.Header.Get("anthropic-ratelimit-requests-reset"); v == "" {
		t.Errorf("429: no anthropic-ratelimit-requests-reset")
	} else if at, err := time.Parse(time.RFC3339, v); err != nil || at.Before(time.Now().Add(-time.Second)) || at.After(time.Now().Add(61*time.Second)) {
		t.Errorf("429: anthropic-ratelimit-requests-reset %q, want an RFC 3339 time within the next minute (%v)", v, err)
	}

	// 503: the only upstream's breaker is open.
	addr := fleet.Replica(0).Addr()
	if status, _ := gw.breakerAction(addr, "open"); status != http.StatusOK {
		t.Fatalf("POST breakers/%s/open: status %d", addr, status)
	}
	before := fleetRequests(fleet)
	r = runSDK(t, "anthropic-stream", gw.URL, nil, map[string]any{"apiKey": free})
	checkAnthropicError(t, "breaker open, messages.stream", r, 503, "ServiceUnavailableError", "overloaded_error")
	r = runSDK(t, "anthropic-create", gw.URL, nil, map[string]any{"apiKey": free})
	checkAnthropicError(t, "breaker open, messages.create", r, 503, "ServiceUnavailableError", "overloaded_error")
	raw503 := mustSend(ctx, t, cl, url, msgs.body("open", 10, true), "x-api-key: "+free)
	checkAnthropicBody(t, "breaker open", raw503, 503, "overloaded_error")
	if raw503.Header.Get("Retry-After") == "" || raw503.Header.Get("X-Circuit-Breaker") != "open" {
		t.Errorf("503: Retry-After %q, X-Circuit-Breaker %q; want both", raw503.Header.Get("Retry-After"), raw503.Header.Get("X-Circuit-Breaker"))
	}
	if n := fleetRequests(fleet) - before; n != 0 {
		t.Errorf("%d requests reached the upstream behind an open breaker", n)
	}
}

// checkAnthropicError checks that the Anthropic SDK raised its typed
// error for status with the body's error.type typ.
func checkAnthropicError(t *testing.T, what string, r sdkResult, status int, class, typ string) {
	t.Helper()
	if r.OK {
		t.Errorf("%s: the SDK did not raise: %+v", what, r)
		return
	}
	if r.ErrorClass != class || !r.APIError || r.Status == nil || *r.Status != status {
		t.Errorf("%s: the SDK raised %s (APIError %v), want %s with status %d", what, r.thrown(), r.APIError, class, status)
	}
	if r.Type == nil || *r.Type != typ || r.BodyType == nil || *r.BodyType != typ {
		t.Errorf("%s: the SDK raised %s with body error.type %v, want type %s", what, r.thrown(), r.BodyType, typ)
	}
}

// checkAnthropicBody checks a gateway refusal's status and Anthropic's
// error body {"type":"error","error":{"type":typ,"message":…}}.
func checkAnthropicBody(t *testing.T, what string, r reply, status int, typ string) {
	t.Helper()
	var b struct {
		Type  string `json:"type"`
		Error *struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		} `json:"error"`
	}
	if r.Status != status || json.Unmarshal(r.Body, &b) != nil || b.Type != "error" || b.Error == nil || b.Error.Type != typ || b.Error.Message == "" {
		t.Errorf("%s: %d %s; want %d with {\"type\":\"error\",\"error\":{\"type\":%q,\"message\":…}}", what, r.Status, r.Body, status, typ)
	}
	if ct := r.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Errorf("%s: Content-Type %q, want application/json", what, ct)
	}
}

// TestTenantTokensAfterAStreamReflectUpstreamUsage: a tenant with tpm
// 2000 streams a Responses and a Messages request through its SDK, each
// with an output limit of 400 of which the upstream generates 7; once it
// is settled, the next request's x-ratelimit-remaining-tokens is 2000
// minus the upstream's reported usage (input + output tokens) minus the
// next reservation (10 + 50) — not minus the 400-token reservation, not
// minus an estimate.
func TestTenantTokensAfterAStreamReflectUpstreamUsage(t *testing.T) {
	t.Parallel()
	requireNode(t)
	for _, c := range streamingAPIs {
		t.Run(string(c.api), func(t *testing.T) {
			t.Parallel()
			key := newKey("tokens")
			fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 7, TokenInterval: 2 * time.Millisecond}})
			gw := startTenantGateway(t, gatewayOptions{
				Globals: fmt.Sprintf(`	llm_proxy {
		tenants {
			key %s metered tier tpm2000
		}
		tier tpm2000 {
			tpm 2000
		}
	}`, key),
				Site: "\tllm_proxy " + upstreams(fleet),
			}, key)
			cl := newClient(t)
			ctx := testContext(t, 60*time.Second)
			id := "usage-" + string(c.api)
			r := runSDK(t, c.sdkStream, gw.URL, map[string]string{"X-Request-Id": id}, map[string]any{"apiKey": key, "maxTokens": 400,
				"prompt": strings.Repeat("a long prompt that the estimate and the upstream count differently; ", 8)})
			if !r.OK {
				t.Fatalf("the SDK's stream: %s", r.thrown())
			}
			prefix := map[mockllm.API]string{mockllm.APIResponses: "resp_", mockllm.APIMessages: "msg_"}[c.api]
			rec, ok := fleetRecord(fleet, prefix+id)
			if !ok || rec.Usage == nil {
				t.Fatalf("the mock has no usage for %s%s", prefix, id)
			}
			used := rec.Usage.PromptTokens + rec.Usage.CompletionTokens
			if got := r.usageInt(c.outputTokens); got != rec.Usage.CompletionTokens {
				t.Errorf("the SDK reports %d output tokens, want the upstream's %d", got, rec.Usage.CompletionTokens)
			}
			gw.waitTenantIdle("metered", 5*time.Second)
			probe := mustSend(ctx, t, cl, gw.URL+"/v1/chat/completions", chatOf(content40, false, map[string]any{"max_tokens": 50}), bearer(key))
			if probe.Status != http.StatusOK {
				t.Fatalf("the probe: status %d: %s", probe.Status, probe.Body)
			}
			rem, err := strconv.Atoi(probe.Header.Get("x-ratelimit-remaining-tokens"))
			if want := 2000 - used - 60; err != nil || rem != want {
				t.Errorf("x-ratelimit-remaining-tokens %q after a %s stream that used %d tokens (%d in, %d out), want %d = 2000 − %d − 60 (the probe's reservation)",
					probe.Header.Get("x-ratelimit-remaining-tokens"), c.api, used, rec.Usage.PromptTokens, rec.Usage.CompletionTokens, want, used)
			}
		})
	}
}

// TestHedgeWinsOnlyWithAGeneratedEvent: both upstreams begin a stream at
// once (response.created + in_progress, message_start + ping), but the
// primary (lb_policy first) holds its first token for 3s; after the
// 100ms hedge delay the backup, whose first token comes after 50ms, wins
// with its first generated event. The primary's beginning neither counts
// as a first event (which would have suppressed the hedge and committed
// the slow primary) nor reaches the client: the client sees one
// beginning, the backup's, and its first text within about 150ms.
func TestHedgeWinsOnlyWithAGeneratedEvent(t *testing.T) {
	t.Parallel()
	for _, c := range streamingAPIs {
		t.Run(string(c.api), func(t *testing.T) {
			t.Parallel()
			fast := mockllm.Behavior{TTFT: mockllm.Fixed(50 * time.Millisecond), Tokens: 5, TokenInterval: 5 * time.Millisecond}
			slow := fast
			slow.TTFT = mockllm.Fixed(3 * time.Second)
			fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, PerReplica: map[int]mockllm.Behavior{0: slow, 1: fast}})
			gw := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		lb_policy first
		hedge {
			after 100ms
			max_ratio 1
		}
	}`, upstreams(fleet)))
			cl := newClient(t)
			ctx := testContext(t, 30*time.Second)
			s := streamRequest(ctx, t, cl, gw.URL+c.api.Path(), c.body("race two servers", 0, true))
			checkCompleteAPIStream(t, "hedged stream", c, s)
			if got := s.Header.Get(mockllm.HeaderReplica); got != fleet.Replica(1).Addr() {
				t.Errorf("served by %q, want the backup %s (the primary's %s is not a first token)", got, fleet.Replica(1).Addr(), c.begin)
			}
			for _, e := range s.dataEvents() {
				if e.name() == c.delta {
					if d := e.At.Sub(s.Sent); d > 1500*time.Millisecond {
						t.Errorf("the first %s reached the client after %v, want about 150ms (hedge delay + the backup's TTFT)", c.delta, d)
					}
					break
				}
			}
			if d := s.dataEvents(); len(d) > 0 {
				m := d[0].object()
				inner, _ := m["response"].(map[string]any)
				if c.api == mockllm.APIMessages {
					inner, _ = m["message"].(map[string]any)
				}
				id, _ := inner["id"].(string)
				if i := fleetIndexOf(fleet, id); i != 1 {
					t.Errorf("the client's %s (id %q) comes from replica %d, want the backup (1)", c.begin, id, i)
				}
			}
			checkHedges(t, gw, 1, 1, 0, 0)
		})
	}
}

// fleetIndexOf returns the index of the replica that holds a record of
// the response id, -1 when none does.
func fleetIndexOf(f *mockllm.Fleet, id string) int {
	for _, r := range f.Stats().Replicas {
		for _, rec := range r.Recent {
			if rec.ID == id {
				return r.Index
			}
		}
	}
	return -1
}

// TestInBandClientErrorsBeforeCommitKeepTheirStatus: an upstream that
// begins a stream and then sends an in-band client error before any
// token — Messages invalid_request_error, Responses code invalid_prompt
// — is not failed over (a 4xx is the request's fault, DESIGN §4): the
// client gets 400 in its API's error shape, which the SDK raises as
// BadRequestError, the other upstream is never asked, and the upstream's
// breaker records no failure. (An in-band rate_limit_error follows the
// 429 row instead: an upstream failure, failed over.)
func TestInBandClientErrorsBeforeCommitKeepTheirStatus(t *testing.T) {
	t.Parallel()
	requireNode(t)
	cases := []struct {
		c              apiCase
		fault          string
		status         int
		mode, class    string
		anthropicType  string
		openAIErrorKey string
	}{
		{streamingAPIs[1], "error_event=0,error_code=400", 400, "anthropic-stream", "BadRequestError", "invalid_request_error", ""},
		{streamingAPIs[0], "error_event=0,error_code=400", 400, "openai-responses", "BadRequestError", "", "invalid_prompt"},
	}
	for _, tc := range cases {
		t.Run(string(tc.c.api)+"/"+strconv.Itoa(tc.status), func(t *testing.T) {
			t.Parallel()
			f, err := mockllm.ParseFault(tc.fault)
			if err != nil {
				t.Fatal(err)
			}
			fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, Behavior: mockllm.Behavior{
				TTFT: mockllm.Fixed(10 * time.Millisecond), Tokens: 4, TokenInterval: mockllm.NoDelay},
				PerReplica: map[int]mockllm.Behavior{0: {TTFT: mockllm.Fixed(10 * time.Millisecond), Fault: f}}})
			gw := startGateway(t, fmt.Sprintf("\tllm_proxy %s {\n\t\tlb_policy first\n\t}", upstreams(fleet)))
			cl := newClient(t)
			ctx := testContext(t, 30*time.Second)
			r := mustSend(ctx, t, cl, gw.URL+tc.c.api.Path(), tc.c.body("a bad request", 0, true))
			if r.Status != tc.status {
				t.Errorf("status %d, want %d: %s", r.Status, tc.status, r.Body)
			}
			if tc.anthropicType != "" {
				checkAnthropicBody(t, "in-band "+tc.fault, r, tc.status, tc.anthropicType)
			} else if _, _, code := openAIError(t, r.Body); code != tc.openAIErrorKey {
				t.Errorf("error code %q, want %q: %s", code, tc.openAIErrorKey, r.Body)
			}
			sdk := runSDK(t, tc.mode, gw.URL, nil, nil)
			if sdk.OK || sdk.ErrorClass != tc.class || sdk.Status == nil || *sdk.Status != tc.status {
				t.Errorf("the SDK: ok %v, threw %s; want %s with status %d", sdk.OK, sdk.thrown(), tc.class, tc.status)
			}
			if st := fleet.Stats().Replicas; st[0].Requests != 2 || st[1].Requests != 0 {
				t.Errorf("upstream requests %d and %d, want 2 and 0 (a client error is not failed over)", st[0].Requests, st[1].Requests)
			}
			if b := gw.breaker(fleet.Replica(0).Addr()); b.ConsecutiveFailures != 0 || b.LastFailure != "" {
				t.Errorf("the upstream's breaker recorded a failure for a client error: %+v", b)
			}
		})
	}
}

// TestCountTokensIsProxiedAsIs: /v1/messages/count_tokens is none of the
// streaming APIs (its path ends in /count_tokens): the gateway passes it
// through with the status-code rules only — the upstream's body unchanged
// — and the Anthropic SDK's messages.countTokens-style request gets the
// upstream's input_tokens.
func TestCountTokensIsProxiedAsIs(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet))
	cl := newClient(t)
	ctx := testContext(t, 30*time.Second)
	body := `{"model":"mock-llama","system":"count","messages":[{"role":"user","content":"how many tokens is this?"}]}`
	want := mustSend(ctx, t, cl, fleet.Replica(0).URL()+"/v1/messages/count_tokens", body)
	got := mustSend(ctx, t, cl, gw.URL+"/v1/messages/count_tokens", body, "x-api-key: sk-e2e-not-a-secret", "anthropic-version: 2023-06-01")
	if got.Status != 200 || string(got.Body) != string(want.Body) || !strings.Contains(string(want.Body), `"input_tokens":`) {
		t.Errorf("through the gateway: %d %s; want the upstream's 200 %s", got.Status, got.Body, want.Body)
	}
}

// TestFirstByteTimeoutCountsOnlyGeneratedEvents: an upstream that begins
// its stream at once (as vLLM does with response.created while a request
// waits in its queue) but holds its first token for 3s is a first-byte
// timeout after 300ms, failed over before commit: the client is served by
// the other upstream, sees one beginning, and the slow upstream's breaker
// records a first_byte_timeout.
func TestFirstByteTimeoutCountsOnlyGeneratedEvents(t *testing.T) {
	t.Parallel()
	for _, c := range streamingAPIs {
		t.Run(string(c.api), func(t *testing.T) {
			t.Parallel()
			fast := mockllm.Behavior{TTFT: mockllm.Fixed(20 * time.Millisecond), Tokens: 5, TokenInterval: 5 * time.Millisecond}
			slow := fast
			slow.TTFT = mockllm.Fixed(3 * time.Second)
			fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, PerReplica: map[int]mockllm.Behavior{0: slow, 1: fast}})
			gw := startGateway(t, fmt.Sprintf("\tllm_proxy %s {\n\t\tlb_policy first\n\t\tfirst_byte_timeout 300ms\n\t}", upstreams(fleet)))
			cl := newClient(t)
			ctx := testContext(t, 30*time.Second)
			s := streamRequest(ctx, t, cl, gw.URL+c.api.Path(), c.body("wait in the queue", 0, true))
			checkCompleteAPIStream(t, "stream", c, s)
			if got := s.Header.Get(mockllm.HeaderReplica); got != fleet.Replica(1).Addr() {
				t.Errorf("served by %q, want the second upstream %s after the first's first-byte timeout", got, fleet.Replica(1).Addr())
			}
			if d := s.lastData().At.Sub(s.Sent); d > 2*time.Second {
				t.Errorf("the stream took %v: the first upstream's %s held off its first-byte timeout", d, c.begin)
			}
			if b := gw.breaker(fleet.Replica(0).Addr()); !strings.Contains(b.LastFailure, "first_byte_timeout") {
				t.Errorf("the slow upstream's breaker: last failure %q, want first_byte_timeout", b.LastFailure)
			}
		})
	}
}

// TestLLMLoadDrivesEveryAPIThroughTheGateway: llmload run --api drives
// each of the four APIs through the gateway: every request ok, and its
// TTFT taken at the first generated event — at least the mock's 150ms
// time to first token, although Responses and Messages servers begin
// their streams at once.
func TestLLMLoadDrivesEveryAPIThroughTheGateway(t *testing.T) {
	t.Parallel()
	bin := filepath.Join(t.TempDir(), "llmload")
	build := exec.Command("go", "build", "-o", bin, "../cmd/llmload")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ../cmd/llmload: %v\n%s", err, out)
	}
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(150 * time.Millisecond), Tokens: 4, TokenInterval: 5 * time.Millisecond}})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet))
	for _, api := range []mockllm.API{mockllm.APIChat, mockllm.APICompletions, mockllm.APIResponses, mockllm.APIMessages} {
		out := filepath.Join(t.TempDir(), string(api)+".json")
		cmd := exec.Command(bin, "run", "--progress=false", "--api", string(api), "--url", gw.URL+api.Path(),
			"--requests", "6", "--concurrency", "2", "--duration", "20s", "--json", out)
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("llmload run --api %s: %v\n%s", api, err, b)
			continue
		}
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		var rep struct {
			Config  struct{ API string }
			Summary struct {
				Requests, OK int
				TTFT         struct {
					P50 float64 `json:"p50_ms"`
				} `json:"ttft"`
			}
		}
		if err := json.Unmarshal(b, &rep); err != nil {
			t.Fatalf("%s: %v", out, err)
		}
		if rep.Config.API != string(api) || rep.Summary.Requests != 6 || rep.Summary.OK != 6 {
			t.Errorf("--api %s: report api %q, %d of %d requests ok; want %s, 6 of 6", api, rep.Config.API, rep.Summary.OK, rep.Summary.Requests, api)
		}
		if p50 := rep.Summary.TTFT.P50; p50 < 150 || p50 > 1000 {
			t.Errorf("--api %s: TTFT p50 %.0fms, want the mock's 150ms or a little more (the first generated event, not the stream's beginning)", api, p50)
		}
	}
}
