package proxy

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/api"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
	"github.com/tidwall/gjson"
)

// transcript reads one of package api's stream transcripts, written from
// OpenAI's and Anthropic's streaming references and vLLM's serving code.
func transcript(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "api", "testdata", "transcripts", name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// events splits a transcript into its events, each with its blank line.
func events(tr string) []string {
	var out []string
	for _, e := range strings.SplitAfter(tr, "\n\n") {
		if e != "" {
			out = append(out, e)
		}
	}
	return out
}

// apiPost is a request to path with body, as an SDK of that API sends it.
func apiPost(path, body string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	return r
}

const (
	responsesBody = `{"model":"m","stream":true,"input":"abcdefgh","max_output_tokens":100}`
	messagesBody  = `{"model":"m","stream":true,"max_tokens":100,"messages":[{"role":"user","content":"abcdefgh"}]}`
)

// TestCompleteStreamsOfEveryAPIAreSuccesses: ten complete Responses and
// ten complete Messages streams reach the client byte for byte, with
// nothing appended, and every attempt is a success: no breaker hears a
// failure from a healthy upstream's healthy answers.
func TestCompleteStreamsOfEveryAPIAreSuccesses(t *testing.T) {
	for _, tc := range []struct {
		path, body, file string
		usage            Usage
	}{
		{"/v1/responses", responsesBody, "responses_complete.sse", Usage{PromptTokens: 37, CompletionTokens: 11, Reported: true}},
		{"/v1/responses", responsesBody, "responses_incomplete.sse", Usage{PromptTokens: 12, CompletionTokens: 16, Reported: true}},
		{"/openai/v1/responses", responsesBody, "responses_function_call.sse", Usage{PromptTokens: 80, CompletionTokens: 9, Reported: true}},
		{"/v1/messages", messagesBody, "messages_complete.sse", Usage{PromptTokens: 30, CompletionTokens: 15, Reported: true}},
		{"/v1/messages", messagesBody, "messages_tool_use.sse", Usage{PromptTokens: 472, CompletionTokens: 89, Reported: true}},
		{"/v1/messages", messagesBody, "messages_thinking_max_tokens.sse", Usage{PromptTokens: 10, CompletionTokens: 32, Reported: true}},
	} {
		t.Run(tc.file, func(t *testing.T) {
			tr := transcript(t, tc.file)
			up := newUpstream(t, sseUpstream(events(tr)...))
			p, _, obs := newTestProxy(t, Config{}, up)
			for i := range 10 {
				w := httptest.NewRecorder()
				res := p.ServeHTTP(w, apiPost(tc.path, tc.body))
				if w.Code != 200 || w.Body.String() != tr {
					t.Fatalf("request %d: code %d body\n%s\nwant\n%s", i, w.Code, w.Body, tr)
				}
				if res.Outcome != OutcomeSuccess || res.Usage != tc.usage || res.API != api.ForPath(tc.path).Name() {
					t.Fatalf("request %d: outcome %s usage %+v api %s", i, res.Outcome, res.Usage, res.API)
				}
			}
			obs.waitFor(t, func() bool { return len(obs.attempts) == 10 })
			for _, a := range obs.attempts {
				if a.Outcome != AttemptSuccess || a.Outcome.UpstreamFault() {
					t.Fatalf("attempt %s: %v", a.Outcome, a.Err)
				}
			}
		})
	}
}

// TestLifecycleThenErrorFailsOver: an upstream that sends only lifecycle
// events (response.created, message_start and ping, a role-only chat
// chunk) and then an in-band 5xx-like error has generated nothing: the
// request fails over, and the client sees the second upstream's stream

// failOver sends a request to path through bad, then through a second
// upstream that answers the transcript good. It checks that the client got
// that transcript alone, from the second upstream, and that the first
// attempt went to bad and ended as wantFirst (an AttemptOutcome's name);
// it returns the response and the first attempt's report.
func failOver(t *testing.T, cfg Config, bad *upstream, path, body, good, wantFirst string) (*httptest.ResponseRecorder, AttemptReport) {
	t.Helper()
	second := newUpstream(t, sseUpstream(events(good)...))
	p, _, obs := newTestProxy(t, cfg, bad, second)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, apiPost(path, body))
	if w.Code != 200 || w.Body.String() != good || res.Outcome != OutcomeSuccess || res.Upstream != second.addr() {
		t.Fatalf("code %d outcome %s upstream %s body\n%s", w.Code, res.Outcome, res.Upstream, w.Body)
	}
	obs.waitFor(t, func() bool { return len(obs.attempts) == 2 })
	if got := strings.Join(obs.outcomes(), " "); got != bad.addr()+"="+wantFirst+" "+second.addr()+"=success" {
		t.Fatalf("attempts: %s", got)
	}
	obs.mu.Lock()
	defer obs.mu.Unlock()
	return w, obs.attempts[0]
}

// alone, with one beginning.
func TestLifecycleThenErrorFailsOver(t *testing.T) {
	for _, tc := range []struct {
		path, body, bad, good, beginning string
	}{
		{"/v1/responses", responsesBody, "responses_lifecycle_error.sse", "responses_complete.sse", "event: response.created"},
		{"/v1/messages", messagesBody, "messages_lifecycle_overloaded.sse", "messages_complete.sse", "event: message_start"},
		{"/v1/chat/completions", `{"stream":true}`, "chat_role_then_error.sse", "chat_vllm_complete.sse", `"role":"assistant"`},
	} {
		t.Run(tc.bad, func(t *testing.T) {
			bad := newUpstream(t, sseUpstream(events(transcript(t, tc.bad))...))
			w, _ := failOver(t, Config{}, bad, tc.path, tc.body, transcript(t, tc.good), "inband_error_5xx")
			if n := strings.Count(w.Body.String(), tc.beginning); n != 1 {
				t.Fatalf("the client saw %d beginnings (%s), want 1", n, tc.beginning)
			}
		})
	}
}

