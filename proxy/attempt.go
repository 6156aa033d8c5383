package proxy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"time"

	"go.uber.org/zap"

	"github.com/llmproxy/caddy-llm-proxy/budget"
	"github.com/llmproxy/caddy-llm-proxy/sse"
)

// maxPreCommitComments bounds the SSE comments (": ping") buffered before the
// first data event; past it, further comments are dropped.
const maxPreCommitComments = 64 << 10

// attempt is one request to one upstream. It runs its pre-commit phase in
// its own goroutine with its own context, derived from the request's, so it
// can be cancelled without touching any other attempt.
type attempt struct {
	x       *exchange
	up      Upstream
	ctx     context.Context
	cancel  context.CancelCauseFunc
	unlink  func() bool // stops the request's cancellation reaching ctx
	started time.Time
	fbTimer *time.Timer

	resp *http.Response
	// isSSE is true when the response is an event stream read through sc.
	isSSE bool
	sc    *sse.Scanner
	// head is what the client receives at commit: the SSE events up to and
	// including the first data event, or the whole non-streaming body.
	head       []byte
	headEvents int
	// finished is true when head already holds a finish_reason or [DONE].
	finished bool
	ttft     time.Duration

	// ok is true when the pre-commit phase produced something to commit.
	ok      bool
	outcome AttemptOutcome
	err     error
	// errBody is an upstream error response body kept for passing through.
	errBody []byte
	// inband is the in-band error event that failed the attempt, if any.
	inband *sse.InbandError
	// retryAfter is the upstream's Retry-After on a 429 or 5xx, 0 if none.
	retryAfter time.Duration
	ended      bool
	// hedge is true for a backup attempt started by the hedge timer.
	hedge bool
	// drain asks end() to read the rest of a finished response (the
	// chunked terminator after [DONE]) so the connection can be reused.
	drain bool
}

// Bounds on reading the rest of a finished upstream response.
const (
	drainTimeout = 2 * time.Second
	drainLimit   = 64 << 10
)

// startAttempt launches an attempt on up; its result arrives on results.
func (x *exchange) startAttempt(up Upstream, results chan<- *attempt) *attempt {
	// The attempt's context carries the request's values but is cancelled
	// only through the link below, which end() may cut: a finished
	// stream's connection can then be drained after the request is over.
	ctx, cancel := context.WithCancelCause(context.WithoutCancel(x.ctx))
	unlink := context.AfterFunc(x.ctx, func() { cancel(context.Cause(x.ctx)) })
	a := &attempt{x: x, up: up, ctx: ctx, cancel: cancel, unlink: unlink, started: time.Now()}
	a.fbTimer = time.AfterFunc(x.p.cfg.FirstByteTimeout, func() { cancel(errFirstByteTimeout) })
	go func() {
		defer func() {
			if v := recover(); v != nil {
				a.ok = false
				a.fail(AttemptInternalError, fmt.Errorf("upstream %s: panic in attempt: %v", up.Addr, v))
				x.p.log.Error("attempt panicked", zap.String("upstream", up.Addr), zap.Any("panic", v), zap.Stack("stack"))
			}
			results <- a
		}()
		a.preCommit()
	}()
	return a
}

// preCommit runs the attempt up to its commit point: the first SSE data
// event, the complete non-streaming body, or a classified failure.
func (a *attempt) preCommit() {
	resp, err := a.x.p.cfg.Transport.RoundTrip(a.request())
	if err != nil {
		a.fail(a.causeOr(AttemptConnectError), fmt.Errorf("upstream %s: %w", a.up.Addr, a.errWithCause(err)))
		return
	}
	a.resp = resp
	if resp.StatusCode >= 400 {
		a.readErrorResponse()
		return
	}
	if isEventStream(resp.Header) {
		a.isSSE = true
		a.readFirstEvent()
	} else {
		a.readFullBody()
	}
	if !a.ok {
		return
	}
	if !a.fbTimer.Stop() {
		// The first-byte timer fired as the first event arrived: the
		// attempt's context is cancelled, so it cannot be relayed.
		a.ok = false
		a.fail(AttemptFirstByteTimeout, fmt.Errorf("upstream %s: %w", a.up.Addr, errFirstByteTimeout))
		return
	}
	a.ttft = time.Since(a.started)
}

