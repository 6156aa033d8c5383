package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"unicode/utf8"

	"github.com/llmproxy/caddy-llm-proxy/internal/jsonscan"
)

// Request holds the few fields of a request body that the gateway acts on,
// whatever the API; everything else passes through untouched.
type Request struct {
	// Model is the "model" field, "" when absent.
	Model string
	// Stream is the "stream" field.
	Stream bool
	// MaxTokens is the API's output limit: max_completion_tokens, else
	// max_tokens (Chat, Completions); max_output_tokens (Responses);
	// max_tokens (Messages); 0 when absent.
	MaxTokens int
	// MaxTokensSet reports that the output limit is present (and not
	// null): MaxTokens is the client's own bound, not a default.
	MaxTokensSet bool
	// N is the number of sequences generated: "n", or "best_of" when
	// larger (the server generates best_of and returns n); 1 when absent.
	N int
	// PromptTokens is the prompt estimate (DESIGN §8): ⌈characters ÷ 4⌉,
	// where the characters are the Unicode code points of all text the
	// model reads, with no per-message overhead. Chat and Completions:
	// every message's "content" (a string, or the "text" of each of its
	// parts), the "prompt" (a string or an array of strings) and the tool
	// definitions ("tools", "functions") as their JSON text; a prompt given
	// as token ids (an array of integers, or of such arrays) adds one
	// token per id. Responses: "instructions", the "input" (a string, or
	// the text of its items: message content, function call arguments and
	// outputs, reasoning summaries) and the tools' JSON text. Messages:
	// "system" (a string or text blocks), every message's content (a
	// string, or its blocks: text, tool_use input, tool_result content,
	// thinking, a document's title, context and plain-text or content
	// source) and the tools' JSON text. Images, audio, files (a base64 or
	// URL document among them), ids, types and signatures count nothing.
	PromptTokens int
	// IncludeUsage is stream_options.include_usage (Chat, Completions).
	IncludeUsage bool
	// StreamOptions reports that "stream_options" is present (and not
	// null).
	StreamOptions bool
	// Layout locates in the parsed body what the gateway reads or edits
	// there later (PromptText, SetIncludeUsage, SetModel,
	// SetOutputLimit, ClampThinking), so that none of them walks the
	// body again; nil for an empty body or one over 2 GiB. ParseInto
	// records it in storage the caller owns.
	Layout *Layout
}

// Layout locates parts of the body a Request was parsed from, by byte
// offsets (int32: a held request pays for it). It is true of that body
// only: the Request's edit methods keep it up to date with the bodies
// they return; a body edited otherwise needs a new parse.
type Layout struct {
	// close is the index of the top-level object's '}', 0 when unparsed.
	close int32
	// members: the object has a member.
	members bool
	// model, limits (in OutputLimitFields' order), thinking and
	// streamOptions are the top-level members the edits set.
	model, thinking, streamOptions member
	limits                         [2]member
	// includeUsage is stream_options' last "include_usage" (the one the
	// server reads); soClose the index of stream_options' '}', soMembers
	// whether it has a member. Unknown once SetIncludeUsage edited them
	// (usageSet).
	includeUsage member
	soClose      int32
	soMembers    bool
	usageSet     bool
	// prompt are the fields PromptText reads, in its order.
	prompt [3]promptField
}

// member is where a top-level member lies: from is the index after the
// value before it (or after '{'), so that body[from:end] with its comma
// can be cut; body[val:end] is its value; end 0 is absent.
type member struct{ from, val, end int32 }

// promptField is a prompt field's value, body[val:end] (end 0: absent);
// raw: yielded as its JSON text (tool definitions, token ids).
type promptField struct {
	val, end int32
	raw      bool
}