// TestInbandClientErrorBeforeCommitIsAnswered: a Messages
// invalid_request_error after message_start is the request's fault: not
// retried, answered 400 in Anthropic's shape.
func TestInbandClientErrorBeforeCommitIsAnswered(t *testing.T) {
	bad := newUpstream(t, sseUpstream(events(transcript(t, "messages_invalid_request.sse"))...))
	other := newUpstream(t, sseUpstream(events(transcript(t, "messages_complete.sse"))...))
	p, _, _ := newTestProxy(t, Config{}, bad, other)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, apiPost("/v1/messages", messagesBody))
	if w.Code != 400 || other.calls.Load() != 0 || !res.TenantFault {
		t.Fatalf("code %d other calls %d tenant fault %v", w.Code, other.calls.Load(), res.TenantFault)
	}
	if want := `{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long"}}` + "\n"; w.Body.String() != want {
		t.Fatalf("body %s, want %s", w.Body, want)
	}
}

// TestCutAfterContentEndsWithTheAPIsErrorEvent: a committed stream that
// is cut gets its own API's terminal error event, which the official SDKs
// raise (not a chat-shaped one they ignore), and counts as a cut. A last
// event without the API's normal end (message_stop without a stop_reason)
// is not relayed: the error event takes its place.
func TestCutAfterContentEndsWithTheAPIsErrorEvent(t *testing.T) {
	msgCut := strings.Join(events(transcript(t, "messages_complete.sse"))[:4], "")
	stopEvents := events(transcript(t, "messages_stop_without_stop_reason.sse"))
	for _, tc := range []struct {
		path, body, stream, tail string
	}{
		{"/v1/responses", responsesBody, transcript(t, "responses_cut.sse"),
			"event: error\n" + `data: {"type":"error","code":"upstream_stream_truncated","message":"upstream stream ended before completion","param":null,"sequence_number":3}` + "\n\n"},
		{"/v1/messages", messagesBody, msgCut,
			"event: error\n" + `data: {"type":"error","error":{"type":"api_error","message":"upstream stream ended before completion"}}` + "\n\n"},
		{"/v1/messages", messagesBody, strings.Join(stopEvents, ""),
			"event: error\n" + `data: {"type":"error","error":{"type":"api_error","message":"upstream stream ended before completion"}}` + "\n\n"},
		{"/v1/chat/completions", `{"stream":true}`, chunkA,
			`data: {"error":{"message":"upstream stream ended before completion","type":"server_error","code":"upstream_stream_truncated"}}` + "\n\n"},
	} {
		t.Run(tc.path, func(t *testing.T) {
			up := newUpstream(t, sseUpstream(events(tc.stream)...))
			p, _, obs := newTestProxy(t, Config{}, up)
			w := httptest.NewRecorder()
			res := p.ServeHTTP(w, apiPost(tc.path, tc.body))
			want := tc.stream + tc.tail
			if tc.stream == strings.Join(stopEvents, "") {
				want = strings.Join(stopEvents[:len(stopEvents)-1], "") + tc.tail
			}
			if got := w.Body.String(); got != want {
				t.Fatalf("body\n%s\nwant\n%s", got, want)
			}
			if res.Outcome != OutcomeTruncated {
				t.Fatalf("outcome %s", res.Outcome)
			}
			obs.waitFor(t, func() bool { return len(obs.attempts) == 1 })
			if a := obs.attempts[0]; a.Outcome != AttemptTruncated || !a.Outcome.UpstreamFault() {
				t.Fatalf("attempt %s", a.Outcome)
			}
		})
	}
}

// anthropicError decodes an Anthropic error body.
func anthropicError(t *testing.T, body string) (typ, message string) {
	t.Helper()
	var e struct {
		Type  string `json:"type"`
		Error struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		} `json:"error"`
	}
	if err := json.Unmarshal([]byte(body), &e); err != nil || e.Type != "error" {
		t.Fatalf("not an Anthropic error body: %v: %s", err, body)
	}
	return e.Error.Type, e.Error.Message
}

// TestGatewayErrorsOnMessagesAreAnthropicShaped: the gateway's own 503
// and a tenant's 429 on /v1/messages are Anthropic's error bodies with the
// same status and headers as on Chat, and the tenant's limits in both
// header forms.
func TestGatewayErrorsOnMessagesAreAnthropicShaped(t *testing.T) {
	t.Run("503 no upstream", func(t *testing.T) {
		p, _, _ := newTestProxy(t, Config{})
		w := httptest.NewRecorder()
		p.ServeHTTP(w, apiPost("/v1/messages", messagesBody))
		if typ, _ := anthropicError(t, w.Body.String()); w.Code != 503 || typ != "overloaded_error" || w.Header().Get("Retry-After") == "" ||
			w.Header().Get("Content-Type") != "application/json" {
			t.Fatalf("code %d headers %v body %s", w.Code, w.Header(), w.Body)
		}
		// The same gateway on Chat still answers in OpenAI's shape.
		w = httptest.NewRecorder()
		p.ServeHTTP(w, apiPost("/v1/chat/completions", `{}`))
		var e errorBody
		if json.Unmarshal(w.Body.Bytes(), &e) != nil || e.Error.Code != "no_upstream" {
			t.Fatalf("chat body %s", w.Body)
		}
	})
	t.Run("429 tenant limit", func(t *testing.T) {
		tn := newTenancy(t, 0)
		up := newUpstream(t, sseUpstream(events(transcript(t, "messages_complete.sse"))...))
		p, _ := tn.proxy(t, Config{}, up)
		var w *httptest.ResponseRecorder
		for range 4 { // gold: 3 requests a minute
			w = httptest.NewRecorder()
			r := apiPost("/v1/messages", messagesBody)
			r.Header.Set("X-Api-Key", "sk-a") // Anthropic's key header
			p.ServeHTTP(w, r)
		}
		typ, msg := anthropicError(t, w.Body.String())
		h := w.Header()
		if w.Code != 429 || typ != "rate_limit_error" || !strings.Contains(msg, "per minute") || h.Get("Retry-After") == "" {
			t.Fatalf("code %d headers %v body %s", w.Code, h, w.Body)
		}
		if h.Get("X-Ratelimit-Limit-Requests") != "3" || h.Get("Anthropic-Ratelimit-Requests-Limit") != "3" ||
			h.Get("Anthropic-Ratelimit-Requests-Remaining") != h.Get("X-Ratelimit-Remaining-Requests") ||
			h.Get("Anthropic-Ratelimit-Tokens-Limit") != "10000" ||
			h.Get("Anthropic-Ratelimit-Tokens-Remaining") != h.Get("X-Ratelimit-Remaining-Tokens") {
			t.Fatalf("headers %v", h)
		}
		for _, k := range []string{"Anthropic-Ratelimit-Requests-Reset", "Anthropic-Ratelimit-Tokens-Reset"} {
			reset, err := time.Parse(time.RFC3339, h.Get(k))
			if err != nil || reset.Before(time.Now().Add(-time.Second)) || reset.After(time.Now().Add(2*time.Minute)) {
				t.Fatalf("%s = %q: want an RFC 3339 time within the window", k, h.Get(k))
			}
		}
		if up.calls.Load() != 3 {
			t.Fatalf("upstream calls %d, want 3", up.calls.Load())
		}
	})
}

