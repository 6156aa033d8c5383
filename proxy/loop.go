package proxy

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"
)

// attemptUntilCommit is step 4 of the lifecycle: it runs attempts until one
// reaches its commit point, and returns it, or nil and the failure to
// report. Attempts run in their own goroutines, with their own contexts,
// and report on a channel, so the loop can wait at once on them, on the
// hedge timer and on the client.
//
// Order of the gates (DESIGN §3): the breaker (inside the Balancer) first,
// then the retry budget, then hedging.
func (x *exchange) attemptUntilCommit() (*attempt, *failure) {
	cfg := &x.p.cfg
	rc := &race{x: x, results: make(chan *attempt, cfg.MaxAttempts)}
	if cfg.Retries != nil {
		cfg.Retries.Request()
	}
	var hedgeDelay time.Duration
	if cfg.Hedging != nil {
		cfg.Hedging.Request()
		hedgeDelay, rc.hedging = cfg.Hedging.Delay(x.res.Info)
	}
	defer func() {
		// A panic here (a selection policy, an observer) must not leave
		// attempts running with their permits and in-flight counts held.
		if v := recover(); v != nil {
			for _, o := range rc.running {
				o.cancel(errLostRace)
			}
			x.abandon(rc.results, rc.inflight)
			panic(v)
		}
	}()
	if f := rc.startNext(false); f != nil {
		return nil, f
	}
	var hedgeC <-chan time.Time
	if rc.hedging {
		t := time.NewTimer(hedgeDelay)
		defer t.Stop()
		hedgeC = t.C
		rc.hedgeTimer = t
	}
	for {
		select {
		case a := <-rc.results:
			rc.inflight--
			if a.ok {
				rc.commit(a)
				return a, nil
			}
			a.end(false)
			rc.last = a
			if rc.inflight > 0 {
				if a.outcome.Retryable() || a.outcome == AttemptCanceled {
					continue // the other attempt of a hedged pair may still commit
				}
				// A 4xx: the request is at fault, and the other attempt
				// will hear the same. Answer now.
				for _, o := range rc.running {
					o.cancel(errLostRace)
				}
				x.abandon(rc.results, rc.inflight)
				return nil, &failure{last: a}
			}
			if f := rc.retry(); f != nil {
				return nil, f
			}
		case <-hedgeC:
			hedgeC = nil
			if rc.hedge() && rc.hedges < cfg.Hedging.MaxHedges() {
				rc.hedgeTimer.Reset(hedgeDelay)
				hedgeC = rc.hedgeTimer.C
			}
		case <-x.ctx.Done():
			x.abandon(rc.results, rc.inflight)
			return nil, &failure{last: rc.last, ctxErr: context.Cause(x.ctx)}
		}
	}
}

// race is the state of one request's attempts.
type race struct {
	x          *exchange
	results    chan *attempt
	tried      []string
	inflight   int
	running    []*attempt // every attempt launched, for cancelling losers
	last       *attempt
	retries    int
	hedges     int
	hedging    bool
	hedgeTimer *time.Timer
	// primaryClosed is whether the latest non-hedge attempt's upstream had
	// a closed breaker; a sick primary is never hedged.
	primaryClosed bool
}

// startNext picks an upstream and starts an attempt on it. It returns the
// failure to report when no upstream can be had.
func (rc *race) startNext(hedge bool) *failure {
	x := rc.x
	up, err := x.p.cfg.Balancer.Pick(x.w, x.r, PickRequest{Info: x.res.Info, Tried: rc.tried, Hedge: hedge})
	if err != nil {
		if rc.last != nil {
			return &failure{last: rc.last, pickErr: err}
		}
		return &failure{pickErr: err}
	}
	rc.launch(up, hedge)
	return nil
}

func (rc *race) launch(up Upstream, hedge bool) {
	x := rc.x
	rc.tried = append(rc.tried, up.Addr)
	x.res.Attempts++
	x.res.Upstream = up.Addr
	if !hedge {
		rc.primaryClosed = up.Closed
	}
	a := x.startAttempt(up, rc.results)
	a.hedge = hedge
	rc.running = append(rc.running, a)
	rc.inflight++
}

