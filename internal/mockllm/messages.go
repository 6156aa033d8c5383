package mockllm

import (
	"cmp"
	"encoding/json"
	"io"
	"net/http"
)

// messagesDialect is Anthropic's Messages API (POST /v1/messages) as
// Anthropic's reference documents it and vLLM and SGLang serve it. A
// stream is named SSE events ("event: <type>", data with the same
// "type"):
//
//	message_start        at once: message with empty content, usage
//	                     {input_tokens, cache_creation_input_tokens,
//	                     cache_read_input_tokens, output_tokens: 1}
//	ping                 at once
//	content_block_start  with the first token: index 0, {"type":"text","text":""}
//	content_block_delta  one per token: {"type":"text_delta","text":…}
//	message_delta        after half the tokens (two or more): stop_reason
//	                     null, usage.output_tokens so far
//	content_block_stop
//	message_delta        stop_reason "end_turn" (or "max_tokens"), usage
//	                     with the whole output_tokens
//	message_stop
//
// usage.output_tokens of message_delta is cumulative, and it comes more
// than once, as real servers may send it: a reader must keep the last
// value, never add them up. The in-band error is event: error
// {"type":"error","error":{"type":…,"message":…}}; HTTP errors carry the
// same body. Messages events without an "event:" line are skipped by
// Anthropic's SDKs, so every event has one.
type messagesDialect struct{}

// anthropicUsage is the Messages API's usage object.
type anthropicUsage struct {
	InputTokens              *int `json:"input_tokens,omitempty"`
	CacheCreationInputTokens *int `json:"cache_creation_input_tokens,omitempty"`
	CacheReadInputTokens     *int `json:"cache_read_input_tokens,omitempty"`
	OutputTokens             int  `json:"output_tokens"`
}

// anthropicMessage is the Message object.
type anthropicMessage struct {
	ID           string           `json:"id"`
	Type         string           `json:"type"`
	Role         string           `json:"role"`
	Model        string           `json:"model"`
	Content      []anthropicBlock `json:"content"`
	StopReason   *string          `json:"stop_reason"`
	StopSequence *string          `json:"stop_sequence"`
	Usage        anthropicUsage   `json:"usage"`
}

// anthropicBlock is a text content block, or a text_delta.
type anthropicBlock struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

// messageDelta is the delta of a message_delta event.
type messageDelta struct {
	StopReason   *string `json:"stop_reason"`
	StopSequence *string `json:"stop_sequence"`
}

// messagesEvent is one streamed event; the fields a type does not use
// are left out.
type messagesEvent struct {
	Type         string            `json:"type"`
	Message      *anthropicMessage `json:"message,omitempty"`
	Index        *int              `json:"index,omitempty"`
	ContentBlock *anthropicBlock   `json:"content_block,omitempty"`
	Delta        any               `json:"delta,omitempty"`
	Usage        *anthropicUsage   `json:"usage,omitempty"`
	Error        *anthropicError   `json:"error,omitempty"`
}

// anthropicError is the error object of Anthropic's error bodies and
// error events.
type anthropicError struct {
	Type    string `json:"type"`
	Message string `json:"message"`
}

func (messagesDialect) idPrefix() string { return "msg_" }

// prompt is the system prompt (a string or blocks) and the messages.
func (messagesDialect) prompt(cr *completionRequest) []byte { return joinRaw(cr.System, cr.Messages) }

func (messagesDialect) maxTokens(cr *completionRequest) int { return positive(cr.MaxTokens) }

// usage is the usage of the whole message; input is false in the
// mid-stream message_delta, which carries output_tokens only.
func (messagesDialect) usage(x *exchange, output int, input bool) *anthropicUsage {
	u := &anthropicUsage{OutputTokens: output}
	if input {
		u.InputTokens, u.CacheCreationInputTokens, u.CacheReadInputTokens = ptr(x.promptN), ptr(0), ptr(0)
	}
	return u
}

// stopReason is the API's stop_reason for the plan's finish.
func stopReason(x *exchange) *string {
	if x.p.finish == "length" {
		return ptr("max_tokens")
	}
	return ptr("end_turn")
}

func (messagesDialect) send(x *exchange, ev messagesEvent) error {
	return x.namedEvent(ev.Type, marshal(ev))
}

