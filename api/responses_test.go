package api_test

import (
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/api"
)

// vllmReasoning, written from vLLM's
// vllm/entrypoints/openai/responses/streaming_events.py
// (emit_reasoning_delta_events), is how vLLM streams a reasoning model's answer on
// /v1/responses: the reasoning item and its empty reasoning_text part are
// announced (response.reasoning_part.added, vLLM's own event) before the
// first reasoning delta.
const vllmReasoning = `event: response.created
data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_r","status":"in_progress","output":[]}}

event: response.in_progress
data: {"type":"response.in_progress","sequence_number":1,"response":{"id":"resp_r","status":"in_progress","output":[]}}

event: response.output_item.added
data: {"type":"response.output_item.added","sequence_number":2,"output_index":0,"item":{"id":"msg_1","type":"reasoning","summary":[],"status":"in_progress"}}

event: response.reasoning_part.added
data: {"type":"response.reasoning_part.added","sequence_number":3,"output_index":0,"item_id":"msg_1","content_index":0,"part":{"text":"","type":"reasoning_text"}}

event: response.reasoning_text.delta
data: {"type":"response.reasoning_text.delta","sequence_number":4,"item_id":"msg_1","output_index":0,"content_index":0,"delta":"Let"}

`

// TestVLLMReasoningPartIsLifecycle: vLLM's response.reasoning_part.added
// carries an empty part, nothing generated: it is held like
// response.content_part.added, and the first reasoning delta commits.
func TestVLLMReasoningPartIsLifecycle(t *testing.T) {
	classes, _ := replay(t, api.Responses, vllmReasoning)
	if want := []api.Class{L, L, L, L, G}; !equalClasses(classes, want) {
		t.Fatalf("classes = %v, want %v", classes, want)
	}
}

// TestResponseFailedCodesAreClassed: every code OpenAI documents for a
// Responses error (openai-node's ResponseError.code) gets the class of
// what it means: server_error and vector_store_timeout are the server's
// (5xx-like: failed over, an upstream failure), rate_limit_exceeded is a
// 429, and the rest describe the request (its prompt, its images, a
// policy): 4xx-like, the tenant's fault, never retried on another
// upstream nor counted against a healthy one.
func TestResponseFailedCodesAreClassed(t *testing.T) {
	for code, want := range map[string]int{
		"server_error": 500, "vector_store_timeout": 500, "rate_limit_exceeded": 429,
		"invalid_prompt": 400, "data_residency_mismatch": 400, "bio_policy": 400,
		"invalid_image": 400, "invalid_image_format": 400, "invalid_base64_image": 400,
		"invalid_image_url": 400, "image_too_large": 400, "image_too_small": 400,
		"image_parse_error": 400, "image_content_policy_violation": 400, "invalid_image_mode": 400,
		"image_file_too_large": 400, "unsupported_image_media_type": 400, "empty_image_file": 400,
		"failed_to_download_image": 400, "image_file_not_found": 400,
	} {
		tr := "event: response.failed\n" + `data: {"type":"response.failed","sequence_number":1,"response":{"status":"failed","error":{"code":"` + code + `","message":"m"}}}` + "\n\n"
		classes, st := replay(t, api.Responses, tr)
		if len(classes) != 1 || classes[0] != X || st.Err.Status != want {
			t.Errorf("%s: classes %v status %d, want %d", code, classes, st.Err.Status, want)
		}
	}
}
