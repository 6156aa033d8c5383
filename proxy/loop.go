package proxy

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"
)

// attemptUntilCommit is step 4 of the lifecycle: it runs attempts, one
// upstream after another, until one reaches its commit point. It returns
// that attempt, or nil and the failure to report.
//
// Attempts run in their own goroutines and report on a channel so that the
// loop can also wait on the client and, later, on a hedge timer. The places
// where breakers, the retry budget and hedging plug in are marked.
func (x *exchange) attemptUntilCommit() (*attempt, *failure) {
	max := x.p.cfg.MaxAttempts
	results := make(chan *attempt, max)
	var tried []string
	var last *attempt
	inflight := 0
	for {
		if inflight == 0 {
			if last != nil && !x.mayRetry(last, len(tried)) {
				return nil, &failure{last: last}
			}
			// Breakers filter candidates inside the Balancer.
			up, err := x.p.cfg.Balancer.Pick(x.w, x.r, x.res.Info, tried)
			if err != nil {
				if last != nil {
					return nil, &failure{last: last}
				}
				return nil, &failure{pickErr: err}
			}
			tried = append(tried, up.Addr)
			x.res.Attempts++
			x.res.Upstream = up.Addr
			x.startAttempt(up, results)
			inflight++
		}
		select {
		case a := <-results:
			inflight--
			if a.ok {
				x.abandon(results, inflight)
				return a, nil
			}
			a.end(false)
			last = a
		case <-x.ctx.Done():
			x.abandon(results, inflight)
			return nil, &failure{last: last, ctxErr: context.Cause(x.ctx)}
		}
	}
}

// mayRetry decides whether a failed attempt is followed by another.
func (x *exchange) mayRetry(last *attempt, attempts int) bool {
	if !last.outcome.Retryable() || attempts >= x.p.cfg.MaxAttempts {
		return false
	}
	// The retry budget and backoff plug in here.
	return x.ctx.Err() == nil
}

// abandon cancels the attempts still running and ends them as they report,
// without waiting for them.
func (x *exchange) abandon(results <-chan *attempt, inflight int) {
	if inflight == 0 {
		return
	}
	go func() {
		for range inflight {
			a := <-results
			a.cancel(errLostRace)
			if a.ok {
				a.ok = false
				a.outcome, a.err = AttemptCanceled, errLostRace
			}
			a.end(false)
		}
	}()
}

// failure is why a request got no committed attempt.
type failure struct {
	// last is the last failed attempt, if any ran.
	last *attempt
	// pickErr is the Balancer's error when no attempt could start.
	pickErr error
	// ctxErr is the request context's cause when it ended the loop.
	ctxErr error
}

// fail writes the response for a request that never committed.
func (x *exchange) fail(f *failure) {
	res := x.res
	switch {
	case f.ctxErr != nil && errors.Is(f.ctxErr, errStreamTimeout):
		res.Outcome = OutcomeStreamTimeout
		x.writeError(&GatewayError{Status: http.StatusGatewayTimeout, Type: TypeTimeout, Code: "stream_timeout",
			Message: "no upstream answered within stream_timeout"})
		return
	case f.ctxErr != nil || x.clientGone():
		res.Outcome = OutcomeClientGone
		res.Status = 499 // nginx's "client closed request"; nothing is written
		return
	case f.last == nil:
		res.Outcome = OutcomeNoUpstream
		ge := &GatewayError{Status: http.StatusServiceUnavailable, Type: TypeServer, Code: "no_upstream",
			Message: f.pickErr.Error(), RetryAfter: 1}
		var ue *UnavailableError
		if errors.As(f.pickErr, &ue) {
			ge.RetryAfter = max(1, int((ue.RetryAfter+time.Second-1)/time.Second))
			if ue.CircuitOpen {
				ge.Header = http.Header{"X-Circuit-Breaker": {"open"}}
				ge.Code = "circuit_open"
			}
		}
		x.writeError(ge)
		return
	}
	a := f.last
	switch a.outcome {
	case AttemptHTTP4xx, AttemptHTTP429, AttemptHTTP5xx:
		res.Outcome = OutcomeUpstreamError
		switch a.outcome {
		case AttemptHTTP4xx:
			res.Outcome = OutcomeClientError
		case AttemptHTTP429:
			res.Outcome = OutcomeRateLimited
		}
		x.passThrough(a)
	case AttemptInbandError4xx:
		res.Outcome = OutcomeClientError
		x.writeError(&GatewayError{Status: a.inband.Status, Type: orDefault(a.inband.Type, TypeInvalidRequest),
			Code: orDefault(a.inband.Code, strconv.Itoa(a.inband.Status)), Message: a.inband.Message})
	case AttemptFirstByteTimeout, AttemptStreamTimeout:
		res.Outcome = OutcomeTimeout
		x.writeError(&GatewayError{Status: http.StatusGatewayTimeout, Type: TypeTimeout, Code: "first_byte_timeout",
			Message: fmt.Sprintf("upstream did not answer in time after %d attempt(s)", res.Attempts)})
	case AttemptCanceled:
		res.Outcome = OutcomeClientGone
		res.Status = 499
	default:
		res.Outcome = OutcomeUpstreamError
		x.writeError(&GatewayError{Status: http.StatusBadGateway, Type: TypeServer, Code: "upstream_error",
			Message: fmt.Sprintf("upstream failed after %d attempt(s): %s", res.Attempts, a.outcome)})
	}
}

// passThrough sends an upstream's error response to the client unchanged
// (status, headers, body).
func (x *exchange) passThrough(a *attempt) {
	h := x.w.Header()
	copyResponseHeader(h, a.resp.Header)
	h.Set("Content-Length", strconv.Itoa(len(a.errBody)))
	x.res.Status = a.resp.StatusCode
	x.w.WriteHeader(a.resp.StatusCode)
	_, _ = x.w.Write(a.errBody)
}

// clientGone reports whether the client's own context has ended.
func (x *exchange) clientGone() bool { return x.r.Context().Err() != nil }

func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}
