package mockllm

import (
	"cmp"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"time"

	"go.uber.org/zap"
)

// maxRequestBody bounds the request bodies the mock reads.
const maxRequestBody = 64 << 20

// errGone reports that the client went away (context cancelled or a write
// failed).
var errGone = errors.New("client went away")

// plan is what one request will get: its Behavior resolved to concrete
// values and samples.
type plan struct {
	model      string // in responses: the request's model, else the served one
	served     string // the replica's model, which labels the metrics
	ttft       time.Duration
	straggler  bool
	tokens     int
	finish     string // "stop" or "length"
	interval   time.Duration
	tokenBytes int
	fault      Fault // the stream modifiers always apply; Kind only when hit
}

// exchange is one completion request in progress.
type exchange struct {
	r       *Replica
	w       http.ResponseWriter
	rc      *http.ResponseController
	req     *http.Request
	ctx     context.Context
	api     API
	d       dialect
	body    []byte
	cr      completionRequest
	p       plan
	rec     *RequestRecord
	gen     uint64
	seq     int64
	start   time.Time
	created int64
	seed    uint64
	promptN int       // prompt tokens, as usage.prompt_tokens reports them
	job     *schedReq // the request's place in the scheduler, once acquired
	eventN  int       // events sent so far (Responses' sequence_number)

	headersSent bool
	writeErr    error
	ended       bool
}

// serveCompletion handles the completion endpoint of an API:
// /v1/chat/completions, /v1/completions, /v1/responses or /v1/messages.
func (r *Replica) serveCompletion(w http.ResponseWriter, req *http.Request, a API) {
	d := dialectOf(a)
	if req.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusMethodNotAllowed)
		w.Write(d.errorBody(http.StatusMethodNotAllowed, "Method Not Allowed"))
		return
	}
	start := time.Now()
	body, err := io.ReadAll(io.LimitReader(req.Body, maxRequestBody+1))
	if err != nil {
		return // the client went away while sending
	}
	x := &exchange{
		r: r, w: w, rc: http.NewResponseController(w), req: req, ctx: req.Context(),
		api: a, d: d, body: body, start: start, created: start.Unix(),
	}
	x.begin()
	defer x.logEnd()
	x.run()
}

// begin counts the request and records it.
func (x *exchange) begin() {
	sum := sha256.Sum256(x.body)
	x.rec = &RequestRecord{
		ID:         x.responseID(),
		Path:       x.req.URL.Path,
		API:        x.api,
		Started:    x.start,
		Outcome:    OutcomeInFlight,
		BodySHA256: hex.EncodeToString(sum[:]),
	}
	headersOfInterest(x.rec, x.req.Header)
	r := x.r
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stats.requests++
	r.stats.seq++
	x.seq, x.gen = r.stats.seq, r.stats.gen
	r.stats.bodies.add(x.rec.BodySHA256)
	r.stats.recent.add(x.rec)
	r.stats.lastBody = x.body // never modified: snapshots share it
	r.inFlight++
	r.stats.maxInFlight = max(r.stats.maxInFlight, r.inFlight)
}

