package api

import (
	"slices"

	"github.com/llmproxy/caddy-llm-proxy/sse"
)

// chatAPI is OpenAI Chat Completions and, with completions set, the legacy
// Completions API: the same chunk shape (chat_chunk.go).
//
//	lifecycle  SSE comments; a chunk whose choices carry only a role and
//	           empty content (vLLM's and OpenAI's first chunk)
//	generated  a chunk with content, refusal, reasoning, tool calls, a
//	           legacy "text", or a finish_reason
//	end        [DONE]; a finish_reason finishes the answer
//	error      {"error":…} (and vLLM's older {"object":"error",…})
//	usage      the usage chunk (stream_options.include_usage, which the
//	           gateway may set on the client's behalf); the last counts
type chatAPI struct {
	name        string
	completions bool
}

func (c chatAPI) Name() string { return c.name }

func (c chatAPI) ParseRequest(body []byte) (Request, error) {
	return parseRequest(body, c.family(), new(Layout))
}

func (c chatAPI) family() int {
	if c.completions {
		return famCompletions
	}
	return famChat
}

func (c chatAPI) OutputLimitFields() []string {
	if c.completions {
		return slices.Clone(maxTokensLimit)
	}
	return slices.Clone(chatLimits)
}

func (chatAPI) InjectsUsage() bool { return true }

func (chatAPI) Inspect(st *Stream, ev sse.Event) Class {
	switch ev.Kind() {
	case sse.KindComment:
		return Lifecycle
	case sse.KindDone:
		st.Finished = true
		return End
	case sse.KindError:
		st.Err = chatError(ev.Data)
		return ErrorEvent
	}
	st.Events++
	ci := inspectChunk(ev.Data)
	if ci.usage {
		st.Usage = Usage{PromptTokens: ci.promptTokens, CompletionTokens: ci.completionTokens, Reported: true}
	}
	if ci.finishReason {
		st.Finished = true
	}
	if ci.usageOnly {
		return UsageOnly
	}
	if !st.Generated && !ci.finishReason && !chunkGenerated(ev.Data) {
		return Lifecycle
	}
	st.Generated = true
	return Generated
}

// chatError parses a Chat in-band error event.
func chatError(data []byte) InbandError {
	ie, ok := parseChatError(data)
	if !ok {
		return InbandError{Message: "upstream sent an error event", Type: "server_error", Status: 500}
	}
	return ie
}

func (chatAPI) InspectBody(body []byte) Usage {
	ci := inspectChunk(body)
	if !ci.usage {
		return Usage{}
	}
	return Usage{PromptTokens: ci.promptTokens, CompletionTokens: ci.completionTokens, Reported: true}
}

func (chatAPI) AppendStreamError(dst []byte, _ *Stream, e Error) []byte {
	return appendChatErrorEvent(dst, e.Message, e.Type, e.Code)
}

func (chatAPI) AppendErrorBody(dst []byte, e Error) []byte { return appendOpenAIError(dst, e) }

// noneAPI is every path that is none of the streaming APIs: no stream
// semantics (every event commits, the end of the body ends the stream, no
// stream usage), OpenAI's error shape. Its request is read as Chat's, so
// that the model matcher and the tenant's estimate see the same fields as
// before; a JSON body's OpenAI "usage" (embeddings report prompt_tokens)
// is read, so that a tenant is charged what the server counted rather
// than an estimate from the body's size.
type noneAPI struct {
	// anthropic: the gateway's errors are in Anthropic's shape (the
	// other paths of a Messages route).
	anthropic bool
}

func (noneAPI) Name() string { return "none" }
func (noneAPI) ParseRequest(body []byte) (Request, error) {
	return parseRequest(body, famNone, new(Layout))
}
func (noneAPI) family() int                   { return famNone }
func (noneAPI) OutputLimitFields() []string   { return nil }
func (noneAPI) InjectsUsage() bool            { return false }
func (noneAPI) InspectBody(body []byte) Usage { return Chat.InspectBody(body) }

func (noneAPI) Inspect(st *Stream, ev sse.Event) Class {
	if !ev.HasData {
		return Lifecycle
	}
	// No end to wait for: whatever arrived is the answer.
	st.Events++
	st.Generated, st.Finished = true, true
	return Generated
}

func (n noneAPI) AppendStreamError(dst []byte, st *Stream, e Error) []byte {
	if n.anthropic {
		return Messages.AppendStreamError(dst, st, e)
	}
	return appendChatErrorEvent(dst, e.Message, e.Type, e.Code)
}

func (n noneAPI) AppendErrorBody(dst []byte, e Error) []byte {
	if n.anthropic {
		return appendAnthropicError(dst, e)
	}
	return appendOpenAIError(dst, e)
}
