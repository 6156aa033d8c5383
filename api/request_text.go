package api

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"
	"unsafe"

	"github.com/llmproxy/caddy-llm-proxy/internal/jsonscan"
)

// The text of a request: what the prompt estimate counts and PromptText
// yields, read by one walker (textWalk) over any JSON value, and Chat's
// own rules for its messages and prompt.

var (
	// errMessage is the error of a chat message that is not an object.
	errMessage = errors.New("messages must be an array of objects")
	// errParts is the error of content parts of the wrong shape.
	errParts = errors.New("content parts must be objects whose text is a string")
	// errPrompt is the error of a completions prompt of the wrong shape.
	errPrompt = errors.New("prompt must be a string, an array of strings or token ids")
	// errSyntax: the value is not valid JSON (the parse reports the
	// body's syntax error).
	errSyntax = errors.New("invalid JSON")
)

// str views b as a string without copying: the string must not outlive
// b's current contents (every use compares, looks up or yields it before
// b changes).
func str(b []byte) string { return unsafe.String(unsafe.SliceData(b), len(b)) }

// keyString is the decoded raw key (between its quotes): a view of its
// bytes when it has no escape (to be compared, not kept), decoded (and
// allocated) when it has one.
func keyString(raw []byte) string {
	if bytes.IndexByte(raw, '\\') < 0 {
		return str(raw)
	}
	q := make([]byte, 0, len(raw)+2)
	return jsonscan.String(append(append(append(q, '"'), raw...), '"'))
}

// metaKeys are the members of input items and content blocks that the
// model does not read as text: identifiers, types, signatures, and the
// sources of images, audio and files (base64 data would count thousands
// of tokens the model never reads as text).
var metaKeys = map[string]bool{
	"type": true, "id": true, "role": true, "call_id": true, "tool_use_id": true, "status": true,
	"signature": true, "encrypted_content": true, "cache_control": true, "source": true,
	"image_url": true, "file_id": true, "file_data": true, "file_url": true, "media_type": true,
	"url": true, "detail": true, "index": true, "data": true, "input_audio": true, "audio": true,
}

// textWalk visits every string the model reads in a JSON value: a string
// itself, the elements of an array, the members of an object except
// metaKeys (but the text of a document's source: see source). Numbers,
// booleans and null are nothing. It counts their code points (chars) or,
// with yield set, yields each one decoded until yield returns false.
type textWalk struct {
	chars   int
	yield   func(string) bool
	stopped bool
}

// value walks the value at it's position, consuming it. It reports false
// when the value is malformed (it's walk is then over) or yield stopped
// the walk (stopped).
func (w *textWalk) value(it *jsonscan.Iter) bool {
	switch it.Peek() {
	case '"':
		v, ok := it.Value()
		return ok && w.text(v)
	case '{', '[':
		child := it.Enter()
		if !w.container(&child) {
			return false
		}
		return it.Leave(&child)
	}
	_, ok := it.Value()
	return ok
}

// text visits the string literal q.
func (w *textWalk) text(q []byte) bool {
	if w.yield == nil {
		w.chars += jsonscan.RuneCount(q)
		return true
	}
	s := ""
	if in := q[1 : len(q)-1]; bytes.IndexByte(in, '\\') < 0 {
		s = str(in)
	} else {
		s = jsonscan.String(q)
	}
	if !w.yield(s) {
		w.stopped = true
		return false
	}
	return true
}

// container walks the elements or members of c to its end.
func (w *textWalk) container(c *jsonscan.Iter) bool {
	if c.IsArray() {
		for c.NextElem() {
			if !w.value(c) {
				return false
			}
		}
		return true
	}
	for {
		raw, ok := c.NextKey()
		if !ok {
			return true
		}
		key := keyString(raw)
		switch {
		case !metaKeys[key]:
			if !w.value(c) {
				return false
			}
		case key == "source" && c.Peek() == '{':
			src := c.Enter()
			if !w.source(&src) || !c.Leave(&src) {
				return false
			}
		default:
			if _, ok := c.Value(); !ok {
				return false
			}
		}
	}
}

// source walks an object's "source" member: of an Anthropic Messages
// document, its text counts — source.type "text" (its "data", plain text)
// or "content" (its "content": a string or content blocks), each the
// first of its key; an image's, a base64 PDF's, a URL's or a file's
// source is nothing.
func (w *textWalk) source(src *jsonscan.Iter) bool {
	var typ, data, content []byte
	for {
		raw, ok := src.NextKey()
		if !ok {
			break
		}
		v, ok := src.Value()
		if !ok {
			return false
		}
		switch key := keyString(raw); {
		case key == "type" && typ == nil:
			typ = v
		case key == "data" && data == nil:
			data = v
		case key == "content" && content == nil:
			content = v
		}
	}
	if src.End() < 0 {
		return true // the caller's Leave reports it
	}
	var v []byte
	switch jsonText(typ) {
	case "text":
		v = data
	case "content":
		v = content
	}
	if len(v) == 0 {
		return true
	}
	return w.span(v) // valid JSON: the walk above checked it
}

// span walks v, a valid JSON value (a parse checked it), loosely; false
// when yield stopped the walk.
func (w *textWalk) span(v []byte) bool {
	switch v[0] {
	case '"':
		return w.text(v)
	case '{':
		it, _ := jsonscan.Object(v, 0, false)
		return w.container(&it)
	case '[':
		it, _ := jsonscan.Array(v, 0, false)
		return w.container(&it)
	}
	return true
}