// TestUsageSettlesTheReservation: a Responses request reserves its
// max_output_tokens (not the tier default), and a Messages stream settles
// with message_start's input and the last message_delta's output_tokens.
func TestUsageSettlesTheReservation(t *testing.T) {
	tn := newTenancy(t, 0)
	var mu sync.Mutex
	stream := ""
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		s := stream
		mu.Unlock()
		sseUpstream(events(s)...)(w, r)
	})
	p, _ := tn.proxy(t, Config{}, up)
	send := func(path, body, file string) (*httptest.ResponseRecorder, *Result) {
		mu.Lock()
		stream = transcript(t, file)
		mu.Unlock()
		w := httptest.NewRecorder()
		r := apiPost(path, body)
		r.Header.Set("X-Api-Key", "sk-a")
		return w, p.ServeHTTP(w, r)
	}
	// input "abcdefgh" is 2 tokens, max_output_tokens 100: 10000 - 102.
	w, res := send("/v1/responses", responsesBody, "responses_complete.sse")
	if got := w.Header().Get("X-Ratelimit-Remaining-Tokens"); got != "9898" {
		t.Fatalf("remaining at commit %s, want 9898 (the reservation of max_output_tokens 100 + 2)", got)
	}
	if res.Tokens != 48 {
		t.Fatalf("settled %d tokens, want 37+11", res.Tokens)
	}
	// 10000 - 48 settled - 102 reserved.
	w, res = send("/v1/messages", messagesBody, "messages_complete.sse")
	if got := w.Header().Get("X-Ratelimit-Remaining-Tokens"); got != "9850" {
		t.Fatalf("remaining at commit %s, want 9850", got)
	}
	if w.Header().Get("Anthropic-Ratelimit-Tokens-Remaining") != "9850" {
		t.Fatalf("anthropic headers %v", w.Header())
	}
	// message_start: 25 input + 3 cache creation + 2 cache read; the last
	// of the two cumulative message_deltas: 15, not 7+15.
	if res.Tokens != 45 || res.Usage.CompletionTokens != 15 {
		t.Fatalf("settled %d tokens (usage %+v), want 30+15", res.Tokens, res.Usage)
	}
	// Settled as reported usage, never as an estimate.
	if got, want := tn.obs.settled(), "a prompt usage 37, a completion usage 11, a prompt usage 30, a completion usage 15"; got != want {
		t.Fatalf("settled %q, want %q", got, want)
	}
	// A third request sees both settled: 10000 - 48 - 45 - 102.
	w, _ = send("/v1/messages", messagesBody, "messages_complete.sse")
	if got := w.Header().Get("X-Ratelimit-Remaining-Tokens"); got != "9805" {
		t.Fatalf("remaining %s, want 9805", got)
	}
}

// TestAnthropicHeadersReachTheUpstreamUntouched: anthropic-version and
// anthropic-beta flow to the upstream as the client sent them, and
// x-api-key identifies the tenant.
func TestAnthropicHeadersReachTheUpstreamUntouched(t *testing.T) {
	tn := newTenancy(t, 0)
	got := make(chan http.Header, 1)
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		got <- r.Header.Clone()
		sseUpstream(events(transcript(t, "messages_complete.sse"))...)(w, r)
	})
	p, _ := tn.proxy(t, Config{}, up)
	r := apiPost("/v1/messages", messagesBody)
	r.Header.Set("X-Api-Key", "sk-a")
	r.Header.Set("Anthropic-Version", "2023-06-01")
	r.Header.Add("Anthropic-Beta", "interleaved-thinking-2025-05-14")
	r.Header.Add("Anthropic-Beta", "fine-grained-tool-streaming-2025-05-14")
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, r)
	if res.Identity.Tenant != "a" || res.Outcome != OutcomeSuccess {
		t.Fatalf("tenant %q outcome %s", res.Identity.Tenant, res.Outcome)
	}
	h := <-got
	if h.Get("Anthropic-Version") != "2023-06-01" ||
		strings.Join(h.Values("Anthropic-Beta"), ",") != "interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14" {
		t.Fatalf("upstream headers %v", h)
	}
}