func (d messagesDialect) lifecycle(x *exchange) error {
	x.sendHeaders()
	m := &anthropicMessage{ID: x.rec.ID, Type: "message", Role: "assistant", Model: x.p.model,
		Content: []anthropicBlock{}, Usage: *d.usage(x, 1, true)}
	if err := d.send(x, messagesEvent{Type: "message_start", Message: m}); err != nil {
		return err
	}
	return d.send(x, messagesEvent{Type: "ping"})
}

func (d messagesDialect) open(x *exchange) error {
	return d.send(x, messagesEvent{Type: "content_block_start", Index: ptr(0), ContentBlock: &anthropicBlock{Type: "text"}})
}

// delta sends content_block_delta, and after half the tokens a
// message_delta with the output tokens so far.
func (d messagesDialect) delta(x *exchange, i, n int, text string) error {
	if n == 0 {
		return nil
	}
	if err := d.send(x, messagesEvent{Type: "content_block_delta", Index: ptr(0), Delta: anthropicBlock{Type: "text_delta", Text: text}}); err != nil {
		return err
	}
	if n >= 2 && i+1 == n/2 {
		return d.send(x, messagesEvent{Type: "message_delta", Delta: messageDelta{}, Usage: d.usage(x, i+1, false)})
	}
	return nil
}

func (d messagesDialect) close(x *exchange) error {
	for _, ev := range []messagesEvent{
		{Type: "content_block_stop", Index: ptr(0)},
		{Type: "message_delta", Delta: messageDelta{StopReason: stopReason(x)}, Usage: d.usage(x, x.p.tokens, true)},
		{Type: "message_stop"},
	} {
		if err := d.send(x, ev); err != nil {
			return err
		}
		if ev.Type == "message_delta" {
			x.recordUsage(x.usage())
		}
	}
	return nil
}

func (d messagesDialect) errorEvent(x *exchange, code int) error {
	return d.send(x, messagesEvent{Type: "error", Error: &anthropicError{Type: cmp.Or(x.p.fault.ErrorType, anthropicErrorType(code)), Message: faultMessage(code)}})
}

// anthropicErrorType is Anthropic's error type for an HTTP status, from
// its API reference's error list (503 is read as overloaded, like 529).
func anthropicErrorType(status int) string {
	switch status {
	case http.StatusBadRequest:
		return "invalid_request_error"
	case http.StatusUnauthorized:
		return "authentication_error"
	case http.StatusPaymentRequired:
		return "billing_error"
	case http.StatusForbidden:
		return "permission_error"
	case http.StatusNotFound:
		return "not_found_error"
	case http.StatusRequestEntityTooLarge:
		return "request_too_large"
	case http.StatusTooManyRequests:
		return "rate_limit_error"
	case http.StatusGatewayTimeout:
		return "timeout_error"
	case http.StatusServiceUnavailable, 529:
		return "overloaded_error"
	}
	if status >= 500 {
		return "api_error"
	}
	return "invalid_request_error"
}

func (messagesDialect) errorBody(status int, msg string) []byte {
	return marshal(messagesEvent{Type: "error", Error: &anthropicError{Type: anthropicErrorType(status), Message: msg}})
}

func (d messagesDialect) full(x *exchange, text string) []byte {
	return marshal(anthropicMessage{ID: x.rec.ID, Type: "message", Role: "assistant", Model: x.p.model,
		Content: []anthropicBlock{{Type: "text", Text: text}}, StopReason: stopReason(x), Usage: *d.usage(x, x.p.tokens, true)})
}

// serveCountTokens answers POST /v1/messages/count_tokens as Anthropic
// and vLLM do: {"input_tokens": N}, N counted as usage's input_tokens
// would be. It is not a completion: no scheduling, no faults, no
// statistics.
func (r *Replica) serveCountTokens(w http.ResponseWriter, req *http.Request) {
	var d messagesDialect
	body, err := io.ReadAll(io.LimitReader(req.Body, maxRequestBody))
	var cr completionRequest
	if err == nil {
		err = json.Unmarshal(body, &cr)
	}
	w.Header().Set("Content-Type", "application/json")
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		w.Write(d.errorBody(http.StatusBadRequest, "Invalid JSON request body"))
		return
	}
	w.Write(marshal(struct {
		InputTokens int `json:"input_tokens"`
	}{promptTokens(d.prompt(&cr))}))
}
