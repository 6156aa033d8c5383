package api

import (
	"errors"
	"strconv"

	"github.com/llmproxy/caddy-llm-proxy/internal/jsonscan"
)

// What the gateway reads from or writes into a request body after its
// parse, at the places the parse's Layout recorded: the prompt text for
// prefix routing, the usage edit, and the degradation ladder's rewrite.
// Every other byte stays as the client sent it.

// PromptText yields, in order, the text that the server reads as the
// prompt of body, the body r was parsed from, one string at a time, for
// routing by prompt prefix (lb_policy prefix_cache): the tool
// definitions' JSON text first ("tools", then Chat's legacy "functions"),
// as the servers render them ahead of the conversation, then Chat's
// "messages", Completions' "prompt", Responses' "instructions" and
// "input", or Messages' "system" and "messages". Within them it yields
// every string the model reads, in document order, as the estimate counts
// them (ids, types, roles, signatures and media sources are skipped, a
// Messages document's text is not); a completions prompt of token ids is
// yielded as its JSON text. None, and a Request not parsed from a JSON
// body, yield nothing. It stops when yield returns false. The order is
// the same on every turn of a conversation, which is what a prefix needs.
// The strings alias body unless they hold escapes: yield must not keep
// them.
func (r *Request) PromptText(body []byte, yield func(string) bool) {
	if r.Layout == nil {
		return
	}
	for _, f := range r.Layout.prompt {
		if f.end == 0 || int(f.end) > len(body) {
			continue
		}
		v := body[f.val:f.end]
		if f.raw {
			if !yield(str(v)) {
				return
			}
			continue
		}
		if w := (textWalk{yield: yield}); !w.span(v) {
			return
		}
	}
}

// errNoLayout is the error of an edit of a body the Request was not
// parsed from (or no JSON object).
var errNoLayout = errors.New("the request body was not parsed as a JSON object")