// TestResponsesHedgeWinsOnlyWithAGeneratedEvent: with hedging, the backup
// that sends response.created early does not win by it; the primary's
// first generated event wins, and the client sees one response.created,
// the winner's.
func TestResponsesHedgeWinsOnlyWithAGeneratedEvent(t *testing.T) {
	evs := events(transcript(t, "responses_complete.sse"))
	primaryGo, backupCreated := make(chan struct{}), make(chan struct{})
	primary := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		sseUpstream(evs[:2]...)(w, r) // created, in_progress at once
		await(t, primaryGo, "primary released")
		sseUpstream(evs[2:]...)(w, r)
	})
	backupEvents := strings.ReplaceAll(evs[0], "resp_1", "resp_backup")
	backup := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		sseUpstream(backupEvents)(w, r)
		close(backupCreated)
		<-r.Context().Done() // generates nothing until cancelled
	})
	clk := clocktest.New(time.Time{})
	h := &fakeHedging{delay: 50 * time.Millisecond, allow: true}
	p, obs := hedgedProxy(t, Config{Clock: clk, Hedging: h, Retries: &fakeRetries{allow: true}}, primary, backup)
	w := httptest.NewRecorder()
	served := serve(p, w, apiPost("/v1/responses", responsesBody))
	clk.WaitTimer(t, h.delay)
	clk.Advance(h.delay) // the primary sent only lifecycle events: hedge
	await(t, backupCreated, "backup sent response.created")
	obs.waitFor(t, func() bool { return obs.hedges[HedgeFired] == 1 })
	close(primaryGo)
	res := result(t, served)
	if res.Upstream != primary.addr() || res.Outcome != OutcomeSuccess || w.Body.String() != strings.Join(evs, "") {
		t.Fatalf("upstream %s (primary %s) outcome %s body\n%s", res.Upstream, primary.addr(), res.Outcome, w.Body)
	}
	if strings.Contains(w.Body.String(), "resp_backup") || strings.Count(w.Body.String(), "event: response.created") != 1 {
		t.Fatalf("the backup's lifecycle reached the client:\n%s", w.Body)
	}
	obs.waitFor(t, func() bool { return len(obs.attempts) == 2 })
	if obs.hedges[HedgeLost] != 1 || obs.hedges[HedgeWon] != 0 {
		t.Fatalf("hedges %v", obs.hedges)
	}
	if got := strings.Join(obs.outcomes(), " "); !strings.Contains(got, backup.addr()+"=canceled") {
		t.Fatalf("the backup must be cancelled, neutral: %s", got)
	}
}

// TestNonStreamingBodiesSettleWithTheirAPIsUsage: a whole Responses or
// Messages JSON body reports its usage.
func TestNonStreamingBodiesSettleWithTheirAPIsUsage(t *testing.T) {
	for _, tc := range []struct {
		path, body string
		want       Usage
	}{
		{"/v1/responses", `{"id":"resp_1","object":"response","status":"completed","usage":{"input_tokens":7,"output_tokens":3}}`, Usage{PromptTokens: 7, CompletionTokens: 3, Reported: true}},
		{"/v1/messages", `{"id":"msg_1","type":"message","usage":{"input_tokens":7,"output_tokens":3}}`, Usage{PromptTokens: 7, CompletionTokens: 3, Reported: true}},
		// Other paths read OpenAI's usage of a JSON body (embeddings).
		{"/v1/embeddings", `{"data":[],"usage":{"prompt_tokens":7,"total_tokens":7}}`, Usage{PromptTokens: 7, Reported: true}},
	} {
		up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, tc.body)
		})
		p, _, _ := newTestProxy(t, Config{}, up)
		w := httptest.NewRecorder()
		res := p.ServeHTTP(w, apiPost(tc.path, `{"model":"m"}`))
		if w.Body.String() != tc.body || res.Usage != tc.want || res.Outcome != OutcomeSuccess {
			t.Fatalf("%s: usage %+v outcome %s body %s", tc.path, res.Usage, res.Outcome, w.Body)
		}
	}
}

// TestAPIOptionOverridesThePath: Config.API makes a server on another path
// speak Messages.
func TestAPIOptionOverridesThePath(t *testing.T) {
	tr := transcript(t, "messages_complete.sse")
	up := newUpstream(t, sseUpstream(events(tr)...))
	p, _, _ := newTestProxy(t, Config{API: api.Messages}, up)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, apiPost("/generate", messagesBody))
	if res.API != "messages" || res.Usage.CompletionTokens != 15 || res.Info.MaxTokens != 100 || w.Body.String() != tr {
		t.Fatalf("api %s usage %+v info %+v", res.API, res.Usage, res.Info)
	}
}

// TestStreamWithoutUsageSettlesAnEstimate: a Responses stream cut before
// its response.completed reported no usage: the tenant is charged the
// prompt estimate plus one token per generated event, counted as
// estimated.
func TestStreamWithoutUsageSettlesAnEstimate(t *testing.T) {
	tn := newTenancy(t, 0)
	up := newUpstream(t, sseUpstream(events(transcript(t, "responses_cut.sse"))...))
	p, _ := tn.proxy(t, Config{}, up)
	r := apiPost("/v1/responses", responsesBody)
	r.Header.Set("X-Api-Key", "sk-a")
	res := p.ServeHTTP(httptest.NewRecorder(), r)
	if res.Usage.Reported || res.Outcome != OutcomeTruncated {
		t.Fatalf("usage %+v outcome %s", res.Usage, res.Outcome)
	}
	// "abcdefgh": 2 prompt tokens; two output_text deltas.
	if got, want := tn.obs.settled(), "a prompt estimate 2, a completion estimate 2"; got != want {
		t.Fatalf("settled %q, want %q", got, want)
	}
}

