package api

import (
	"bytes"
	"strconv"
	"strings"

	"github.com/llmproxy/caddy-llm-proxy/internal/jsonscan"
)

// chunkInfo is what the gateway needs from an OpenAI chat completion chunk.
type chunkInfo struct {
	// finishReason reports that some element of the top-level "choices"
	// array has a non-null "finish_reason" ("stop", "length", "tool_calls",
	// ...): the generation finished.
	finishReason bool
	// usage reports that the top-level "usage" is an object (not null): the
	// chunk carries token counts.
	usage bool
	// promptTokens and completionTokens are usage.prompt_tokens and
	// usage.completion_tokens when usage is true and the value is a JSON
	// integer without sign, fraction or exponent, of at most 18 digits;
	// otherwise 0. Servers that repeat cumulative usage on every chunk
	// (TGI) are read by keeping the last chunk's values, never by summing.
	promptTokens, completionTokens int
	// usageOnly reports a usage-only chunk: usage is true and the
	// top-level "choices" is an empty array, null, absent or not an array.
	// It is the chunk that stream_options.include_usage adds at the end of
	// a stream, which a gateway that asked for it on the client's behalf
	// removes before it reaches the client.
	usageOnly bool
}

// inspectChunk reports the finish_reason and token usage of an OpenAI
// chunk, or of a whole non-streaming chat completion body (same top-level
// shape). It follows the object structure, so the same text inside a
// string (a model writing "finish_reason":"stop") does not fool it, and it
// does not allocate. When a key repeats, the last one counts, as with
// encoding/json. Malformed input yields what was found before the point
// where it stops making sense.
func inspectChunk(data []byte) chunkInfo {
	if plainChunk(data) {
		// Most chunks of a stream carry one token: no finish_reason, no
		// usage. Three byte searches prove it without walking the JSON.
		return chunkInfo{}
	}
	return walkChunk(data)
}

// walkChunk is inspectChunk without its plain-chunk shortcut.
func walkChunk(data []byte) chunkInfo {
	info, choices := chunkMembers(data)
	info.usageOnly = info.usage && choices == 0
	return info
}

// chunkMembers is walkChunk without usageOnly; choices is the number of
// elements of the last top-level choices array.
func chunkMembers(data []byte) (info chunkInfo, choices int) {
	it, ok := jsonscan.Object(data, 0, false)
	if !ok {
		return info, 0
	}
	for {
		key, ok := it.NextKey()
		if !ok {
			return info, choices
		}
		isChoices := jsonscan.KeyIs(key, "choices")
		if isChoices && it.Peek() == '[' {
			arr := it.Enter()
			info.finishReason, choices = choicesFinished(&arr)
			if !it.Leave(&arr) {
				return info, choices
			}
			continue
		}
		if isChoices {
			info.finishReason, choices = false, 0
		}
		val, ok := it.Value()
		if !ok {
			return info, choices
		}
		if jsonscan.KeyIs(key, "usage") {
			info.usage = val[0] == '{'
			info.promptTokens, info.completionTokens = 0, 0
			if info.usage {
				info.promptTokens, info.completionTokens = usageCounts(val)
			}
		}
	}
}

// choicesFinished walks a choices array and reports whether an element is
// an object whose last finish_reason is not null, and how many elements
// it has (counted up to where it stops making sense).
func choicesFinished(arr *jsonscan.Iter) (finished bool, n int) {
	for arr.NextElem() {
		n++
		if arr.Peek() != '{' {
			if _, ok := arr.Value(); !ok {
				return finished, n
			}
			continue
		}
		obj := arr.Enter()
		fin := false
		for {
			key, ok := obj.NextKey()
			if !ok {
				break
			}
			val, ok := obj.Value()
			if !ok {
				break
			}
			if jsonscan.KeyIs(key, "finish_reason") {
				fin = string(val) != "null"
			}
		}
		if !arr.Leave(&obj) {
			return finished, n
		}
		finished = finished || fin
	}
	return finished, n
}

// chunkGenerated reports whether an OpenAI chat or completion chunk
// carries something generated: some element of its top-level "choices"
// has a non-null finish_reason, a "text" (legacy completions) that is a
// non-empty string, or a "delta" with a member other than "role" whose
// value is not null, "" or [] (content, refusal, reasoning, tool_calls,
// ...). A chunk that carries only a role and empty content — vLLM's and
// OpenAI's first chunk — is not generated, nor is one without choices
// (a usage-only chunk). Malformed input is generated: the gateway does
// not hold what it cannot understand. It does not allocate.
func chunkGenerated(data []byte) bool {
	it, ok := jsonscan.Object(data, 0, false)
	if !ok {
		return true
	}
	gen := false
	for {
		key, ok := it.NextKey()
		if !ok {
			return gen || it.End() < 0
		}
		isChoices := jsonscan.KeyIs(key, "choices")
		if isChoices && it.Peek() == '[' {
			arr := it.Enter()
			g, ok := choicesGenerated(&arr)
			if !ok || !it.Leave(&arr) {
				return true
			}
			gen = g
			continue
		}
		if isChoices {
			gen = false // the last "choices" counts, as in inspectChunk
		}
		if _, ok := it.Value(); !ok {
			return true
		}
	}
}

