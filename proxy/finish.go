package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/llmproxy/caddy-llm-proxy/api"
	"github.com/llmproxy/caddy-llm-proxy/sse"
)

// finish is step 8. run (or stream) defers it, so it runs on every path,
// client gone and panics included: it ends every attempt still running,
// classifies the request's outcome (the only place that does), writes the
// gateway's own last word (an error response, or a stream's terminal error
// event), ends the committed attempt (its Done reports to the breaker),
// settles the admission and reports the Result. panicked is the value of a
// panic in a step (nil: none); ServeHTTP re-raises it once finish is done.
func (x *exchange) finish(panicked any) {
	defer func() {
		// finish runs on the lifecycle's goroutine, where a panic would
		// end the process: one of its own is kept for ServeHTTP to
		// re-raise, on the handler's goroutine, as one in a step is.
		if v := recover(); v != nil && x.panicked == nil {
			x.panicked = v
		}
		x.done.Done()
	}()
	x.panicked = panicked
	// Whatever happens below, the admission is settled (its slot and
	// reservation given back) and no key header is left for the access
	// log, on every path: a read that failed never reached identify.
	defer x.redactKeys()
	if x.held != nil {
		defer x.held.Release()
	}
	defer x.releaseFallbackBodies()
	released := false
	defer func() {
		if !released && x.admission != nil {
			released = true
			x.admission.Release(&x.result)
		}
	}()
	if rc := x.rc; rc != nil && rc.inflight > 0 {
		// Only a panic leaves attempts unaccounted for: the loop and the
		// commit abandon theirs.
		rc.cancelAll(x.won)
		rc.abandon()
	}
	res := &x.result
	res.Outcome = x.answer()
	if x.discardAfter {
		x.discardBody()
	}
	if x.won != nil {
		x.won.end()
	}
	res.Duration = x.since(x.start)
	prompt, completion, _ := res.Settlement()
	res.Tokens = prompt + completion
	if x.admission != nil {
		released = true
		x.admission.Release(res)
	}
	x.p.obs.RequestDone(res)
}

// answer classifies the request from the facts the steps recorded and
// writes what the gateway owes the client for it.
func (x *exchange) answer() Outcome {
	switch {
	case x.panicked != nil:
		if x.won == nil {
			x.result.Status = http.StatusInternalServerError // what Caddy answers a handler panic with
		}
		return OutcomeInternalError
	case x.readErr != nil:
		return x.answerRead()
	case x.jsonErr != nil:
		x.writeError(&GatewayError{Status: http.StatusBadRequest, Type: TypeInvalidRequest,
			Code: "invalid_json", Message: x.jsonErr.Error()})
		return OutcomeInvalidRequest
	case x.refusal != nil:
		return x.answerRefusal()
	case x.won == nil:
		return x.answerFailure(x.failure)
	}
	return x.answerCommitted(x.won)
}

func (x *exchange) answerRead() Outcome {
	err := x.readErr
	if errors.Is(err, ErrBodyTooLarge) {
		x.writeError(&GatewayError{Status: http.StatusRequestEntityTooLarge, Type: TypeInvalidRequest,
			Code: "request_too_large", Message: err.Error()})
		return OutcomeInvalidRequest
	}
	if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
		x.writeError(&GatewayError{Status: http.StatusRequestTimeout, Type: TypeInvalidRequest,
			Code: "stream_timeout", Message: "request body not received within stream_timeout"})
		return OutcomeStreamTimeout
	}
	if x.readGone {
		return OutcomeClientGone
	}
	x.writeError(&GatewayError{Status: http.StatusBadRequest, Type: TypeInvalidRequest,
		Code: "invalid_body", Message: err.Error()})
	return OutcomeInvalidRequest
}

// answerRefusal answers an Identifier's or Admitter's no.
func (x *exchange) answerRefusal() Outcome {
	if ge, ok := errors.AsType[*GatewayError](x.refusal); ok {
		x.writeError(ge)
		return OutcomeRefused
	}
	switch {
	case x.clientGone():
		x.result.Status = 499
		return OutcomeClientGone
	case errors.Is(context.Cause(x.ctx), errStreamTimeout):
		x.writeError(&GatewayError{Status: http.StatusGatewayTimeout, Type: TypeTimeout, Code: "stream_timeout",
			Message: "request not admitted within stream_timeout"})
		return OutcomeStreamTimeout
	}
	x.p.log.Error("admission failed", zap.Error(x.refusal))
	x.writeError(&GatewayError{Status: http.StatusInternalServerError, Type: TypeServer, Code: "internal_error",
		Message: "the gateway could not admit the request"})
	return OutcomeInternalError
}

