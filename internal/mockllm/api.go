package mockllm

import (
	"encoding/json"
	"net/http"
)

// API names one of the four HTTP APIs a replica speaks. Its string form
// is what RequestRecord.API and the cmd/llmload -api flag use.
type API string

// The APIs, each served on its vLLM path.
const (
	// APIChat is OpenAI Chat Completions, POST /v1/chat/completions.
	APIChat API = "chat"
	// APICompletions is OpenAI's legacy Completions, POST /v1/completions.
	APICompletions API = "completions"
	// APIResponses is OpenAI's Responses API, POST /v1/responses (served
	// by vLLM since 0.10).
	APIResponses API = "responses"
	// APIMessages is Anthropic's Messages API, POST /v1/messages (served
	// by vLLM and SGLang for open models).
	APIMessages API = "messages"
)

// Path is the request path of the API on a vLLM server, e.g.
// "/v1/responses".
func (a API) Path() string {
	switch a {
	case APICompletions:
		return "/v1/completions"
	case APIResponses:
		return "/v1/responses"
	case APIMessages:
		return "/v1/messages"
	}
	return "/v1/chat/completions"
}

// dialect is what differs between the four APIs: ids, the request's
// prompt and output limit, the events of a stream, the non-streaming body
// and the error shapes. chatDialect (chat and completions, completion.go),
// responsesDialect (responses.go) and messagesDialect (messages.go)
// implement it. Writing methods return errGone when the client went away.
type dialect interface {
	// idPrefix is the prefix of response ids ("chatcmpl-", "resp_", …).
	idPrefix() string
	// prompt is the raw JSON the model reads, which seeds the generated
	// text and sizes usage's prompt tokens.
	prompt(cr *completionRequest) []byte
	// maxTokens is the request's output limit, 0 when unset.
	maxTokens(cr *completionRequest) int
	// lifecycle sends the events a server sends as soon as a stream
	// starts, before queueing and the first token: nothing for Chat and
	// Completions, response.created and response.in_progress (Responses),
	// message_start and ping (Messages).
	lifecycle(x *exchange) error
	// open sends what comes with the first token, before its delta: the
	// role chunk (Chat), the output item and content part (Responses),
	// the text content block's start (Messages).
	open(x *exchange) error
	// delta sends token i of n (text is empty when n is 0).
	delta(x *exchange, i, n int, text string) error
	// close sends what follows the last token: usage and [DONE] (Chat,
	// Completions), the .done events and response.completed or
	// response.incomplete (Responses), content_block_stop, message_delta
	// and message_stop (Messages). It records the usage it reports.
	close(x *exchange) error
	// errorEvent sends the in-band error of a FaultErrorEvent with the
	// given HTTP-like code.
	errorEvent(x *exchange, code int) error
	// errorBody is the JSON body of an HTTP error response.
	errorBody(status int, msg string) []byte
	// full is the non-streaming response body holding text.
	full(x *exchange, text string) []byte
}

// dialectOf returns the dialect of an API.
func dialectOf(a API) dialect {
	switch a {
	case APICompletions:
		return chatDialect{chat: false}
	case APIResponses:
		return responsesDialect{}
	case APIMessages:
		return messagesDialect{}
	}
	return chatDialect{chat: true}
}

// serveAPI returns the handler of an API's completion endpoint.
func (r *Replica) serveAPI(a API) http.HandlerFunc {
	return func(w http.ResponseWriter, req *http.Request) { r.serveCompletion(w, req, a) }
}

// joinRaw concatenates raw JSON values that are present (not empty, not
// null), as the prompt seed of APIs whose prompt has several fields.
func joinRaw(parts ...json.RawMessage) []byte {
	var out []byte
	for _, p := range parts {
		if len(p) == 0 || string(p) == "null" {
			continue
		}
		out = append(out, p...)
	}
	return out
}