// choicesGenerated walks a choices array for chunkGenerated; ok is false
// when it is malformed.
func choicesGenerated(arr *jsonscan.Iter) (gen, ok bool) {
	for arr.NextElem() {
		if arr.Peek() != '{' {
			if _, ok := arr.Value(); !ok {
				return true, false
			}
			continue
		}
		obj := arr.Enter()
		for {
			key, ok := obj.NextKey()
			if !ok {
				break
			}
			if jsonscan.KeyIs(key, "delta") && obj.Peek() == '{' {
				d := obj.Enter()
				for {
					k, ok := d.NextKey()
					if !ok {
						break
					}
					v, ok := d.Value()
					if !ok {
						break
					}
					if !jsonscan.KeyIs(k, "role") && !emptyValue(v) {
						gen = true
					}
				}
				if !obj.Leave(&d) {
					return true, false
				}
				continue
			}
			v, ok := obj.Value()
			if !ok {
				break
			}
			if jsonscan.KeyIs(key, "finish_reason") || jsonscan.KeyIs(key, "text") {
				gen = gen || !emptyValue(v)
			}
		}
		if !arr.Leave(&obj) {
			return true, false
		}
	}
	return gen, arr.End() >= 0
}

// emptyValue reports a JSON null, "" or [] (whitespace allowed in []).
func emptyValue(v []byte) bool {
	switch {
	case string(v) == "null", string(v) == `""`:
		return true
	case v[0] == '[':
		return len(jsonscan.TrimSpace(v[1:len(v)-1])) == 0
	}
	return false
}

// plainChunk reports that data has no non-null finish_reason and no
// non-null usage anywhere, so that inspectChunk would find nothing: every
// occurrence of the bytes finish_reason" and usage" is followed by a colon
// and a null (whitespace allowed). Inside a JSON string a quote is escaped,
// so such an occurrence ends a key; a key can only spell those names
// differently through a \u escape, so data holding \u is not plain. Any
// other occurrence (a model writing "finish_reason" in its content) makes
// the answer false, and inspectChunk walks the JSON.
func plainChunk(data []byte) bool {
	return !bytes.Contains(data, []byte(`\u`)) &&
		onlyNullValues(data, []byte(`finish_reason"`)) && onlyNullValues(data, []byte(`usage"`))
}

// onlyNullValues reports whether every occurrence of key in data is
// followed by optional whitespace, a colon, optional whitespace and a null
// literal that ends where a loose walk would end it.
func onlyNullValues(data, key []byte) bool {
	for {
		i := bytes.Index(data, key)
		if i < 0 {
			return true
		}
		j := jsonscan.SkipSpace(data, i+len(key))
		if j >= len(data) || data[j] != ':' {
			return false
		}
		j = jsonscan.SkipSpace(data, j+1)
		if !bytes.HasPrefix(data[j:], []byte("null")) {
			return false
		}
		j += len("null")
		if j < len(data) {
			if c := data[j]; !jsonscan.IsSpace(c) && c != ',' && c != '}' && c != ']' && c != ':' {
				return false
			}
		}
		data = data[j:]
	}
}

// usageCounts reads prompt_tokens and completion_tokens from the usage
// object obj (its complete raw text). The last occurrence of a key counts.
func usageCounts(obj []byte) (prompt, completion int) {
	it, _ := jsonscan.Object(obj, 0, false)
	for {
		key, ok := it.NextKey()
		if !ok {
			return prompt, completion
		}
		val, ok := it.Value()
		if !ok {
			return prompt, completion
		}
		switch {
		case jsonscan.KeyIs(key, "prompt_tokens"):
			prompt = jsonscan.Count(val)
		case jsonscan.KeyIs(key, "completion_tokens"):
			completion = jsonscan.Count(val)
		}
	}
}