// responseID is "chatcmpl-…", "cmpl-…", "resp_…" or "msg_…", from
// X-Request-Id when present (as vLLM does) or random.
func (x *exchange) responseID() string {
	prefix := x.d.idPrefix()
	if id := x.req.Header.Get("X-Request-Id"); id != "" {
		return prefix + id
	}
	var b [16]byte
	rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// end records the outcome once, after leaving the scheduler; fault is the
// kind injected, if any.
func (x *exchange) end(outcome string, fault FaultKind) {
	if x.ended {
		return
	}
	x.ended = true
	x.leave()
	r := x.r
	r.mu.Lock()
	defer r.mu.Unlock()
	r.inFlight--
	x.rec.Ended = time.Now()
	x.rec.Outcome = outcome
	if fault != FaultNone {
		x.rec.Fault = string(fault)
	}
	if x.gen != r.stats.gen {
		return
	}
	switch outcome {
	case OutcomeCompleted:
		r.stats.completed++
	case OutcomeCancelled:
		r.stats.cancelled++
	}
}

// countFault counts an injected fault when it happens.
func (x *exchange) countFault(k FaultKind) {
	r := x.r
	r.mu.Lock()
	defer r.mu.Unlock()
	x.rec.Fault = string(k)
	if x.gen == r.stats.gen {
		r.stats.faults[string(k)]++
	}
}

// update changes the record under the replica's lock.
func (x *exchange) update(f func(*RequestRecord)) {
	x.r.mu.Lock()
	f(x.rec)
	x.r.mu.Unlock()
}

func (x *exchange) logEnd() {
	if !x.ended {
		x.end(OutcomeCompleted, FaultNone)
	}
	if ce := x.r.log.Check(zap.DebugLevel, "request finished"); ce != nil {
		x.r.mu.Lock()
		rec := *x.rec
		x.r.mu.Unlock()
		ce.Write(zap.Int("replica", x.r.index), zap.String("id", rec.ID), zap.String("path", rec.Path),
			zap.String("outcome", rec.Outcome), zap.Int("status", rec.Status), zap.Int("tokens_sent", rec.TokensSent),
			zap.Duration("duration", rec.Ended.Sub(rec.Started)))
	}
}

// run carries the request from parsing to its last byte.
func (x *exchange) run() {
	if len(x.body) > maxRequestBody {
		x.fail(http.StatusRequestEntityTooLarge, fmt.Sprintf("request body over %d bytes", maxRequestBody))
		return
	}
	if err := json.Unmarshal(x.body, &x.cr); err != nil {
		x.fail(http.StatusBadRequest, "Invalid JSON request body: "+err.Error())
		return
	}
	x.update(func(rec *RequestRecord) { rec.Model, rec.Stream = x.cr.Model, x.cr.Stream })
	x.seed = contentSeed(x.prompt())
	x.promptN = promptTokens(x.prompt())
	b, err := x.r.Behavior().WithHeaders(x.req.Header)
	if err != nil {
		x.fail(http.StatusBadRequest, "mockllm: "+err.Error())
		return
	}
	x.p = x.r.plan(b, &x.cr, x.d.maxTokens(&x.cr), x.seq)

	switch f := x.p.fault; f.Kind {
	case FaultStatus:
		x.countFault(f.Kind)
		if f.RetryAfter > 0 {
			x.w.Header().Set("Retry-After", strconv.Itoa(f.RetryAfter))
		}
		x.writeError(f.Status, faultMessage(f.Status))
		x.end("fault:"+string(f.Kind), f.Kind)
		return
	case FaultReset:
		x.countFault(f.Kind)
		x.abort(true, "fault:"+string(f.Kind), f.Kind)
		return
	case FaultHang:
		x.countFault(f.Kind)
		x.waitUntil(time.Time{}, nil)
		x.end(OutcomeCancelled, f.Kind)
		return
	case FaultHangAfterHeaders:
		x.countFault(f.Kind)
		x.sendHeaders()
		x.waitUntil(time.Time{}, nil)
		x.end(OutcomeCancelled, f.Kind)
		return
	}

	if x.cr.Stream && x.p.fault.CommentInterval > 0 {
		x.sendHeaders()
	}
	// Responses and Messages servers start a stream at once, before the
	// request is scheduled: response.created / message_start carry
	// nothing generated.
	if x.cr.Stream && x.d.lifecycle(x) != nil {
		x.end(OutcomeCancelled, FaultNone)
		return
	}
	if !x.acquire() {
		x.end(OutcomeCancelled, FaultNone)
		return
	}
	defer x.leave()
	if x.wait(x.p.ttft+x.prefill()) != nil {
		x.end(OutcomeCancelled, FaultNone)
		return
	}
	if x.cr.Stream {
		x.stream()
	} else {
		x.respond()
	}
}

// plan resolves b for one request whose output limit is maxTokens (0 for
// none).
func (r *Replica) plan(b Behavior, cr *completionRequest, maxTokens int, seq int64) plan {
	p := plan{model: cr.Model, tokens: b.Tokens, interval: b.TokenInterval, tokenBytes: b.TokenBytes, finish: "stop"}
	p.served = cmp.Or(b.Model, DefaultModel)
	p.model = cmp.Or(p.model, p.served)
	switch {
	case p.tokens == 0:
		p.tokens = DefaultTokens
	case p.tokens < 0:
		p.tokens = 0
	}
	if m := maxTokens; m > 0 && m < p.tokens {
		p.tokens, p.finish = m, "length"
	}
	switch {
	case p.interval == 0:
		p.interval = DefaultTokenInterval
	case p.interval < 0:
		p.interval = 0
	}
	p.tokenBytes = min(max(p.tokenBytes, 0), maxTokenBytes)

	r.mu.Lock()
	defer r.mu.Unlock()
	p.ttft = b.TTFT.sample(r.rng, DefaultTTFT)
	if s := b.Straggler; s.Fraction > 0 && r.rng.Float64() < s.Fraction {
		p.straggler = true
		p.ttft = s.Min
		if s.Max > s.Min {
			p.ttft += time.Duration(r.rng.Int64N(int64(s.Max - s.Min + 1)))
		}
	}
	p.fault = b.Fault
	if !b.Fault.hits(seq, r.rng) {
		p.fault.Kind = FaultNone
	}
	return p
}

// fail answers with a JSON error before anything was sent.
func (x *exchange) fail(status int, msg string) {
	x.writeError(status, msg)
	x.end(OutcomeInvalidRequest, FaultNone)
}

// writeError sends a JSON error response in the API's shape (vLLM's for
// Chat, Completions and Responses, Anthropic's for Messages).
func (x *exchange) writeError(status int, msg string) {
	x.w.Header().Set("Content-Type", "application/json")
	x.writeStatus(status)
	x.writeBody(x.d.errorBody(status, msg))
}

// acquire waits until the scheduler runs the request (a capacity slot and
// KV blocks for its prompt) and observes the queue time; false when the
// client went away first.
func (x *exchange) acquire() bool {
	s := x.r.queue.enqueue(x.promptN)
	if s.ready != nil {
		if err := x.waitUntil(time.Time{}, s.ready); err != nil {
			x.r.queue.abandon(s)
			return false
		}
	}
	x.job = s
	x.r.metrics.queueTime.WithLabelValues(x.p.served).Observe(s.waited.Seconds())
	return true
}

// leave gives the request's slot and KV blocks back to the scheduler,
// once: when the outcome is recorded, so that statistics never show an
// ended request still running.
func (x *exchange) leave() {
	if x.job != nil {
		x.r.queue.release(x.job)
		x.job = nil
	}
}

// generated records that the first n tokens have been generated: the
// request's KV-cache blocks grow to hold them.
func (x *exchange) generated(n int) { x.r.queue.grow(x.job, x.promptN+n) }

// wait sleeps for d, or less if the client goes away.
func (x *exchange) wait(d time.Duration) error {
	if d <= 0 {
		return x.gone()
	}
	return x.waitUntil(time.Now().Add(d), nil)
}

// waitUntil blocks until deadline (forever when zero) or until ready is
// closed, sending ": ping" comments every Fault.CommentInterval once the
// headers of a stream are out. It returns errGone as soon as the client
// goes away.
func (x *exchange) waitUntil(deadline time.Time, ready <-chan struct{}) error {
	if err := x.gone(); err != nil {
		return err
	}
	var timeout <-chan time.Time
	if !deadline.IsZero() {
		d := time.Until(deadline)
		if d <= 0 {
			return nil
		}
		t := time.NewTimer(d)
		defer t.Stop()
		timeout = t.C
	}
	var tick <-chan time.Time
	if iv := x.p.fault.CommentInterval; iv > 0 && x.headersSent && x.cr.Stream {
		t := time.NewTicker(iv)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-x.ctx.Done():
			return errGone
		case <-timeout:
			return nil
		case <-ready:
			return nil
		case <-tick:
			if err := x.writeBody([]byte(": ping\n\n")); err != nil {
				return err
			}
		}
	}
}

