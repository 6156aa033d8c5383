package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/tidwall/gjson"
)

// Request holds the few fields of a request body that the gateway acts on,
// whatever the API; everything else passes through untouched.
type Request struct {
	// Model is the "model" field, "" when absent.
	Model string
	// Stream is the "stream" field.
	Stream bool
	// MaxTokens is the API's output limit: max_completion_tokens, else
	// max_tokens (Chat, Completions); max_output_tokens (Responses);
	// max_tokens (Messages); 0 when absent.
	MaxTokens int
	// MaxTokensSet reports that the output limit is present (and not
	// null): MaxTokens is the client's own bound, not a default.
	MaxTokensSet bool
	// N is the number of sequences generated: "n", or "best_of" when
	// larger (the server generates best_of and returns n); 1 when absent.
	N int
	// PromptTokens is the prompt estimate (DESIGN §8): ⌈characters ÷ 4⌉,
	// where the characters are the Unicode code points of all text the
	// model reads, with no per-message overhead. Chat and Completions:
	// every message's "content" (a string, or the "text" of each of its
	// parts), the "prompt" (a string or an array of strings) and the tool
	// definitions ("tools", "functions") as their JSON text; a prompt given
	// as token ids (an array of integers, or of such arrays) adds one
	// token per id. Responses: "instructions", the "input" (a string, or
	// the text of its items: message content, function call arguments and
	// outputs, reasoning summaries) and the tools' JSON text. Messages:
	// "system" (a string or text blocks), every message's content (a
	// string, or its blocks: text, tool_use input, tool_result content,
	// thinking, a document's title, context and plain-text or content
	// source) and the tools' JSON text. Images, audio, files (a base64 or
	// URL document among them), ids, types and signatures count nothing.
	PromptTokens int
	// IncludeUsage is stream_options.include_usage (Chat, Completions).
	IncludeUsage bool
	// StreamOptions reports that "stream_options" is present (and not
	// null).
	StreamOptions bool
}

// rawChars counts the code points of a JSON value's text as sent: tool
// definitions are read by the model as the server renders them into the
// prompt, keys and punctuation included.
type rawChars struct{ chars int }

// UnmarshalJSON counts b's code points; null counts nothing.
func (r *rawChars) UnmarshalJSON(b []byte) error {
	r.chars = 0
	if string(b) != "null" {
		r.chars = utf8.RuneCount(b)
	}
	return nil
}

// message is a chat message; only its text content is read.
type message struct {
	Content messageContent
}

// errMessage is the error of a chat message that is not an object.
var errMessage = errors.New("messages must be an array of objects")

// UnmarshalJSON reads the "content" member, by its exact name as the
// inference servers read it (encoding/json would also take "Content"),
// walking the object in place; when it repeats, the last one counts.
func (m *message) UnmarshalJSON(b []byte) error {
	*m = message{}
	if b[0] != '{' {
		return errMessage
	}
	i := skipSpace(b, 1)
	for i < len(b) && b[i] != '}' {
		if b[i] == ',' {
			i = skipSpace(b, i+1)
			continue
		}
		ke := skipJSON(b, i) // the key
		key := b[i:ke]
		i = skipSpace(b, skipSpace(b, ke)+1) // past the colon
		ve := skipJSON(b, i)
		if isKey(key, "content") {
			if err := m.Content.UnmarshalJSON(b[i:ve]); err != nil {
				return err
			}
		}
		i = skipSpace(b, ve)
	}
	return nil
}

