package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/tidwall/gjson"
)

// The top-level fields each API's parser reads (Messages' "thinking" is
// read by the degradation ladder, which keeps its budget below a clamped
// max_tokens); a body that repeats one, or sends one differing only in
// case, is refused (see ambiguousField).
var (
	responsesFields = []string{"model", "stream", "max_output_tokens", "input", "instructions", "tools"}
	messagesFields  = []string{"model", "stream", "max_tokens", "messages", "system", "tools", "thinking"}
)

// parseResponses reads an OpenAI Responses request: model, stream,
// max_output_tokens, and the estimate over instructions, input and tools.
func parseResponses(body []byte) (Request, error) {
	return parseTyped(body, responsesFields, "max_output_tokens", func(root gjson.Result) int {
		return textChars(root.Get("instructions")) + textChars(root.Get("input")) + jsonChars(root.Get("tools"))
	})
}

// parseMessages reads an Anthropic Messages request: model, stream,
// max_tokens, and the estimate over system, messages and tools.
func parseMessages(body []byte) (Request, error) {
	return parseTyped(body, messagesFields, "max_tokens", func(root gjson.Result) int {
		return textChars(root.Get("system")) + textChars(root.Get("messages")) + jsonChars(root.Get("tools"))
	})
}

// parseTyped is the parser of the APIs whose requests the gateway reads
// with gjson: body must be one JSON object; model a string, stream a
// boolean and the output limit (limitField) a non-negative integer, each
// when present and not null.
func parseTyped(body []byte, fields []string, limitField string, chars func(gjson.Result) int) (Request, error) {
	req := Request{N: 1}
	if len(body) == 0 {
		return req, nil
	}
	if !gjson.ValidBytes(body) { // as json.Valid (FuzzValidMatchesEncodingJSON), at several times its speed
		var v any
		err := json.Unmarshal(body, &v)
		if err == nil {
			err = errors.New("not valid JSON")
		}
		return Request{}, fmt.Errorf("invalid JSON body: %w", err)
	}
	if firstNonSpace(body) != '{' {
		return Request{}, errors.New("invalid JSON body: expected a JSON object")
	}
	if key := ambiguousFieldIn(body, fields); key != "" {
		return Request{}, fmt.Errorf("invalid JSON body: field %q repeats or differs only in case from a field the gateway reads; send each of %s once, in lower case",
			key, strings.Join(fields, ", "))
	}
	root := gjson.Parse(str(body))
	switch m := root.Get("model"); m.Type {
	case gjson.String:
		req.Model = copyStr(m.Str)
	case gjson.Null:
	default:
		return Request{}, errors.New("invalid model: must be a string")
	}
	switch s := root.Get("stream"); s.Type {
	case gjson.True:
		req.Stream = true
	case gjson.False, gjson.Null:
	default:
		return Request{}, errors.New("invalid stream: must be a boolean")
	}
	switch l := root.Get(limitField); l.Type {
	case gjson.Null:
	case gjson.Number:
		n, ok := intValue(l.Raw)
		if !ok || n < 0 {
			return Request{}, fmt.Errorf("invalid %s %s: must be a non-negative integer", limitField, l.Raw)
		}
		req.MaxTokens, req.MaxTokensSet = n, true
	default:
		return Request{}, fmt.Errorf("invalid %s: must be an integer", limitField)
	}
	req.PromptTokens = (chars(root) + 3) / 4
	return req, nil
}

// intValue parses a JSON integer (optionally negative, at most 18 digits).
func intValue(raw string) (int, bool) {
	neg := strings.HasPrefix(raw, "-")
	n := parseCount(strings.TrimPrefix(raw, "-"))
	if n == 0 && strings.Trim(raw, "-0") != "" {
		return 0, false
	}
	if neg {
		n = -n
	}
	return n, true
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

// textChars counts the code points of every string the model reads in r:
// a string itself, the elements of an array, the members of an object
// except metaKeys (but the text of a document's source: see readValue).
// Numbers, booleans and null count nothing.
func textChars(r gjson.Result) int {
	switch {
	case r.Type == gjson.String:
		return utf8.RuneCountInString(r.Str)
	case r.IsArray(), r.IsObject():
		n := 0
		obj := r.IsObject()
		r.ForEach(func(k, v gjson.Result) bool {
			if v, ok := readValue(obj, k, v); ok {
				n += textChars(v)
			}
			return true
		})
		return n
	}
	return 0
}

// readValue returns the part of member k (value v) of an object (obj) or
// element of an array that the model reads as text, ok false for none: an
// array's elements and an object's members that are not metaKeys whole;
// of a "source", only an Anthropic Messages document's text — source.type
// "text" (its "data", plain text) or "content" (its "content": a string or
// content blocks); an image's, a base64 PDF's, a URL's or a file's source
// is none.
func readValue(obj bool, k, v gjson.Result) (gjson.Result, bool) {
	switch {
	case !obj || !metaKeys[k.Str]:
		return v, true
	case k.Str != "source" || !v.IsObject():
		return gjson.Result{}, false
	}
	switch v.Get("type").Str {
	case "text":
		return v.Get("data"), true
	case "content":
		return v.Get("content"), true
	}
	return gjson.Result{}, false
}

// jsonChars counts the code points of r's JSON text (tool definitions, as
// the server renders them into the prompt); absent or null counts nothing.
func jsonChars(r gjson.Result) int {
	if !r.Exists() || r.Type == gjson.Null {
		return 0
	}
	return utf8.RuneCountInString(r.Raw)
}
