package proxy

import (
	"errors"
	"fmt"
	"net/http"
	"net/textproto"
	"strings"
)

// AttemptOutcome classifies how one upstream attempt ended (DESIGN §3,
// failure classification). Its string form is the "outcome" metric label.
type AttemptOutcome uint8

const (
	// AttemptSuccess: the attempt committed and its stream (or body) finished.
	AttemptSuccess AttemptOutcome = iota
	// AttemptConnectError: dial error, or connection refused/reset before a response.
	AttemptConnectError
	// AttemptFirstByteTimeout: no first event (or full JSON body) within first_byte_timeout.
	AttemptFirstByteTimeout
	// AttemptHTTP5xx: the upstream answered 500–599.
	AttemptHTTP5xx
	// AttemptHTTP429: the upstream answered 429 Too Many Requests.
	AttemptHTTP429
	// AttemptHTTP4xx: the upstream answered another 4xx; the request is at fault.
	AttemptHTTP4xx
	// AttemptInbandError5xx: an in-band error event with a server-side code.
	AttemptInbandError5xx
	// AttemptInbandError4xx: an in-band error event with a client-side code.
	AttemptInbandError4xx
	// AttemptInbandError429: an in-band error event saying "rate limited".
	AttemptInbandError429
	// AttemptTruncated: the stream or body ended early (no finish_reason, no [DONE]).
	AttemptTruncated
	// AttemptIdleTimeout: no event within stream_idle_timeout after commit.
	AttemptIdleTimeout
	// AttemptStreamTimeout: the response outlived stream_timeout, the
	// client's own deadline. Neutral: a long request is not the
	// upstream's fault.
	AttemptStreamTimeout
	// AttemptInternalError: the gateway itself failed (a panic in the
	// attempt). Retryable, but neutral: it says nothing about the upstream.
	AttemptInternalError
	// AttemptCanceled: ended by the gateway or the client (client gone, hedge
	// loser, config unloaded). Neutral: it says nothing about the upstream.
	AttemptCanceled
	// AttemptMalformedResponse: the upstream's response broke HTTP/1.1 (a
	// bad status line or header, conflicting framing, broken chunked
	// coding) before the commit point. A failure of the upstream, judged
	// as statistical evidence: a server that speaks broken HTTP on one
	// route may serve others; one that does it always fails with no
	// success in the window, which is hard evidence.
	AttemptMalformedResponse
	// AttemptStaleConnection: the request was written on a kept
	// connection that the upstream closed at once, before any response
	// byte (its idle close crossed the request). Retryable under the retry
	// rules, as the upstream may have received it; neutral, as it says
	// nothing about the upstream's health.
	AttemptStaleConnection
)

var attemptOutcomeNames = [...]string{
	AttemptSuccess:           "success",
	AttemptConnectError:      "connect_error",
	AttemptFirstByteTimeout:  "first_byte_timeout",
	AttemptHTTP5xx:           "http_5xx",
	AttemptHTTP429:           "http_429",
	AttemptHTTP4xx:           "http_4xx",
	AttemptInbandError5xx:    "inband_error_5xx",
	AttemptInbandError4xx:    "inband_error_4xx",
	AttemptInbandError429:    "inband_error_429",
	AttemptTruncated:         "truncated",
	AttemptIdleTimeout:       "idle_timeout",
	AttemptStreamTimeout:     "stream_timeout",
	AttemptInternalError:     "internal_error",
	AttemptCanceled:          "canceled",
	AttemptMalformedResponse: "malformed_response",
	AttemptStaleConnection:   "stale_connection",
}

// String returns the outcome's metric label, e.g. "first_byte_timeout".
func (o AttemptOutcome) String() string {
	if int(o) < len(attemptOutcomeNames) {
		return attemptOutcomeNames[o]
	}
	return fmt.Sprintf("attempt_outcome(%d)", o)
}

// UpstreamFault reports whether the outcome counts against the upstream
// (its breaker). 4xx responses and canceled attempts do not.
func (o AttemptOutcome) UpstreamFault() bool {
	switch o {
	case AttemptSuccess, AttemptHTTP4xx, AttemptInbandError4xx, AttemptCanceled, AttemptStreamTimeout,
		AttemptInternalError, AttemptStaleConnection:
		return false
	}
	return true
}

// Retryable reports whether a failure with this outcome, before commit, may
// be tried again on another upstream.
func (o AttemptOutcome) Retryable() bool {
	switch o {
	case AttemptConnectError, AttemptFirstByteTimeout, AttemptHTTP5xx, AttemptHTTP429,
		AttemptInbandError5xx, AttemptInbandError429, AttemptTruncated, AttemptInternalError,
		AttemptMalformedResponse, AttemptStaleConnection:
		return true
	}
	return false
}

// Outcome is how a whole request ended. Its string form is the "outcome"
// label of caddy_llm_proxy_requests_total and {http.llm_proxy.outcome}.
type Outcome uint8