// parseChat validates body as one JSON object and extracts Request.
// An empty body yields a zero Request (N 1). Invalid JSON, a non-object,
// or a listed field of the wrong type (messages not an array of objects,
// content neither a string nor an array of parts, prompt neither a string
// nor an array of strings or token ids, a negative max_tokens, n below 1)
// is an error suitable for a 400 response. After json.Valid it walks the
// top-level members once, in place, reading only the fields it needs, with
// encoding/json's semantics for them (keys match case-insensitively, the
// last of a repeated key counts, null leaves a field unset, an integer
// field takes only an integer): encoding/json's reflection decoded at
// 50-80 MB/s and allocated per field; the text it counts is measured in
// place, never copied.
func parseChat(body []byte) (Request, error) {
	info := Request{N: 1}
	if len(body) == 0 {
		return info, nil
	}
	if !gjson.ValidBytes(body) {
		var v any
		err := json.Unmarshal(body, &v) // the syntax error, as encoding/json words it
		return Request{}, fmt.Errorf("invalid JSON body: %w", err)
	}
	// A request must be an object (null, a number... are valid JSON).
	if first := firstNonSpace(body); first != '{' {
		return Request{}, errors.New("invalid JSON body: expected a JSON object")
	}
	if key := ambiguousField(body); key != "" {
		return Request{}, fmt.Errorf("invalid JSON body: field %q repeats or differs only in case from a field the gateway reads; send each of %s once, in lower case",
			key, strings.Join(readFields[:], ", "))
	}
	var (
		// The integer fields, and whether each is set (not absent, not null).
		maxTokens, maxCompletion, n, bestOf    int
		hasMax, hasCompletion, hasN, hasBestOf bool
		streamOptions, includeUsage            bool
		prompt                                 promptText
		tools, funcs                           rawChars
		chars                                  int
	)
	// body is one valid JSON object: walk its members in place.
	i := skipSpace(body, skipSpace(body, 0)+1)
	for i < len(body) && body[i] != '}' {
		if body[i] == ',' {
			i = skipSpace(body, i+1)
			continue
		}
		ke := skipJSON(body, i)
		key := jsonKey(body[i:ke])
		i = skipSpace(body, skipSpace(body, ke)+1) // past the colon
		ve := skipJSON(body, i)
		v := body[i:ve]
		i = skipSpace(body, ve)
		var err error
		switch {
		case strings.EqualFold(key, "model"):
			switch v[0] {
			case '"':
				info.Model = jsonString(v)
			case 'n':
			default:
				err = errors.New("invalid JSON body: model must be a string")
			}
		case strings.EqualFold(key, "stream"):
			switch v[0] {
			case 't', 'f':
				info.Stream = v[0] == 't'
			case 'n':
			default:
				err = errors.New("invalid JSON body: stream must be a boolean")
			}
		case strings.EqualFold(key, "max_tokens"):
			maxTokens, hasMax, err = intField(v, hasMax, maxTokens, "max_tokens")
		case strings.EqualFold(key, "max_completion_tokens"):
			maxCompletion, hasCompletion, err = intField(v, hasCompletion, maxCompletion, "max_completion_tokens")
		case strings.EqualFold(key, "n"):
			n, hasN, err = intField(v, hasN, n, "n")
		case strings.EqualFold(key, "best_of"):
			bestOf, hasBestOf, err = intField(v, hasBestOf, bestOf, "best_of")
		case strings.EqualFold(key, "stream_options"):
			switch v[0] {
			case '{':
				streamOptions, includeUsage = true, false
				includeUsage, err = includeUsageOf(v)
			case 'n':
				streamOptions, includeUsage = false, false
			default:
				err = errors.New("invalid JSON body: stream_options must be an object")
			}
		case strings.EqualFold(key, "messages"):
			chars = 0
			switch v[0] {
			case '[':
				chars, err = messagesChars(v)
			case 'n':
			default:
				err = errMessage
			}
		case strings.EqualFold(key, "prompt"):
			err = prompt.UnmarshalJSON(v)
		case strings.EqualFold(key, "tools"):
			err = tools.UnmarshalJSON(v)
		case strings.EqualFold(key, "functions"):
			err = funcs.UnmarshalJSON(v)
		}
		if err != nil {
			return Request{}, err
		}
	}
	switch {
	case hasCompletion && (maxCompletion != 0 || !hasMax):
		// vLLM takes max_completion_tokens, else (absent or 0) max_tokens.
		info.MaxTokens, info.MaxTokensSet = maxCompletion, true
	case hasMax:
		info.MaxTokens, info.MaxTokensSet = maxTokens, true
	}
	if info.MaxTokens < 0 {
		return Request{}, fmt.Errorf("invalid max_tokens %d: must not be negative", info.MaxTokens)
	}
	if hasN {
		if n < 1 {
			return Request{}, fmt.Errorf("invalid n %d: must be at least 1", n)
		}
		info.N = n
	}
	if hasBestOf {
		// /v1/completions' best_of: the server generates that many
		// sequences and returns n of them; reserve for what it generates.
		if bestOf < 1 {
			return Request{}, fmt.Errorf("invalid best_of %d: must be at least 1", bestOf)
		}
		info.N = max(info.N, bestOf)
	}
	info.StreamOptions = streamOptions
	info.IncludeUsage = streamOptions && includeUsage
	chars += prompt.chars + tools.chars + funcs.chars
	info.PromptTokens = (chars+3)/4 + prompt.tokens
	return info, nil
}