// messagesChars sums the content characters of an array of chat messages
// (arr, entered), each of which must be an object; only its "content"
// member (its exact name, as the inference servers read it; when it
// repeats, the last one counts) is read. A syntax error ends arr's walk
// and returns no error (the caller's Leave reports it).
func messagesChars(arr *jsonscan.Iter) (int, error) {
	chars := 0
	for arr.NextElem() {
		if arr.Peek() != '{' {
			return 0, errMessage
		}
		msg := arr.Enter()
		n, err := 0, error(nil)
		for {
			raw, ok := msg.NextKey()
			if !ok {
				break
			}
			if !jsonscan.KeyIs(raw, "content") {
				if _, ok := msg.Value(); !ok {
					break
				}
				continue
			}
			n, err = contentChars(&msg)
			if err == errSyntax {
				return 0, nil
			}
		}
		if !arr.Leave(&msg) {
			return 0, nil
		}
		if err != nil {
			return 0, err
		}
		chars += n
	}
	return chars, nil
}

// contentChars measures a chat message's content at msg's position,
// consuming it: a string, null, or an array of parts whose "text" strings
// count (image and audio parts count nothing); errSyntax when it is not
// valid JSON.
func contentChars(msg *jsonscan.Iter) (int, error) {
	switch msg.Peek() {
	case '"':
		v, ok := msg.Value()
		if !ok {
			return 0, errSyntax
		}
		return jsonscan.RuneCount(v), nil
	case '[':
		parts := msg.Enter()
		n, err := partsChars(&parts)
		if err != nil {
			if _, ok := msg.Value(); !ok {
				return 0, errSyntax
			}
			return 0, err
		}
		if !msg.Leave(&parts) {
			return 0, errSyntax
		}
		return n, nil
	}
	v, ok := msg.Value()
	switch {
	case !ok:
		return 0, errSyntax
	case v[0] == 'n': // null: an assistant message with tool calls
		return 0, nil
	}
	return 0, errors.New("content must be a string or an array of parts")
}

// partsChars counts the code points of the "text" strings of an array of
// content parts (entered); when a part repeats "text", the last one
// counts. A syntax error ends the walk with no error.
func partsChars(arr *jsonscan.Iter) (int, error) {
	n := 0
	for arr.NextElem() {
		if arr.Peek() != '{' {
			return 0, errParts
		}
		part := arr.Enter()
		text, err := 0, error(nil)
		for {
			raw, ok := part.NextKey()
			if !ok {
				break
			}
			v, ok := part.Value()
			if !ok {
				break
			}
			if jsonscan.KeyIs(raw, "text") {
				switch v[0] {
				case '"':
					text, err = jsonscan.RuneCount(v), nil
				case 'n':
					text, err = 0, nil
				default:
					err = errParts
				}
			}
		}
		if !arr.Leave(&part) {
			return 0, nil
		}
		if err != nil {
			return 0, err
		}
		n += text
	}
	return n, nil
}

// promptChars measures a completions prompt at it's position, consuming
// it: a string (its characters), an array of strings, or token ids (an
// array of integers, or an array of such arrays: one token each), as
// encoding/json decodes them into strings and uint32s (a null id counts
// one). errSyntax when it is not valid JSON.
func promptChars(it *jsonscan.Iter) (chars, tokens int, err error) {
	switch it.Peek() {
	case '"':
		v, ok := it.Value()
		if !ok {
			return 0, 0, errSyntax
		}
		return jsonscan.RuneCount(v), 0, nil
	case '[':
		arr := it.Enter()
		for arr.NextElem() {
			switch arr.Peek() {
			case '"':
				v, ok := arr.Value()
				if !ok {
					break
				}
				chars += jsonscan.RuneCount(v)
			case '[':
				ids := arr.Enter()
				for ids.NextElem() {
					v, ok := ids.Value()
					if !ok {
						break
					}
					if !tokenID(v) && err == nil {
						err = errPrompt
					}
					tokens++
				}
				if !arr.Leave(&ids) {
					return 0, 0, errSyntax
				}
			default:
				v, ok := arr.Value()
				if !ok {
					break
				}
				if !tokenID(v) && err == nil {
					err = errPrompt
				}
				tokens++
			}
		}
		if !it.Leave(&arr) {
			return 0, 0, errSyntax
		}
		if err != nil {
			return 0, 0, err
		}
		return chars, tokens, nil
	}
	v, ok := it.Value()
	switch {
	case !ok:
		return 0, 0, errSyntax
	case v[0] == 'n':
		return 0, 0, nil
	}
	return 0, 0, errPrompt
}

// tokenID reports whether the valid JSON value v decodes into a uint32 as
// encoding/json decodes it: digits only, at most 4294967295, or null.
func tokenID(v []byte) bool {
	if string(v) == "null" {
		return true
	}
	if v[0] < '0' || v[0] > '9' {
		return false
	}
	_, err := strconv.ParseUint(str(v), 10, 32)
	return err == nil
}

// tokenIDs reports whether a valid completions prompt is given as token
// ids: an array whose first element is a number, or an array of such
// arrays.
func tokenIDs(v []byte) bool {
	for len(v) > 0 && v[0] == '[' {
		v = jsonscan.TrimSpace(v[1:])
	}
	return len(v) > 0 && (v[0] == '-' || v[0] >= '0' && v[0] <= '9')
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

// intValue parses a JSON integer (optionally negative, at most 18 digits).
func intValue(raw []byte) (int, bool) {
	neg := len(raw) > 0 && raw[0] == '-'
	if neg {
		raw = raw[1:]
	}
	n := jsonscan.Count(raw)
	if n == 0 && len(bytes.Trim(raw, "0")) != 0 {
		return 0, false
	}
	if neg {
		n = -n
	}
	return n, true
}
