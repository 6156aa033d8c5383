package sse

import (
	"bytes"
	"encoding/json"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Kind is the gateway's classification of an event; see Event.Kind.
type Kind uint8

const (
	// KindComment is an event without data lines: only comments (": ping")
	// or other fields. It never commits a stream.
	KindComment Kind = iota
	// KindData is a data event that is neither [DONE] nor an error.
	KindData
	// KindDone is the OpenAI end-of-stream marker: data is exactly "[DONE]",
	// surrounding whitespace tolerated.
	KindDone
	// KindError is an in-band error: data is a JSON object whose top-level
	// "error" is an object or a string (OpenAI, vLLM, TGI), or whose
	// top-level "object" is "error" (older vLLM). ParseInbandError reads it.
	KindError
)

// String returns the kind's lowercase name, for logs.
func (k Kind) String() string {
	switch k {
	case KindComment:
		return "comment"
	case KindData:
		return "data"
	case KindDone:
		return "done"
	case KindError:
		return "error"
	}
	return "kind(" + strconv.Itoa(int(k)) + ")"
}

// Kind classifies the event without allocating. Malformed JSON is KindData:
// the gateway relays what it cannot understand.
func (e *Event) Kind() Kind {
	if !e.HasData {
		return KindComment
	}
	d := trimWS(e.Data)
	if string(d) == "[DONE]" {
		return KindDone
	}
	if len(d) > 0 && d[0] == '{' && mayBeError(d) && isErrorObject(d) {
		return KindError
	}
	return KindData
}

// ChunkInfo is what the gateway needs from an OpenAI chat completion chunk.
type ChunkInfo struct {
	// FinishReason reports that some element of the top-level "choices"
	// array has a non-null "finish_reason" ("stop", "length", "tool_calls",
	// ...): the generation finished.
	FinishReason bool
	// Usage reports that the top-level "usage" is an object (not null): the
	// chunk carries token counts.
	Usage bool
	// PromptTokens and CompletionTokens are usage.prompt_tokens and
	// usage.completion_tokens when Usage is true and the value is a JSON
	// integer without sign, fraction or exponent, of at most 18 digits;
	// otherwise 0. Servers that repeat cumulative usage on every chunk
	// (TGI) are read by keeping the last chunk's values, never by summing.
	PromptTokens, CompletionTokens int
	// UsageOnly reports a usage-only chunk: Usage is true and the
	// top-level "choices" is an empty array, null, absent or not an array.
	// It is the chunk that stream_options.include_usage adds at the end of
	// a stream, which a gateway that asked for it on the client's behalf
	// removes before it reaches the client.
	UsageOnly bool
}

// InspectChunk reports the finish_reason and token usage of an OpenAI chunk,
// or of a whole non-streaming chat completion body (same top-level shape). It
// scans bytes instead of decoding: it follows the object structure, so the
// same text inside a string (a model writing "finish_reason":"stop") does not
// fool it, and it does not allocate. When a key repeats, the last one counts,
// as with encoding/json. Malformed input yields what was found before the
// point where it stops making sense.
func InspectChunk(data []byte) ChunkInfo {
	if plainChunk(data) {
		// Most chunks of a stream carry one token: no finish_reason, no
		// usage. Three byte searches prove it without walking the JSON.
		return ChunkInfo{}
	}
	info, choices := inspectChunk(data)
	info.UsageOnly = info.Usage && choices == 0
	return info
}

// inspectChunk is InspectChunk without UsageOnly; choices is the number of
// elements of the last top-level choices array.
func inspectChunk(data []byte) (info ChunkInfo, choices int) {
	i := skipWS(data, 0)
	if i >= len(data) || data[i] != '{' {
		return info, choices
	}
	// One pass: choices is walked in place rather than skipped and then
	// walked again.
	it := iter{b: data, i: i + 1}
	for {
		key, ok := it.nextKey()
		if !ok {
			return info, choices
		}
		switch {
		case keyIs(key, "choices") && data[it.i] == '[':
			fin, n, end := choicesFinished(data, it.i)
			info.FinishReason, choices = fin, n
			if end < 0 {
				return info, choices
			}
			it.i = end
			continue
		case keyIs(key, "choices"):
			info.FinishReason, choices = false, 0
		}
		val, ok := it.skip()
		if !ok {
			return info, choices
		}
		if keyIs(key, "usage") {
			info.Usage = val[0] == '{'
			info.PromptTokens, info.CompletionTokens = 0, 0
			if info.Usage {
				info.PromptTokens, info.CompletionTokens = usageCounts(val)
			}
		}
	}
}

// ChunkGenerated reports whether an OpenAI chat or completion chunk carries
// something generated: some element of its top-level "choices" has a
// non-null finish_reason, a "text" (legacy completions) that is a
// non-empty string, or a "delta" with a member other than "role" whose
// value is not null, "" or [] (content, refusal, reasoning, tool_calls,
// ...). A chunk that carries only a role and empty content — vLLM's and
// OpenAI's first chunk — is not generated, nor is one without choices
// (a usage-only chunk). Malformed input is generated: the gateway does not
// hold what it cannot understand. It does not allocate.
func ChunkGenerated(data []byte) bool {
	i := skipWS(data, 0)
	if i >= len(data) || data[i] != '{' {
		return true
	}
	it := iter{b: data, i: i + 1}
	gen := false
	for {
		key, ok := it.nextKey()
		if !ok {
			return gen || it.end < 0
		}
		if keyIs(key, "choices") && data[it.i] == '[' {
			g, end := choicesGenerated(data, it.i)
			if end < 0 {
				return true
			}
			gen, it.i = g, end
			continue
		}
		if keyIs(key, "choices") {
			gen = false // the last "choices" counts, as in InspectChunk
		}
		if _, ok := it.skip(); !ok {
			return true
		}
	}
}

// choicesGenerated walks the choices array at b[i] for ChunkGenerated; end
// is the index after it, -1 when malformed.
func choicesGenerated(b []byte, i int) (gen bool, end int) {
	arr := iter{b: b, i: i + 1, array: true}
	for arr.nextElem() {
		if b[arr.i] != '{' {
			if _, ok := arr.skip(); !ok {
				return true, -1
			}
			continue
		}
		obj := iter{b: b, i: arr.i + 1}
		for {
			key, ok := obj.nextKey()
			if !ok {
				break
			}
			if keyIs(key, "delta") && b[obj.i] == '{' {
				d := iter{b: b, i: obj.i + 1}
				for {
					k, ok := d.nextKey()
					if !ok {
						break
					}
					v, ok := d.skip()
					if !ok {
						break
					}
					if !keyIs(k, "role") && !emptyValue(v) {
						gen = true
					}
				}
				if d.end < 0 {
					return true, -1
				}
				obj.i = d.end
				continue
			}
			v, ok := obj.skip()
			if !ok {
				break
			}
			switch {
			case keyIs(key, "finish_reason"), keyIs(key, "text"):
				gen = gen || !emptyValue(v)
			}
		}
		if obj.end < 0 {
			return true, -1
		}
		arr.i = obj.end
	}
	return gen, arr.end
}

// emptyValue reports a JSON null, "" or [] (whitespace allowed in []).
func emptyValue(v []byte) bool {
	switch {
	case string(v) == "null", string(v) == `""`:
		return true
	case v[0] == '[':
		return len(trimWS(v[1:len(v)-1])) == 0
	}
	return false
}

// plainChunk reports that data has no non-null finish_reason and no
// non-null usage anywhere, so that InspectChunk would find nothing: every
// occurrence of the bytes finish_reason" and usage" is followed by a colon
// and a null (whitespace allowed). Inside a JSON string a quote is escaped,
// so such an occurrence ends a key; a key can only spell those names
// differently through a \u escape, so data holding \u is not plain. Any
// other occurrence (a model writing "finish_reason" in its content) makes
// the answer false, and InspectChunk walks the JSON as before.
func plainChunk(data []byte) bool {
	return !bytes.Contains(data, []byte(`\u`)) &&
		onlyNullValues(data, []byte(`finish_reason"`)) && onlyNullValues(data, []byte(`usage"`))
}

// onlyNullValues reports whether every occurrence of key in data is
// followed by optional whitespace, a colon, optional whitespace and a null
// literal that ends where skipValue would end it.
func onlyNullValues(data, key []byte) bool {
	for {
		i := bytes.Index(data, key)
		if i < 0 {
			return true
		}
		j := skipWS(data, i+len(key))
		if j >= len(data) || data[j] != ':' {
			return false
		}
		j = skipWS(data, j+1)
		if !bytes.HasPrefix(data[j:], []byte("null")) {
			return false
		}
		j += len("null")
		if j < len(data) {
			if c := data[j]; !isWS(c) && c != ',' && c != '}' && c != ']' && c != ':' {
				return false
			}
		}
		data = data[j:]
	}
}

// usageCounts reads prompt_tokens and completion_tokens from the usage
// object obj (its complete raw text). The last occurrence of a key counts.
func usageCounts(obj []byte) (prompt, completion int) {
	it := iter{b: obj, i: 1}
	for {
		key, ok := it.nextKey()
		if !ok {
			return prompt, completion
		}
		val, ok := it.skip()
		if !ok {
			return prompt, completion
		}
		switch {
		case keyIs(key, "prompt_tokens"):
			prompt = parseCount(val)
		case keyIs(key, "completion_tokens"):
			completion = parseCount(val)
		}
	}
}

// parseCount returns the value of a JSON number written as 1 to 18 decimal
// digits, and 0 for anything else (negative, fractional, exponent, string).
func parseCount(v []byte) int {
	if len(v) == 0 || len(v) > 18 {
		return 0
	}
	n := 0
	for _, c := range v {
		if c < '0' || c > '9' {
			return 0
		}
		n = n*10 + int(c-'0')
	}
	return n
}

// choicesFinished walks the choices array starting at b[i] and reports
// whether an element is an object whose last finish_reason is not null, and
// how many elements it has (counted up to where it stops making sense). end
// is the index after the array, or -1 if it is malformed.
func choicesFinished(b []byte, i int) (finished bool, n, end int) {
	arr := iter{b: b, i: i + 1, array: true}
	for arr.nextElem() {
		n++
		if b[arr.i] != '{' {
			if _, ok := arr.skip(); !ok {
				return finished, n, -1
			}
			continue
		}
		obj := iter{b: b, i: arr.i + 1}
		fin := false
		for {
			key, ok := obj.nextKey()
			if !ok {
				break
			}
			val, ok := obj.skip()
			if !ok {
				break
			}
			if keyIs(key, "finish_reason") {
				fin = string(val) != "null"
			}
		}
		if obj.end < 0 {
			return finished, n, -1
		}
		finished = finished || fin
		arr.i = obj.end
	}
	return finished, n, arr.end
}

// mayBeError is a fast pre-check for isErrorObject: both the "error" key and
// the "error" value spell "rror" literally unless written with \u escapes.
func mayBeError(d []byte) bool {
	return bytes.Contains(d, []byte("rror")) || bytes.Contains(d, []byte(`\u`))
}

// isErrorObject reports whether a JSON object has a top-level "error" that is
// an object or a string, or a top-level "object" equal to "error". The last
// occurrence of a key counts, as in ParseInbandError.
func isErrorObject(d []byte) bool {
	errField, objectIsError := false, false
	it := iter{b: d, i: 1}
	for {
		key, ok := it.nextKey()
		if !ok {
			return errField || objectIsError
		}
		val, ok := it.skip()
		if !ok {
			return errField || objectIsError
		}
		switch {
		case keyIs(key, "error"):
			errField = val[0] == '{' || val[0] == '"'
		case keyIs(key, "object"):
			objectIsError = val[0] == '"' && keyIs(val[1:len(val)-1], "error")
		}
	}
}

// InbandError describes an error event sent inside a stream. Three shapes are
// understood:
//
//	{"error":{"message":"...","type":"...","code":"..."}}                   OpenAI
//	{"error":{"object":"error","message":"...","type":"...","code":400}}    vLLM
//	{"object":"error","message":"...","type":"...","param":null,"code":500} older vLLM
//
// and TGI's {"error":"...","error_type":"..."}.
type InbandError struct {
	// Message is the human-readable message, as sent.
	Message string
	// Type is the error type ("invalid_request_error", "BadRequestError", ...).
	Type string
	// Code is the code as sent, stringified: "400", "server_error", or ""
	// when absent or null.
	Code string
	// Status is the HTTP status the error maps to: a numeric code (number
	// or numeric string) in 400..599; otherwise 400 when the type or code
	// says invalid_request, BadRequest, context_length or validation; 429
	// when it says rate_limit or too many requests; otherwise 500.
	Status int
}

// ParseInbandError parses the data of a KindError event. ok is false when
// data is not valid JSON or not one of the error shapes; for valid JSON it
// agrees with Event.Kind. It may allocate: errors are the rare path.
func ParseInbandError(data []byte) (e InbandError, ok bool) {
	var top map[string]json.RawMessage
	if json.Unmarshal(data, &top) != nil || top == nil {
		return InbandError{}, false
	}
	fields := top
	switch raw := top["error"]; {
	case len(raw) > 0 && raw[0] == '{':
		var inner map[string]json.RawMessage
		if json.Unmarshal(raw, &inner) != nil {
			return InbandError{}, false
		}
		fields = inner
	case len(raw) > 0 && raw[0] == '"':
		// TGI: {"error":"message","error_type":"validation"}
		e.Message = jsonText(raw)
		e.Type = jsonText(top["error_type"])
		if e.Type == "" {
			e.Type = jsonText(top["type"])
		}
		e.Code = jsonText(top["code"])
		e.Status = errorStatus(e.Type, e.Code)
		return e, true
	default:
		if jsonText(top["object"]) != "error" || top["object"][0] != '"' {
			return InbandError{}, false
		}
	}
	e.Message = jsonText(fields["message"])
	e.Type = jsonText(fields["type"])
	e.Code = jsonText(fields["code"])
	e.Status = errorStatus(e.Type, e.Code)
	return e, true
}

// jsonText returns a JSON string's value, or a scalar's literal text ("400"),
// or "" for null or absence. Objects and arrays keep their JSON text.
func jsonText(raw json.RawMessage) string {
	if len(raw) == 0 || string(raw) == "null" {
		return ""
	}
	if raw[0] == '"' {
		var s string
		if json.Unmarshal(raw, &s) == nil {
			return s
		}
	}
	return string(raw)
}

// ErrorStatus maps an in-band error's type and code to an HTTP status: a
// numeric code (number or numeric string) in 400..599 as it is; otherwise
// 400 when the type or code says invalid_request, BadRequest,
// context_length or validation; 429 when it says rate_limit or too many
// requests; otherwise 500. It is the rule of InbandError.Status, for the
// error shapes of other APIs (package api).
func ErrorStatus(typ, code string) int { return errorStatus(typ, code) }

// errorStatus maps an in-band error's type and code to an HTTP status.
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

// AppendErrorEvent appends a terminal SSE error event in OpenAI's shape,
//
//	data: {"error":{"message":"...","type":"...","code":"..."}}\n\n
//
// to dst and returns the extended slice. The strings are JSON-escaped
// (invalid UTF-8 becomes U+FFFD); code is always a JSON string, "" included.
func AppendErrorEvent(dst []byte, message, typ, code string) []byte {
	dst = append(dst, `data: {"error":{"message":`...)
	dst = appendJSONString(dst, message)
	dst = append(dst, `,"type":`...)
	dst = appendJSONString(dst, typ)
	dst = append(dst, `,"code":`...)
	dst = appendJSONString(dst, code)
	return append(dst, "}}\n\n"...)
}

// AppendJSONString appends s to dst as a JSON string literal, escaped as
// AppendErrorEvent escapes its strings (control characters, U+2028 and
// U+2029 escaped; invalid UTF-8 becomes U+FFFD), and returns the extended
// slice.
func AppendJSONString(dst []byte, s string) []byte { return appendJSONString(dst, s) }

// appendJSONString appends s as a JSON string. Control characters are escaped
// so that the event stays on one line; U+2028 and U+2029 are escaped for
// JavaScript clients, as encoding/json does.
func appendJSONString(dst []byte, s string) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch c {
			case '"', '\\':
				dst = append(dst, '\\', c)
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			dst = append(dst, s[start:i]...)
			dst = append(dst, `\ufffd`...)
			i++
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			dst = append(dst, s[start:i]...)
			dst = append(dst, '\\', 'u', '2', '0', '2', hex[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}

// The helpers below walk JSON without decoding it. They trust nothing: on
// malformed input they report "no more members" instead of panicking.

func isWS(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func skipWS(b []byte, i int) int {
	for i < len(b) && isWS(b[i]) {
		i++
	}
	return i
}

func trimWS(b []byte) []byte {
	i, j := 0, len(b)
	for i < j && isWS(b[i]) {
		i++
	}
	for j > i && isWS(b[j-1]) {
		j--
	}
	return b[i:j]
}

// scanString returns the index after the string starting with the quote at
// b[i], or -1 if it does not end. A plain loop: keys and streamed tokens are
// too short for bytes.IndexByte's setup to pay off.
func scanString(b []byte, i int) int {
	for j := i + 1; j < len(b); j++ {
		switch b[j] {
		case '\\':
			j++ // skip the escaped byte
		case '"':
			return j + 1
		}
	}
	return -1
}

// structural marks the bytes that skipValue must look at inside an object or
// array; everything else is skipped with one table lookup.
var structural = [256]bool{'"': true, '{': true, '[': true, '}': true, ']': true}

// skipValue returns the index after the JSON value starting at b[i] (which
// is not whitespace), or -1 if it is malformed or truncated. Nesting is
// counted, not recursed, so deep input cannot exhaust the stack.
func skipValue(b []byte, i int) int {
	if i >= len(b) {
		return -1
	}
	switch b[i] {
	case '"':
		return scanString(b, i)
	case '{', '[':
		depth := 0
		for i < len(b) {
			if !structural[b[i]] {
				i++
				continue
			}
			switch b[i] {
			case '"':
				i = scanString(b, i)
				if i < 0 {
					return -1
				}
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
		return -1
	case '}', ']', ',', ':':
		return -1
	}
	// number, true, false, null: runs to the next delimiter
	j := i
	for j < len(b) && !isWS(b[j]) && b[j] != ',' && b[j] != '}' && b[j] != ']' && b[j] != ':' {
		j++
	}
	return j
}

// iter walks the members of an object or the elements of an array; i starts
// after the opening bracket. nextKey (objects) or nextElem (arrays) leaves i
// at the first byte of a value; the caller then consumes it with skip or by
// walking it and setting i to the index after it.
type iter struct {
	b     []byte
	i     int
	array bool
	more  bool // a value has been read: the next one needs a comma
	end   int  // once done: the index after the closing bracket, or -1 if malformed
}

// open moves to the next value, past a comma if one is due. It reports false
// at the closing bracket or at malformed input, recording end.
func (it *iter) open() bool {
	close := byte('}')
	if it.array {
		close = ']'
	}
	b := it.b
	i := skipWS(b, it.i)
	if i < len(b) && b[i] == close {
		it.end = i + 1
		return false
	}
	if it.more {
		if i >= len(b) || b[i] != ',' {
			it.end = -1
			return false
		}
		i = skipWS(b, i+1)
	}
	it.i, it.more = i, true
	if i >= len(b) {
		it.end = -1
		return false
	}
	return true
}

// nextKey returns the raw key (between its quotes, escapes undecoded) of the
// next object member and leaves i at its value.
func (it *iter) nextKey() (key []byte, ok bool) {
	if !it.open() {
		return nil, false
	}
	b, i := it.b, it.i
	ke := -1
	if b[i] == '"' {
		ke = scanString(b, i)
	}
	if ke < 0 {
		it.end = -1
		return nil, false
	}
	key = b[i+1 : ke-1]
	j := skipWS(b, ke)
	if j >= len(b) || b[j] != ':' {
		it.end = -1
		return nil, false
	}
	j = skipWS(b, j+1)
	if j >= len(b) {
		it.end = -1
		return nil, false
	}
	it.i = j
	return key, true
}

// nextElem moves i to the next array element.
func (it *iter) nextElem() bool { return it.open() }

// skip consumes the value at i and returns its raw text (never empty).
func (it *iter) skip() (val []byte, ok bool) {
	e := skipValue(it.b, it.i)
	if e <= it.i {
		it.end = -1
		return nil, false
	}
	val, it.i = it.b[it.i:e], e
	return val, true
}

// keyIs reports whether the raw (still escaped) JSON string content raw
// decodes to the ASCII string want, without allocating. An escape is longer
// than the byte it stands for, so a raw key no longer than want matches only
// verbatim; otherwise decoding stops at the first difference.
func keyIs(raw []byte, want string) bool {
	if len(raw) <= len(want) {
		return string(raw) == want
	}
	j := 0
	for i := 0; i < len(raw); {
		if j >= len(want) {
			return false
		}
		c := raw[i]
		if c != '\\' {
			if c != want[j] {
				return false
			}
			i++
			j++
			continue
		}
		if i+1 >= len(raw) {
			return false
		}
		switch e := raw[i+1]; e {
		case '"', '\\', '/':
			c = e
		case 'b':
			c = '\b'
		case 'f':
			c = '\f'
		case 'n':
			c = '\n'
		case 'r':
			c = '\r'
		case 't':
			c = '\t'
		case 'u':
			if i+6 > len(raw) {
				return false
			}
			r, ok := hex4(raw[i+2 : i+6])
			// want is ASCII, so a non-ASCII escape never matches.
			if !ok || r >= utf8.RuneSelf || byte(r) != want[j] {
				return false
			}
			i += 6
			j++
			continue
		default:
			return false
		}
		if c != want[j] {
			return false
		}
		i += 2
		j++
	}
	return j == len(want)
}

// hex4 decodes the four hex digits of a \uXXXX escape.
func hex4(h []byte) (rune, bool) {
	var r rune
	for _, c := range h {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		case 'A' <= c && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, false
		}
		r = r<<4 | rune(c)
	}
	return r, true
}