// answerFailure answers a request that no attempt committed.
func (x *exchange) answerFailure(f *failure) Outcome {
	res := &x.result
	switch {
	case f.ctxErr != nil && errors.Is(f.ctxErr, errStreamTimeout):
		x.writeError(&GatewayError{Status: http.StatusGatewayTimeout, Type: TypeTimeout, Code: "stream_timeout",
			Message: "no upstream answered within stream_timeout"})
		return OutcomeStreamTimeout
	case f.ctxErr != nil || x.clientGone():
		res.Status = 499 // nginx's "client closed request"; nothing is written
		return OutcomeClientGone
	case f.last == nil:
		return x.answerUnavailable(f.pickErr)
	}
	a := f.last
	switch a.outcome {
	case AttemptHTTP4xx:
		// Without the client's key, an upstream's 401 or 403 refused the
		// operator's credentials (header_up): not the tenant's fault.
		res.TenantFault = tenantFaultStatus(a.status) &&
			!(x.withholdsKeys(x.rung.pool) && (a.status == http.StatusUnauthorized || a.status == http.StatusForbidden))
		x.passThrough(a)
		return OutcomeClientError
	case AttemptHTTP429:
		x.passThrough(a)
		return OutcomeRateLimited
	case AttemptHTTP5xx:
		x.passThrough(a)
		return OutcomeUpstreamError
	case AttemptInbandError4xx:
		// OpenAI's type for the status (SDKs map on both); the upstream's
		// own type stays visible in the code when it sent none.
		typ := TypeInvalidRequest
		if a.inband.Status == http.StatusTooManyRequests {
			typ = TypeRateLimit
		}
		res.TenantFault = true
		x.writeError(&GatewayError{Status: a.inband.Status, Type: typ,
			Code: orDefault(a.inband.Code, strconv.Itoa(a.inband.Status)), Message: a.inband.Message})
		return OutcomeClientError
	case AttemptInbandError429:
		x.writeError(&GatewayError{Status: http.StatusTooManyRequests, Type: TypeRateLimit,
			Code: orDefault(a.inband.Code, "429"), Message: a.inband.Message, RetryAfter: 1})
		return OutcomeRateLimited
	case AttemptFirstByteTimeout, AttemptStreamTimeout:
		x.writeError(&GatewayError{Status: http.StatusGatewayTimeout, Type: TypeTimeout, Code: "first_byte_timeout",
			Message: fmt.Sprintf("upstream did not answer in time after %d attempt(s)", res.Attempts)})
		return OutcomeTimeout
	case AttemptCanceled:
		res.Status = 499
		return OutcomeClientGone
	case AttemptMalformedResponse:
		x.writeError(&GatewayError{Status: http.StatusBadGateway, Type: TypeServer, Code: "malformed_response",
			Message: fmt.Sprintf("upstream sent a malformed HTTP response after %d attempt(s)", res.Attempts)})
		return OutcomeUpstreamError
	}
	x.writeError(&GatewayError{Status: http.StatusBadGateway, Type: TypeServer, Code: "upstream_error",
		Message: fmt.Sprintf("upstream failed after %d attempt(s): %s", res.Attempts, a.outcome)})
	return OutcomeUpstreamError
}

// answerUnavailable answers a request for which the Balancer had no
// upstream at all: 503, with the cause in the code and headers.
func (x *exchange) answerUnavailable(err error) Outcome {
	ge := &GatewayError{Status: http.StatusServiceUnavailable, Type: TypeServer, Code: "no_upstream",
		Message: err.Error(), RetryAfter: 1}
	outcome := OutcomeNoUpstream
	if ue, ok := errors.AsType[*UnavailableError](err); ok {
		switch {
		case ue.CircuitOpen:
			ge.RetryAfter = max(1, int((ue.RetryAfter+time.Second-1)/time.Second))
			ge.Header = http.Header{"X-Circuit-Breaker": {"open"}}
			ge.Code = "circuit_open"
			outcome = OutcomeCircuitOpen
		case ue.Busy:
			// A slot frees as soon as any stream ends.
			ge.Code = "upstreams_busy"
		default:
			ge.RetryAfter = max(1, int((ue.RetryAfter+time.Second-1)/time.Second))
		}
	}
	if c := x.client; c != nil && c.openRetry > 0 {
		// A pool higher on the ladder opens again sooner.
		ge.RetryAfter = min(ge.RetryAfter, max(1, int((c.openRetry+time.Second-1)/time.Second)))
	}
	x.writeError(ge)
	return outcome
}