// The top-level fields each API's parser reads; a body that repeats one,
// or sends one differing only in case, is refused: encoding/json matches
// names case-insensitively and keeps the last duplicate, while the
// inference servers (Python) read the exact key, so {"max_tokens":100000,
// "MAX_TOKENS":1} would be reserved as 1 token and generate 100,000.
// Messages' "thinking" is the degradation ladder's (ClampThinking).
var (
	chatFields      = []string{"model", "stream", "max_tokens", "max_completion_tokens", "n", "best_of", "messages", "prompt", "stream_options"}
	responsesFields = []string{"model", "stream", "max_output_tokens", "input", "instructions", "tools"}
	messagesFields  = []string{"model", "stream", "max_tokens", "messages", "system", "tools", "thinking"}
)

// The output limit fields of each family: read on every parse, and
// copied by each API's OutputLimitFields.
var (
	chatLimits     = []string{"max_completion_tokens", "max_tokens"}
	maxTokensLimit = []string{"max_tokens"}
	responsesLimit = []string{"max_output_tokens"}
)

// The families of request bodies parseRequest reads.
const (
	famChat = iota
	famCompletions
	famResponses
	famMessages
	famNone
)

// parser is the state of one parse.
type parser struct {
	fam    int
	fields []string
	limits []string
	body   []byte
	req    Request
	seen   uint64 // bit i: fields[i] was seen
	// ambiguous is the first key refused by the fields rule.
	ambiguous string
	// err is the first error of a field's value (Chat's, in body order);
	// errModel, errStream, errLimit are Responses' and Messages' (in this
	// order of precedence).
	err, errModel, errStream, errLimit error
	// Chat's integer fields, and whether each is set (not null).
	maxTokens, maxCompletion, n, bestOf    int
	hasMax, hasCompletion, hasN, hasBestOf bool
	streamOptions, includeUsage            bool
	// chars are the prompt's code points; tokens its token ids (Chat's
	// "messages", "prompt", "tools" and "functions" each replace their
	// own count when repeated).
	messages, prompt, tools, funcs, chars, tokens int
}

// parseRequest validates body as one JSON object and extracts the Request
// of family fam, in one walk: the walk that validates the JSON (exactly
// as json.Valid: FuzzValidMatchesEncodingJSON) reads the fields, counts
// the prompt's characters in place and records the Layout. An empty body
// yields a zero Request (N 1). Invalid JSON, a non-object, a refused key
// (see chatFields) or a read field of the wrong type is an error suitable
// for a 400 response, in that order of precedence.
func parseRequest(body []byte, fam int, l *Layout) (Request, error) {
	if len(body) == 0 {
		return Request{N: 1}, nil
	}
	req, err := parseLayout(body, fam, l)
	if len(body) > math.MaxInt32 {
		req.Layout = nil // its offsets do not fit
	}
	return req, err
}

// ParseInto is a.ParseRequest with the Layout recorded in *l, storage the
// caller owns (the holder of the request's body), so that the parse
// allocates nothing for it: the Request's Layout is l.
func ParseInto(a API, body []byte, l *Layout) (Request, error) {
	return parseRequest(body, a.family(), l)
}

// parseLayout is parseRequest of a non-empty body.
func parseLayout(body []byte, fam int, l *Layout) (Request, error) {
	*l = Layout{}
	p := parser{fam: fam, body: body, req: Request{N: 1, Layout: l}}
	switch fam {
	case famResponses:
		p.fields, p.limits = responsesFields, responsesLimit
	case famMessages:
		p.fields, p.limits = messagesFields, maxTokensLimit
	case famCompletions:
		p.fields, p.limits = chatFields, maxTokensLimit
	default:
		p.fields, p.limits = chatFields, chatLimits
	}
	it, ok := jsonscan.Object(body, 0, true)
	if !ok {
		if !jsonscan.Valid(body) {
			return Request{}, syntaxError(body)
		}
		return Request{}, errors.New("invalid JSON body: expected a JSON object")
	}
	for {
		from := it.Pos()
		raw, ok := it.NextKey()
		if !ok {
			break
		}
		m := member{from: int32(from), val: int32(it.Pos())}
		if !p.member(&it, keyString(raw), &m) {
			return Request{}, syntaxError(body)
		}
		p.req.Layout.members = true
	}
	if end := it.End(); end < 0 || jsonscan.SkipSpace(body, end) != len(body) {
		return Request{}, syntaxError(body)
	}
	p.req.Layout.close = int32(it.End() - 1)
	return p.finish()
}

