package proxy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"strings"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/llmproxy/caddy-llm-proxy/api"
	"github.com/llmproxy/caddy-llm-proxy/budget"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
	"github.com/llmproxy/caddy-llm-proxy/sse"
)

// maxPreCommitComments bounds the SSE comments (": ping") buffered before the
// first generated event; past it, further comments are dropped.
const maxPreCommitComments = 64 << 10

// maxPreCommitHeld bounds the lifecycle events (response.created,
// message_start, ...) held before the first generated event. A stream
// whose lifecycle events outgrow it (a response.created echoing huge
// instructions) commits with them rather than drop any.
const maxPreCommitHeld = 1 << 20

// staleWindow bounds the time from writing a request to the failure of its
// reused connection for that failure to count as a stale connection: the
// server's close races the write within a round trip (it had decided to
// close before the request arrived), while a failure later than this may
// follow work the upstream did on the request. Wall clock, as the
// transport's own timing is.
const staleWindow = 100 * time.Millisecond

// attempt is one request to one upstream. It runs its pre-commit phase in
// its own goroutine with its own context, derived from the request's, so it
// can be cancelled without touching any other attempt. It records what
// happened; classify (finish.go) turns that into its outcome, once.
type attempt struct {
	x       *exchange
	up      Upstream
	ctx     context.Context
	cancel  context.CancelCauseFunc
	unlink  func() bool   // stops the request's cancellation reaching ctx
	started time.Duration // since the exchange's start
	fbTimer clock.Timer

	// resp is the upstream's response until commit, which keeps only its
	// status and body (a held stream need not hold the rest).
	resp   *http.Response
	status int
	rbody  io.ReadCloser
	sc     *sse.Scanner
	// head is what the client receives at commit: the lifecycle events
	// held and the first generated event, or the whole non-streaming body.
	head       []byte
	headEvents int
	// headContent is 1 when head ends with a generated event (a chunk).
	headContent int
	// st is the stream's inspection by the request's API (usage, normal
	// end, in-band error), from its first event on; for a body, its
	// Usage is the body's.
	st   api.Stream
	ttft time.Duration
	// conn tells a stale keep-alive connection from a failing upstream.
	conn connTrace

	// Facts of the pre-commit phase: err is what went wrong; cause is
	// the attempt context's cancellation cause when it failed (nil while
	// live: a genuine transport failure).
	err   error
	cause error
	// errBody is an upstream error response body kept for passing through.
	errBody []byte
	// inband is the in-band error event that failed the attempt, if any.
	inband *api.InbandError
	// retryAfter is the upstream's Retry-After on a 429 or 5xx, 0 if none.
	retryAfter time.Duration

	// Facts after commit (commit.go, relay.go): writeErr is why writing
	// a body to the client failed.
	writeErr error
	// postInband is an upstream error event relayed after commit.
	postInband *api.InbandError
	// streamErr is why reading the stream stopped.
	streamErr error
	// idle is the stream idle timeout while the relay runs.
	idle idleWatch

	// body is the request body this attempt sends (its GetBody's bytes),
	// nil once the attempt is committed: nothing sends it again.
	body []byte
	// report is what end() reports to Upstream.Done and the Observer
	// (held here: no allocation of its own).
	report AttemptReport

	// The flags, together (each alone between wider fields took eight
	// bytes).
	//
	// isSSE is true when the response is an event stream read through sc.
	isSSE bool
	// hedge is true for a backup attempt started by the hedge timer.
	hedge bool
	// ok is true when the pre-commit phase produced something to commit;
	// failed says where it failed; gone is whether the client was gone
	// when it failed.
	ok     bool
	failed failKind
	gone   bool
	// committed: the attempt's response reached the client.
	committed bool
	// writeFailed: writing to the client failed (writeErr for a body).
	writeFailed bool
	// sawDone: the API's last event of a finished stream was relayed
	// ([DONE], response.completed, message_stop); st.Finished says whether
	// the stream carried its normal end.
	sawDone bool
	// goneAtEnd: the client was gone when the stream stopped.
	goneAtEnd bool
	// classified and ended make classify and end run once.
	classified, ended bool
	outcome           AttemptOutcome
	// drain asks end() to read the rest of a finished response (the
	// chunked terminator after [DONE]) so the connection can be reused.
	drain bool
}

