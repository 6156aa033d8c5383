package api

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/tidwall/gjson"
)

// FuzzAmbiguousFieldWalksKeysAsGjson: the in-place walk of the top-level
// keys finds what gjson.ParseBytes(body).ForEach found (its former
// implementation, which copied the body), for every body ParseRequest's
// json.Unmarshal accepts as an object.
func FuzzAmbiguousFieldWalksKeysAsGjson(f *testing.F) {
	for _, s := range []string{
		`{"max_tokens":1,"MAX_TOKENS":2}`, `{"model":"a","model":"b"}`, `{"m\u006fdel":"a","model":"b"}`,
		` { "a" : [1,{"model":2}] , "Stream":true } `, `{"x":"}\"model\":","n":1}`, `{}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var obj map[string]json.RawMessage
		if json.Unmarshal(body, &obj) != nil || obj == nil {
			return
		}
		var seen [len(readFields)]bool
		want := ""
		gjson.ParseBytes(body).ForEach(func(k, _ gjson.Result) bool {
			for i, f := range readFields {
				if !strings.EqualFold(k.Str, f) {
					continue
				}
				if k.Str != f || seen[i] {
					want = k.Str
					return false
				}
				seen[i] = true
			}
			return true
		})
		if got := ambiguousField(body); got != want {
			t.Fatalf("ambiguousField(%q) = %q, want %q", body, got, want)
		}
	})
}