// syntaxError is the error of a body that is not valid JSON, worded by
// encoding/json.
func syntaxError(body []byte) error {
	var v any
	err := json.Unmarshal(body, &v)
	if err == nil {
		err = errors.New("not valid JSON")
	}
	return fmt.Errorf("invalid JSON body: %w", err)
}

// refuse applies the fields rule to key.
func (p *parser) refuse(key string) {
	for j, f := range p.fields {
		if !strings.EqualFold(key, f) {
			continue
		}
		if p.ambiguous == "" && (key != f || p.seen&(1<<j) != 0) {
			p.ambiguous = key
		}
		p.seen |= 1 << j
	}
}

// member reads the member key whose value is at it's position, consuming
// it, and records where the members the edits set lie (m is where this
// one starts). It reports false when the value is not valid JSON.
func (p *parser) member(it *jsonscan.Iter, key string, m *member) bool {
	p.refuse(key)
	l := p.req.Layout
	switch {
	case strings.EqualFold(key, "model"):
		v, ok := it.Value()
		if !ok {
			return false
		}
		switch v[0] {
		case '"':
			p.req.Model = jsonscan.String(v)
		case 'n':
		default:
			p.typeError(&p.errModel, "model must be a string")
		}
		l.model = *m
		l.model.end = int32(it.Pos())
		return true
	case strings.EqualFold(key, "stream"):
		v, ok := it.Value()
		if !ok {
			return false
		}
		switch v[0] {
		case 't', 'f':
			p.req.Stream = v[0] == 't'
		case 'n':
		default:
			p.typeError(&p.errStream, "stream must be a boolean")
		}
		return true
	}
	for i, f := range p.limits {
		if strings.EqualFold(key, f) {
			v, ok := it.Value()
			if !ok {
				return false
			}
			l.limits[i] = *m
			l.limits[i].end = int32(it.Pos())
			p.limit(key, v)
			return true
		}
	}
	switch p.fam {
	case famResponses, famMessages:
		texts := [2]string{"instructions", "input"}
		if p.fam == famMessages {
			texts = [2]string{"system", "messages"}
		}
		switch {
		case strings.EqualFold(key, texts[0]):
			return p.text(it, 1)
		case strings.EqualFold(key, texts[1]):
			return p.text(it, 2)
		case strings.EqualFold(key, "tools"):
			return p.raw(it, 0, &p.tools)
		case p.fam == famMessages && strings.EqualFold(key, "thinking"):
			if _, ok := it.Value(); !ok {
				return false
			}
			l.thinking = *m
			l.thinking.end = int32(it.Pos())
			return true
		}
	default:
		if ok, done := p.chatMember(it, key); done {
			return ok
		}
	}
	_, ok := it.Value()
	return ok
}

// typeError records that a field has the wrong type: for Chat and
// Completions as the parse's error (the first in body order counts), for
// Responses and Messages in *dst (they rank model, stream, limit).
func (p *parser) typeError(dst *error, msg string) {
	if p.fam == famResponses || p.fam == famMessages {
		if *dst == nil {
			*dst = errors.New("invalid " + strings.Replace(msg, " must", ": must", 1))
		}
		return
	}
	p.keep(errors.New("invalid JSON body: " + msg))
}

// limit reads an output limit field's value v (Chat's, Completions': the
// integer fields; Responses', Messages': a non-negative integer).
func (p *parser) limit(key string, v []byte) {
	if p.fam == famResponses || p.fam == famMessages {
		switch {
		case v[0] == 'n':
		case v[0] == '-' || v[0] >= '0' && v[0] <= '9':
			n, ok := intValue(v)
			if !ok || n < 0 {
				if p.errLimit == nil {
					p.errLimit = fmt.Errorf("invalid %s %s: must be a non-negative integer", key, v)
				}
				return
			}
			p.req.MaxTokens, p.req.MaxTokensSet = n, true
		default:
			if p.errLimit == nil {
				p.errLimit = fmt.Errorf("invalid %s: must be an integer", key)
			}
		}
		return
	}
	var err error
	if strings.EqualFold(key, "max_tokens") {
		p.maxTokens, p.hasMax, err = intField(v, p.hasMax, p.maxTokens, "max_tokens")
	} else {
		p.maxCompletion, p.hasCompletion, err = intField(v, p.hasCompletion, p.maxCompletion, "max_completion_tokens")
	}
	if err != nil && p.err == nil {
		p.err = err
	}
}