// TestMessagesCutBeforeMessageDeltaSettlesAnEstimate: a Messages stream
// cut between content_block_stop and message_delta reported only
// message_start's usage, whose output_tokens (1) is not what was
// generated. The client gets Anthropic's api_error event, the attempt is
// a cut, and the tenant is settled with an estimate: message_start's
// prompt count (25 + 3 + 2) and one token per generated event relayed
// (two text deltas and content_block_stop; the empty content_block_start
// is lifecycle), never the 1
// output token of message_start as if it were the answer's usage.
func TestMessagesCutBeforeMessageDeltaSettlesAnEstimate(t *testing.T) {
	tn := newTenancy(t, 0)
	cut := strings.Join(events(transcript(t, "messages_complete.sse"))[:6], "")
	up := newUpstream(t, sseUpstream(events(cut)...))
	p, _ := tn.proxy(t, Config{}, up)
	w := httptest.NewRecorder()
	r := apiPost("/v1/messages", messagesBody)
	r.Header.Set("X-Api-Key", "sk-a")
	res := p.ServeHTTP(w, r)
	tail := "event: error\n" + `data: {"type":"error","error":{"type":"api_error","message":"upstream stream ended before completion"}}` + "\n\n"
	if w.Body.String() != cut+tail || res.Outcome != OutcomeTruncated {
		t.Fatalf("outcome %s body\n%s", res.Outcome, w.Body)
	}
	if res.Usage.Reported {
		t.Fatalf("usage %+v: message_start's usage is not the stream's", res.Usage)
	}
	if got, want := tn.obs.settled(), "a prompt estimate 30, a completion estimate 3"; got != want {
		t.Fatalf("settled %q, want %q", got, want)
	}
}

// TestMessagesPingsAfterCommitAreNotCountedAsTokens: Anthropic sends ping
// events (and a proxy may add SSE comments) while a stream runs; they
// carry nothing generated. A stream cut before its message_delta is
// settled with one completion token per generated event relayed: the
// pings and comments between the deltas are relayed to the client but
// count nothing (3 generated events, as without them).
func TestMessagesPingsAfterCommitAreNotCountedAsTokens(t *testing.T) {
	tn := newTenancy(t, 0)
	evs := events(transcript(t, "messages_complete.sse"))[:6]
	ping := "event: ping\n" + `data: {"type": "ping"}` + "\n\n"
	dataOnlyPing := `data: {"type":"ping"}` + "\n\n"
	var withPings []string
	for i, ev := range evs {
		withPings = append(withPings, ev)
		if i >= 3 {
			withPings = append(withPings, ping, ": keep-alive\n\n", dataOnlyPing)
		}
	}
	up := newUpstream(t, sseUpstream(withPings...))
	p, _ := tn.proxy(t, Config{}, up)
	w := httptest.NewRecorder()
	r := apiPost("/v1/messages", messagesBody)
	r.Header.Set("X-Api-Key", "sk-a")
	res := p.ServeHTTP(w, r)
	tail := "event: error\n" + `data: {"type":"error","error":{"type":"api_error","message":"upstream stream ended before completion"}}` + "\n\n"
	if w.Body.String() != strings.Join(withPings, "")+tail || res.Outcome != OutcomeTruncated {
		t.Fatalf("outcome %s body\n%s", res.Outcome, w.Body)
	}
	if res.ContentEvents != 3 {
		t.Fatalf("content events %d, want 3", res.ContentEvents)
	}
	if got, want := tn.obs.settled(), "a prompt estimate 30, a completion estimate 3"; got != want {
		t.Fatalf("settled %q, want %q", got, want)
	}
}

// TestLifecycleThenStopWithoutStopReasonFailsOver: an upstream whose
// Messages stream ends (message_stop) after only message_start and ping,
// with no message_delta and so no stop_reason, generated nothing and did
// not finish: nothing generated, nothing committed. The request fails
// over to the next upstream, the client sees its stream alone, and the
// first attempt is a cut (an upstream failure).
func TestLifecycleThenStopWithoutStopReasonFailsOver(t *testing.T) {
	bad := newUpstream(t, sseUpstream(
		"event: message_start\n"+`data: {"type":"message_start","message":{"id":"msg_bad","usage":{"input_tokens":4,"output_tokens":1}}}`+"\n\n",
		"event: ping\n"+`data: {"type":"ping"}`+"\n\n",
		"event: message_stop\n"+`data: {"type":"message_stop"}`+"\n\n",
	))
	failOver(t, Config{}, bad, "/v1/messages", messagesBody, transcript(t, "messages_complete.sse"), "truncated")
}

// TestUpstreamAnthropicRateLimitHeadersNeverReachATenant: with tenants,
// the upstream's own rate-limit headers are the shared account's figures
// and never reach a tenant (as for x-ratelimit-*): an Anthropic-compatible
// upstream's anthropic-ratelimit-* headers (requests, tokens, and the
// input-tokens and output-tokens forms) are dropped; a tenant with limits
// gets its own, one without none.
func TestUpstreamAnthropicRateLimitHeadersNeverReachATenant(t *testing.T) {
	tn := newTenancy(t, 0)
	tr := transcript(t, "messages_complete.sse")
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		for _, k := range []string{"requests", "tokens", "input-tokens", "output-tokens"} {
			w.Header().Set("anthropic-ratelimit-"+k+"-limit", "999999")
			w.Header().Set("anthropic-ratelimit-"+k+"-remaining", "999998")
			w.Header().Set("anthropic-ratelimit-"+k+"-reset", "2030-01-01T00:00:00Z")
		}
		sseUpstream(events(tr)...)(w, r)
	})
	p, _ := tn.proxy(t, Config{}, up)
	for _, key := range []string{"sk-a", "sk-c"} { // gold (limits), free (none)
		w := httptest.NewRecorder()
		r := apiPost("/v1/messages", messagesBody)
		r.Header.Set("X-Api-Key", key)
		if res := p.ServeHTTP(w, r); res.Outcome != OutcomeSuccess {
			t.Fatalf("%s: outcome %s", key, res.Outcome)
		}
		for k, v := range w.Header() {
			if strings.HasPrefix(k, "Anthropic-Ratelimit-") && (strings.Contains(v[0], "99999") || strings.HasPrefix(v[0], "2030")) {
				t.Errorf("%s: the upstream's %s: %s reached the tenant", key, k, v[0])
			}
		}
	}
}