// gone returns errGone when the client has gone away.
func (x *exchange) gone() error {
	if x.writeErr != nil || x.ctx.Err() != nil {
		return errGone
	}
	return nil
}

// writeStatus sends the status line and headers.
func (x *exchange) writeStatus(status int) {
	x.w.WriteHeader(status)
	x.headersSent = true
	x.update(func(rec *RequestRecord) { rec.Status = status })
}

// sendHeaders sends 200 and the headers of the response (SSE or JSON),
// once, and flushes them.
func (x *exchange) sendHeaders() {
	if x.headersSent {
		return
	}
	h := x.w.Header()
	if x.cr.Stream {
		h.Set("Content-Type", "text/event-stream; charset=utf-8")
		h.Set("Cache-Control", "no-cache")
	} else {
		h.Set("Content-Type", "application/json")
	}
	x.writeStatus(http.StatusOK)
	if err := x.rc.Flush(); err != nil && x.writeErr == nil {
		x.writeErr = err
	}
}

// writeBody writes p in Fault.Fragment-sized writes (or one), flushing
// after each.
func (x *exchange) writeBody(p []byte) error {
	if x.writeErr != nil {
		return errGone
	}
	n := len(p)
	if f := x.p.fault.Fragment; f > 0 {
		n = f
	}
	for len(p) > 0 {
		k := min(n, len(p))
		if _, err := x.w.Write(p[:k]); err != nil {
			x.writeErr = err
			return errGone
		}
		if err := x.rc.Flush(); err != nil {
			x.writeErr = err
			return errGone
		}
		p = p[k:]
	}
	return nil
}

