package api

import (
	"bytes"

	"github.com/llmproxy/caddy-llm-proxy/internal/jsonscan"
)

// The readers of Responses' and Messages' events: a member by its path,
// found by a loose walk (the first occurrence of each key; an event that
// stops making sense has no more members), without allocating.

// field returns the raw value at path (nested object members) in data,
// nil when it is absent or data is malformed before it.
func field(data []byte, path ...string) []byte {
	for _, name := range path {
		it, ok := jsonscan.Object(data, 0, false)
		if !ok {
			return nil
		}
		data = nil
		for data == nil {
			raw, ok := it.NextKey()
			if !ok {
				return nil
			}
			v, ok := it.Value()
			if !ok {
				return nil
			}
			if jsonscan.KeyIs(raw, name) {
				data = v
			}
		}
	}
	return data
}

// isObject reports whether the raw value v is an object.
func isObject(v []byte) bool { return len(v) > 0 && v[0] == '{' }

// isNumber reports whether the raw value v is a number.
func isNumber(v []byte) bool { return len(v) > 0 && (v[0] == '-' || v[0] >= '0' && v[0] <= '9') }

// view returns the value of the raw string v without copying when it has
// no escape (to be compared, not kept), decoded when it has one; "" when v
// is not a string.
func view(v []byte) string {
	if len(v) < 2 || v[0] != '"' {
		return ""
	}
	if in := v[1 : len(v)-1]; bytes.IndexByte(in, '\\') < 0 {
		return str(in)
	}
	return jsonscan.String(v)
}

// countOf returns the integer member key of the object u.
func countOf(u []byte, key string) (n int, ok bool) {
	v := field(u, key)
	if !isNumber(v) {
		return 0, false
	}
	return jsonscan.Count(v), true
}

// eventType is an event's type: its SSE event name when it has one (vLLM,
// OpenAI and Anthropic name every event after its type), else the data's
// top-level "type".
func eventType(name, data []byte) string {
	if len(name) > 0 {
		return str(name)
	}
	return view(field(data, "type"))
}

// lastSequence reads the last "sequence_number" in data without walking
// it: Responses events carry it at the top level only.
func lastSequence(data []byte) (n int64, ok bool) {
	i := bytes.LastIndex(data, []byte(`"sequence_number"`))
	if i < 0 {
		return 0, false
	}
	j := i + len(`"sequence_number"`)
	for j < len(data) && (data[j] == ' ' || data[j] == ':' || data[j] == '\t') {
		j++
	}
	k := j
	for k < len(data) && data[k] >= '0' && data[k] <= '9' && k-j < 18 {
		n = n*10 + int64(data[k]-'0')
		k++
	}
	return n, k > j
}
