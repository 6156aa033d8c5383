package mockllm

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
)

// completionRequest holds the request fields the mock looks at, of all
// four APIs (see dialect for which API reads which).
type completionRequest struct {
	Model               string          `json:"model"`
	Messages            json.RawMessage `json:"messages"` // Chat, Messages
	Prompt              json.RawMessage `json:"prompt"`   // Completions
	Input               json.RawMessage `json:"input"`    // Responses
	Instructions        json.RawMessage `json:"instructions"`
	System              json.RawMessage `json:"system"` // Messages
	Tools               json.RawMessage `json:"tools"`
	Stream              bool            `json:"stream"`
	MaxTokens           *int            `json:"max_tokens"`            // Chat, Completions, Messages
	MaxCompletionTokens *int            `json:"max_completion_tokens"` // Chat
	MaxOutputTokens     *int            `json:"max_output_tokens"`     // Responses
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

// maxTokens is the Chat/Completions token limit, 0 when unset.
func (r *completionRequest) maxTokens() int {
	switch {
	case r.MaxCompletionTokens != nil && *r.MaxCompletionTokens > 0:
		return *r.MaxCompletionTokens
	case r.MaxTokens != nil && *r.MaxTokens > 0:
		return *r.MaxTokens
	}
	return 0
}

// positive is *p when p is set and positive, else 0.
func positive(p *int) int {
	if p != nil && *p > 0 {
		return *p
	}
	return 0
}

func (r *completionRequest) includeUsage() bool {
	return r.Stream && r.StreamOptions != nil && r.StreamOptions.IncludeUsage
}

// usage is OpenAI's usage object, in vLLM's field order.
type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	TotalTokens      int `json:"total_tokens"`
	CompletionTokens int `json:"completion_tokens"`
}

// delta is the delta of a chat.completion.chunk choice.
type delta struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

// chunkChoice is one choice of a streamed chunk; Delta is used by chat
// chunks, Text by text_completion chunks.
type chunkChoice struct {
	Index        int       `json:"index"`
	Delta        *delta    `json:"delta,omitempty"`
	Text         *string   `json:"text,omitempty"`
	Logprobs     *struct{} `json:"logprobs"`
	FinishReason *string   `json:"finish_reason"`
}

// chunk is one streamed event: chat.completion.chunk or text_completion.
type chunk struct {
	ID      string        `json:"id"`
	Object  string        `json:"object"`
	Created int64         `json:"created"`
	Model   string        `json:"model"`
	Choices []chunkChoice `json:"choices"`
	Usage   *usage        `json:"usage,omitempty"`
}

// message is the assistant message of a non-streaming chat completion.
type message struct {
	Role      string `json:"role"`
	Content   string `json:"content"`
	ToolCalls []any  `json:"tool_calls"`
}

// fullChoice is the choice of a non-streaming response.
type fullChoice struct {
	Index        int       `json:"index"`
	Message      *message  `json:"message,omitempty"`
	Text         *string   `json:"text,omitempty"`
	Logprobs     *struct{} `json:"logprobs"`
	FinishReason string    `json:"finish_reason"`
	StopReason   *string   `json:"stop_reason"`
}

// completion is a non-streaming chat.completion or text_completion.
type completion struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"`
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []fullChoice `json:"choices"`
	Usage   usage        `json:"usage"`
}

// apiError is vLLM's error object; Object is set ("error") only in the
// in-band error event.
type apiError struct {
	Object  string  `json:"object,omitempty"`
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

type errorBody struct {
	Error apiError `json:"error"`
}

// errorType is the error type vLLM (and the OpenAI SDK) uses for a status.
func errorType(status int) string {
	switch status {
	case http.StatusBadRequest:
		return "BadRequestError"
	case http.StatusUnauthorized:
		return "AuthenticationError"
	case http.StatusForbidden:
		return "PermissionDeniedError"
	case http.StatusNotFound:
		return "NotFoundError"
	case http.StatusMethodNotAllowed:
		return "MethodNotAllowedError"
	case http.StatusRequestEntityTooLarge:
		return "RequestEntityTooLargeError"
	case http.StatusUnprocessableEntity:
		return "UnprocessableEntityError"
	case http.StatusTooManyRequests:
		return "RateLimitError"
	case http.StatusServiceUnavailable:
		return "ServiceUnavailableError"
	case http.StatusGatewayTimeout:
		return "GatewayTimeoutError"
	}
	if status >= 500 {
		return "InternalServerError"
	}
	return "BadRequestError"
}

// faultMessage is the error message of an injected status or error event.
func faultMessage(status int) string {
	switch status {
	case http.StatusBadRequest:
		return "This model's maximum context length is 4096 tokens. However, you requested 8192 tokens (4096 in the messages, 4096 in the completion). Please reduce the length of the messages or completion."
	case http.StatusTooManyRequests:
		return "Too many requests (mock fault)."
	case http.StatusServiceUnavailable:
		return "The server is overloaded or not ready yet (mock fault)."
	case 529:
		return "Overloaded (mock fault 529)."
	}
	text := http.StatusText(status)
	if text == "" {
		text = "Error"
	}
	return fmt.Sprintf("%s (mock fault %d).", text, status)
}

// marshal encodes v as compact JSON without HTML escaping, like vLLM's
// pydantic output (non-ASCII stays raw UTF-8).
func marshal(v any) []byte {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		panic(fmt.Sprintf("mockllm: marshal %T: %v", v, err))
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
}

// writeError writes a vLLM-shaped JSON error response.
func writeError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(marshal(errorBody{Error: apiError{Message: msg, Type: errorType(status), Code: status}}))
}

func ptr[T any](v T) *T { return &v }
