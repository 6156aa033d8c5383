package api

import (
	"slices"
	"strconv"
	"strings"

	"github.com/llmproxy/caddy-llm-proxy/internal/jsonscan"
	"github.com/llmproxy/caddy-llm-proxy/sse"
)

// responsesAPI is OpenAI Responses (/v1/responses), as OpenAI and vLLM
// stream it: every event named after its "type", numbered by
// "sequence_number".
//
//	lifecycle  SSE comments; response.created, response.queued,
//	           response.in_progress; response.output_item.added of a
//	           message or reasoning item; response.content_part.added,
//	           response.reasoning_summary_part.added and vLLM's
//	           response.reasoning_part.added (empty parts)
//	generated  every other event: output_text, refusal, reasoning and
//	           function_call_arguments deltas, an output item of a
//	           function call or tool, ...
//	end        response.completed; response.incomplete (a length or
//	           content limit: a normal end, like finish_reason "length");
//	           a [DONE] ends the stream without finishing it
//	error      event error {"type":"error","code","message"}; and
//	           response.failed, its response.error.code classed
//	usage      response.usage (input_tokens, output_tokens) of the
//	           terminal event, or of the JSON body
type responsesAPI struct{}

func (responsesAPI) Name() string { return "responses" }

func (responsesAPI) ParseRequest(body []byte) (Request, error) {
	return parseRequest(body, famResponses, new(Layout))
}

func (responsesAPI) family() int { return famResponses }

func (responsesAPI) OutputLimitFields() []string { return slices.Clone(responsesLimit) }

func (responsesAPI) InjectsUsage() bool { return false }

func (responsesAPI) Inspect(st *Stream, ev sse.Event) Class {
	if !ev.HasData {
		return Lifecycle
	}
	st.Events++
	if n, ok := lastSequence(ev.Data); ok && (!st.seqSeen || n > st.seq) {
		st.seq, st.seqSeen = n, true
	}
	switch typ := eventType(ev.Name, ev.Data); typ {
	case "response.output_text.delta", "response.reasoning_text.delta",
		"response.reasoning_summary_text.delta", "response.function_call_arguments.delta",
		"response.refusal.delta":
		// The hot path: one delta per token.
	case "response.created", "response.queued", "response.in_progress", "response.content_part.added",
		"response.reasoning_summary_part.added", "response.reasoning_part.added":
		if !st.Generated {
			return Lifecycle
		}
	case "response.output_item.added":
		if !st.Generated {
			switch view(field(ev.Data, "item", "type")) {
			case "message", "reasoning":
				return Lifecycle
			}
		}
	case "response.completed", "response.incomplete":
		st.Finished = true
		responsesUsage(st, field(ev.Data, "response", "usage"))
		return End
	case "response.failed":
		responsesUsage(st, field(ev.Data, "response", "usage"))
		e := field(ev.Data, "response", "error")
		st.Err = responsesError(jsonText(field(e, "code")), jsonText(field(e, "message")), "")
		if st.Err.Message == "" {
			st.Err.Message = "upstream response failed"
		}
		return ErrorEvent
	case "error":
		d := ev.Data
		if e := field(d, "error"); isObject(e) {
			d = e
		}
		st.Err = responsesError(jsonText(field(d, "code")), jsonText(field(d, "message")), jsonText(field(d, "type")))
		return ErrorEvent
	default:
		switch ev.Kind() {
		case sse.KindError:
			// A chat-shaped error from a server that mixes its shapes.
			st.Err = chatError(ev.Data)
			return ErrorEvent
		case sse.KindDone:
			// Servers that end every stream with [DONE]: it ends this
			// one, finished only if response.completed came first. It
			// is no Responses event, so it takes no sequence number.
			st.Events--
			return End
		}
	}
	st.Generated = true
	return Generated
}

// responsesUsage records the usage object u, if it is one.
func responsesUsage(st *Stream, u []byte) {
	if !isObject(u) {
		return
	}
	in, _ := countOf(u, "input_tokens")
	out, _ := countOf(u, "output_tokens")
	st.Usage = Usage{PromptTokens: in, CompletionTokens: out, Reported: true}
}

// responsesError classes a Responses error by its code (and type): a
// numeric code in 400..599 as it is, rate limits 429; invalid requests
// and prompts, context length, not-found errors, and the codes OpenAI
// documents for a request's images and policies (image_*, *_image_*,
// bio_policy, data_residency_mismatch; openai-node's ResponseError.code)
// 400; the rest (server_error, vector_store_timeout, vLLM's internal
// errors) 500.
func responsesError(code, message, typ string) InbandError {
	status := errorStatus(typ, code)
	if status == 500 {
		s := strings.ToLower(code + " " + typ)
		for _, w := range [...]string{"invalid", "not_found", "too_large", "image", "policy", "residency"} {
			if strings.Contains(s, w) {
				status = 400
				break
			}
		}
	}
	return InbandError{Message: message, Type: typ, Code: code, Status: status}
}

func (responsesAPI) InspectBody(body []byte) Usage {
	var st Stream
	responsesUsage(&st, field(body, "usage"))
	return st.Usage
}

// AppendStreamError appends
//
//	event: error
//	data: {"type":"error","code":…,"message":…,"param":null,"sequence_number":<next>}
//
// where next follows the last sequence_number relayed (or counts the data
// events when the upstream numbered none).
func (responsesAPI) AppendStreamError(dst []byte, st *Stream, e Error) []byte {
	next := int64(st.Events)
	if st.seqSeen {
		next = st.seq + 1
	}
	dst = append(dst, "event: error\ndata: {\"type\":\"error\",\"code\":"...)
	dst = jsonscan.AppendString(dst, e.Code)
	dst = append(dst, `,"message":`...)
	dst = jsonscan.AppendString(dst, e.Message)
	dst = append(dst, `,"param":null,"sequence_number":`...)
	dst = strconv.AppendInt(dst, next, 10)
	return append(dst, "}\n\n"...)
}

func (responsesAPI) AppendErrorBody(dst []byte, e Error) []byte { return appendOpenAIError(dst, e) }