// parseChatError parses the data of an sse.KindError event in the shapes
// OpenAI, vLLM and TGI send:
//
//	{"error":{"message":"...","type":"...","code":"..."}}                   OpenAI
//	{"error":{"object":"error","message":"...","type":"...","code":400}}    vLLM
//	{"object":"error","message":"...","type":"...","param":null,"code":500} older vLLM
//	{"error":"...","error_type":"..."}                                      TGI
//
// Code is the code as sent, stringified ("400", "server_error", "" when
// absent or null); Status follows errorStatus. ok is false when data is
// not valid JSON or not one of the shapes; for valid JSON it agrees with
// sse.Event.Kind. It may allocate: errors are the rare path. When a key
// repeats, the last one counts.
func parseChatError(data []byte) (e InbandError, ok bool) {
	if !jsonscan.Valid(data) {
		return InbandError{}, false
	}
	top := errorFields(data)
	if !top.object {
		return InbandError{}, false
	}
	fields := top
	switch raw := top.err; {
	case len(raw) > 0 && raw[0] == '{':
		fields = errorFields(raw)
	case len(raw) > 0 && raw[0] == '"':
		// TGI: {"error":"message","error_type":"validation"}
		e.Message = jsonText(raw)
		e.Type = jsonText(top.errorType)
		if e.Type == "" {
			e.Type = jsonText(top.typ)
		}
		e.Code = jsonText(top.code)
		e.Status = errorStatus(e.Type, e.Code)
		return e, true
	default:
		if len(top.obj) == 0 || top.obj[0] != '"' || jsonText(top.obj) != "error" {
			return InbandError{}, false
		}
	}
	e.Message = jsonText(fields.message)
	e.Type = jsonText(fields.typ)
	e.Code = jsonText(fields.code)
	e.Status = errorStatus(e.Type, e.Code)
	return e, true
}

// errorMembers are the raw values of the members of an error object that
// parseChatError reads (nil when absent); object is false when the text
// is not an object.
type errorMembers struct {
	object                                  bool
	err, errorType, typ, code, obj, message []byte
}

// errorFields reads errorMembers from the valid JSON text data.
func errorFields(data []byte) (m errorMembers) {
	it, ok := jsonscan.Object(data, 0, true)
	m.object = ok
	for {
		key, ok := it.NextKey()
		if !ok {
			return m
		}
		val, _ := it.Value()
		switch {
		case jsonscan.KeyIs(key, "error"):
			m.err = val
		case jsonscan.KeyIs(key, "error_type"):
			m.errorType = val
		case jsonscan.KeyIs(key, "type"):
			m.typ = val
		case jsonscan.KeyIs(key, "code"):
			m.code = val
		case jsonscan.KeyIs(key, "object"):
			m.obj = val
		case jsonscan.KeyIs(key, "message"):
			m.message = val
		}
	}
}

// jsonText returns a JSON string's value, or a scalar's literal text
// ("400"), or "" for null or absence. Objects and arrays keep their JSON
// text.
func jsonText(raw []byte) string {
	switch {
	case len(raw) == 0, string(raw) == "null":
		return ""
	case raw[0] == '"':
		return jsonscan.String(raw)
	}
	return string(raw)
}

// errorStatus maps an in-band error's type and code to an HTTP status: a
// numeric code (number or numeric string) in 400..599 as it is; otherwise
// 400 when the type or code says invalid_request, BadRequest,
// context_length or validation; 429 when it says rate_limit or too many
// requests; otherwise 500.
func errorStatus(typ, code string) int {
	if n, err := strconv.ParseFloat(strings.TrimSpace(code), 64); err == nil && n >= 400 && n <= 599 && n == float64(int(n)) {
		return int(n)
	}
	s := strings.ToLower(typ + " " + code)
	switch {
	case strings.Contains(s, "invalid_request"), strings.Contains(s, "badrequest"),
		strings.Contains(s, "bad_request"), strings.Contains(s, "context_length"),
		strings.Contains(s, "validation"):
		return 400
	case strings.Contains(s, "rate_limit"), strings.Contains(s, "ratelimit"),
		strings.Contains(s, "too many requests"), strings.Contains(s, "too_many_requests"),
		strings.Contains(s, "toomanyrequests"):
		return 429
	}
	return 500
}

// appendChatErrorEvent appends a terminal SSE error event in OpenAI's
// shape,
//
//	data: {"error":{"message":"...","type":"...","code":"..."}}\n\n
//
// to dst and returns the extended slice. The strings are JSON-escaped
// (invalid UTF-8 becomes U+FFFD); code is always a JSON string, ""
// included.
func appendChatErrorEvent(dst []byte, message, typ, code string) []byte {
	dst = append(dst, `data: {"error":{"message":`...)
	dst = jsonscan.AppendString(dst, message)
	dst = append(dst, `,"type":`...)
	dst = jsonscan.AppendString(dst, typ)
	dst = append(dst, `,"code":`...)
	dst = jsonscan.AppendString(dst, code)
	return append(dst, "}}\n\n"...)
}