// anthropicOverloaded answers 529 with Anthropic's overloaded_error body.
const anthropicOverloaded = `{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}`

// TestAnthropic529FailsOverThenPassesThrough: Anthropic's 529 (overloaded)
// is a 5xx: the request fails over to the next upstream; when every
// attempt gets it, the last 529 reaches the client unchanged (status,
// Anthropic body, Retry-After), which the Anthropic SDKs raise as their
// overloaded error.
func TestAnthropic529FailsOverThenPassesThrough(t *testing.T) {
	overloaded := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Retry-After", "3")
		w.WriteHeader(529)
		_, _ = io.WriteString(w, anthropicOverloaded)
	}
	t.Run("fails over", func(t *testing.T) {
		bad := newUpstream(t, overloaded)
		_, a := failOver(t, Config{MaxAttempts: 2}, bad, "/v1/messages", messagesBody, transcript(t, "messages_complete.sse"), AttemptHTTP5xx.String())
		if !a.Outcome.UpstreamFault() || a.Status != 529 {
			t.Fatalf("first attempt %s status %d", a.Outcome, a.Status)
		}
	})
	t.Run("passes through", func(t *testing.T) {
		a, b := newUpstream(t, overloaded), newUpstream(t, overloaded)
		p, _, _ := newTestProxy(t, Config{MaxAttempts: 2}, a, b)
		w := httptest.NewRecorder()
		res := p.ServeHTTP(w, apiPost("/v1/messages", messagesBody))
		if typ, _ := anthropicError(t, w.Body.String()); w.Code != 529 || typ != "overloaded_error" ||
			w.Header().Get("Retry-After") != "3" || res.Outcome != OutcomeUpstreamError {
			t.Fatalf("code %d headers %v outcome %s body %s", w.Code, w.Header(), res.Outcome, w.Body)
		}
	})
}

// TestAnthropicRateLimitBodyPassesThrough: an upstream's 429 with
// Anthropic's rate_limit_error body and a Retry-After too long for the
// request reaches a Messages client unchanged.
func TestAnthropicRateLimitBodyPassesThrough(t *testing.T) {
	body := `{"type":"error","error":{"type":"rate_limit_error","message":"Number of request tokens has exceeded your per-minute rate limit"}}`
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Retry-After", "3600")
		w.WriteHeader(429)
		_, _ = io.WriteString(w, body)
	})
	p, _, _ := newTestProxy(t, Config{MaxAttempts: 2}, up)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, apiPost("/v1/messages", messagesBody))
	if w.Code != 429 || w.Body.String() != body || w.Header().Get("Retry-After") != "3600" || res.Outcome != OutcomeRateLimited {
		t.Fatalf("code %d headers %v outcome %s body %s", w.Code, w.Header(), res.Outcome, w.Body)
	}
}

// TestCountTokensIsProxiedWithoutStreamSemantics: /v1/messages/count_tokens
// is none of the streaming APIs: its JSON answer passes through, reports
// no usage and is a success.
func TestCountTokensIsProxiedWithoutStreamSemantics(t *testing.T) {
	const answer = `{"input_tokens":123}`
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, answer)
	})
	p, _, _ := newTestProxy(t, Config{}, up)
	w := httptest.NewRecorder()
	body := `{"model":"m","system":[{"type":"text","text":"be brief","cache_control":{"type":"ephemeral"}}],"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}`
	res := p.ServeHTTP(w, apiPost("/v1/messages/count_tokens", body))
	if w.Code != 200 || w.Body.String() != answer || res.API != "none" || res.Usage.Reported || res.Outcome != OutcomeSuccess {
		t.Fatalf("code %d api %s usage %+v outcome %s body %s", w.Code, res.API, res.Usage, res.Outcome, w.Body)
	}
}

// TestMessagesClientGoneSettlesAnEstimate: a client that leaves a
// Messages stream mid-answer (Claude Code's Escape) is not charged
// message_start's output_tokens as if they were the answer's: the tenant
// is settled with an estimate of what was relayed.
func TestMessagesClientGoneSettlesAnEstimate(t *testing.T) {
	tn := newTenancy(t, 0)
	head := events(transcript(t, "messages_complete.sse"))[:4] // through the first text delta
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		sseUpstream(head...)(w, r)
		<-r.Context().Done()
	})
	p, _ := tn.proxy(t, Config{}, up)
	ctx, cancel := context.WithCancel(context.Background())
	r := apiPost("/v1/messages", messagesBody).WithContext(ctx)
	r.Header.Set("X-Api-Key", "sk-a")
	res := p.ServeHTTP(&cancelOnWrite{ResponseRecorder: httptest.NewRecorder(), cancel: cancel}, r)
	if res.Outcome != OutcomeClientGone || res.Usage.Reported {
		t.Fatalf("outcome %s usage %+v", res.Outcome, res.Usage)
	}
	if got, want := tn.obs.settled(), "a prompt estimate 30, a completion estimate 1"; got != want {
		t.Fatalf("settled %q, want %q", got, want)
	}
}

