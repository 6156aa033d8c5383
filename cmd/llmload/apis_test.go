package main

import (
	"context"
	"encoding/json"
	"testing"
	"time"
)

func ev(name, data string) string { return "event: " + name + "\ndata: " + data + "\n\n" }

// TestTypedStreamsTakeTTFTAtTheFirstGeneratedEvent: for Responses and
// Messages, the lifecycle events sent at once (response.created,
// message_start, ping) do not count as the first token: TTFT is taken at
// the first delta, 80ms later; the API's end is ok, its error event an
// error_event, a stream without its end truncated.
func TestTypedStreamsTakeTTFTAtTheFirstGeneratedEvent(t *testing.T) {
	const ttft = 80 * time.Millisecond
	cases := []struct {
		api, outcome, finish string
		steps                []step
	}{
		{APIResponses, OutcomeOK, "completed", []step{
			{0, ev("response.created", `{"type":"response.created","sequence_number":0,"response":{"status":"in_progress","error":null}}`)},
			{0, ev("response.in_progress", `{"type":"response.in_progress","sequence_number":1,"response":{"status":"in_progress"}}`)},
			{ttft, ev("response.output_text.delta", `{"type":"response.output_text.delta","sequence_number":2,"delta":"hi"}`)},
			{10 * time.Millisecond, ev("response.output_text.delta", `{"type":"response.output_text.delta","sequence_number":3,"delta":" there"}`)},
			{0, ev("response.completed", `{"type":"response.completed","sequence_number":4,"response":{"status":"completed","error":null,"usage":{"input_tokens":3,"output_tokens":2}}}`)},
		}},
		{APIMessages, OutcomeOK, "end_turn", []step{
			{0, ev("message_start", `{"type":"message_start","message":{"usage":{"input_tokens":3,"output_tokens":1}}}`)},
			{0, ev("ping", `{"type":"ping"}`)},
			{ttft, ev("content_block_start", `{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}`) +
				ev("content_block_delta", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}`)},
			{10 * time.Millisecond, ev("content_block_delta", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" there"}}`)},
			{0, ev("content_block_stop", `{"type":"content_block_stop","index":0}`) +
				ev("message_delta", `{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":2}}`) +
				ev("message_stop", `{"type":"message_stop"}`)},
		}},
		{APIMessages, OutcomeErrorEvent, "", []step{
			{0, ev("message_start", `{"type":"message_start","message":{}}`)},
			{ttft, ev("content_block_delta", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}`)},
			{10 * time.Millisecond, ev("error", `{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}`)},
		}},
		{APIResponses, OutcomeErrorEvent, "", []step{
			{0, ev("response.created", `{"type":"response.created","sequence_number":0,"response":{}}`)},
			{ttft, ev("response.output_text.delta", `{"type":"response.output_text.delta","sequence_number":1,"delta":"hi"}`)},
			{10 * time.Millisecond, ev("error", `{"type":"error","sequence_number":2,"code":"server_error","message":"boom"}`)},
		}},
		{APIResponses, OutcomeTruncated, "", []step{
			{0, ev("response.created", `{"type":"response.created","sequence_number":0,"response":{}}`)},
			{ttft, ev("response.output_text.delta", `{"type":"response.output_text.delta","sequence_number":1,"delta":"hi"}`)},
			{10 * time.Millisecond, ev("response.output_text.delta", `{"type":"response.output_text.delta","sequence_number":2,"delta":"!"}`)},
		}},
	}
	for _, c := range cases {
		t.Run(c.api+"/"+c.outcome, func(t *testing.T) {
			srv := fakeSSE(t, 200, c.steps...)
			q := &Requester{Client: newHTTPClient(1), URL: srv.URL, Body: apiBody(c.api, "m", true, 0, 0), Timeout: 5 * time.Second, API: c.api}
			res := q.Do(context.Background())
			if res.Outcome != c.outcome || res.FinishReason != c.finish {
				t.Fatalf("outcome %q (%s), finish %q; want %q, %q", res.Outcome, res.Detail, res.FinishReason, c.outcome, c.finish)
			}
			if !res.HasTTFT || res.TTFT < ttft || res.TTFT > ttft+60*time.Millisecond {
				t.Errorf("TTFT %v (has %v), want about %v: the first generated event, not the lifecycle events sent at once", res.TTFT, res.HasTTFT, ttft)
			}
			wantGaps := 1 // between the two generated events
			if c.outcome == OutcomeErrorEvent {
				wantGaps = 0 // one generated event, then the error
			}
			if len(res.Gaps) != wantGaps {
				t.Errorf("gaps %v, want %d", res.Gaps, wantGaps)
			}
		})
	}
}

// TestAPIBodyPutsThePromptAndLimitInTheAPIsFields: the same prompt goes
// into messages (Chat, Messages), prompt (Completions) or input
// (Responses), the limit into each API's field, and Messages always has
// the max_tokens it requires.
func TestAPIBodyPutsThePromptAndLimitInTheAPIsFields(t *testing.T) {
	for _, c := range []struct {
		api, promptKey, limitKey string
		limit                    float64
	}{
		{APIChat, "messages", "max_tokens", 40},
		{APICompletions, "prompt", "max_tokens", 40},
		{APIResponses, "input", "max_output_tokens", 40},
		{APIMessages, "messages", "max_tokens", 40},
	} {
		var m map[string]any
		if err := json.Unmarshal(apiBody(c.api, "m", true, 40, 0), &m); err != nil {
			t.Fatal(err)
		}
		if m[c.promptKey] == nil || m[c.limitKey] != c.limit || m["model"] != "m" || m["stream"] != true {
			t.Errorf("%s body %v: want %s and %s %v", c.api, m, c.promptKey, c.limitKey, c.limit)
		}
	}
	var m map[string]any
	json.Unmarshal(apiBody(APIMessages, "m", false, 0, 0), &m)
	if m["max_tokens"] != 1024.0 {
		t.Errorf("messages body without a limit: max_tokens %v, want 1024 (the API requires one)", m["max_tokens"])
	}
	if !validAPI("") || !validAPI(APIMessages) || validAPI("embeddings") {
		t.Errorf("validAPI")
	}
}

// FuzzClassifyEvent: whatever an event carries, classifyEvent does not
// panic, an event named error is always an error, and the API's normal
// end is only ever its end event.
func FuzzClassifyEvent(f *testing.F) {
	f.Add(APIResponses, "response.completed", `{"type":"response.completed","response":{"status":"completed"}}`)
	f.Add(APIResponses, "", `{"type":"response.output_text.delta","delta":"x"}`)
	f.Add(APIResponses, "response.failed", `{"type":"response.failed","response":{"error":{"code":"server_error","message":"m"}}}`)
	f.Add(APIMessages, "message_delta", `{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":3}}`)
	f.Add(APIMessages, "content_block_start", `{"type":"content_block_start","content_block":{"type":"tool_use","id":"t"}}`)
	f.Add(APIMessages, "error", `{"type":"error","error":{"type":"overloaded_error","message":"o"}}`)
	f.Add(APIMessages, "", `{"error":{"message":"chat-shaped"}}`)
	f.Add(APIMessages, "error", `not json`)
	f.Fuzz(func(t *testing.T, api, name, data string) {
		k, _, _ := classifyEvent(api, name, []byte(data))
		if name == "error" && k != eventError {
			t.Errorf("event error classed %v", k)
		}
		if k == eventEnd && name != "" && name != "response.completed" && name != "response.incomplete" && name != "message_stop" {
			t.Errorf("event %q classed as the end", name)
		}
	})
}