// answerCommitted classifies a committed response and ends a failed stream
// with a terminal error event.
func (x *exchange) answerCommitted(a *attempt) Outcome {
	a.classify()
	switch a.outcome {
	case AttemptSuccess:
		return OutcomeSuccess
	case AttemptCanceled:
		return OutcomeClientGone
	case AttemptInbandError5xx, AttemptInbandError4xx, AttemptInbandError429:
		return OutcomeInbandError
	}
	msg, code := a.streamFailure()
	x.send(x.api.AppendStreamError(nil, &a.st, api.Error{Status: http.StatusBadGateway, Type: TypeServer, Code: code, Message: msg}), 0)
	switch a.outcome {
	case AttemptIdleTimeout:
		return OutcomeIdleTimeout
	case AttemptStreamTimeout:
		return OutcomeStreamTimeout
	}
	return OutcomeTruncated
}

// classify decides the attempt's outcome from its facts, once: at the end
// of its pre-commit phase for one that failed or lost, in finish for the
// committed one.
func (a *attempt) classify() {
	if a.classified {
		return
	}
	a.classified = true
	if a.committed {
		a.classifyCommitted()
		return
	}
	switch a.failed {
	case failNone:
		// It reached its commit point, but another attempt committed
		// first or the request ended.
		a.outcome, a.err = AttemptCanceled, errLostRace
	case failPanic:
		a.outcome = AttemptInternalError
	case failRoundTrip:
		a.outcome = causeOutcome(a.cause, AttemptConnectError)
	case failStatus:
		a.outcome = classifyStatus(a.status)
		if a.gone {
			a.outcome = AttemptCanceled
		}
	case failInband:
		a.outcome = inbandOutcome(a.inband)
	case failRead:
		a.outcome = causeOutcome(a.cause, AttemptTruncated)
	case failTooLarge:
		a.outcome = AttemptTruncated
	case failLate:
		a.outcome = AttemptFirstByteTimeout
	case failMalformed:
		a.outcome = causeOutcome(a.cause, AttemptMalformedResponse)
	case failStale:
		a.outcome = causeOutcome(a.cause, AttemptStaleConnection)
	}
}

// classifyCommitted classifies an attempt whose response reached the
// client. Only a finished response is a success; a panic in the gateway
// leaves it neutral.
func (a *attempt) classifyCommitted() {
	switch {
	case a.x.panicked != nil:
		a.outcome, a.err = AttemptCanceled, nil
	case a.writeFailed:
		a.outcome, a.err = AttemptCanceled, a.writeErr
	case !a.isSSE:
		a.outcome = AttemptSuccess
	case a.postInband != nil:
		a.outcome = inbandOutcome(a.postInband)
		a.err = fmt.Errorf("upstream %s: error event after commit: %s", a.up.Addr, a.postInband.Message)
	case a.sawDone && a.st.Finished:
		a.outcome = AttemptSuccess
	case a.goneAtEnd:
		a.outcome, a.err = AttemptCanceled, nil
	case a.st.Finished:
		// The API's normal end arrived (a finish_reason): the answer is
		// whole, whatever came after.
		a.outcome = AttemptSuccess
	default:
		switch o := causeOutcome(context.Cause(a.ctx), AttemptTruncated); o {
		case AttemptIdleTimeout, AttemptStreamTimeout:
			a.outcome = o
		default:
			a.outcome = AttemptTruncated
			if a.streamErr != nil && isMalformed(a.streamErr) {
				// Cut by a framing error: the client sees a cut
				// stream, the metrics see why.
				a.outcome = AttemptMalformedResponse
			}
		}
		msg, _ := a.streamFailure()
		a.err = fmt.Errorf("upstream %s: %s: %w", a.up.Addr, msg, a.errWithCause(a.streamErr))
	}
}

// streamFailure is the message and code of the terminal error event of a
// committed stream classified as failed.
func (a *attempt) streamFailure() (msg, code string) {
	cfg := &a.x.p.cfg
	switch a.outcome {
	case AttemptIdleTimeout:
		return fmt.Sprintf("upstream sent no event for %v", cfg.StreamIdleTimeout), "stream_idle_timeout"
	case AttemptStreamTimeout:
		return fmt.Sprintf("response exceeded %v", cfg.StreamTimeout), "stream_timeout"
	case AttemptMalformedResponse:
		return "upstream sent a malformed HTTP response mid-stream", "malformed_response"
	}
	if errors.Is(a.streamErr, sse.ErrEventTooLarge) {
		return fmt.Sprintf("upstream sent an SSE event larger than the gateway's %d-byte limit", cfg.MaxEventSize), "upstream_stream_truncated"
	}
	return "upstream stream ended before completion", "upstream_stream_truncated"
}

// causeOutcome is the outcome that a cancellation cause implies, or def
// when there is none (a genuine transport failure).
func causeOutcome(cause error, def AttemptOutcome) AttemptOutcome {
	switch cause {
	case nil:
		return def
	case errFirstByteTimeout:
		return AttemptFirstByteTimeout
	case errIdleTimeout:
		return AttemptIdleTimeout
	case errStreamTimeout:
		return AttemptStreamTimeout
	}
	return AttemptCanceled
}

