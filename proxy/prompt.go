package proxy

import "github.com/tidwall/gjson"

// PromptSegments yields the prompt text of a request body in order, for
// selection policies that route by prompt prefix (lb_policy prefix_cache):
// Anthropic's "system", Responses' "instructions", the "tools" definitions
// (their JSON as sent), then each of "messages" (Chat Completions, Anthropic
// Messages), Responses' "input" or the completions "prompt": a string as
// it is, an array's strings and the "text" of its content parts, a
// message's "content" likewise. Other parts (images, audio, tool calls) are
// yielded as their JSON. A body that is not a JSON object yields nothing.
// The order is the same on every turn of a conversation, which is all a
// prefix match needs.
func PromptSegments(body []byte, yield func(string) bool) {
	if !gjson.ValidBytes(body) {
		return
	}
	for _, f := range gjson.GetManyBytes(body, "system", "instructions", "tools", "messages", "input", "prompt") {
		if f.Exists() && !yieldPromptText(f, yield, 0) {
			return
		}
	}
}

// yieldPromptText yields the text of v; false when yield asked to stop.
func yieldPromptText(v gjson.Result, yield func(string) bool, depth int) bool {
	switch {
	case v.Type == gjson.String:
		return yield(v.Str)
	case v.IsArray() && depth < 6:
		ok := true
		v.ForEach(func(_, e gjson.Result) bool {
			ok = yieldPromptText(e, yield, depth+1)
			return ok
		})
		return ok
	case v.IsObject() && depth < 6:
		if t := v.Get("text"); t.Type == gjson.String {
			return yield(t.Str)
		}
		if c := v.Get("content"); c.Exists() {
			return yieldPromptText(c, yield, depth+1)
		}
	}
	if v.Type == gjson.Null {
		return true
	}
	return yield(v.Raw)
}
