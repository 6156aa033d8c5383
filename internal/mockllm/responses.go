package mockllm

import (
	"encoding/json"
	"net/http"
)

// responsesDialect is OpenAI's Responses API (POST /v1/responses) as
// vLLM serves it. A stream is named SSE events ("event: <type>" and a
// data object whose "type" repeats it), each with a sequence_number from
// 0:
//
//	response.created, response.in_progress        at once (lifecycle)
//	response.output_item.added                    with the first token
//	response.content_part.added
//	response.output_text.delta                    one per token
//	response.output_text.done
//	response.content_part.done
//	response.output_item.done
//	response.completed                            status "completed", usage
//
// A request whose max_output_tokens is below the tokens to generate ends
// with response.incomplete (status "incomplete", incomplete_details
// {"reason":"max_output_tokens"}) instead. The in-band error is
// event: error {"type":"error","code","message","param","sequence_number"}
// or, with Fault.ResponseFailed, response.failed (status "failed",
// error {"code","message"}). The non-streaming body is the Response
// object of response.completed; HTTP errors have vLLM's OpenAI shape.
// Shapes follow OpenAI's API reference and the openai SDKs' types.
type responsesDialect struct{}

// responseObject is the Response object (the fields vLLM writes).
type responseObject struct {
	ID                 string             `json:"id"`
	Object             string             `json:"object"`
	CreatedAt          int64              `json:"created_at"`
	Status             string             `json:"status"`
	Background         bool               `json:"background"`
	Error              *responseError     `json:"error"`
	IncompleteDetails  *incompleteDetails `json:"incomplete_details"`
	Instructions       json.RawMessage    `json:"instructions"`
	MaxOutputTokens    *int               `json:"max_output_tokens"`
	Model              string             `json:"model"`
	Output             []outputMessage    `json:"output"`
	ParallelToolCalls  bool               `json:"parallel_tool_calls"`
	PreviousResponseID *string            `json:"previous_response_id"`
	Temperature        float64            `json:"temperature"`
	Text               responseText       `json:"text"`
	ToolChoice         string             `json:"tool_choice"`
	Tools              []any              `json:"tools"`
	TopP               float64            `json:"top_p"`
	Truncation         string             `json:"truncation"`
	Usage              *responseUsage     `json:"usage"`
	Metadata           map[string]string  `json:"metadata"`
}

type responseError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

type incompleteDetails struct {
	Reason string `json:"reason"`
}

type responseText struct {
	Format struct {
		Type string `json:"type"`
	} `json:"format"`
}

// outputMessage is a "message" output item.
type outputMessage struct {
	ID      string       `json:"id"`
	Type    string       `json:"type"`
	Status  string       `json:"status"`
	Role    string       `json:"role"`
	Content []outputText `json:"content"`
}

// outputText is an "output_text" content part.
type outputText struct {
	Type        string `json:"type"`
	Text        string `json:"text"`
	Annotations []any  `json:"annotations"`
	Logprobs    []any  `json:"logprobs,omitempty"`
}