// inbandOutcome classifies an in-band error event by the status it maps to.
func inbandOutcome(ie *api.InbandError) AttemptOutcome {
	switch {
	case ie.Status == http.StatusTooManyRequests:
		return AttemptInbandError429
	case ie.Status >= 400 && ie.Status < 500:
		return AttemptInbandError4xx
	}
	return AttemptInbandError5xx
}

// end classifies the attempt, releases its resources and reports it to its
// Upstream's Done and the Observer. Every attempt ends exactly once, on
// every path: a failed or losing one as soon as it reports (its permit goes
// back at once), the committed one in finish.
func (a *attempt) end() { a.endAs(a.x.result.Info.Model) }

// endAs is end with the model to report, for a goroutine other than the
// request's, which may be rewriting the request's Info (a fallback).
func (a *attempt) endAs(model string) {
	if a.ended {
		return
	}
	a.ended = true
	a.classify()
	a.fbTimer.Stop()
	// The request's end no longer reaches the attempt: a drain outlives
	// it, and any other attempt is cancelled below. (Left linked, the
	// request's end ran the link in a goroutine of its own.)
	a.unlink()
	switch {
	case a.rbody != nil && a.drain:
		// Closing a body before EOF closes its connection; a stream that
		// sent [DONE] is about to end, so read its end off the wire,
		// past the end of the request.
		body, cancel := a.rbody, a.cancel
		go func() {
			t := a.x.p.clock.AfterFunc(drainTimeout, func() { cancel(errLostRace) })
			_, _ = io.Copy(io.Discard, io.LimitReader(body, drainLimit))
			t.Stop()
			cancel(errLostRace)
			_ = body.Close()
		}()
	case a.rbody != nil:
		a.cancel(errLostRace)
		_ = a.rbody.Close()
	default:
		a.cancel(errLostRace)
	}
	rep := &a.report
	*rep = AttemptReport{
		Upstream:  a.up.Addr,
		Model:     model,
		Outcome:   a.outcome,
		TTFT:      a.ttft,
		Committed: a.committed,
		Err:       a.err,
	}
	if a.rbody != nil {
		rep.Status = a.status
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

// passThrough sends an upstream's error response to the client unchanged
// (status, headers, body), but for its pool's header_down.
//
// When the degradation ladder passed over fallbacks for reasons of their
// own, the client gets the same status with the gateway's error body
// instead, whose message says which fallbacks were refused and why.
func (x *exchange) passThrough(a *attempt) {
	if len(x.notes) > 0 {
		code := a.resp.StatusCode
		ge := &GatewayError{Status: code, Type: TypeServer, Code: "upstream_error",
			Message: fmt.Sprintf("upstream %s answered %d after %d attempt(s)", a.up.Addr, code, x.result.Attempts)}
		switch {
		case code == http.StatusTooManyRequests:
			ge.Type, ge.Code = TypeRateLimit, "upstream_rate_limited"
			ge.RetryAfter = int(ceilSeconds(a.retryAfter) / time.Second)
		case code < 500:
			ge.Type, ge.Code = TypeInvalidRequest, strconv.Itoa(code)
		}
		x.writeError(ge)
		return
	}
	h := x.w.Header()
	copyResponseHeader(h, a.resp.Header)
	x.setAdmissionHeader(h)
	h.Set("Content-Length", strconv.Itoa(len(a.errBody)))
	x.result.Status = a.resp.StatusCode
	x.headerDown(a.resp.StatusCode, h)
	x.w.WriteHeader(a.resp.StatusCode)
	_, _ = x.w.Write(a.errBody)
}

// writeError writes a gateway error and records its status. An admitted
// request's error carries the admission's headers (x-ratelimit-*).
//
// The message names the fallbacks that the degradation ladder passed over
// and why.
func (x *exchange) writeError(e *GatewayError) {
	if len(x.notes) > 0 {
		c := *e
		c.Message = x.withNotes(c.Message)
		e = &c
	}
	x.result.Status = e.Status
	x.setAdmissionHeader(x.w.Header())
	e.WriteFor(x.w, x.api)
}

// tenantFaultStatus reports the upstream statuses that are the tenant's own
// fault (DESIGN §4): a bad request, a bad key, a forbidden or unknown
// model, a body or context too large, an invalid parameter.
func tenantFaultStatus(code int) bool {
	switch code {
	case http.StatusBadRequest, http.StatusUnauthorized, http.StatusForbidden, http.StatusNotFound,
		http.StatusRequestEntityTooLarge, http.StatusUnprocessableEntity:
		return true
	}
	return false
}

// clientGone reports whether the client's own context has ended.
func (x *exchange) clientGone() bool { return x.r.Context().Err() != nil }

func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}