// messagesChars sums the content characters of a valid JSON array of chat
// messages, each of which must be an object (message.UnmarshalJSON).
func messagesChars(v []byte) (int, error) {
	chars := 0
	i := skipSpace(v, 1)
	for i < len(v) && v[i] != ']' {
		if v[i] == ',' {
			i = skipSpace(v, i+1)
			continue
		}
		e := skipJSON(v, i)
		var m message
		if err := m.UnmarshalJSON(v[i:e]); err != nil {
			return 0, err
		}
		chars += m.Content.chars
		i = skipSpace(v, e)
	}
	return chars, nil
}

// includeUsageOf reads include_usage from a valid stream_options object
// (its key matched case-insensitively, the last one counting, null leaving
// it false), as encoding/json would.
func includeUsageOf(v []byte) (bool, error) {
	on := false
	i := skipSpace(v, 1)
	for i < len(v) && v[i] != '}' {
		if v[i] == ',' {
			i = skipSpace(v, i+1)
			continue
		}
		ke := skipJSON(v, i)
		key := jsonKey(v[i:ke])
		i = skipSpace(v, skipSpace(v, ke)+1)
		ve := skipJSON(v, i)
		if strings.EqualFold(key, "include_usage") {
			switch v[i] {
			case 't', 'f':
				on = v[i] == 't'
			case 'n':
			default:
				return false, errors.New("invalid JSON body: stream_options.include_usage must be a boolean")
			}
		}
		i = skipSpace(v, ve)
	}
	return on, nil
}

// intField reads the integer field name from its valid JSON value v: null
// leaves it as it was (x, has), an integer sets it, anything else is an
// error.
func intField(v []byte, has bool, x int, name string) (int, bool, error) {
	if v[0] == 'n' {
		return x, has, nil
	}
	x, err := jsonInt(v)
	if err != nil {
		return 0, false, fmt.Errorf("invalid JSON body: %s must be an integer", name)
	}
	return x, true, nil
}

// jsonInt parses a valid JSON number that must be an integer fitting an
// int, as encoding/json decodes one into an int (no fraction, no
// exponent).
func jsonInt(v []byte) (int, error) {
	if v[0] != '-' && (v[0] < '0' || v[0] > '9') {
		return 0, errors.New("not a number")
	}
	return strconv.Atoi(str(v))
}

// jsonString decodes a valid JSON string literal; one without escapes and
// with valid UTF-8 is copied as it is, any other is decoded by
// encoding/json (invalid UTF-8 becomes U+FFFD).
func jsonString(q []byte) string {
	in := q[1 : len(q)-1]
	if bytes.IndexByte(in, '\\') < 0 && utf8.Valid(in) {
		return string(in)
	}
	var s string
	_ = json.Unmarshal(q, &s)
	return s
}

// readFields are the top-level fields the gateway reads from a body.
var readFields = [...]string{"model", "stream", "max_tokens", "max_completion_tokens", "n", "best_of", "messages", "prompt", "stream_options"}

// ambiguousField returns a top-level key that repeats one of readFields or
// differs from it only in case, "" when there is none. encoding/json
// matches names case-insensitively and keeps the last duplicate, while the
// inference servers (Python) read the exact key: {"max_tokens":100000,
// "MAX_TOKENS":1} would be reserved as 1 token and generate 100,000.
func ambiguousField(body []byte) string { return ambiguousFieldIn(body, readFields[:]) }

