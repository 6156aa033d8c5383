package jsonscan_test

import (
	"encoding/json"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/llmproxy/caddy-llm-proxy/internal/jsonscan"
)

var validSeeds = []string{``, ` `, `{}`, `[]`, `null`, `1`, `-0`, `01`, `1.`, `.5`, `1e`, `1E+2`, `-`, `"\u12"`, `"\ud800"`,
	"\"\x01\"", "\"\xff\"", `{"a":1,}`, `[1,]`, `{"a" 1}`, `{"a":1} {}`, `  {"a":[1,{"b":null}]}  `, `tru`, `nul`, `"\q"`,
	`{"a":NaN}`, `[-Infinity]`, `{"a":[1,2,{"b":"c\"d"}],"e":true,"f":false}`, `{1:2}`, `{"a":}`, `[,]`, `["a" "b"]`,
	`{"a":1 "b":2}`, `[1]]`, `{"a":{"b":[]}}}`, "[\"\t\"]", `"\/\b\f\n\r\t\\\""`, `0.0e-0`, `-01`, `1e+`}

// FuzzValidMatchesEncodingJSON: the strict walk accepts exactly what
// json.Valid accepts, and a strict Iter over an object (every member
// consumed whole) ends where the object ends exactly when it is valid.
func FuzzValidMatchesEncodingJSON(f *testing.F) {
	for _, s := range validSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		want := json.Valid(b)
		if got := jsonscan.Valid(b); got != want {
			t.Fatalf("%q: Valid %v, json.Valid %v", b, got, want)
		}
		it, ok := jsonscan.Object(b, 0, true)
		if !ok {
			return
		}
		for {
			if _, ok := it.NextKey(); !ok {
				break
			}
			if _, ok := it.Value(); !ok {
				break
			}
		}
		walked := it.End() >= 0 && jsonscan.SkipSpace(b, it.End()) == len(b)
		if walked != want {
			t.Fatalf("%q: strict Iter walked it %v, json.Valid %v", b, walked, want)
		}
	})
}

// A strict walk refuses nesting deeper than encoding/json's limit, and
// accepts it at the limit, through Valid and through Enter alike.
func TestStrictWalkStopsAtEncodingJSONsDepth(t *testing.T) {
	for _, depth := range []int{jsonscan.MaxDepth, jsonscan.MaxDepth + 1} {
		doc := []byte(strings.Repeat("[", depth) + strings.Repeat("]", depth))
		want := json.Valid(doc)
		if got := jsonscan.Valid(doc); got != want {
			t.Errorf("depth %d: Valid %v, json.Valid %v", depth, got, want)
		}
		// The same document walked level by level with Enter.
		it, _ := jsonscan.Array(doc, 0, true)
		var walk func(it *jsonscan.Iter) bool
		walk = func(it *jsonscan.Iter) bool {
			for it.NextElem() {
				child := it.Enter()
				if !walk(&child) || !it.Leave(&child) {
					return false
				}
			}
			return it.End() >= 0
		}
		if got := walk(&it); got != want {
			t.Errorf("depth %d: walked with Enter %v, json.Valid %v", depth, got, want)
		}
	}
}

// A loose walk reads past what Python writes for a float it cannot encode
// (NaN, -Infinity in a logprob) and finds the members after it.
func TestLooseWalkReadsPastNaN(t *testing.T) {
	data := []byte(`{"logprob":-Infinity,"x":NaN,"finish_reason":"stop"}`)
	it, _ := jsonscan.Object(data, 0, false)
	var found string
	for {
		k, ok := it.NextKey()
		if !ok {
			break
		}
		v, _ := it.Value()
		if jsonscan.KeyIs(k, "finish_reason") {
			found = string(v)
		}
	}
	if found != `"stop"` || it.End() != len(data) {
		t.Fatalf("found %s, end %d", found, it.End())
	}
	strict, _ := jsonscan.Object(data, 0, true)
	for {
		if _, ok := strict.NextKey(); !ok {
			break
		}
		if _, ok := strict.Value(); !ok {
			break
		}
	}
	if strict.End() != -1 {
		t.Fatal("a strict walk accepted -Infinity")
	}
}

func TestKeyIsDecodesEscapes(t *testing.T) {
	for _, tt := range []struct {
		raw, want string
		match     bool
	}{
		{`usage`, "usage", true},
		{`usag\u0065`, "usage", true},
		{`\u0075sage`, "usage", true},
		{`usag\u00e9`, "usage", false},
		{`usage\n`, "usage", false},
		{`usag\e`, "usage", false},
		{`us\"ge`, "us\"ge", true},
		{`Usage`, "usage", false},
		{`usag`, "usage", false},
	} {
		if got := jsonscan.KeyIs([]byte(tt.raw), tt.want); got != tt.match {
			t.Errorf("KeyIs(%s, %q) = %v", tt.raw, tt.want, got)
		}
	}
}

// FuzzStringDecodesAsEncodingJSON: String decodes every valid literal as
// json.Unmarshal does, RuneCount counts its code points, and AppendString
// writes a literal that decodes back to the string (invalid UTF-8 as
// U+FFFD).
func FuzzStringDecodesAsEncodingJSON(f *testing.F) {
	for _, s := range []string{`"abc"`, `"\u00e9\n"`, `"\ud83d\ude00"`, `"\ud800"`, `"\ud800\u0041"`, "\"\xff\"", `"a\"b\\"`, `"\u2028"`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, q []byte) {
		var want string
		if json.Unmarshal(q, &want) != nil || q[0] != '"' || q[len(q)-1] != '"' {
			return
		}
		if got := jsonscan.String(q); got != want {
			t.Fatalf("String(%q) = %q, want %q", q, got, want)
		}
		if got, want := jsonscan.RuneCount(q), utf8.RuneCountInString(want); got != want {
			t.Fatalf("RuneCount(%q) = %d, want %d", q, got, want)
		}
		raw := string(q)
		out := jsonscan.AppendString(nil, raw)
		var back string
		if err := json.Unmarshal(out, &back); err != nil || back != string([]rune(raw)) || strings.ContainsAny(string(out), "\n\r") {
			t.Fatalf("AppendString(%q) = %s, decodes to %q (%v)", raw, out, back, err)
		}
	})
}