// event writes one SSE data event.
func (x *exchange) event(data []byte) error { return x.namedEvent("", data) }

// namedEvent writes one SSE event with an "event: name" line (none when
// name is empty) and data.
func (x *exchange) namedEvent(name string, data []byte) error {
	buf := make([]byte, 0, len(name)+len(data)+16)
	if name != "" {
		buf = append(buf, "event: "...)
		buf = append(buf, name...)
		buf = append(buf, '\n')
	}
	buf = append(buf, "data: "...)
	buf = append(buf, data...)
	buf = append(buf, "\n\n"...)
	if err := x.writeBody(buf); err != nil {
		return err
	}
	x.eventN++
	x.update(func(rec *RequestRecord) { rec.EventsSent++ })
	return nil
}

// abort closes the connection under the response: with a TCP RST when rst
// is true, else with a FIN, leaving whatever was sent truncated.
// When the connection cannot be hijacked (not HTTP/1.x) the handler
// panics with http.ErrAbortHandler, after the outcome has been recorded.
func (x *exchange) abort(rst bool, outcome string, fault FaultKind) {
	conn, _, err := x.rc.Hijack()
	if err != nil {
		x.end(outcome, fault)
		panic(http.ErrAbortHandler)
	}
	if tc, ok := conn.(*net.TCPConn); ok && rst {
		tc.SetLinger(0)
	}
	conn.Close()
	x.end(outcome, fault)
}

// faultAt is the number of token events after which the request's cut or
// error-event fault strikes, or -1.
func (x *exchange) faultAt() int {
	switch x.p.fault.Kind {
	case FaultCut, FaultCutRST, FaultErrorEvent:
		return min(x.p.fault.After, x.p.tokens)
	}
	return -1
}

// strike executes the cut or error-event fault and records the outcome.
func (x *exchange) strike() {
	k := x.p.fault.Kind
	x.countFault(k)
	switch k {
	case FaultCut, FaultCutRST:
		x.abort(k == FaultCutRST, "fault:"+string(k), k)
	case FaultErrorEvent:
		code := cmp.Or(x.p.fault.ErrorCode, http.StatusInternalServerError)
		if !x.cr.Stream {
			x.writeError(code, faultMessage(code))
		} else {
			x.sendHeaders()
			x.d.errorEvent(x, code)
		}
	}
	x.end("fault:"+string(k), k)
}

