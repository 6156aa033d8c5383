package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/tidwall/gjson"
)

// read is step 1: the body into memory, bounded by max_request_body and
// charged to the body budget, and the parse of the few fields the gateway
// acts on. A body the llm_model matcher already read (a *Body in r.Body)
// is taken as it is, neither read nor charged again. It records why it
// could not go on (finish answers 400, 408, 413, or 503 when the body
// budget has no room) and reports whether to go on. The body's charge is
// given back when the request's context ends, which run's deferred cancel
// does after finish, on every path.
func (x *exchange) read() bool {
	if d := x.p.cfg.StreamTimeout; d > 0 {
		// stream_timeout runs from the request's arrival: a body that
		// trickles in must not hold the request past it. A connection
		// deadline is wall-clock time, whatever the proxy's Clock.
		rc := http.NewResponseController(x.w)
		if rc.SetReadDeadline(time.Now().Add(d-x.since(x.start))) == nil {
			defer func() { _ = rc.SetReadDeadline(time.Time{}) }()
		}
	}
	body, err := BufferBody(x.ctx, x.r, BodyLimits{Limit: x.p.cfg.MaxRequestBody, Budget: x.p.cfg.BodyBudget, Clock: x.p.clock})
	if errors.Is(err, ErrBodyBudget) {
		x.refusal = &GatewayError{Status: http.StatusServiceUnavailable, Type: TypeServer,
			Code: "body_memory_exhausted", RetryAfter: 1,
			Message: "the gateway has no memory free for the request body now (max_buffered_bodies); retry shortly"}
		// Answered first, then the body read to nowhere (finish), so that a
		// client still sending it reads the 503 instead of a reset.
		x.discardAfter = http.NewResponseController(x.w).EnableFullDuplex() == nil
		return false
	}
	if err != nil && x.ctx.Err() != nil && errors.Is(err, context.Cause(x.ctx)) {
		// The request ended while it waited for the budget (client gone,
		// stream_timeout): answered as a wait for admission is.
		x.refusal = err
		return false
	}
	if err != nil {
		x.readErr, x.readGone = err, x.clientGone()
		return false
	}
	x.body = body.Bytes()
	if isJSONRequest(x.r) {
		info, err := body.Parse()
		if err != nil {
			x.jsonErr = err
			return false
		}
		x.res.Info = info
		if x.p.cfg.RequestUsage && info.Stream && !info.IncludeUsage {
			if edited, ok := requestUsage(x.body); ok {
				x.body, x.stripUsage = edited, true
			}
		}
	}
	return true
}

// requestUsage returns body with stream_options.include_usage set to true,
// every other byte as the client sent it: the upstream then reports the
// stream's real usage in a usage-only chunk, which relay reads and keeps
// from the client that did not ask for it. The edit is made in place when
// body has the room after it (a read body keeps usageSlack bytes), else in
// a copy. ok is false when the body cannot be edited (it is then sent
// unchanged).
func requestUsage(body []byte) (edited []byte, ok bool) {
	at, del, ins, ok := usageEdit(body)
	if !ok {
		return body, false
	}
	n := len(body) - del + len(ins)
	var out []byte
	if n <= cap(body) {
		out = body[:n]
	} else {
		out = make([]byte, n)
		copy(out, body[:at])
	}
	copy(out[at+len(ins):], body[at+del:])
	copy(out[at:], ins)
	return out, true
}

// usageEdit finds the edit that sets stream_options.include_usage to true,
// as sjson.SetBytes would make it: replace body[at:at+del] with ins. A
// missing member is appended at the end of its object; a stream_options
// that is not an object (null) is replaced by one. ok is false when body is
// not an object or a value cannot be located.
func usageEdit(body []byte) (at, del int, ins string, ok bool) {
	end := len(body)
	for end > 0 && isJSONSpace(body[end-1]) {
		end--
	}
	if end == 0 || body[end-1] != '}' || firstNonSpace(body) != '{' {
		return 0, 0, "", false
	}
	so := gjson.GetBytes(body[:end], "stream_options")
	switch {
	case !so.Exists():
		ins = `"stream_options":{"include_usage":true}`
		if hasMembers(body[skipSpace(body, 0):end]) {
			ins = "," + ins
		}
		return end - 1, 0, ins, true
	case so.Index <= 0:
		return 0, 0, "", false
	case so.IsObject():
		iu := so.Get("include_usage")
		if iu.Exists() {
			if iu.Index <= 0 {
				return 0, 0, "", false
			}
			return iu.Index, len(iu.Raw), "true", true // Result.Get indexes the whole body
		}
		ins = `"include_usage":true`
		if hasMembers([]byte(so.Raw)) {
			ins = "," + ins
		}
		return so.Index + len(so.Raw) - 1, 0, ins, true
	}
	return so.Index, len(so.Raw), `{"include_usage":true}`, true
}