// responseUsage is the Responses API's usage object.
type responseUsage struct {
	InputTokens        int `json:"input_tokens"`
	InputTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"input_tokens_details"`
	OutputTokens        int `json:"output_tokens"`
	OutputTokensDetails struct {
		ReasoningTokens int `json:"reasoning_tokens"`
	} `json:"output_tokens_details"`
	TotalTokens int `json:"total_tokens"`
}

// responseEvent is one streamed event; the fields a type does not use
// are left out.
type responseEvent struct {
	Type           string          `json:"type"`
	SequenceNumber int             `json:"sequence_number"`
	Response       *responseObject `json:"response,omitempty"`
	OutputIndex    *int            `json:"output_index,omitempty"`
	ContentIndex   *int            `json:"content_index,omitempty"`
	ItemID         string          `json:"item_id,omitempty"`
	Item           *outputMessage  `json:"item,omitempty"`
	Part           *outputText     `json:"part,omitempty"`
	Delta          *string         `json:"delta,omitempty"`
	Text           *string         `json:"text,omitempty"`
	Logprobs       *[]any          `json:"logprobs,omitempty"` // [] on text deltas and done
	// The error event's fields.
	Code    *string `json:"code,omitempty"`
	Message *string `json:"message,omitempty"`
	Param   *string `json:"param,omitempty"`
}

func (responsesDialect) idPrefix() string { return "resp_" }

// prompt is the instructions and the input (a string or items).
func (responsesDialect) prompt(cr *completionRequest) []byte {
	return joinRaw(cr.Instructions, cr.Input)
}

func (responsesDialect) maxTokens(cr *completionRequest) int { return positive(cr.MaxOutputTokens) }

// object is the Response object in a given status.
func (responsesDialect) object(x *exchange, status string) *responseObject {
	o := &responseObject{
		ID: x.rec.ID, Object: "response", CreatedAt: x.created, Status: status,
		Instructions: x.cr.Instructions, Model: x.p.model, Output: []outputMessage{},
		ParallelToolCalls: true, Temperature: 1, ToolChoice: "auto", Tools: []any{}, TopP: 1,
		Truncation: "disabled", Metadata: map[string]string{},
	}
	if m := positive(x.cr.MaxOutputTokens); m > 0 {
		o.MaxOutputTokens = &m
	}
	o.Text.Format.Type = "text"
	return o
}

// itemID is the id of the response's one message item.
func (responsesDialect) itemID(x *exchange) string { return "msg_" + x.rec.ID }

// item is the message item holding text, in status.
func (d responsesDialect) item(x *exchange, status string, content ...outputText) *outputMessage {
	if content == nil {
		content = []outputText{}
	}
	return &outputMessage{ID: d.itemID(x), Type: "message", Status: status, Role: "assistant", Content: content}
}

// send writes ev as a named event with the next sequence_number.
func (responsesDialect) send(x *exchange, ev responseEvent) error {
	ev.SequenceNumber = x.eventN
	return x.namedEvent(ev.Type, marshal(ev))
}

func (d responsesDialect) lifecycle(x *exchange) error {
	x.sendHeaders()
	if err := d.send(x, responseEvent{Type: "response.created", Response: d.object(x, "in_progress")}); err != nil {
		return err
	}
	return d.send(x, responseEvent{Type: "response.in_progress", Response: d.object(x, "in_progress")})
}

func (d responsesDialect) open(x *exchange) error {
	if err := d.send(x, responseEvent{Type: "response.output_item.added", OutputIndex: ptr(0), Item: d.item(x, "in_progress")}); err != nil {
		return err
	}
	return d.send(x, responseEvent{Type: "response.content_part.added", ItemID: d.itemID(x), OutputIndex: ptr(0), ContentIndex: ptr(0),
		Part: &outputText{Type: "output_text", Text: "", Annotations: []any{}}})
}

// delta sends response.output_text.delta; an empty completion has none.
func (d responsesDialect) delta(x *exchange, _, n int, text string) error {
	if n == 0 {
		return nil
	}
	return d.send(x, responseEvent{Type: "response.output_text.delta", ItemID: d.itemID(x), OutputIndex: ptr(0), ContentIndex: ptr(0),
		Delta: &text, Logprobs: &[]any{}})
}

// final is the Response of a finished request: completed, or incomplete
// when max_output_tokens cut it.
func (d responsesDialect) final(x *exchange, text string) *responseObject {
	status := "completed"
	if x.p.finish == "length" {
		status = "incomplete"
	}
	o := d.object(x, status)
	if status == "incomplete" {
		o.IncompleteDetails = &incompleteDetails{Reason: "max_output_tokens"}
	}
	o.Output = []outputMessage{*d.item(x, status, outputText{Type: "output_text", Text: text, Annotations: []any{}})}
	u := x.usage()
	o.Usage = &responseUsage{InputTokens: u.PromptTokens, OutputTokens: u.CompletionTokens, TotalTokens: u.TotalTokens}
	return o
}

func (d responsesDialect) close(x *exchange) error {
	text := completionText(x.seed, x.p.tokens, x.p.tokenBytes)
	part := outputText{Type: "output_text", Text: text, Annotations: []any{}}
	o := d.final(x, text)
	for _, ev := range []responseEvent{
		{Type: "response.output_text.done", ItemID: d.itemID(x), OutputIndex: ptr(0), ContentIndex: ptr(0), Text: &text, Logprobs: &[]any{}},
		{Type: "response.content_part.done", ItemID: d.itemID(x), OutputIndex: ptr(0), ContentIndex: ptr(0), Part: &part},
		{Type: "response.output_item.done", OutputIndex: ptr(0), Item: &o.Output[0]},
		{Type: "response." + o.Status, Response: o},
	} {
		if err := d.send(x, ev); err != nil {
			return err
		}
	}
	x.recordUsage(x.usage())
	return nil
}

// errorEvent sends event: error, or response.failed when the fault asks.
func (d responsesDialect) errorEvent(x *exchange, code int) error {
	c, msg := responsesErrorCode(code, x.p.fault.ErrorType), faultMessage(code)
	if x.p.fault.ResponseFailed {
		o := d.object(x, "failed")
		o.Error = &responseError{Code: c, Message: msg}
		return d.send(x, responseEvent{Type: "response.failed", Response: o})
	}
	return d.send(x, responseEvent{Type: "error", Code: &c, Message: &msg})
}

// responsesErrorCode is the error code of an in-band error with an
// HTTP-like code, unless typ names one.
func responsesErrorCode(code int, typ string) string {
	switch {
	case typ != "":
		return typ
	case code == http.StatusTooManyRequests:
		return "rate_limit_exceeded"
	case code >= 500:
		return "server_error"
	}
	return "invalid_prompt"
}

func (responsesDialect) errorBody(status int, msg string) []byte {
	return marshal(errorBody{Error: apiError{Message: msg, Type: errorType(status), Code: status}})
}

func (d responsesDialect) full(x *exchange, text string) []byte { return marshal(d.final(x, text)) }