// failKind is where an attempt's pre-commit phase failed.
type failKind uint8

const (
	failNone      failKind = iota // reached the commit point (or still running)
	failPanic                     // the attempt's goroutine panicked
	failRoundTrip                 // no response: dial, reset, canceled
	failStatus                    // an error status (4xx, 5xx)
	failInband                    // an error event before the first token
	failRead                      // the stream or body ended before the commit point
	failTooLarge                  // the body is over max_response_body
	failLate                      // the first event raced the first-byte timer and lost
	failMalformed                 // the response broke HTTP/1.1 (head, framing, chunked coding)
	failStale                     // the kept connection closed as the request went out
)

// Bounds on reading the rest of a finished upstream response.
const (
	drainTimeout = 2 * time.Second
	drainLimit   = 64 << 10
)

// startAttempt launches an attempt on up. With results it runs in a
// goroutine of its own and reports there (buffered: it never blocks);
// without, it runs to its commit point on the calling goroutine and is
// done when startAttempt returns: without hedging nothing else runs beside
// an attempt, and a goroutine of its own would cost two scheduler hand-offs
// before the first byte, which at saturated cores is where the tail of
// time to first token came from. Everything that must
// interrupt it (the client leaving, stream_timeout, first_byte_timeout)
// does so through its context, as in its own goroutine.
func (x *exchange) startAttempt(up Upstream, results chan<- *attempt) *attempt {
	// The attempt's context carries the request's values but is cancelled
	// only through the link below, which end() cuts: a finished stream's
	// connection can then be drained after the request is over.
	ctx, cancel := context.WithCancelCause(context.WithoutCancel(x.ctx))
	unlink := context.AfterFunc(x.ctx, func() { cancel(context.Cause(x.ctx)) })
	// body is taken here, on the request's goroutine: a hedged attempt
	// may build its request after another one committed (releaseBody).
	a := &attempt{x: x, up: up, ctx: ctx, cancel: cancel, unlink: unlink, started: x.since(x.start), body: x.body}
	a.fbTimer = x.p.clock.AfterFunc(x.p.cfg.FirstByteTimeout, func() { cancel(errFirstByteTimeout) })
	if results == nil {
		a.run(nil)
	} else {
		go a.run(results)
	}
	return a
}

// run runs the attempt to its commit point and reports it on results when
// set, a panic included (as a failed attempt).
func (a *attempt) run(results chan<- *attempt) {
	defer func() {
		if v := recover(); v != nil {
			a.ok = false
			a.failAt(failPanic, fmt.Errorf("upstream %s: panic in attempt: %v", a.up.Addr, v))
			a.x.p.log.Error("attempt panicked", zap.String("upstream", a.up.Addr), zap.Any("panic", v), zap.Stack("stack"))
		}
		if results != nil {
			results <- a
		}
	}()
	a.preCommit()
}

func (a *attempt) preCommit() {
	resp, err := a.roundTrip()
	if err != nil {
		kind := failRoundTrip
		switch {
		case isMalformed(err):
			kind = failMalformed
		case a.stale():
			kind = failStale
			a.x.p.obs.StaleConnection(a.up.Addr)
		}
		a.failAt(kind, fmt.Errorf("upstream %s: %w", a.up.Addr, a.errWithCause(err)))
		return
	}
	a.resp, a.status, a.rbody = resp, resp.StatusCode, resp.Body
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
		a.failAt(failLate, fmt.Errorf("upstream %s: %w", a.up.Addr, errFirstByteTimeout))
		return
	}
	a.ttft = a.x.since(a.x.start) - a.started
}

// roundTrip sends the request, once. A request is never sent again within
// an attempt: once written it may have reached the upstream (a generation
// may be running), so a failure, even on a kept connection the upstream
// was closing, is the attempt's, and only the retry rules (before commit,
// with the budget, counted) send it again. A connection found dead before
// anything was written is re-dialled by the transport itself, as net/http
// and internal/h1 both do.
func (a *attempt) roundTrip() (*http.Response, error) {
	ct := &a.conn
	ct.hooks.GotConn, ct.hooks.GotFirstResponseByte, ct.hooks.WroteRequest = ct.gotConn, ct.gotFirstByte, ct.wroteRequest
	return a.x.p.cfg.Transport.RoundTrip(a.request(&ct.hooks))
}

