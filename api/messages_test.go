package api_test

import (
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/api"
)

// TestMessageDeltaUsageUpdatesOnlyTheFieldsItCarries: a message_delta
// that repeats input_tokens but not the cache counts keeps message_start's
// cache tokens, as the Anthropic SDK's accumulator does
// (src/anthropic/lib/streaming/_messages.py: each field of
// MessageDeltaUsage is updated only when present and not null).
func TestMessageDeltaUsageUpdatesOnlyTheFieldsItCarries(t *testing.T) {
	tr := `event: message_start
data: {"type":"message_start","message":{"usage":{"input_tokens":100,"cache_creation_input_tokens":30,"cache_read_input_tokens":20,"output_tokens":1}}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a"}}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"input_tokens":100,"cache_read_input_tokens":null,"output_tokens":12}}

event: message_stop
data: {"type":"message_stop"}

`
	_, st := replay(t, api.Messages, tr)
	want := api.Usage{PromptTokens: 150, CompletionTokens: 12, Reported: true}
	if st.Usage != want {
		t.Fatalf("usage %+v, want %+v", st.Usage, want)
	}
}

// TestMessageStartAloneIsNotTheStreamsUsage: message_start's usage counts
// the prompt but not the output (output_tokens 0 or 1): a stream that
// ends before its message_delta (cut, or the client gone) has not
// reported what it generated, so its usage is not Reported and the
// tenant is settled with an estimate of the events relayed. The prompt
// count message_start gave is kept.
func TestMessageStartAloneIsNotTheStreamsUsage(t *testing.T) {
	tr := `event: message_start
data: {"type":"message_start","message":{"usage":{"input_tokens":100,"cache_read_input_tokens":20,"output_tokens":1}}}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a"}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"b"}}

`
	_, st := replay(t, api.Messages, tr)
	if st.Usage.Reported || st.Usage.PromptTokens != 120 || st.Finished {
		t.Fatalf("usage %+v finished %v: want the prompt count of message_start, not Reported", st.Usage, st.Finished)
	}
}