// ambiguousFieldIn is ambiguousField for the field list fields (at most 64).
func ambiguousFieldIn(body []byte, fields []string) string {
	var seen uint64
	// body is one valid JSON object (the parser checked): walk its
	// top-level keys in place (gjson.ParseBytes would copy the body).
	i := skipSpace(body, skipSpace(body, 0)+1)
	for i < len(body) && body[i] != '}' {
		if body[i] == ',' {
			i = skipSpace(body, i+1)
			continue
		}
		ke := skipJSON(body, i)
		key := jsonKey(body[i:ke])
		i = skipSpace(body, skipSpace(body, ke)+1) // past the colon
		i = skipSpace(body, skipJSON(body, i))     // past the value
		for j, f := range fields {
			if !strings.EqualFold(key, f) {
				continue
			}
			if key != f || seen&(1<<j) != 0 {
				return key
			}
			seen |= 1 << j
		}
	}
	return ""
}

// jsonKey decodes the quoted JSON key q; only an escaped one allocates.
// An unescaped key is a view of q's bytes (str), to be compared and not
// kept: a copy allocated per key, as the function is not inlined.
func jsonKey(q []byte) string {
	if bytes.IndexByte(q, '\\') < 0 {
		return str(q[1 : len(q)-1])
	}
	var k string
	_ = json.Unmarshal(q, &k)
	return k
}

// messageContent measures a chat message's content: a string, null, or an
// array of parts whose "text" strings count (image and audio parts count
// nothing).
type messageContent struct{ chars int }

// UnmarshalJSON counts the content's characters without decoding them.
func (c *messageContent) UnmarshalJSON(b []byte) error {
	*c = messageContent{} // a repeated key: the last one counts
	switch b[0] {
	case 'n': // null: an assistant message with tool calls
		return nil
	case '"':
		c.chars = jsonStringLen(b)
		return nil
	case '[':
		n, err := partsChars(b)
		c.chars = n
		return err
	}
	return errors.New("content must be a string or an array of parts")
}

// errParts is the error of content parts of the wrong shape.
var errParts = errors.New("content parts must be objects whose text is a string")

// partsChars counts the code points of the "text" strings of an array of
// content parts, walking it in place: b is valid JSON (encoding/json
// checked the whole body before handing it over), so the walk only
// checks the shape. When an object repeats "text", the last one counts.
func partsChars(b []byte) (int, error) {
	n := 0
	i := skipSpace(b, 1)
	for i < len(b) && b[i] != ']' {
		if b[i] == ',' {
			i = skipSpace(b, i+1)
			continue
		}
		if b[i] != '{' {
			return 0, errParts
		}
		text := 0
		i = skipSpace(b, i+1)
		for i < len(b) && b[i] != '}' {
			if b[i] == ',' {
				i = skipSpace(b, i+1)
				continue
			}
			ke := skipJSON(b, i) // the key
			key := b[i:ke]
			i = skipSpace(b, skipSpace(b, ke)+1) // past the colon
			ve := skipJSON(b, i)
			if isTextKey(key) {
				switch b[i] {
				case '"':
					text = jsonStringLen(b[i:ve])
				case 'n':
					text = 0
				default:
					return 0, errParts
				}
			}
			i = skipSpace(b, ve)
		}
		n += text
		i = skipSpace(b, i+1)
	}
	return n, nil
}

// isTextKey reports whether the quoted JSON key q decodes to "text".
func isTextKey(q []byte) bool { return isKey(q, "text") }

// isKey reports whether the quoted JSON key q decodes to name.
func isKey(q []byte, name string) bool {
	if len(q) == len(name)+2 && string(q[1:len(q)-1]) == name {
		return true
	}
	if bytes.IndexByte(q, '\\') < 0 {
		return false
	}
	var k string // an escaped key: rare, decode it
	return json.Unmarshal(q, &k) == nil && k == name
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && isJSONSpace(b[i]) {
		i++
	}
	return i
}

