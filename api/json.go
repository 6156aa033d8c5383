package api

import (
	"bytes"
	"unsafe"

	"github.com/tidwall/gjson"
)

// str views b as a string without copying, for gjson: the string must not
// outlive b's current contents (every use here ends before Inspect
// returns, or copies).
func str(b []byte) string { return unsafe.String(unsafe.SliceData(b), len(b)) }

// get returns the value at path in the JSON data; a plain string's Str
// aliases data (gjson copies only strings with escapes).
func get(data []byte, path string) gjson.Result { return gjson.Get(str(data), path) }

// countOf returns the integer member key of the object r.
func countOf(r gjson.Result, key string) (n int, ok bool) {
	v := r.Get(key)
	if v.Type != gjson.Number {
		return 0, false
	}
	return parseCount(v.Raw), true
}

// eventType is an event's type: its SSE event name when it has one (vLLM,
// OpenAI and Anthropic name every event after its type), else the data's
// top-level "type".
func eventType(name, data []byte) string {
	if len(name) > 0 {
		return str(name)
	}
	return get(data, "type").Str
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

// copyStr returns a copy of s (a gjson string that may alias an event's
// buffer).
func copyStr(s string) string { return string([]byte(s)) }