// TestResponsesDoneBeforeCompletedIsACut: a Responses upstream that ends
// with [DONE] and no response.completed did not finish. Before anything
// was generated that fails over; after commit the client gets the
// terminal error event, and not the [DONE] (OpenAI's SDKs stop reading at
// [DONE], so an error event after it would never be raised).
func TestResponsesDoneBeforeCompletedIsACut(t *testing.T) {
	created := "event: response.created\n" + `data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_d","status":"in_progress"}}` + "\n\n"
	delta := "event: response.output_text.delta\n" + `data: {"type":"response.output_text.delta","sequence_number":1,"delta":"Hi"}` + "\n\n"
	doneEv := "data: [DONE]\n\n"
	t.Run("before commit", func(t *testing.T) {
		bad := newUpstream(t, sseUpstream(created, doneEv))
		failOver(t, Config{}, bad, "/v1/responses", responsesBody, transcript(t, "responses_complete.sse"), AttemptTruncated.String())
	})
	t.Run("after commit", func(t *testing.T) {
		up := newUpstream(t, sseUpstream(created, delta, doneEv))
		p, _, _ := newTestProxy(t, Config{}, up)
		w := httptest.NewRecorder()
		res := p.ServeHTTP(w, apiPost("/v1/responses", responsesBody))
		tail := "event: error\n" + `data: {"type":"error","code":"upstream_stream_truncated","message":"upstream stream ended before completion","param":null,"sequence_number":2}` + "\n\n"
		if w.Body.String() != created+delta+tail || res.Outcome != OutcomeTruncated {
			t.Fatalf("outcome %s body\n%s", res.Outcome, w.Body)
		}
	})
}

// TestLadderClampKeepsAMessagesThinkingBudgetBelowMaxTokens: Anthropic
// requires thinking.budget_tokens < max_tokens (and >= 1024). When the
// ladder clamps a Messages request's max_tokens below its thinking
// budget, the budget becomes max_tokens-1 while that stays >= 1024, else
// thinking is removed; otherwise an Anthropic-compatible fallback would
// refuse the gateway's own rewrite with 400. Thinking that already fits,
// or is not "enabled", is left as sent.
func TestLadderClampKeepsAMessagesThinkingBudgetBelowMaxTokens(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		max      int
		want     string
		wantNote string
	}{
		{"budget lowered", `{"model":"big","max_tokens":16000,"thinking":{"type":"enabled","budget_tokens":8000},"messages":[]}`, 4096,
			`{"model":"small","max_tokens":4096,"thinking":{"type":"enabled","budget_tokens":4095},"messages":[]}`,
			"max_tokens=4096; thinking_budget=4095"},
		{"budget equal to the clamp", `{"max_tokens":16000,"thinking":{"budget_tokens":4096,"type":"enabled"}}`, 4096,
			`{"max_tokens":4096,"thinking":{"type":"enabled","budget_tokens":4095},"model":"small"}`,
			"max_tokens=4096; thinking_budget=4095"},
		{"lowest budget kept", `{"max_tokens":16000,"thinking":{"type":"enabled","budget_tokens":2000}}`, 1025,
			`{"max_tokens":1025,"thinking":{"type":"enabled","budget_tokens":1024},"model":"small"}`,
			"max_tokens=1025; thinking_budget=1024"},
		{"too small for thinking: removed", `{"model":"big","max_tokens":16000,"thinking":{"type":"enabled","budget_tokens":8000},"messages":[]}`, 1024,
			`{"model":"small","max_tokens":1024,"messages":[]}`,
			"max_tokens=1024; thinking=off"},
		{"budget already below", `{"max_tokens":16000,"thinking":{"type":"enabled","budget_tokens":2000}}`, 4096,
			`{"max_tokens":4096,"thinking":{"type":"enabled","budget_tokens":2000},"model":"small"}`,
			"max_tokens=4096"},
		{"disabled is left", `{"max_tokens":16000,"thinking":{"type":"disabled"}}`, 100,
			`{"max_tokens":100,"thinking":{"type":"disabled"},"model":"small"}`,
			"max_tokens=100"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, note, err := rewriteParsed([]byte(tc.in), api.Messages, "small", tc.max, true)
			if err != nil {
				t.Fatal(err)
			}
			if string(out) != tc.want || note != tc.wantNote {
				t.Fatalf("got %s (note %q)\nwant %s (note %q)", out, note, tc.want, tc.wantNote)
			}
			if b := gjson.GetBytes(out, "thinking.budget_tokens"); b.Exists() && b.Int() >= int64(tc.max) {
				t.Fatalf("budget_tokens %d with max_tokens %d: %s", b.Int(), tc.max, out)
			}
		})
	}
}

// TestDegradedHeaderNamesTheClampedField: X-LLM-Proxy-Degraded names the
// output-limit field the fallback's server reads, as the client sent it
// (Responses' max_output_tokens, Chat's max_completion_tokens), and says
// how a Messages request's thinking was cut; the fallback's upstream gets
// exactly that body.
func TestDegradedHeaderNamesTheClampedField(t *testing.T) {
	for _, tc := range []struct {
		name, path, body string
		wantBody, header string
	}{
		{"responses", "/v1/responses", `{"model":"big","max_output_tokens":9000,"input":"hi"}`,
			`{"model":"small","max_output_tokens":300,"input":"hi"}`, "fallback=fb; model=small; max_output_tokens=300"},
		{"chat max_completion_tokens", "/v1/chat/completions", `{"model":"big","max_completion_tokens":9000,"messages":[]}`,
			`{"model":"small","max_completion_tokens":300,"messages":[]}`, "fallback=fb; model=small; max_completion_tokens=300"},
		{"chat max_tokens", "/v1/chat/completions", `{"model":"big","max_tokens":9000,"messages":[]}`,
			`{"model":"small","max_tokens":300,"messages":[]}`, "fallback=fb; model=small; max_tokens=300"},
		{"messages thinking off", "/v1/messages", `{"model":"big","max_tokens":9000,"thinking":{"type":"enabled","budget_tokens":4000},"messages":[]}`,
			`{"model":"small","max_tokens":300,"messages":[]}`, "fallback=fb; model=small; max_tokens=300; thinking=off"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			primary := newUpstream(t, failing(503))
			fb := newUpstream(t, failing(400))
			cfg := Config{MaxAttempts: 1, Fallbacks: []Fallback{{Name: "fb", Model: "small", MaxOutputTokens: 300,
				Pool: Pool{Balancer: &listBalancer{addrs: []string{fb.addr()}}}}}}
			p, _, _ := newTestProxy(t, cfg, primary)
			w := httptest.NewRecorder()
			res := p.ServeHTTP(w, apiPost(tc.path, tc.body))
			if fb.calls.Load() != 1 || res.Fallback != "fb" {
				t.Fatalf("fallback calls %d, result fallback %q, status %d", fb.calls.Load(), res.Fallback, w.Code)
			}
			if got := string(fb.bodies[0]); got != tc.wantBody {
				t.Fatalf("fallback got %s, want %s", got, tc.wantBody)
			}
			if got := res.Degraded; got != tc.header {
				t.Fatalf("degraded %q, want %q", got, tc.header)
			}
		})
	}
}