// skipJSON returns the index after the valid JSON value at b[i]. A
// string's end is found with bytes.IndexByte (prompt text is most of a
// body's bytes).
func skipJSON(b []byte, i int) int {
	switch b[i] {
	case '"':
		for j := i + 1; j < len(b); {
			q := bytes.IndexByte(b[j:], '"')
			if q < 0 {
				return len(b)
			}
			j += q
			// The quote ends the string unless an odd run of
			// backslashes escapes it.
			k := j
			for k > i+1 && b[k-1] == '\\' {
				k--
			}
			if (j-k)%2 == 0 {
				return j + 1
			}
			j++
		}
		return len(b)
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				j = skipJSON(b, j) - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return j + 1
				}
			}
		}
		return len(b)
	}
	j := i
	for j < len(b) && !isJSONSpace(b[j]) && b[j] != ',' && b[j] != '}' && b[j] != ']' {
		j++
	}
	return j
}

// promptText measures a completions prompt: a string, an array of strings,
// or token ids (an array of integers, or an array of such arrays).
type promptText struct{ chars, tokens int }

// UnmarshalJSON counts the prompt's characters (or token ids).
func (p *promptText) UnmarshalJSON(b []byte) error {
	*p = promptText{} // a repeated key: the last one counts
	switch b[0] {
	case 'n':
		return nil
	case '"':
		p.chars = jsonStringLen(b)
		return nil
	case '[':
		var elems []promptElem
		if err := json.Unmarshal(b, &elems); err != nil {
			return errors.New("prompt must be a string, an array of strings or token ids")
		}
		for _, e := range elems {
			p.chars += e.chars
			p.tokens += e.tokens
		}
		return nil
	}
	return errors.New("prompt must be a string, an array of strings or token ids")
}

// promptElem is one element of a prompt array: a string, a token id, or
// an array of token ids.
type promptElem struct{ chars, tokens int }

// UnmarshalJSON counts one prompt element.
func (e *promptElem) UnmarshalJSON(b []byte) error {
	*e = promptElem{}
	switch b[0] {
	case '"':
		e.chars = jsonStringLen(b)
		return nil
	case '[':
		var ids []uint32
		if err := json.Unmarshal(b, &ids); err != nil {
			return err
		}
		e.tokens = len(ids)
		return nil
	}
	var id uint32
	if err := json.Unmarshal(b, &id); err != nil {
		return err
	}
	e.tokens = 1
	return nil
}

// jsonStringLen returns the number of code points of the decoded value of
// q, a JSON string literal (quotes included) that encoding/json has
// already validated: an escape is one code point (a surrogate pair one),
// and each byte of invalid UTF-8 is one (it decodes to U+FFFD), as
// utf8.RuneCountInString of the decoded string.
func jsonStringLen(q []byte) int {
	n := 0
	b := q[1 : len(q)-1]
	for i := 0; i < len(b); {
		c := b[i]
		switch {
		case c == '\\':
			if b[i+1] == 'u' && i+12 <= len(b) && isHighSurrogate(b[i+2:i+6]) &&
				b[i+6] == '\\' && b[i+7] == 'u' && isLowSurrogate(b[i+8:i+12]) {
				i += 12
			} else if b[i+1] == 'u' {
				i += 6
			} else {
				i += 2
			}
		case c < utf8.RuneSelf:
			i++
		default:
			_, size := utf8.DecodeRune(b[i:])
			i += size
		}
		n++
	}
	return n
}

// isHighSurrogate and isLowSurrogate test the four hex digits of a \u
// escape for U+D800–DBFF and U+DC00–DFFF.
func isHighSurrogate(h []byte) bool {
	return (h[0] == 'd' || h[0] == 'D') && strings.IndexByte("89abAB", h[1]) >= 0
}

func isLowSurrogate(h []byte) bool {
	return (h[0] == 'd' || h[0] == 'D') && strings.IndexByte("cdefCDEF", h[1]) >= 0
}

func firstNonSpace(b []byte) byte {
	for _, c := range b {
		switch c {
		case ' ', '\t', '\r', '\n':
			continue
		}
		return c
	}
	return 0
}

func isJSONSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\r' || c == '\n' }