// hasMembers reports whether the JSON object obj (braces included, no
// space around them) has a member.
func hasMembers(obj []byte) bool {
	for _, c := range obj[1 : len(obj)-1] {
		if !isJSONSpace(c) {
			return true
		}
	}
	return false
}

func isJSONSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\r' || c == '\n' }

// DefaultMaxRequestBody is the request body limit when none is configured:
// 16 MiB holds a 128K-token prompt with room to spare.
const DefaultMaxRequestBody int64 = 16 << 20

// ErrBodyTooLarge is returned by ReadBody when the body exceeds the limit.
var ErrBodyTooLarge = errors.New("request body too large")

// ReadBody reads r's body into memory, refusing more than limit bytes. A
// declared Content-Length over the limit is refused without reading a byte.
// The buffer is sized once from a declared length (at most 256 KiB of it
// before the bytes arrive), else doubles as the body arrives. The returned
// slice is what every attempt sends, so all attempts carry an identical
// body. It charges no budget (the lifecycle's read does). Errors wrap
// ErrBodyTooLarge or the read error.
func ReadBody(r *http.Request, limit int64) ([]byte, error) {
	b, err := readBody(r.Context(), r, BodyLimits{Limit: limit})
	if err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// RequestInfo holds the few fields of an OpenAI-style request body that the
// gateway acts on. Everything else passes through untouched.
type RequestInfo struct {
	// Model is the "model" field, "" when absent.
	Model string
	// Stream is the "stream" field.
	Stream bool
	// MaxTokens is max_completion_tokens, else max_tokens; 0 when absent.
	MaxTokens int
	// MaxTokensSet reports that max_completion_tokens or max_tokens is
	// present (and not null): MaxTokens is the client's own bound, not a
	// default.
	MaxTokensSet bool
	// N is the number of sequences generated: "n", or "best_of" when
	// larger (the server generates best_of and returns n); 1 when absent.
	N int
	// PromptTokens is the prompt estimate: ⌈characters ÷ 4⌉, where the
	// characters are the Unicode code points of all text content, with no
	// per-message overhead: every chat message's "content" (a string, or
	// the "text" of each of its parts) and the completions "prompt" (a
	// string or an array of strings). A prompt given as token ids (an
	// array of integers, or of such arrays) adds one token per id.
	// Images, audio, tool definitions and names count nothing.
	PromptTokens int
	// IncludeUsage is stream_options.include_usage.
	IncludeUsage bool
	// StreamOptions reports that "stream_options" is present (and not
	// null).
	StreamOptions bool
}

// requestFields mirrors the JSON we read; unknown fields are ignored.
type requestFields struct {
	Model               string `json:"model"`
	Stream              bool   `json:"stream"`
	MaxTokens           *int   `json:"max_tokens"`
	MaxCompletionTokens *int   `json:"max_completion_tokens"`
	N                   *int   `json:"n"`
	BestOf              *int   `json:"best_of"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	Messages []message  `json:"messages"`
	Prompt   promptText `json:"prompt"`
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

// ParseRequest validates body as one JSON object and extracts RequestInfo.
// An empty body yields a zero RequestInfo (N 1). Invalid JSON, a non-object,
// or a listed field of the wrong type (messages not an array of objects,
// content neither a string nor an array of parts, prompt neither a string
// nor an array of strings or token ids, a negative max_tokens, n below 1)
// is an error suitable for a 400 response. It decodes in one pass, and the
// text it counts is measured in place, never copied.
func ParseRequest(body []byte) (RequestInfo, error) {
	info := RequestInfo{N: 1}
	if len(body) == 0 {
		return info, nil
	}
	var f requestFields
	if err := json.Unmarshal(body, &f); err != nil {
		return RequestInfo{}, fmt.Errorf("invalid JSON body: %w", err)
	}
	// json.Unmarshal accepts "null" into a struct; a request must be an object.
	if first := firstNonSpace(body); first != '{' {
		return RequestInfo{}, errors.New("invalid JSON body: expected a JSON object")
	}
	if key := ambiguousField(body); key != "" {
		return RequestInfo{}, fmt.Errorf("invalid JSON body: field %q repeats or differs only in case from a field the gateway reads; send each of %s once, in lower case",
			key, strings.Join(readFields[:], ", "))
	}
	info.Model = f.Model
	info.Stream = f.Stream
	switch {
	case f.MaxCompletionTokens != nil && (*f.MaxCompletionTokens != 0 || f.MaxTokens == nil):
		// vLLM takes max_completion_tokens, else (absent or 0) max_tokens.
		info.MaxTokens, info.MaxTokensSet = *f.MaxCompletionTokens, true
	case f.MaxTokens != nil:
		info.MaxTokens, info.MaxTokensSet = *f.MaxTokens, true
	}
	if info.MaxTokens < 0 {
		return RequestInfo{}, fmt.Errorf("invalid max_tokens %d: must not be negative", info.MaxTokens)
	}
	if f.N != nil {
		if *f.N < 1 {
			return RequestInfo{}, fmt.Errorf("invalid n %d: must be at least 1", *f.N)
		}
		info.N = *f.N
	}
	if f.BestOf != nil {
		// /v1/completions' best_of: the server generates that many
		// sequences and returns n of them; reserve for what it generates.
		if *f.BestOf < 1 {
			return RequestInfo{}, fmt.Errorf("invalid best_of %d: must be at least 1", *f.BestOf)
		}
		info.N = max(info.N, *f.BestOf)
	}
	info.StreamOptions = f.StreamOptions != nil
	info.IncludeUsage = f.StreamOptions != nil && f.StreamOptions.IncludeUsage
	chars := f.Prompt.chars
	for i := range f.Messages {
		chars += f.Messages[i].Content.chars
	}
	info.PromptTokens = (chars+3)/4 + f.Prompt.tokens
	return info, nil
}

// readFields are the top-level fields the gateway reads from a body.
var readFields = [...]string{"model", "stream", "max_tokens", "max_completion_tokens", "n", "best_of", "messages", "prompt", "stream_options"}

// ambiguousField returns a top-level key that repeats one of readFields or
// differs from it only in case, "" when there is none. encoding/json
// matches names case-insensitively and keeps the last duplicate, while the
// inference servers (Python) read the exact key: {"max_tokens":100000,
// "MAX_TOKENS":1} would be reserved as 1 token and generate 100,000.
func ambiguousField(body []byte) string {
	var seen [len(readFields)]bool
	// body is one valid JSON object (ParseRequest checked): walk its
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
		for j, f := range readFields {
			if !strings.EqualFold(key, f) {
				continue
			}
			if key != f || seen[j] {
				return key
			}
			seen[j] = true
		}
	}
	return ""
}

// jsonKey decodes the quoted JSON key q; only an escaped one allocates.
func jsonKey(q []byte) string {
	if bytes.IndexByte(q, '\\') < 0 {
		return string(q[1 : len(q)-1]) // compared only: does not escape
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

// skipJSON returns the index after the valid JSON value at b[i].
func skipJSON(b []byte, i int) int {
	switch b[i] {
	case '"':
		for j := i + 1; j < len(b); j++ {
			switch b[j] {
			case '\\':
				j++
			case '"':
				return j + 1
			}
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

// isJSONRequest reports whether the request body should be parsed as JSON:
// OpenAI's completion endpoints take JSON whatever the client labels it
// (curl -d sends application/x-www-form-urlencoded), so every body is
// parsed except uploads: multipart forms (audio transcription, files) and
// raw binary or media types, which pass through unparsed.
func isJSONRequest(r *http.Request) bool {
	ct := r.Header.Get("Content-Type")
	if ct == "" {
		return true
	}
	ct = strings.ToLower(strings.TrimSpace(strings.SplitN(ct, ";", 2)[0]))
	switch {
	case strings.HasPrefix(ct, "multipart/"), ct == "application/octet-stream",
		strings.HasPrefix(ct, "audio/"), strings.HasPrefix(ct, "image/"), strings.HasPrefix(ct, "video/"):
		return false
	}
	return true
}

// discardBody reads a refused request's body to nowhere (nothing is held),
// after its answer was written, for at most discardFor and MaxRequestBody
// bytes: the server closes a connection whose large body was left unread,
// and a client still writing it into the connection gets a broken pipe
// instead of the 503 it was sent.
func (x *exchange) discardBody() {
	rc := http.NewResponseController(x.w)
	if rc.SetReadDeadline(time.Now().Add(discardFor)) == nil {
		defer func() { _ = rc.SetReadDeadline(time.Time{}) }()
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(x.r.Body, x.p.cfg.MaxRequestBody+1))
}

// discardFor bounds how long a refused body is read to nowhere.
const discardFor = 2 * time.Second
