package sse

import (
	"bytes"
	"strconv"

	"github.com/llmproxy/caddy-llm-proxy/internal/jsonscan"
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
	// top-level "object" is "error" (older vLLM). What the error says is
	// the API's to read (package api).
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
	d := jsonscan.TrimSpace(e.Data)
	if string(d) == "[DONE]" {
		return KindDone
	}
	if len(d) > 0 && d[0] == '{' && mayBeError(d) && isErrorObject(d) {
		return KindError
	}
	return KindData
}

// mayBeError is a fast pre-check for isErrorObject: both the "error" key and
// the "error" value spell "rror" literally unless written with \u escapes.
func mayBeError(d []byte) bool {
	return bytes.Contains(d, []byte("rror")) || bytes.Contains(d, []byte(`\u`))
}

// isErrorObject reports whether a JSON object has a top-level "error" that is
// an object or a string, or a top-level "object" equal to "error". The last
// occurrence of a key counts, as encoding/json reads it.
func isErrorObject(d []byte) bool {
	errField, objectIsError := false, false
	it, _ := jsonscan.Object(d, 0, false)
	for {
		key, ok := it.NextKey()
		if !ok {
			return errField || objectIsError
		}
		val, ok := it.Value()
		if !ok {
			return errField || objectIsError
		}
		switch {
		case jsonscan.KeyIs(key, "error"):
			errField = val[0] == '{' || val[0] == '"'
		case jsonscan.KeyIs(key, "object"):
			objectIsError = val[0] == '"' && jsonscan.KeyIs(val[1:len(val)-1], "error")
		}
	}
}
