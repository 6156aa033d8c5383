// Package api knows what each streaming API that inference servers speak
// means to the gateway (DESIGN §3a): OpenAI Chat Completions, legacy
// Completions, OpenAI Responses and Anthropic Messages, plus None for every
// other path (embeddings, count_tokens, audio, files), which is proxied
// with the status-code rules only.
//
// One interface, API, answers for each: the request fields the gateway
// acts on (model, stream, output limit, prompt estimate), which stream
// events are lifecycle (held until commit, they carry nothing generated)
// and which is the first generated one, the stream's normal end, in-band
// errors and their class, token usage, the terminal error event written
// after commit and the gateway's own error body before it. A stream's
// state lives in a Stream value that the caller owns, so that inspecting
// an event allocates nothing.
//
// The package imports neither Caddy nor net/http.
package api

import (
	"encoding/json"
	"strings"

	"github.com/llmproxy/caddy-llm-proxy/sse"
)

// API is what one streaming API means to the gateway. Implementations are
// stateless values (Chat, Completions, Responses, Messages, None), safe for
// concurrent use; a stream's state is the caller's Stream.
type API interface {
	// Name is the API's short name, the "api" metric label and the
	// {http.llm_proxy.api} placeholder: "chat", "completions",
	// "responses", "messages" or "none".
	Name() string
	// ParseRequest validates a JSON request body and extracts its Request.
	// An empty body yields a zero Request with N 1. Invalid JSON, a
	// non-object, or a field the gateway reads with the wrong type is an
	// error suitable for a 400 response.
	ParseRequest(body []byte) (Request, error)
	// OutputLimitFields names the body fields that hold the output limit,
	// in the order the server reads them: the degradation ladder sets
	// every one the client sent, or the last one when it sent none.
	// Chat: max_completion_tokens, max_tokens; Completions and Messages:
	// max_tokens; Responses: max_output_tokens; None: nil (no limit).
	OutputLimitFields() []string
	// InjectsUsage reports whether stream_options.include_usage may be set
	// on the client's behalf (Chat and Completions only; the other APIs
	// report usage unasked).
	InjectsUsage() bool
	// Inspect classifies one SSE event of a stream and records in st what
	// it says: the first generated event, the normal end, usage, an
	// in-band error. It does not allocate, except to parse an in-band
	// error (the rare path).
	Inspect(st *Stream, ev sse.Event) Class
	// InspectBody reads a complete (non-streaming) JSON response body for
	// its token usage; Reported is false when it has none.
	InspectBody(body []byte) Usage
	// AppendStreamError appends the terminal error event of a committed
	// stream that failed, in the API's own shape, to dst and returns the
	// extended slice. st is the stream's state (Responses numbers the
	// event after the last one relayed). e.Status picks the error's type
	// where the API has types (Messages: AnthropicErrorType, so a cut
	// stream's 502 is api_error and a 503 overloaded_error).
	AppendStreamError(dst []byte, st *Stream, e Error) []byte
	// AppendErrorBody appends the gateway's own JSON error body, written
	// before commit, to dst and returns the extended slice: OpenAI's
	// {"error":{"message","type","code"}} for every API but Messages,
	// Anthropic's {"type":"error","error":{"type","message"}} for
	// Messages (its type from e.Status: see AnthropicErrorType).
	AppendErrorBody(dst []byte, e Error) []byte
	// family is the parse rules of the API's requests.
	family() int
}

// Error is an error the gateway reports to a client.
type Error struct {
	// Status is the HTTP status it stands for (the response's status
	// before commit).
	Status int
	// Type and Code are OpenAI's error type ("server_error",
	// "rate_limit_error", ...) and code ("upstream_stream_truncated").
	Type, Code string
	// Message is the human-readable message.
	Message string
}

// Class is what one event of a stream is to the gateway.
type Class uint8

const (
	// Lifecycle events carry nothing generated (SSE comments, a Chat
	// chunk with only a role, response.created, message_start, ping):
	// held before commit, sent at commit in order with the first
	// generated event; an attempt that fails before commit loses them.
	// After commit only SSE comments, Messages' ping and (Chat,
	// Completions) chunks that generate nothing are Lifecycle: relayed,
	// but not counted as generated.
	Lifecycle Class = iota
	// Generated events carry something the model generated (a text,
	// refusal or reasoning delta, a tool call, ...); the first one is the
	// commit point.
	Generated
	// End is the API's last event of a finished stream ([DONE],
	// response.completed, message_stop): relayed, then the stream is
	// over. Stream.Finished says whether the answer is whole.
	End
	// ErrorEvent is an in-band error event; Stream.Err describes it.
	ErrorEvent
	// UsageOnly is a Chat or Completions chunk that carries usage and no
	// choices (stream_options.include_usage): a gateway that asked for it
	// on the client's behalf keeps it from the client.
	UsageOnly
)

// String returns the class's lowercase name, for logs and tests.
func (c Class) String() string {
	switch c {
	case Lifecycle:
		return "lifecycle"
	case Generated:
		return "generated"
	case End:
		return "end"
	case ErrorEvent:
		return "error"
	case UsageOnly:
		return "usage_only"
	}
	return "class(?)"
}

// Usage is the token usage a response reported.
type Usage struct {
	// PromptTokens is what the model read: Chat's prompt_tokens,
	// Responses' input_tokens (cached ones included), Messages'
	// input_tokens plus cache_creation_input_tokens and
	// cache_read_input_tokens.
	PromptTokens int
	// CompletionTokens is what it generated: completion_tokens,
	// output_tokens (Messages: the last message_delta's, which is
	// cumulative).
	CompletionTokens int
	// Reported is true when the upstream sent the response's usage.
	// Messages: only once a message_delta (or the JSON body) carried it;
	// before that PromptTokens may hold message_start's prompt count
	// while Reported is false.
	Reported bool
}

