package proxy

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
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