// chunk builds a streamed chunk with one choice.
func (x *exchange) chunk(d *delta, text *string, finish *string) []byte {
	c := chunk{ID: x.rec.ID, Created: x.created, Model: x.p.model}
	ch := chunkChoice{FinishReason: finish}
	if x.api == APIChat {
		c.Object = "chat.completion.chunk"
		ch.Delta = d
	} else {
		c.Object = "text_completion"
		ch.Text = text
	}
	c.Choices = []chunkChoice{ch}
	return marshal(c)
}

// prompt is the raw JSON the model reads (see dialect.prompt).
func (x *exchange) prompt() []byte { return x.d.prompt(&x.cr) }

// recordUsage notes the usage reported to the client in the record.
func (x *exchange) recordUsage(u usage) {
	x.update(func(rec *RequestRecord) {
		rec.Usage = &Usage{PromptTokens: u.PromptTokens, CompletionTokens: u.CompletionTokens, TotalTokens: u.TotalTokens}
	})
}

func (x *exchange) usage() usage {
	u := usage{PromptTokens: x.promptN, CompletionTokens: x.p.tokens}
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	return u
}

// stream sends the SSE response: the API's opening events with the first
// token, one delta event per token, then its closing events (see
// dialect). A cut or error-event fault strikes after Fault.After tokens.
func (x *exchange) stream() {
	x.sendHeaders()
	at := x.faultAt()
	if at == 0 {
		x.strike()
		return
	}
	n := x.p.tokens
	var first time.Time
	for i := range max(n, 1) {
		if i > 0 {
			prev := time.Now()
			if x.waitUntil(first.Add(time.Duration(i)*x.p.interval), nil) != nil {
				x.end(OutcomeCancelled, FaultNone)
				return
			}
			x.r.metrics.itl.WithLabelValues(x.p.served).Observe(time.Since(prev).Seconds())
		}
		if i == 0 {
			first = time.Now()
			x.firstToken(first)
			if x.d.open(x) != nil {
				break
			}
		}
		text := ""
		if n > 0 {
			x.generated(i + 1)
			text = tokenText(x.seed, i, x.p.tokenBytes)
		}
		if x.d.delta(x, i, n, text) != nil {
			break
		}
		if n > 0 {
			x.update(func(rec *RequestRecord) { rec.TokensSent++ })
		}
		if i+1 == at {
			// A cut strikes when the next token is due, as when a server
			// dies mid-generation; this also gives the client time to read
			// what was sent before an RST discards it.
			if k := x.p.fault.Kind; (k == FaultCut || k == FaultCutRST) && x.wait(x.p.interval) != nil {
				x.end(OutcomeCancelled, FaultNone)
				return
			}
			x.strike()
			return
		}
		if ce := x.p.fault.CommentEvery; ce > 0 && (i+1)%ce == 0 && x.writeBody([]byte(": ping\n\n")) != nil {
			break
		}
	}
	if x.gone() == nil {
		x.d.close(x)
	}
	if x.gone() != nil {
		x.end(OutcomeCancelled, FaultNone)
		return
	}
	x.finished()
}

// chatDialect is Chat Completions (chat) or the legacy Completions API:
// vLLM's chat.completion(.chunk) and text_completion objects, data-only
// SSE events ending with [DONE].
type chatDialect struct{ chat bool }

func (c chatDialect) idPrefix() string {
	if c.chat {
		return "chatcmpl-"
	}
	return "cmpl-"
}

func (c chatDialect) prompt(cr *completionRequest) []byte {
	if c.chat {
		return cr.Messages
	}
	return cr.Prompt
}

func (chatDialect) maxTokens(cr *completionRequest) int { return cr.maxTokens() }

func (chatDialect) lifecycle(*exchange) error { return nil }

// open sends the role chunk of a chat stream (vLLM's first chunk).
func (c chatDialect) open(x *exchange) error {
	if !c.chat {
		return nil
	}
	return x.event(x.chunk(&delta{Role: "assistant", Content: ptr("")}, nil, nil))
}