// stale reports whether a round trip that failed did so on a kept
// connection the upstream was closing as the request went out: written,
// then the connection's end within staleWindow and no response byte. That
// says nothing about the upstream's health (it had decided to close before
// the request arrived), but the request did reach it.
func (a *attempt) stale() bool {
	ct := &a.conn
	if !ct.reused.Load() || ct.gotByte.Load() || a.ctx.Err() != nil {
		return false
	}
	w := ct.wroteAt.Load()
	return w != 0 && time.Since(time.Unix(0, w)) <= staleWindow
}

// connTrace records, for one round trip, whether its connection was reused
// and whether any response byte arrived. It lives in the attempt, so the
// trace costs two method values per attempt, not a fresh set per try.
type connTrace struct {
	reused, gotByte atomic.Bool
	// wroteAt is when the request was written (unix ns), 0 before.
	wroteAt atomic.Int64
	hooks   httptrace.ClientTrace
}

func (c *connTrace) wroteRequest(httptrace.WroteRequestInfo) { c.wroteAt.Store(time.Now().UnixNano()) }

func (c *connTrace) gotConn(i httptrace.GotConnInfo) { c.reused.Store(i.Reused) }
func (c *connTrace) gotFirstByte()                   { c.gotByte.Store(true) }

// request builds the outbound request: the client's request with the kept
// body, its own context, and headers prepared once per exchange.
func (a *attempt) request(trace *httptrace.ClientTrace) *http.Request {
	x := a.x
	ctx := a.ctx
	if a.up.Context != nil {
		ctx = a.up.Context(ctx)
	}
	ctx = httptrace.WithClientTrace(ctx, trace)
	out := x.r.WithContext(ctx) // shallow copy; every shared field is replaced below
	u := *x.r.URL
	u.Host = a.up.Addr
	out.URL = &u
	out.RequestURI = ""
	// Shared by every attempt, not cloned: a RoundTripper must not modify
	// the request (net/http keeps the headers it adds in a map of its
	// own), and nothing writes outHeader while an attempt of its pool may
	// run (commit lets go of it only when no other attempt runs; the
	// ladder prepares the next pool's once every attempt has ended). The
	// transport holds the request for the whole stream, so a clone cost
	// every open stream its own copy.
	out.Header = x.outHeader
	if host, ok := x.outHost(); ok {
		out.Host = host // header_up Host
	}
	out.Trailer = nil
	out.Close = false
	out.ContentLength = int64(len(a.body))
	if len(a.body) == 0 {
		out.Body, out.GetBody = http.NoBody, nil
	} else {
		out.Body = newBodyReader(a.body)
		out.GetBody = a.getBody
	}
	return out
}

// getBody is the outbound request's GetBody: the transport calls it only
// within a round trip, to send the body again on a fresh connection.
func (a *attempt) getBody() (io.ReadCloser, error) { return newBodyReader(a.body), nil }

// bodyReader is an outbound request body over the kept bytes: one
// allocation where io.NopCloser(bytes.NewReader(b)) took two. Once read to
// its end it lets go of the bytes: the transport holds the request (and so
// its Body) for as long as the response streams.
type bodyReader struct{ bytes.Reader }

func newBodyReader(b []byte) *bodyReader {
	r := &bodyReader{}
	r.Reset(b)
	return r
}

// Read reads the body; at its end the bytes are let go.
func (r *bodyReader) Read(p []byte) (int, error) {
	n, err := r.Reader.Read(p)
	if err == io.EOF {
		r.Reset(nil)
	}
	return n, err
}

// WriteTo writes the body to w (io.Copy's path); then the bytes are let go.
func (r *bodyReader) WriteTo(w io.Writer) (int64, error) {
	n, err := r.Reader.WriteTo(w)
	if err == nil {
		r.Reset(nil)
	}
	return n, err
}