// retry decides, after every attempt has failed, whether another one runs:
// only for a retryable failure, within max_attempts, when the retry budget
// grants it, after a full-jitter backoff. It starts the attempt, or
// returns the failure to report at once.
func (rc *race) retry() *failure {
	x, cfg, last := rc.x, &rc.x.p.cfg, rc.last
	stop := &failure{last: last}
	if !last.outcome.Retryable() || x.res.Attempts >= cfg.MaxAttempts || x.ctx.Err() != nil {
		return stop
	}
	if cfg.Retries != nil && !cfg.Retries.TryRetry() {
		x.p.obs.RetryBudgetExhausted()
		return stop
	}
	x.p.obs.Retry(last.up.Addr, last.outcome)
	n := rc.retries
	rc.retries++
	x.res.Retries = rc.retries
	// With hedging on, a primary that fails before the hedge fires is
	// replaced at once: the failover is the backup.
	immediate := rc.hedging && rc.hedges == 0
	pick := func() (Upstream, error) {
		return cfg.Balancer.Pick(x.w, x.r, PickRequest{Info: x.res.Info, Tried: rc.tried})
	}
	// Find out first whether any upstream can take the retry: a client
	// whose upstreams all asked for a long pause gets its 429/503 now, not
	// after a backoff.
	up, err := pick()
	if err != nil {
		var ue *UnavailableError
		if !errors.As(err, &ue) || ue.RetryAfter <= 0 || cfg.Retries == nil {
			return stop
		}
		// Wait for the earliest upstream only if that fits.
		d, ok := cfg.Retries.Backoff(n, ue.RetryAfter, x.remaining())
		if !ok {
			return stop
		}
		if !x.sleep(d) {
			return &failure{last: last, ctxErr: context.Cause(x.ctx)}
		}
		if up, err = pick(); err != nil {
			return stop
		}
	} else if cfg.Retries != nil {
		// Going back to the upstream that asked for a pause (the only one,
		// or breakers off): honour its Retry-After if it fits, else stop.
		var retryAfter time.Duration
		if up.Addr == last.up.Addr {
			retryAfter = last.retryAfter
		}
		if retryAfter > 0 || !immediate {
			d, ok := cfg.Retries.Backoff(n, retryAfter, x.remaining())
			if !ok && retryAfter > 0 {
				release(up)
				return stop
			}
			if ok && d > 0 {
				// Give the pick back while backing off: no breaker probe
				// slot or in-flight count is held through the wait.
				release(up)
				if !x.sleep(d) {
					return &failure{last: last, ctxErr: context.Cause(x.ctx)}
				}
				if up, err = pick(); err != nil {
					return stop
				}
			}
		}
	}
	rc.launch(up, false)
	return nil
}

// release gives back an upstream that was picked but not used.
func release(up Upstream) {
	if up.Done != nil {
		up.Done(nil)
	}
}

// hedge runs when the hedge delay passes without a first event: it starts
// a backup on another upstream when the primary's breaker is closed, the
// hedge-rate cap and the retry budget allow, and attempts remain. It
// reports whether a backup started.
func (rc *race) hedge() bool {
	x, cfg := rc.x, &rc.x.p.cfg
	if rc.inflight == 0 || rc.hedges >= cfg.Hedging.MaxHedges() || x.res.Attempts >= cfg.MaxAttempts {
		return false
	}
	// The hedge-rate cap is asked before the budget: when the budget then
	// refuses (a failing pool, where hedging is unwanted anyway) a cap slot
	// is spent, which only makes hedging more conservative; the other order
	// would spend retry budget on hedges the cap refuses.
	if !rc.primaryClosed || !cfg.Hedging.TryHedge() || (cfg.Retries != nil && !cfg.Retries.TryRetry()) {
		x.p.obs.Hedge(HedgeSuppressed)
		return false
	}
	if f := rc.startNext(true); f != nil {
		x.p.obs.Hedge(HedgeSuppressed)
		return false
	}
	rc.hedges++
	x.res.Hedged = true
	x.p.obs.Hedge(HedgeFired)
	return true
}

// commit makes a the winner: every other attempt is cancelled through its
// own context (neutral for its breaker), and the hedge statistics learn.
func (rc *race) commit(a *attempt) {
	x := rc.x
	// Cancel the losers now, wherever they are (waiting for headers, or
	// for a first event); abandon collects them as they report.
	for _, o := range rc.running {
		if o != a {
			o.cancel(errLostRace)
		}
	}
	x.abandon(rc.results, rc.inflight)
	if rc.hedges > 0 {
		if a.hedge {
			x.p.obs.Hedge(HedgeWon)
		} else if rc.inflight > 0 {
			x.p.obs.Hedge(HedgeLost)
		}
	}
	if x.p.cfg.Hedging != nil && a.ttft > 0 {
		x.p.cfg.Hedging.Observe(x.res.Info, a.ttft)
	}
}

// remaining is the time left before stream_timeout, 0 without one.
func (x *exchange) remaining() time.Duration {
	if x.p.cfg.StreamTimeout <= 0 {
		return 0
	}
	return max(x.p.cfg.StreamTimeout-time.Since(x.start), time.Nanosecond)
}

// sleep waits d, or until the request ends; it reports whether d passed.
func (x *exchange) sleep(d time.Duration) bool {
	if d <= 0 {
		return x.ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-x.ctx.Done():
		return false
	}
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
				res.Outcome = OutcomeCircuitOpen
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
		// OpenAI's type for the status (SDKs map on both); the upstream's
		// own type stays visible in the code when it sent none.
		typ := TypeInvalidRequest
		if a.inband.Status == http.StatusTooManyRequests {
			typ = TypeRateLimit
		}
		x.writeError(&GatewayError{Status: a.inband.Status, Type: typ,
			Code: orDefault(a.inband.Code, strconv.Itoa(a.inband.Status)), Message: a.inband.Message})
	case AttemptInbandError429:
		res.Outcome = OutcomeRateLimited
		x.writeError(&GatewayError{Status: http.StatusTooManyRequests, Type: TypeRateLimit,
			Code: orDefault(a.inband.Code, "429"), Message: a.inband.Message, RetryAfter: 1})
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