// TestDataOnlyStreamsOfEveryAPI: servers that send data lines only (no
// event: lines) and end a Responses stream with [DONE] after
// response.completed: the stream is a success, the client gets it up to
// its API's end, and a thinking block that starts before an in-band
// overloaded_error has generated nothing, so the request fails over.
func TestDataOnlyStreamsOfEveryAPI(t *testing.T) {
	dataOnly := func(tr string) []string {
		var out []string
		for _, ev := range events(tr) {
			var b strings.Builder
			for _, line := range strings.SplitAfter(ev, "\n") {
				if !strings.HasPrefix(line, "event:") {
					b.WriteString(line)
				}
			}
			out = append(out, b.String())
		}
		return out
	}
	t.Run("responses then [DONE]", func(t *testing.T) {
		evs := dataOnly(transcript(t, "responses_complete.sse"))
		up := newUpstream(t, sseUpstream(append(evs, "data: [DONE]\n\n")...))
		p, _, obs := newTestProxy(t, Config{}, up)
		w := httptest.NewRecorder()
		res := p.ServeHTTP(w, apiPost("/v1/responses", responsesBody))
		if w.Body.String() != strings.Join(evs, "") || res.Outcome != OutcomeSuccess || res.Usage.CompletionTokens != 11 {
			t.Fatalf("outcome %s usage %+v body\n%s", res.Outcome, res.Usage, w.Body)
		}
		obs.waitFor(t, func() bool { return len(obs.attempts) == 1 })
		if a := obs.attempts[0]; a.Outcome != AttemptSuccess {
			t.Fatalf("attempt %s", a.Outcome)
		}
	})
	t.Run("thinking then overloaded fails over", func(t *testing.T) {
		bad := newUpstream(t, sseUpstream(dataOnly(
			`data: {"type":"message_start","message":{"usage":{"input_tokens":4,"output_tokens":0}}}`+"\n\n"+
				`data: {"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"","signature":""}}`+"\n\n"+
				`data: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}`+"\n\n")...))
		failOver(t, Config{}, bad, "/v1/messages", messagesBody, transcript(t, "messages_thinking_max_tokens.sse"), "inband_error_5xx")
	})
}

// TestGatewayErrorsOnCountTokensAreAnthropicShaped: the other paths of a
// Messages route (/v1/messages/count_tokens, which Anthropic's SDKs and
// vLLM answer in Anthropic's error shape) get the gateway's own errors in
// Anthropic's shape too, while keeping no stream semantics ("none").
func TestGatewayErrorsOnCountTokensAreAnthropicShaped(t *testing.T) {
	p, _, _ := newTestProxy(t, Config{})
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, apiPost("/v1/messages/count_tokens", `{"model":"m","messages":[]}`))
	if typ, _ := anthropicError(t, w.Body.String()); w.Code != 503 || typ != "overloaded_error" || res.API != "none" {
		t.Fatalf("code %d api %s body %s", w.Code, res.API, w.Body)
	}
	// Other paths keep OpenAI's shape.
	w = httptest.NewRecorder()
	p.ServeHTTP(w, apiPost("/v1/embeddings", `{"model":"m"}`))
	var e errorBody
	if json.Unmarshal(w.Body.Bytes(), &e) != nil || e.Error.Code != "no_upstream" {
		t.Fatalf("embeddings body %s", w.Body)
	}
}

// TestEndBeforeAnythingGeneratedEndsTheResponse: a Responses stream whose
// response.completed comes before any generated event (an empty answer)
// is whole at that event: the client's response ends there, even when
// the upstream keeps its connection open afterwards, as it does after a
// generated one.
func TestEndBeforeAnythingGeneratedEndsTheResponse(t *testing.T) {
	created := "event: response.created\n" + `data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_e","status":"in_progress"}}` + "\n\n"
	completed := "event: response.completed\n" + `data: {"type":"response.completed","sequence_number":1,"response":{"id":"resp_e","status":"completed","output":[],"usage":{"input_tokens":3,"output_tokens":0}}}` + "\n\n"
	release := make(chan struct{})
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		sseUpstream(created, completed)(w, r)
		select { // holds the connection open
		case <-r.Context().Done():
		case <-release:
		}
	})
	t.Cleanup(func() { close(release) }) // before the upstream closes
	p, _, obs := newTestProxy(t, Config{Clock: clocktest.New(time.Time{})}, up)
	w := httptest.NewRecorder()
	done := make(chan *Result, 1)
	go func() { done <- p.ServeHTTP(w, apiPost("/v1/responses", responsesBody)) }()
	select {
	case res := <-done:
		if w.Body.String() != created+completed || res.Outcome != OutcomeSuccess || res.Usage.PromptTokens != 3 {
			t.Fatalf("outcome %s usage %+v body\n%s", res.Outcome, res.Usage, w.Body)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the response did not end at response.completed")
	}
	obs.waitFor(t, func() bool { return len(obs.attempts) == 1 })
}