// request builds the outbound request: the client's request with the kept
// body, its own context, and headers prepared once per exchange.
func (a *attempt) request() *http.Request {
	x := a.x
	ctx := a.ctx
	if a.up.Context != nil {
		ctx = a.up.Context(ctx)
	}
	out := x.r.WithContext(ctx) // shallow copy; every shared field is replaced below
	u := *x.r.URL
	u.Host = a.up.Addr
	out.URL = &u
	out.RequestURI = ""
	out.Header = x.outHeader.Clone()
	out.Trailer = nil
	out.Close = false
	out.ContentLength = int64(len(x.body))
	if len(x.body) == 0 {
		out.Body, out.GetBody = http.NoBody, nil
	} else {
		body := x.body
		out.Body = io.NopCloser(bytes.NewReader(body))
		out.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	}
	return out
}

// prepareHeader computes the outbound header once per exchange.
func (x *exchange) prepareHeader() {
	h := x.r.Header.Clone()
	removeHopHeaders(h)
	// The gateway must read the stream: ask for identity encoding (the
	// transport may still negotiate gzip itself and decode it).
	h.Del("Accept-Encoding")
	out := &http.Request{Header: h}
	trusted := x.p.cfg.TrustedProxy != nil && x.p.cfg.TrustedProxy(x.r)
	setForwarded(out, x.r, trusted)
	x.outHeader = h
}

// readErrorResponse keeps an upstream error response for passing through.
func (a *attempt) readErrorResponse() {
	body, err := io.ReadAll(io.LimitReader(a.resp.Body, a.x.p.cfg.MaxResponseBody))
	a.errBody = body
	outcome := classifyStatus(a.resp.StatusCode)
	if outcome == AttemptHTTP429 || outcome == AttemptHTTP5xx {
		a.retryAfter, _ = budget.ParseRetryAfter(a.resp.Header.Get("Retry-After"), time.Now())
	}
	if err != nil && !a.x.clientGone() {
		err = fmt.Errorf("upstream %s: status %d: reading body: %w", a.up.Addr, a.resp.StatusCode, a.errWithCause(err))
	} else {
		err = fmt.Errorf("upstream %s: status %d", a.up.Addr, a.resp.StatusCode)
	}
	if a.x.clientGone() {
		outcome = AttemptCanceled
	}
	a.fail(outcome, err)
}

// readFirstEvent reads SSE events until the first data event.
func (a *attempt) readFirstEvent() {
	a.sc = sse.NewScanner(a.resp.Body, a.x.p.cfg.MaxEventSize)
	for {
		ev, err := a.sc.Next()
		if err != nil {
			a.fail(a.causeOr(AttemptTruncated), fmt.Errorf("upstream %s: stream ended before the first event: %w", a.up.Addr, a.errWithCause(err)))
			return
		}
		switch ev.Kind() {
		case sse.KindComment:
			if len(a.head) < maxPreCommitComments {
				a.head = append(a.head, ev.Raw...)
				a.headEvents++
			}
			continue
		case sse.KindError:
			ie, ok := sse.ParseInbandError(ev.Data)
			if !ok {
				ie = sse.InbandError{Message: "upstream sent an error event", Type: TypeServer, Status: 500}
			}
			a.inband = &ie
			outcome := AttemptInbandError5xx
			switch {
			case ie.Status == http.StatusTooManyRequests:
				outcome = AttemptInbandError429
			case ie.Status >= 400 && ie.Status < 500:
				outcome = AttemptInbandError4xx
			}
			a.fail(outcome, fmt.Errorf("upstream %s: error event before the first token: %s", a.up.Addr, ie.Message))
			return
		case sse.KindDone:
			a.finished = true
		case sse.KindData:
			a.finished = sse.InspectChunk(ev.Data).FinishReason
		}
		a.head = append(a.head, ev.Raw...)
		a.headEvents++
		a.ok = true
		return
	}
}

