package api

import "github.com/llmproxy/caddy-llm-proxy/sse"

// chatAPI is OpenAI Chat Completions and, with completions set, the legacy
// Completions API: the same chunk shape, read by package sse.
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

func (chatAPI) ParseRequest(body []byte) (Request, error) { return parseChat(body) }

func (c chatAPI) OutputLimitFields() []string {
	if c.completions {
		return []string{"max_tokens"}
	}
	return []string{"max_completion_tokens", "max_tokens"}
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
	ci := sse.InspectChunk(ev.Data)
	if ci.Usage {
		st.Usage = Usage{PromptTokens: ci.PromptTokens, CompletionTokens: ci.CompletionTokens, Reported: true}
	}
	if ci.FinishReason {
		st.Finished = true
	}
	if ci.UsageOnly {
		return UsageOnly
	}
	if !st.Generated && !ci.FinishReason && !sse.ChunkGenerated(ev.Data) {
		return Lifecycle
	}
	st.Generated = true
	return Generated
}

// chatError parses a Chat in-band error event.
func chatError(data []byte) InbandError {
	ie, ok := sse.ParseInbandError(data)
	if !ok {
		return InbandError{Message: "upstream sent an error event", Type: "server_error", Status: 500}
	}
	return InbandError{Message: ie.Message, Type: ie.Type, Code: ie.Code, Status: ie.Status}
}

func (chatAPI) InspectBody(body []byte) Usage {
	ci := sse.InspectChunk(body)
	if !ci.Usage {
		return Usage{}
	}
	return Usage{PromptTokens: ci.PromptTokens, CompletionTokens: ci.CompletionTokens, Reported: true}
}

func (chatAPI) AppendStreamError(dst []byte, _ *Stream, e Error) []byte {
	return sse.AppendErrorEvent(dst, e.Message, e.Type, e.Code)
}

func (chatAPI) AppendErrorBody(dst []byte, e Error) []byte { return appendOpenAIError(dst, e) }

// noneAPI is every path that is none of the streaming APIs: no stream
// semantics (every event commits, the end of the body ends the stream, no
// stream usage), OpenAI's error shape. Its request is read as Chat's, so
// that the model matcher and the tenant's estimate see the same fields as
// before; a JSON body's OpenAI "usage" (embeddings report prompt_tokens)
// is read, so that a tenant is charged what the server counted rather
// than an estimate from the body's size.
type noneAPI struct{}

func (noneAPI) Name() string                              { return "none" }
func (noneAPI) ParseRequest(body []byte) (Request, error) { return parseChat(body) }
func (noneAPI) OutputLimitFields() []string               { return nil }
func (noneAPI) InjectsUsage() bool                        { return false }
func (noneAPI) InspectBody(body []byte) Usage             { return Chat.InspectBody(body) }

func (noneAPI) Inspect(st *Stream, ev sse.Event) Class {
	if !ev.HasData {
		return Lifecycle
	}
	// No end to wait for: whatever arrived is the answer.
	st.Events++
	st.Generated, st.Finished = true, true
	return Generated
}

func (noneAPI) AppendStreamError(dst []byte, _ *Stream, e Error) []byte {
	return sse.AppendErrorEvent(dst, e.Message, e.Type, e.Code)
}

func (noneAPI) AppendErrorBody(dst []byte, e Error) []byte { return appendOpenAIError(dst, e) }
