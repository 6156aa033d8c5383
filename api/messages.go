package api

import (
	"github.com/llmproxy/caddy-llm-proxy/internal/jsonscan"
	"github.com/llmproxy/caddy-llm-proxy/sse"
	"slices"
)

// messagesAPI is Anthropic Messages (/v1/messages), as Anthropic, vLLM and
// SGLang stream it: every event named after its "type".
//
//	lifecycle  SSE comments and ping, anywhere in the stream (after
//	           commit they are relayed and count nothing generated);
//	           message_start and content_block_start of a text or
//	           thinking block that is still empty, before commit
//	generated  content_block_delta (text, thinking, input_json, citations,
//	           signature); content_block_start of a tool_use block (or of
//	           any other kind, or with text); content_block_stop;
//	           message_delta; anything unknown
//	end        message_stop; finished only after a message_delta with a
//	           stop_reason. A [DONE] ends the stream without finishing it
//	error      event error {"type":"error","error":{"type","message"}}:
//	           overloaded_error and api_error (and unknown types, such as
//	           vLLM's internal_error) are 5xx-like; invalid_request_error
//	           400, authentication_error 401, permission_error 403,
//	           not_found_error 404, request_too_large 413,
//	           rate_limit_error 429
//	usage      message_start's message.usage (input_tokens plus the cache
//	           tokens), then every message_delta's usage: output_tokens
//	           is cumulative, so the last one counts, never the sum. The
//	           usage is Reported only once a message_delta carried it:
//	           message_start's output_tokens (0 or 1) is not the answer's,
//	           so a stream cut before its message_delta is settled with
//	           an estimate (Usage keeps message_start's prompt count)
type messagesAPI struct{}

func (messagesAPI) Name() string { return "messages" }

func (messagesAPI) ParseRequest(body []byte) (Request, error) {
	return parseRequest(body, famMessages, new(Layout))
}

func (messagesAPI) family() int { return famMessages }

func (messagesAPI) OutputLimitFields() []string { return slices.Clone(maxTokensLimit) }

func (messagesAPI) InjectsUsage() bool { return false }

func (messagesAPI) Inspect(st *Stream, ev sse.Event) Class {
	if !ev.HasData {
		return Lifecycle
	}
	st.Events++
	switch typ := eventType(ev.Name, ev.Data); typ {
	case "content_block_delta":
		// The hot path: one delta per token.
	case "ping":
		// A keep-alive, before or after commit: relayed, but never a
		// token of the estimate when the stream reports no usage.
		return Lifecycle
	case "message_start":
		messagesUsage(st, field(ev.Data, "message", "usage"), false)
		if !st.Generated {
			return Lifecycle
		}
	case "content_block_start":
		if !st.Generated {
			b := field(ev.Data, "content_block")
			switch view(field(b, "type")) {
			case "text":
				if view(field(b, "text")) == "" {
					return Lifecycle
				}
			case "thinking":
				if view(field(b, "thinking")) == "" {
					return Lifecycle
				}
			}
		}
	case "message_delta":
		u := field(ev.Data, "usage")
		messagesUsage(st, u, true)
		// message_start counted the prompt, not the answer: usage is
		// reported once a message_delta carries it.
		st.Usage.Reported = st.Usage.Reported || isObject(u)
		if r := field(ev.Data, "delta", "stop_reason"); r != nil && string(r) != "null" {
			st.stopReason = true
		}
	case "message_stop":
		st.Finished = st.stopReason
		return End
	case "error":
		st.Err = messagesError(ev.Data)
		return ErrorEvent
	default:
		switch ev.Kind() {
		case sse.KindError:
			st.Err = chatError(ev.Data)
			return ErrorEvent
		case sse.KindDone:
			// A server that ends every stream with [DONE]: it ends this
			// one without finishing it (message_stop is the end).
			return End
		}
	}
	st.Generated = true
	return Generated
}