// delta sends one chunk per token; the last carries finish_reason (an
// empty completion is one chunk with empty content and finish_reason).
func (chatDialect) delta(x *exchange, i, n int, text string) error {
	var finish *string
	if i == max(n, 1)-1 {
		finish = &x.p.finish
	}
	return x.event(x.chunk(&delta{Content: &text}, &text, finish))
}

// close sends the usage chunk when the request asked for it, then [DONE].
func (c chatDialect) close(x *exchange) error {
	if x.cr.includeUsage() {
		u := x.usage()
		if err := x.event(marshal(chunk{ID: x.rec.ID, Object: c.chunkObject(), Created: x.created, Model: x.p.model, Choices: []chunkChoice{}, Usage: &u})); err != nil {
			return err
		}
		x.recordUsage(u)
	}
	return x.event([]byte("[DONE]"))
}

// errorEvent sends vLLM's in-band error: data: {"error":{"object":"error",…}}.
func (chatDialect) errorEvent(x *exchange, code int) error {
	return x.event(marshal(errorBody{Error: apiError{Object: "error", Message: faultMessage(code), Type: cmp.Or(x.p.fault.ErrorType, errorType(code)), Code: code}}))
}

func (chatDialect) errorBody(status int, msg string) []byte {
	return marshal(errorBody{Error: apiError{Message: msg, Type: errorType(status), Code: status}})
}

func (c chatDialect) full(x *exchange, text string) []byte {
	co := completion{ID: x.rec.ID, Created: x.created, Model: x.p.model, Usage: x.usage()}
	ch := fullChoice{FinishReason: x.p.finish}
	if c.chat {
		co.Object = "chat.completion"
		ch.Message = &message{Role: "assistant", Content: text, ToolCalls: []any{}}
	} else {
		co.Object = "text_completion"
		ch.Text = &text
	}
	co.Choices = []fullChoice{ch}
	return marshal(co)
}

func (c chatDialect) chunkObject() string {
	if c.chat {
		return "chat.completion.chunk"
	}
	return "text_completion"
}

// firstToken records the first token's time.
func (x *exchange) firstToken(t time.Time) {
	x.update(func(rec *RequestRecord) { rec.FirstEvent = t })
	x.r.metrics.ttft.WithLabelValues(x.p.served).Observe(t.Sub(x.start).Seconds())
}

// finished records a complete response.
func (x *exchange) finished() {
	m := x.r.metrics
	u := x.usage()
	m.success.WithLabelValues(x.p.served, x.p.finish).Inc()
	m.promptTokens.WithLabelValues(x.p.served).Add(float64(u.PromptTokens))
	m.genTokens.WithLabelValues(x.p.served).Add(float64(u.CompletionTokens))
	m.e2e.WithLabelValues(x.p.served).Observe(time.Since(x.start).Seconds())
	x.end(OutcomeCompleted, FaultNone)
}

// respond sends a non-streaming response once all tokens would have been
// generated.
func (x *exchange) respond() {
	first := time.Now()
	x.firstToken(first)
	if n := x.p.tokens; x.p.interval == 0 {
		x.generated(n)
	} else {
		x.generated(min(n, 1))
		for i := 1; i < n; i++ {
			if x.waitUntil(first.Add(time.Duration(i)*x.p.interval), nil) != nil {
				x.end(OutcomeCancelled, FaultNone)
				return
			}
			x.generated(i + 1)
		}
	}
	text := completionText(x.seed, x.p.tokens, x.p.tokenBytes)
	body := x.d.full(x, text)

	switch x.p.fault.Kind {
	case FaultErrorEvent:
		x.strike()
		return
	case FaultCut, FaultCutRST:
		// Promise the whole body, send half of it, then close.
		x.w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		x.sendHeaders()
		x.writeBody(body[:len(body)/2])
		x.strike()
		return
	}
	x.w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	x.sendHeaders()
	if x.writeBody(body) != nil {
		x.end(OutcomeCancelled, FaultNone)
		return
	}
	x.update(func(rec *RequestRecord) { rec.TokensSent = x.p.tokens })
	x.recordUsage(x.usage())
	x.finished()
}