// chatMember reads Chat's and Completions' other fields; done is false
// for a member it does not read.
func (p *parser) chatMember(it *jsonscan.Iter, key string) (ok, done bool) {
	prompt := p.fam != famNone
	switch {
	case strings.EqualFold(key, "max_tokens"), strings.EqualFold(key, "max_completion_tokens"):
		// Completions reads max_tokens only; the other is still an
		// integer field of the request.
		v, ok := it.Value()
		if ok {
			p.limit(key, v)
		}
		return ok, true
	case strings.EqualFold(key, "n"), strings.EqualFold(key, "best_of"):
		v, ok := it.Value()
		if !ok {
			return false, true
		}
		var err error
		if strings.EqualFold(key, "n") {
			p.n, p.hasN, err = intField(v, p.hasN, p.n, "n")
		} else {
			p.bestOf, p.hasBestOf, err = intField(v, p.hasBestOf, p.bestOf, "best_of")
		}
		p.keep(err)
		return true, true
	case strings.EqualFold(key, "stream_options"):
		return p.streamOptionsMember(it), true
	case strings.EqualFold(key, "messages"):
		start := it.Pos()
		p.messages = 0
		switch it.Peek() {
		case '[':
			arr := it.Enter()
			n, err := messagesChars(&arr)
			if err != nil {
				p.keep(err)
				_, ok := it.Value()
				return ok, true
			}
			if !it.Leave(&arr) {
				return false, true
			}
			p.messages = n
		case 'n':
			if _, ok := it.Value(); !ok {
				return false, true
			}
		default:
			p.keep(errMessage)
			_, ok := it.Value()
			return ok, true
		}
		if prompt && p.fam == famChat {
			p.req.Layout.prompt[2] = promptField{val: int32(start), end: int32(it.Pos())}
		}
		return true, true
	case strings.EqualFold(key, "prompt"):
		start := it.Pos()
		chars, tokens, err := promptChars(it)
		if err == errSyntax {
			return false, true
		}
		p.keep(err)
		p.prompt, p.tokens = chars, tokens
		if prompt && p.fam == famCompletions {
			p.req.Layout.prompt[1] = promptField{val: int32(start), end: int32(it.Pos()), raw: tokenIDs(p.body[start:it.Pos()])}
		}
		return true, true
	case strings.EqualFold(key, "tools"):
		slot := -1
		if prompt {
			slot = 0
		}
		return p.raw(it, slot, &p.tools), true
	case strings.EqualFold(key, "functions"):
		slot := -1
		if prompt && p.fam == famChat {
			slot = 1
		}
		return p.raw(it, slot, &p.funcs), true
	}
	return false, false
}

// keep records err as the parse's error unless one came first.
func (p *parser) keep(err error) {
	if err != nil && p.err == nil {
		p.err = err
	}
}

// raw counts the code points of a value's JSON text into *n (null counts
// nothing) and records it as prompt field slot (-1: none).
func (p *parser) raw(it *jsonscan.Iter, slot int, n *int) bool {
	start := it.Pos()
	v, ok := it.Value()
	if !ok {
		return false
	}
	*n = 0
	if string(v) != "null" {
		*n = utf8.RuneCount(v)
	}
	if slot >= 0 {
		p.req.Layout.prompt[slot] = promptField{val: int32(start), end: int32(it.Pos()), raw: true}
		if string(v) == "null" {
			p.req.Layout.prompt[slot] = promptField{}
		}
	}
	return true
}