// messagesUsage records the usage object u, if it is one. A message_delta
// (delta) updates only the counts it carries as numbers (absent or null
// keeps the last one, as the Anthropic SDK's accumulator does): the input,
// cache creation and cache read counts of message_start stay unless it
// repeats them, and its output_tokens replaces the last (cumulative).
func messagesUsage(st *Stream, u []byte, delta bool) {
	if !isObject(u) {
		return
	}
	for i, key := range [...]string{"input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"} {
		if n, ok := countOf(u, key); ok || !delta {
			st.msgInput[i] = n
		}
	}
	st.Usage.PromptTokens = st.msgInput[0] + st.msgInput[1] + st.msgInput[2]
	if out, ok := countOf(u, "output_tokens"); ok || !delta {
		st.Usage.CompletionTokens = out
	}
}

// messagesError parses an Anthropic error event's data.
func messagesError(data []byte) InbandError {
	e := field(data, "error")
	typ, msg := jsonText(field(e, "type")), jsonText(field(e, "message"))
	if !isObject(e) {
		typ, msg = "api_error", "upstream sent an error event"
	}
	return InbandError{Message: msg, Type: typ, Status: AnthropicErrorStatus(typ)}
}

// AnthropicErrorStatus maps an Anthropic error type to the HTTP status
// Anthropic documents for it (docs.anthropic.com/en/api/errors):
// invalid_request_error 400, authentication_error 401, permission_error
// 403, not_found_error 404, request_too_large 413, rate_limit_error 429,
// api_error 500, overloaded_error 529; any other type 500.
func AnthropicErrorStatus(typ string) int {
	switch typ {
	case "invalid_request_error":
		return 400
	case "authentication_error":
		return 401
	case "permission_error":
		return 403
	case "not_found_error":
		return 404
	case "request_too_large":
		return 413
	case "rate_limit_error":
		return 429
	case "overloaded_error":
		return 529
	}
	return 500
}

// AnthropicErrorType is the Anthropic error type of a gateway error with
// HTTP status: overloaded_error for 503 and 529, rate_limit_error for 429,
// authentication_error for 401, permission_error for 403,
// not_found_error for 404, invalid_request_error for 400, 408, 413 and
// 422, api_error otherwise.
func AnthropicErrorType(status int) string {
	switch status {
	case 503, 529:
		return "overloaded_error"
	case 429:
		return "rate_limit_error"
	case 401:
		return "authentication_error"
	case 403:
		return "permission_error"
	case 404:
		return "not_found_error"
	case 400, 408, 413,
		422:
		return "invalid_request_error"
	}
	return "api_error"
}

func (messagesAPI) InspectBody(body []byte) Usage {
	var st Stream
	u := field(body, "usage")
	messagesUsage(&st, u, false)
	st.Usage.Reported = isObject(u)
	return st.Usage
}

// AppendStreamError appends
//
//	event: error
//	data: {"type":"error","error":{"type":…,"message":…}}
//
// with the type AnthropicErrorType gives e.Status (api_error for a cut
// stream, overloaded_error for 503).
func (messagesAPI) AppendStreamError(dst []byte, _ *Stream, e Error) []byte {
	dst = append(dst, "event: error\ndata: "...)
	dst = appendAnthropicError(dst, e)
	return append(dst, "\n\n"...)
}

// AppendErrorBody appends {"type":"error","error":{"type":…,"message":…}}.
func (messagesAPI) AppendErrorBody(dst []byte, e Error) []byte { return appendAnthropicError(dst, e) }

func appendAnthropicError(dst []byte, e Error) []byte {
	dst = append(dst, `{"type":"error","error":{"type":`...)
	dst = jsonscan.AppendString(dst, AnthropicErrorType(e.Status))
	dst = append(dst, `,"message":`...)
	dst = jsonscan.AppendString(dst, e.Message)
	return append(dst, "}}"...)
}
