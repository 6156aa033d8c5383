package proxy

import (
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
			good := transcript(t, tc.good)
			second := newUpstream(t, sseUpstream(events(good)...))
			p, _, obs := newTestProxy(t, Config{}, bad, second)
			w := httptest.NewRecorder()
			res := p.ServeHTTP(w, apiPost(tc.path, tc.body))
			if w.Code != 200 || w.Body.String() != good || res.Outcome != OutcomeSuccess || res.Upstream != second.addr() {
				t.Fatalf("code %d outcome %s upstream %s body\n%s", w.Code, res.Outcome, res.Upstream, w.Body)
			}
			if n := strings.Count(w.Body.String(), tc.beginning); n != 1 {
				t.Fatalf("the client saw %d beginnings (%s), want 1", n, tc.beginning)
			}
			obs.waitFor(t, func() bool { return len(obs.attempts) == 2 })
			if got := strings.Join(obs.outcomes(), " "); got != bad.addr()+"=inband_error_5xx "+second.addr()+"=success" {
				t.Fatalf("attempts: %s", got)
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
