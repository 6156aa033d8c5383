package proxy

import (
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