// text counts the text the model reads in a Responses or Messages field
// (textWalk) and records it as prompt field slot.
func (p *parser) text(it *jsonscan.Iter, slot int) bool {
	start := it.Pos()
	w := textWalk{}
	if !w.value(it) {
		return false
	}
	p.chars += w.chars
	if string(p.body[start:it.Pos()]) != "null" {
		p.req.Layout.prompt[slot] = promptField{val: int32(start), end: int32(it.Pos())}
	}
	return true
}

// streamOptionsMember reads stream_options: an object whose include_usage
// (matched case-insensitively, the last one counting, null leaving it
// false) is a boolean, or null.
func (p *parser) streamOptionsMember(it *jsonscan.Iter) bool {
	l := p.req.Layout
	l.streamOptions = member{val: int32(it.Pos())}
	defer func() { l.streamOptions.end = int32(it.Pos()) }()
	switch it.Peek() {
	case 'n':
		p.streamOptions, p.includeUsage = false, false
		_, ok := it.Value()
		return ok
	case '{':
	default:
		p.keep(errors.New("invalid JSON body: stream_options must be an object"))
		_, ok := it.Value()
		return ok
	}
	p.streamOptions, p.includeUsage = true, false
	l.includeUsage, l.soMembers = member{}, false
	obj := it.Enter()
	var err error
	for {
		from := obj.Pos()
		raw, ok := obj.NextKey()
		if !ok {
			break
		}
		l.soMembers = true
		val := obj.Pos()
		v, ok := obj.Value()
		if !ok {
			break
		}
		if jsonscan.KeyIs(raw, "include_usage") {
			l.includeUsage = member{from: int32(from), val: int32(val), end: int32(obj.Pos())}
		}
		if strings.EqualFold(keyString(raw), "include_usage") {
			switch v[0] {
			case 't', 'f':
				p.includeUsage = v[0] == 't'
			case 'n':
			default:
				if err == nil {
					err = errors.New("invalid JSON body: stream_options.include_usage must be a boolean")
				}
			}
		}
	}
	if !it.Leave(&obj) {
		return false
	}
	l.soClose = int32(it.Pos() - 1)
	p.keep(err)
	return true
}

// finish applies the rules between fields and returns the Request.
func (p *parser) finish() (Request, error) {
	if p.ambiguous != "" {
		return Request{}, fmt.Errorf("invalid JSON body: field %q repeats or differs only in case from a field the gateway reads; send each of %s once, in lower case",
			p.ambiguous, strings.Join(p.fields, ", "))
	}
	info := p.req
	if p.fam == famResponses || p.fam == famMessages {
		for _, err := range []error{p.errModel, p.errStream, p.errLimit} {
			if err != nil {
				return Request{}, err
			}
		}
		info.PromptTokens = (p.chars + p.tools + 3) / 4
		return info, nil
	}
	if p.err != nil {
		return Request{}, p.err
	}
	switch {
	case p.hasCompletion && (p.maxCompletion != 0 || !p.hasMax):
		// vLLM takes max_completion_tokens, else (absent or 0) max_tokens.
		info.MaxTokens, info.MaxTokensSet = p.maxCompletion, true
	case p.hasMax:
		info.MaxTokens, info.MaxTokensSet = p.maxTokens, true
	}
	if info.MaxTokens < 0 {
		return Request{}, fmt.Errorf("invalid max_tokens %d: must not be negative", info.MaxTokens)
	}
	if p.hasN {
		if p.n < 1 {
			return Request{}, fmt.Errorf("invalid n %d: must be at least 1", p.n)
		}
		info.N = p.n
	}
	if p.hasBestOf {
		// /v1/completions' best_of: the server generates that many
		// sequences and returns n of them; reserve for what it generates.
		if p.bestOf < 1 {
			return Request{}, fmt.Errorf("invalid best_of %d: must be at least 1", p.bestOf)
		}
		info.N = max(info.N, p.bestOf)
	}
	info.StreamOptions = p.streamOptions
	info.IncludeUsage = p.streamOptions && p.includeUsage
	chars := p.messages + p.prompt + p.tools + p.funcs
	info.PromptTokens = (chars+3)/4 + p.tokens
	return info, nil
}