// Close lets go of the bytes (they are the exchange's, which keeps them
// while an attempt may still need them).
func (r *bodyReader) Close() error {
	r.Reset(nil)
	return nil
}

// readErrorResponse keeps an upstream error response for passing through.
func (a *attempt) readErrorResponse() {
	code := a.resp.StatusCode
	body, err := io.ReadAll(io.LimitReader(a.resp.Body, a.x.p.cfg.MaxResponseBody))
	a.errBody = body
	if code == http.StatusTooManyRequests || code >= 500 {
		a.retryAfter, _ = budget.ParseRetryAfter(a.resp.Header.Get("Retry-After"), a.x.p.clock.Now())
	}
	if err != nil && !a.x.clientGone() {
		err = fmt.Errorf("upstream %s: status %d: reading body: %w", a.up.Addr, code, a.errWithCause(err))
	} else {
		err = fmt.Errorf("upstream %s: status %d", a.up.Addr, code)
	}
	a.failAt(failStatus, err)
}

// readFirstEvent reads SSE events until the first generated event (the
// API's commit point), holding the lifecycle events before it: they go to
// the client with it at commit, or nowhere if the attempt fails.
func (a *attempt) readFirstEvent() {
	a.sc = sse.NewScanner(a.resp.Body, a.x.p.cfg.MaxEventSize)
	for {
		ev, err := a.sc.Next()
		if err != nil {
			a.failAt(readFailure(err), fmt.Errorf("upstream %s: stream ended before the first generated event: %w", a.up.Addr, a.errWithCause(err)))
			return
		}
		switch a.x.api.Inspect(&a.st, ev) {
		case api.Lifecycle:
			if !ev.HasData {
				if len(a.head) < maxPreCommitComments {
					a.head = append(a.head, ev.Raw...)
					a.headEvents++
				}
				continue
			}
			if len(a.head)+len(ev.Raw) <= maxPreCommitHeld {
				a.head = append(a.head, ev.Raw...)
				a.headEvents++
				continue
			}
			// Too much held: commit with it rather than drop any.
		case api.ErrorEvent:
			ie := a.st.Err
			a.inband = &ie
			a.failAt(failInband, fmt.Errorf("upstream %s: error event before the first token: %s", a.up.Addr, ie.Message))
			return
		case api.End:
			// The stream ended with nothing generated: a whole (empty)
			// answer when the API says it finished; else (a Messages
			// message_stop without a stop_reason) a cut before the
			// commit point, which fails over like any other.
			if !a.st.Finished {
				a.failAt(failRead, fmt.Errorf("upstream %s: stream ended before the first generated event: %w", a.up.Addr, errNoNormalEnd))
				return
			}
			// Whole at this event: commit ends the client's response
			// with it, as the relay does after a generated event.
			a.sawDone, a.drain = true, true
		case api.UsageOnly:
			if a.x.stripUsage {
				continue // asked for on the client's behalf: not theirs to see
			}
			a.headContent = 1
		case api.Generated:
			a.headContent = 1
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
		a.failAt(readFailure(err), fmt.Errorf("upstream %s: reading body: %w", a.up.Addr, a.errWithCause(err)))
		return
	}
	if int64(len(body)) > limit {
		a.failAt(failTooLarge, fmt.Errorf("upstream %s: response body over %d bytes", a.up.Addr, limit))
		return
	}
	a.head = body
	a.st.Usage = a.x.api.InspectBody(body)
	a.ok = true
}

// failAt records where the pre-commit phase failed and what its
// classification depends on at that moment.
func (a *attempt) failAt(k failKind, err error) {
	a.failed, a.err = k, err
	a.cause = context.Cause(a.ctx)
	a.gone = a.x.clientGone()
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

// isEventStream reports whether a response is text/event-stream: its
// Content-Type's media type, case-insensitive, before any parameters. It
// reads the header in place (mime.ParseMediaType allocated a map of the
// parameters per request).
func isEventStream(h http.Header) bool {
	ct := h.Get("Content-Type")
	if i := strings.IndexByte(ct, ';'); i >= 0 {
		ct = ct[:i]
	}
	return strings.EqualFold(strings.TrimSpace(ct), "text/event-stream")
}