// Stream is the state of one stream's inspection. Its zero value is a new
// stream; the caller owns it (one per attempt) and passes it to every
// Inspect of that stream.
type Stream struct {
	// Generated is set once an event of class Generated has been seen.
	Generated bool
	// Finished is set once the stream carried its API's normal end: a
	// finish_reason or [DONE] (Chat, Completions); response.completed or
	// response.incomplete (Responses); message_stop after a
	// message_delta with a stop_reason (Messages). A length limit is a
	// normal end.
	Finished bool
	// Usage is the last usage the stream reported (never summed).
	Usage Usage
	// Err is the last in-band error event's description.
	Err InbandError
	// Events counts the data events inspected (a [DONE] in a Responses
	// stream excluded: it takes no sequence number).
	Events int

	// seq is the highest Responses sequence_number seen, -1 before any.
	seq int64
	// seqSeen: seq is set.
	seqSeen bool
	// stopReason: a Messages message_delta carried a stop_reason.
	stopReason bool
	// msgInput is the last Messages input_tokens,
	// cache_creation_input_tokens and cache_read_input_tokens, each
	// updated on its own (Usage.PromptTokens is their sum).
	msgInput [3]int
}

// InbandError describes an in-band error event, in any API's shape.
type InbandError struct {
	// Message is the error's message, as sent.
	Message string
	// Type is the error's type as sent ("overloaded_error",
	// "server_error"), "" when absent.
	Type string
	// Code is the error's code as sent, stringified, "" when absent.
	Code string
	// Status is the HTTP status it maps to (DESIGN §4 rows): 5xx-like
	// errors are retryable before commit and an upstream failure; 429 and
	// other 4xx follow their rows.
	Status int
}

// ForPath returns the API that a request path speaks, by its suffix (so
// that a route keeping a prefix, /openai/v1/responses, works):
// /chat/completions, /completions, /responses, /messages (but not OpenAI's
// message lists /threads/{id}/messages and /completions/{id}/messages,
// which are None). Every other path
// has no stream semantics: None (/v1/embeddings, audio, files), or, under
// a Messages route (/v1/messages/count_tokens, /v1/messages/batches),
// None's rules with Anthropic's error shapes (named "none" too; see
// AnthropicShaped), as Anthropic and vLLM answer them. A trailing slash
// is ignored.
func ForPath(path string) API {
	path = strings.TrimSuffix(path, "/")
	switch {
	case strings.HasSuffix(path, "/chat/completions"):
		return Chat
	case strings.HasSuffix(path, "/completions"):
		return Completions
	case strings.HasSuffix(path, "/responses"):
		return Responses
	case strings.HasSuffix(path, "/messages") && !openAIMessageList(path):
		return Messages
	case strings.Contains(path, "/v1/messages/"):
		return messagesOther
	}
	return None
}

// openAIMessageList reports whether path, which ends in /messages, is one
// of OpenAI's message lists rather than Anthropic Messages: its parent
// segments are threads/<id> (Assistants, /v1/threads/{thread_id}/messages)
// or completions/<id> (stored chat completions,
// /v1/chat/completions/{completion_id}/messages).
func openAIMessageList(path string) bool {
	parent := strings.TrimSuffix(path, "/messages")
	i := strings.LastIndexByte(parent, '/')
	if i < 0 || i == len(parent)-1 {
		return false
	}
	parent = parent[:i]
	return strings.HasSuffix(parent, "/threads") || strings.HasSuffix(parent, "/completions") ||
		parent == "threads" || parent == "completions"
}

// AnthropicShaped reports whether the gateway's own errors on a request of
// API a are Anthropic's ({"type":"error","error":{…}}, with the
// anthropic-ratelimit-* headers): Messages, and the other paths of a
// Messages route that ForPath finds (count_tokens).
func AnthropicShaped(a API) bool { return a == Messages || a == messagesOther }

// ByName returns the API named name ("chat", "completions", "responses",
// "messages", "none"); ok is false for any other name ("auto" included:
// the caller chooses by path then).
func ByName(name string) (a API, ok bool) {
	switch name {
	case "chat":
		return Chat, true
	case "completions":
		return Completions, true
	case "responses":
		return Responses, true
	case "messages":
		return Messages, true
	case "none":
		return None, true
	}
	return nil, false
}

// The APIs.
var (
	// Chat is OpenAI Chat Completions (/v1/chat/completions).
	Chat API = chatAPI{name: "chat"}
	// Completions is OpenAI's legacy Completions (/v1/completions).
	Completions API = chatAPI{name: "completions", completions: true}
	// Responses is OpenAI Responses (/v1/responses).
	Responses API = responsesAPI{}
	// Messages is Anthropic Messages (/v1/messages).
	Messages API = messagesAPI{}
	// None is every other path: status-code rules only; a stream commits
	// at its first event and ends at the end of its body.
	None API = noneAPI{}
	// messagesOther is None on the other paths of a Messages route, with
	// Anthropic's error shapes.
	messagesOther API = noneAPI{anthropic: true}
)

// appendOpenAIError appends OpenAI's error body
// {"error":{"message","type","code"}}, encoded by encoding/json.
func appendOpenAIError(dst []byte, e Error) []byte {
	body, _ := json.Marshal(openAIError{Error: openAIDetail{Message: e.Message, Type: e.Type, Code: e.Code}})
	return append(dst, body...)
}

type openAIError struct {
	Error openAIDetail `json:"error"`
}

type openAIDetail struct {
	Message string `json:"message"`
	Type    string `json:"type"`
	Code    string `json:"code"`
}
