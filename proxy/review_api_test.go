package proxy

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/tidwall/gjson"

	"github.com/llmproxy/caddy-llm-proxy/api"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

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
	good := transcript(t, "messages_complete.sse")
	second := newUpstream(t, sseUpstream(events(good)...))
	p, _, obs := newTestProxy(t, Config{}, bad, second)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, apiPost("/v1/messages", messagesBody))
	if w.Body.String() != good || res.Outcome != OutcomeSuccess || res.Upstream != second.addr() {
		t.Fatalf("outcome %s upstream %s body\n%s", res.Outcome, res.Upstream, w.Body)
	}
	obs.waitFor(t, func() bool { return len(obs.attempts) == 2 })
	if got := strings.Join(obs.outcomes(), " "); got != bad.addr()+"=truncated "+second.addr()+"=success" {
		t.Fatalf("attempts: %s", got)
	}
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
		good := transcript(t, "messages_complete.sse")
		second := newUpstream(t, sseUpstream(events(good)...))
		p, _, obs := newTestProxy(t, Config{MaxAttempts: 2}, bad, second)
		w := httptest.NewRecorder()
		res := p.ServeHTTP(w, apiPost("/v1/messages", messagesBody))
		if w.Code != 200 || w.Body.String() != good || res.Outcome != OutcomeSuccess {
			t.Fatalf("code %d outcome %s body %s", w.Code, res.Outcome, w.Body)
		}
		obs.waitFor(t, func() bool { return len(obs.attempts) == 2 })
		if a := obs.attempts[0]; a.Outcome != AttemptHTTP5xx || !a.Outcome.UpstreamFault() || a.Status != 529 {
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
		good := transcript(t, "responses_complete.sse")
		second := newUpstream(t, sseUpstream(events(good)...))
		p, _, obs := newTestProxy(t, Config{}, bad, second)
		w := httptest.NewRecorder()
		res := p.ServeHTTP(w, apiPost("/v1/responses", responsesBody))
		if w.Body.String() != good || res.Upstream != second.addr() || res.Outcome != OutcomeSuccess {
			t.Fatalf("outcome %s upstream %s body\n%s", res.Outcome, res.Upstream, w.Body)
		}
		obs.waitFor(t, func() bool { return len(obs.attempts) == 2 })
		if a := obs.attempts[0]; a.Outcome != AttemptTruncated {
			t.Fatalf("first attempt %s", a.Outcome)
		}
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
		good := transcript(t, "messages_thinking_max_tokens.sse")
		second := newUpstream(t, sseUpstream(events(good)...))
		p, _, obs := newTestProxy(t, Config{}, bad, second)
		w := httptest.NewRecorder()
		res := p.ServeHTTP(w, apiPost("/v1/messages", messagesBody))
		if w.Body.String() != good || res.Outcome != OutcomeSuccess || res.Upstream != second.addr() {
			t.Fatalf("outcome %s upstream %s body\n%s", res.Outcome, res.Upstream, w.Body)
		}
		obs.waitFor(t, func() bool { return len(obs.attempts) == 2 })
		if got := strings.Join(obs.outcomes(), " "); got != bad.addr()+"=inband_error_5xx "+second.addr()+"=success" {
			t.Fatalf("attempts: %s", got)
		}
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