const (
	// OutcomeSuccess: a complete response reached the client.
	OutcomeSuccess Outcome = iota
	// OutcomeInvalidRequest: the gateway refused the request (400, 413).
	OutcomeInvalidRequest
	// OutcomeClientError: an upstream 4xx (or 4xx-like in-band error) passed through.
	OutcomeClientError
	// OutcomeUpstreamError: attempts spent on 5xx, connection errors or bad streams.
	OutcomeUpstreamError
	// OutcomeRateLimited: the upstream's 429 passed through.
	OutcomeRateLimited
	// OutcomeTimeout: attempts spent on first-byte timeouts (504).
	OutcomeTimeout
	// OutcomeNoUpstream: no upstream could take the request (503).
	OutcomeNoUpstream
	// OutcomeCircuitOpen: every upstream's breaker refused (503).
	OutcomeCircuitOpen
	// OutcomeTruncated: a committed stream ended early; a terminal error event was sent.
	OutcomeTruncated
	// OutcomeIdleTimeout: a committed stream went idle past stream_idle_timeout.
	OutcomeIdleTimeout
	// OutcomeStreamTimeout: a committed stream outlived stream_timeout.
	OutcomeStreamTimeout
	// OutcomeInbandError: a committed stream carried an upstream error event.
	OutcomeInbandError
	// OutcomeClientGone: the client disconnected.
	OutcomeClientGone
	// OutcomeRefused: the Identifier or Admitter refused the request
	// (e.g. 401 unknown key, 429 tenant limit, 503 shed).
	OutcomeRefused
	// OutcomeInternalError: the gateway itself failed (a panic in a step,
	// an Identifier or Admitter error that is not a *GatewayError).
	OutcomeInternalError
)

var outcomeNames = [...]string{
	OutcomeSuccess:        "success",
	OutcomeInvalidRequest: "invalid_request",
	OutcomeClientError:    "client_error",
	OutcomeUpstreamError:  "upstream_error",
	OutcomeRateLimited:    "rate_limited",
	OutcomeTimeout:        "timeout",
	OutcomeNoUpstream:     "no_upstream",
	OutcomeCircuitOpen:    "circuit_open",
	OutcomeTruncated:      "truncated",
	OutcomeIdleTimeout:    "idle_timeout",
	OutcomeStreamTimeout:  "stream_timeout",
	OutcomeInbandError:    "inband_error",
	OutcomeClientGone:     "client_gone",
	OutcomeRefused:        "refused",
	OutcomeInternalError:  "internal_error",
}

// String returns the outcome's metric label, e.g. "client_gone".
func (o Outcome) String() string {
	if int(o) < len(outcomeNames) {
		return outcomeNames[o]
	}
	return fmt.Sprintf("outcome(%d)", o)
}

// Causes with which the gateway cancels an attempt's context. They tell a
// gateway-made cancellation apart from a transport failure.
var (
	errFirstByteTimeout = errors.New("no first event before first_byte_timeout")
	errIdleTimeout      = errors.New("no event within stream_idle_timeout")
	errStreamTimeout    = errors.New("response exceeded stream_timeout")
	errLostRace         = errors.New("another attempt committed first")
)

// malformedError is implemented by a transport's error for a response it
// refused to read (internal/h1's).
type malformedError interface {
	error
	MalformedResponse() bool
}

// netHTTPMalformed are the messages of net/http's errors for a response
// it refused to read (they have no type to test): its parser's, its
// chunked decoder's, and its transport's head bound.
var netHTTPMalformed = []string{
	"malformed HTTP", "malformed MIME header", "bad Content-Length", "invalid Transfer-Encoding",
	"unsupported transfer encoding", "too many transfer encodings", "malformed chunked encoding",
	"chunked line ends with bare LF", "invalid CR in chunked line", "header line too long",
	"empty hex number for chunk length", "invalid byte in chunk length", "http chunk length too large",
	"chunked encoding contains too much non-data", "suspiciously long trailer", "bad trailer key",
	"server response headers exceeded", "invalid header field", "multiple Content-Length headers",
	"invalid empty Content-Length", "invalid Trailer key",
}

// isMalformed reports whether err says the upstream's response broke
// HTTP/1.1 rather than that the connection failed.
func isMalformed(err error) bool {
	if me, ok := errors.AsType[malformedError](err); ok && me.MalformedResponse() {
		return true
	}
	if _, ok := errors.AsType[textproto.ProtocolError](err); ok {
		return true
	}
	msg := err.Error()
	for _, m := range netHTTPMalformed {
		if strings.Contains(msg, m) {
			return true
		}
	}
	return false
}

// readFailure is where an attempt failed that could not read its
// response to the commit point.
func readFailure(err error) failKind {
	if isMalformed(err) {
		return failMalformed
	}
	return failRead
}

// classifyStatus maps an upstream error status to its attempt outcome.
func classifyStatus(code int) AttemptOutcome {
	switch {
	case code == http.StatusTooManyRequests:
		return AttemptHTTP429
	case code >= 500:
		return AttemptHTTP5xx
	default:
		return AttemptHTTP4xx
	}
}
