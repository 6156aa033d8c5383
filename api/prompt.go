package api

import "github.com/tidwall/gjson"

// PromptText yields, in order, the text that a's server reads as the
// prompt of body, one string at a time, for routing by prompt prefix
// (lb_policy prefix_cache): the tool definitions' JSON text first ("tools",
// then Chat's legacy "functions"), as the servers render them ahead of
// the conversation, then Chat's "messages", Completions' "prompt",
// Responses' "instructions" and "input", or Messages' "system" and
// "messages". Within them it yields every string the model reads, in
// document order, as Request.PromptTokens counts them (ids, types, roles,
// signatures and media sources are skipped, a Messages document's text is
// not); a completions prompt of token
// ids is yielded as its JSON text. None, an empty body or one that is not
// JSON yields nothing. It stops when yield returns false. The order is the
// same on every turn of a conversation, which is what a prefix needs.
func PromptText(a API, body []byte, yield func(string) bool) {
	if len(body) == 0 || !gjson.ValidBytes(body) {
		return
	}
	var fields []string
	switch a {
	case Chat:
		fields = []string{"tools", "functions", "messages"}
	case Completions:
		fields = []string{"tools", "prompt"}
	case Responses:
		fields = []string{"tools", "instructions", "input"}
	case Messages:
		fields = []string{"tools", "system", "messages"}
	default:
		return
	}
	root := gjson.Parse(str(body))
	for _, f := range fields {
		v := root.Get(f)
		switch {
		case !v.Exists() || v.Type == gjson.Null:
			continue
		case f == "tools" || f == "functions" || (f == "prompt" && tokenIDs(v)):
			if !yield(v.Raw) {
				return
			}
		case !textSegments(v, yield):
			return
		}
	}
}

// tokenIDs reports whether a completions prompt is given as token ids (an
// array of numbers, or of such arrays).
func tokenIDs(v gjson.Result) bool {
	if !v.IsArray() {
		return false
	}
	ids := false
	v.ForEach(func(_, e gjson.Result) bool {
		ids = e.Type == gjson.Number || (e.IsArray() && tokenIDs(e))
		return false
	})
	return ids
}

// textSegments yields every string the model reads in r (as textChars
// counts them); false when yield asked to stop.
func textSegments(r gjson.Result, yield func(string) bool) bool {
	switch {
	case r.Type == gjson.String:
		return yield(r.Str)
	case r.IsArray(), r.IsObject():
		ok := true
		obj := r.IsObject()
		r.ForEach(func(k, v gjson.Result) bool {
			if v, read := readValue(obj, k, v); read {
				ok = textSegments(v, yield)
			}
			return ok
		})
		return ok
	}
	return true
}