// SetIncludeUsage returns body, the body r was parsed from, with
// stream_options.include_usage set to true (the last one, which the
// server reads; stream_options made an object, or added), so that the
// upstream reports the stream's real usage; r's Layout follows the edit.
// The edit is made in place when body has the room after it (cap), else in
// a copy. ok is false when body cannot be edited (it is then unchanged).
func (r *Request) SetIncludeUsage(body []byte) (edited []byte, ok bool) {
	l := r.Layout
	if !l.locates(body) || l.usageSet {
		return body, false
	}
	var at, del int
	var ins string
	switch so, iu := l.streamOptions, l.includeUsage; {
	case so.end == 0:
		at, ins = int(l.close), `"stream_options":{"include_usage":true}`
		if l.members {
			ins = "," + ins
		}
	case body[so.val] != '{':
		at, del, ins = int(so.val), int(so.end-so.val), `{"include_usage":true}`
	case iu.end != 0:
		at, del, ins = int(iu.val), int(iu.end-iu.val), "true"
	default:
		at, ins = int(l.soClose), `"include_usage":true`
		if l.soMembers {
			ins = "," + ins
		}
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
	l.shift(at, del, len(ins))
	l.usageSet = true
	l.streamOptions, l.includeUsage, l.soClose, l.soMembers = member{}, member{}, 0, false
	return out, true
}

// SetModel returns a copy of body, the body r was parsed from, with its
// "model" set to model (added at the end of the object when absent); r's
// Layout and Model follow the edit.
func (r *Request) SetModel(body []byte, model string) ([]byte, error) {
	l, err := r.ownLayout(body)
	if err != nil {
		return nil, err
	}
	out := l.set(body, &l.model, "model", jsonscan.AppendString(nil, model))
	r.Model = model
	return out, nil
}

// SetOutputLimit returns a copy of body, the body r was parsed from, with
// every one of a's output limit fields (a.OutputLimitFields) that the
// client sent (and not null) set to n, or the last of them added (or
// replacing a null) when it sent none; r's Layout, MaxTokens and
// MaxTokensSet follow the edit. field is the first field set (the one
// the server reads). An API without a limit (None) is an error.
func (r *Request) SetOutputLimit(body []byte, a API, n int) (out []byte, field string, err error) {
	fields := a.OutputLimitFields()
	if len(fields) == 0 {
		return nil, "", errors.New("the API has no output limit")
	}
	l, err := r.ownLayout(body)
	if err != nil {
		return nil, "", err
	}
	val := strconv.AppendInt(nil, int64(n), 10)
	out = body
	for i, f := range fields {
		if m := &l.limits[i]; m.end != 0 && string(out[m.val:m.end]) != "null" {
			out = l.set(out, m, f, val)
			if field == "" {
				field = f
			}
		}
	}
	if field == "" {
		i := len(fields) - 1
		field = fields[i]
		out = l.set(out, &l.limits[i], field, val)
	}
	r.MaxTokens, r.MaxTokensSet = n, true
	return out, field, nil
}

// minThinkingBudget is the least thinking.budget_tokens Anthropic's
// Messages API accepts, which also requires budget_tokens < max_tokens
// (docs.anthropic.com/en/docs/build-with-claude/extended-thinking).
const minThinkingBudget = 1024

// ClampThinking keeps the extended thinking of a Messages request body
// (the body r was parsed from) valid for its clamped maxTokens, returning
// a copy when it edits: when "thinking" is
// {"type":"enabled","budget_tokens":b} with b >= maxTokens, budget_tokens
// becomes maxTokens-1 if that is at least 1024 (note
// "thinking_budget=<n>"), else the "thinking" member is removed (note
// "thinking=off"): the answer is degraded anyway, and an
// Anthropic-compatible upstream would refuse the request with 400. Any
// other thinking (disabled, adaptive, a budget already below maxTokens, a
// budget that is not a number) is left as sent; note is "" then.
func (r *Request) ClampThinking(body []byte, maxTokens int) (out []byte, note string, err error) {
	l, err := r.ownLayout(body)
	if err != nil {
		return nil, "", err
	}
	th := l.thinking
	if th.end == 0 {
		return body, "", nil
	}
	v := body[th.val:th.end]
	if !isObject(v) || view(field(v, "type")) != "enabled" {
		return body, "", nil
	}
	b := field(v, "budget_tokens")
	if !isNumber(b) {
		return body, "", nil
	}
	if f, err := strconv.ParseFloat(str(b), 64); err != nil || f < float64(maxTokens) {
		return body, "", nil
	}
	budget := maxTokens - 1
	if budget < minThinkingBudget {
		from, end := int(th.from), int(th.end)
		if body[jsonscan.SkipSpace(body, from)] != ',' {
			// The first member: its comma is the one after it.
			if j := jsonscan.SkipSpace(body, end); body[j] == ',' {
				end = j + 1
			}
		}
		out = l.splice(body, from, end-from, nil)
		l.thinking = member{}
		return out, "thinking=off", nil
	}
	// Rebuilt member by member: every budget_tokens (a repeated one too,
	// which a server may read instead of the first) gives way to one.
	obj := []byte{'{'}
	it, _ := jsonscan.Object(v, 0, false)
	for {
		raw, ok := it.NextKey()
		if !ok {
			break
		}
		val, _ := it.Value()
		if !jsonscan.KeyIs(raw, "budget_tokens") {
			obj = append(append(append(append(append(obj, '"'), raw...), '"', ':'), val...), ',')
		}
	}
	obj = append(obj, `"budget_tokens":`...)
	obj = strconv.AppendInt(obj, int64(budget), 10)
	obj = append(obj, '}')
	out = l.set(body, &l.thinking, "thinking", obj)
	return out, "thinking_budget=" + strconv.Itoa(budget), nil
}

// locates reports whether l was recorded from body (or kept up to date
// with it): the top-level object's '}' is where l says.
func (l *Layout) locates(body []byte) bool {
	return l != nil && l.close > 0 && int(l.close) < len(body) && body[l.close] == '}'
}

// ownLayout gives r a Layout of its own, a copy, before an edit for the
// degradation ladder: the client's Request keeps the one of the client's
// body.
func (r *Request) ownLayout(body []byte) (*Layout, error) {
	if !r.Layout.locates(body) {
		return nil, errNoLayout
	}
	l := *r.Layout
	r.Layout = &l
	return &l, nil
}

// set returns a copy of body with the member m (named name) set to the raw
// JSON value val: its value replaced, or the member added at the end of
// the object.
func (l *Layout) set(body []byte, m *member, name string, val []byte) []byte {
	if m.end != 0 {
		out := l.splice(body, int(m.val), int(m.end-m.val), val)
		m.end = m.val + int32(len(val))
		return out
	}
	ins := make([]byte, 0, len(name)+len(val)+4)
	if l.members {
		ins = append(ins, ',')
	}
	ins = append(jsonscan.AppendString(ins, name), ':')
	at := int(l.close)
	valAt := at + len(ins)
	ins = append(ins, val...)
	out := l.splice(body, at, 0, ins)
	*m = member{from: int32(at), val: int32(valAt), end: int32(valAt + len(val))}
	l.members = true
	return out
}

// splice returns a copy of body with body[at:at+del] replaced by ins, and
// moves l's positions after the edit.
func (l *Layout) splice(body []byte, at, del int, ins []byte) []byte {
	out := make([]byte, 0, len(body)-del+len(ins))
	out = append(append(append(out, body[:at]...), ins...), body[at+del:]...)
	l.shift(at, del, len(ins))
	return out
}

// shift moves l's positions for an edit that replaced body[at:at+del]
// with n bytes: a position at or after the edit's end moves, one inside
// what was cut goes to its start (an end that is the edit's end stays:
// its member is the one edited, or ends there).
func (l *Layout) shift(at, del, n int) {
	d, edge, at32 := int32(n-del), int32(at+del), int32(at)
	start := func(p *int32) {
		switch {
		case *p >= edge:
			*p += d
		case *p > at32:
			*p = at32 // inside what was cut
		}
	}
	mem := func(m *member) {
		if m.end == 0 {
			return
		}
		start(&m.from)
		start(&m.val)
		if m.end > edge {
			m.end += d
		}
	}
	start(&l.close)
	start(&l.soClose)
	mem(&l.model)
	mem(&l.thinking)
	mem(&l.streamOptions)
	mem(&l.includeUsage)
	for i := range l.limits {
		mem(&l.limits[i])
	}
	for i := range l.prompt {
		if f := &l.prompt[i]; f.end != 0 {
			start(&f.val)
			if f.end > edge {
				f.end += d
			}
		}
	}
}