// readFullBody reads a non-streaming response whole, so that a failure
// mid-body can still fail over.
func (a *attempt) readFullBody() {
	limit := a.x.p.cfg.MaxResponseBody
	body, err := io.ReadAll(io.LimitReader(a.resp.Body, limit+1))
	if err != nil {
		a.fail(a.causeOr(AttemptTruncated), fmt.Errorf("upstream %s: reading body: %w", a.up.Addr, a.errWithCause(err)))
		return
	}
	if int64(len(body)) > limit {
		a.fail(AttemptTruncated, fmt.Errorf("upstream %s: response body over %d bytes", a.up.Addr, limit))
		return
	}
	a.head = body
	a.ok = true
}

// fail records a pre-commit failure.
func (a *attempt) fail(o AttemptOutcome, err error) {
	a.outcome, a.err = o, err
}

// causeOr returns the outcome that the attempt context's cancellation cause
// implies, or def when the context is live (a genuine transport failure).
func (a *attempt) causeOr(def AttemptOutcome) AttemptOutcome {
	if a.ctx.Err() == nil {
		return def
	}
	switch context.Cause(a.ctx) {
	case errFirstByteTimeout:
		return AttemptFirstByteTimeout
	case errIdleTimeout:
		return AttemptIdleTimeout
	case errStreamTimeout:
		return AttemptStreamTimeout
	}
	return AttemptCanceled
}

// errWithCause prefers the gateway's cancellation cause over the transport's
// generic "context canceled".
func (a *attempt) errWithCause(err error) error {
	if a.ctx.Err() != nil {
		if c := context.Cause(a.ctx); c != nil && !errors.Is(err, c) {
			return fmt.Errorf("%w (%v)", c, err)
		}
	}
	return err
}

// end releases the attempt's resources and reports it. Every attempt ends
// exactly once, on every path.
func (a *attempt) end(committed bool) {
	if a.ended {
		return
	}
	a.ended = true
	a.fbTimer.Stop()
	switch {
	case a.resp != nil && a.drain:
		// Closing a body before EOF closes its connection; a stream that
		// sent [DONE] is about to end, so read its end off the wire,
		// past the end of the request.
		a.unlink()
		body, cancel := a.resp.Body, a.cancel
		go func() {
			t := time.AfterFunc(drainTimeout, func() { cancel(errLostRace) })
			_, _ = io.Copy(io.Discard, io.LimitReader(body, drainLimit))
			t.Stop()
			cancel(errLostRace)
			_ = body.Close()
		}()
	case a.resp != nil:
		a.cancel(errLostRace)
		_ = a.resp.Body.Close()
	default:
		a.cancel(errLostRace)
	}
	rep := &AttemptReport{
		Upstream:  a.up.Addr,
		Model:     a.x.res.Info.Model,
		Outcome:   a.outcome,
		TTFT:      a.ttft,
		Committed: committed,
		Err:       a.err,
	}
	if a.resp != nil {
		rep.Status = a.resp.StatusCode
		rep.RetryAfter = a.retryAfter
	}
	if a.up.Done != nil {
		a.up.Done(rep)
	}
	a.x.p.obs.AttemptDone(rep)
	if a.err != nil {
		if ce := a.x.p.checkDebug("upstream attempt failed"); ce != nil {
			ce.Write(zap.String("upstream", a.up.Addr), zap.String("outcome", a.outcome.String()), zap.Error(a.err))
		}
	}
}

// isEventStream reports whether a response is text/event-stream.
func isEventStream(h http.Header) bool {
	mt, _, err := mime.ParseMediaType(h.Get("Content-Type"))
	return err == nil && mt == "text/event-stream"
}
