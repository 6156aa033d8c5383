// Package proxy is the request lifecycle engine of the LLM gateway (DESIGN
// §3): read and parse the body, run attempts against upstreams until one
// commits, relay its stream event by event, and classify the outcome. It
// knows HTTP and SSE and nothing of Caddy's configuration; upstream choice
// and transport come in through small interfaces.
package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Upstream is the target of one attempt, as chosen by a Balancer.
type Upstream struct {
	// Addr is the dial address ("host:port"). It is the URL host of the
	// outbound request and the upstream's identity in metrics, logs and the
	// set of upstreams a request has already tried.
	Addr string
	// Context, when set, decorates the attempt's context before the round
	// trip (Caddy's transport reads its dial information from there).
	Context func(context.Context) context.Context
	// Closed reports that the upstream's circuit breaker was closed when
	// it was picked (or that it has none): only such a primary is hedged.
	Closed bool
	// Committed, when set, is called once when this attempt is committed,
	// with its TTFT (a breaker settles a half-open probe there: the first
	// token proves the upstream, however long the stream then runs).
	Committed func(ttft time.Duration)
	// Done, when set, is called exactly once when the attempt ends, on
	// every path, with the attempt's report (the balancer releases its
	// in-flight count and records the outcome on the upstream's breaker).
	Done func(*AttemptReport)
}

// ErrNoUpstream is returned by a Balancer that has no upstream to offer.
var ErrNoUpstream = errors.New("no upstream available")

// UnavailableError is a Balancer's refusal with the detail the client's 503
// carries. It wraps ErrNoUpstream.
type UnavailableError struct {
	// RetryAfter is when an upstream may accept again; sent as Retry-After
	// in whole seconds, at least 1.
	RetryAfter time.Duration
	// CircuitOpen is true when open circuit breakers are the cause; the
	// response then carries X-Circuit-Breaker: open.
	CircuitOpen bool
	// Reason says why, for the error message.
	Reason string
}

// Error says that no upstream is available, and why.
func (e *UnavailableError) Error() string { return "no upstream available: " + e.Reason }

// Unwrap returns ErrNoUpstream.
func (e *UnavailableError) Unwrap() error { return ErrNoUpstream }

// Balancer chooses the upstream for the next attempt of a request.
type Balancer interface {
	// Pick returns an upstream for r, preferring one whose Addr is not in
	// tried; it returns one already tried only when no other exists. It
	// returns an error wrapping ErrNoUpstream when there is none (an
	// *UnavailableError says when to come back). info is the parsed request
	// (model, for per-model breakers). w is the
	// client's writer, for policies that set a cookie; nothing is written
	// to its body.
	Pick(w http.ResponseWriter, r *http.Request, req PickRequest) (Upstream, error)
}

// PickRequest is what a Balancer knows of the attempt to place.
type PickRequest struct {
	// Info is the parsed request (its model, for per-model breakers).
	Info RequestInfo
	// Tried lists the upstreams this request has already tried.
	Tried []string
	// Hedge is true for a backup attempt: only upstreams whose breaker is
	// closed qualify (never hedge into a sick fleet).
	Hedge bool
}

// Retries gates and paces retries. Hedges draw from the same budget, so
// together they stay within its bound. Implementations must be safe for
// concurrent use.
type Retries interface {
	// Request records an original request, which earns retry capacity.
	Request()
	// TryRetry charges one retry (or hedge) to the budget when it is
	// scheduled; false refuses it.
	TryRetry() bool
	// Backoff returns the wait before retry n (0 for the first), at least
	// retryAfter when that is positive; ok is false when the wait does not
	// fit in remaining (0: no deadline) or the implementation's own bound.
	Backoff(n int, retryAfter, remaining time.Duration) (d time.Duration, ok bool)
}

// Hedging decides when a backup attempt starts. Implementations must be
// safe for concurrent use.
type Hedging interface {
	// Delay is how long to wait for the primary's first event before
	// starting a backup; ok=false disables hedging for this request.
	Delay(info RequestInfo) (d time.Duration, ok bool)
	// Request records a request for the hedge-rate cap.
	Request()
	// TryHedge charges a hedge to the hedge-rate cap; false refuses it.
	TryHedge() bool
	// Observe records the TTFT of a committed attempt (the percentile
	// delay learns from it).
	Observe(info RequestInfo, ttft time.Duration)
	// MaxHedges bounds the backups per request.
	MaxHedges() int
}

// Hedge outcomes, the "outcome" label of caddy_llm_proxy_hedges_total.
const (
	HedgeFired      = "fired"      // a backup attempt started
	HedgeWon        = "won"        // the backup committed first
	HedgeLost       = "lost"       // the primary committed while the backup ran
	HedgeSuppressed = "suppressed" // the delay passed but a gate refused the backup
)

// Observer receives the lifecycle's measurements (metrics, logs). Calls come
// from the request's goroutines; implementations must be safe for
// concurrent use and cheap.
type Observer interface {
	// AttemptDone reports one finished attempt.
	AttemptDone(a *AttemptReport)
	// EventRelayed is called once per SSE event written to the client.
	EventRelayed()
	// Retry is called when a retry is scheduled after upstream failed with reason.
	Retry(upstream string, reason AttemptOutcome)
	// RetryBudgetExhausted is called when the budget refuses a retry.
	RetryBudgetExhausted()
	// Hedge is called with HedgeFired, HedgeWon, HedgeLost or HedgeSuppressed.
	Hedge(outcome string)
	// RequestDone reports the finished request.
	RequestDone(r *Result)
}

// AttemptReport describes one finished upstream attempt.
type AttemptReport struct {
	// Upstream is the upstream's dial address.
	Upstream string
	// Model is the request's model, "" when absent.
	Model string
	// Outcome classifies how the attempt ended.
	Outcome AttemptOutcome
	// TTFT is the time from the attempt's start to its first SSE data
	// event (or full JSON body); 0 when it never got that far.
	TTFT time.Duration
	// Committed is true for the attempt whose response reached the client.
	Committed bool
	// Status is the upstream's HTTP status, 0 when none arrived.
	Status int
	// RetryAfter is the upstream's Retry-After on a 429 or 5xx, parsed and
	// clamped; 0 when absent or junk.
	RetryAfter time.Duration
	// Err says what went wrong, nil on success.
	Err error
}

// Result describes a finished request; the Caddy layer turns it into
// placeholders, metrics and a log line.
type Result struct {
	// Info holds the parsed request fields.
	Info RequestInfo
	// Upstream is the upstream that served the response, or the last one
	// tried; "" when none was.
	Upstream string
	// Attempts is the number of upstream attempts started.
	Attempts int
	// Status is the HTTP status sent to the client.
	Status int
	// Outcome is the request's outcome.
	Outcome Outcome
	// TTFT is the time from the request's arrival to the first event (or
	// full body) written to the client; 0 when nothing was committed.
	TTFT time.Duration
	// Duration is the time from the request's arrival to the end of the response.
	Duration time.Duration
	// Events is the number of SSE events relayed to the client.
	Events int
	// Streamed is true when the response was an SSE stream.
	Streamed bool
	// Retries is the number of retries scheduled.
	Retries int
	// Hedged is true when a backup attempt was started.
	Hedged bool
}

// Config configures a Proxy. Zero durations take the documented defaults.
type Config struct {
	// Transport performs the round trips (Caddy's http transport). Required.
	Transport http.RoundTripper
	// Balancer picks upstreams. Required.
	Balancer Balancer
	// Observer receives measurements; nil discards them.
	Observer Observer
	// Logger receives debug and error logs; nil discards them.
	Logger *zap.Logger
	// TrustedProxy reports whether the request's peer is a trusted proxy,
	// whose X-Forwarded-* headers are kept and extended. Nil trusts nobody.
	TrustedProxy func(*http.Request) bool

	// MaxRequestBody is the request body limit in bytes; default 16 MiB.
	MaxRequestBody int64
	// MaxResponseBody bounds a non-streaming response held before commit;
	// default 64 MiB.
	MaxResponseBody int64
	// MaxEventSize bounds one SSE event; default 1 MiB.
	MaxEventSize int
	// FirstByteTimeout bounds the time from an attempt's start to its first
	// SSE data event or full JSON body; default 60s.
	FirstByteTimeout time.Duration
	// StreamIdleTimeout is the longest gap between events after commit;
	// default 60s.
	StreamIdleTimeout time.Duration
	// StreamTimeout bounds the whole response from the request's arrival;
	// 0 means no bound.
	StreamTimeout time.Duration
	// MaxAttempts bounds the attempts per request, hedges included;
	// default 2.
	MaxAttempts int
	// Retries gates and paces retries; nil retries at once within
	// MaxAttempts.
	Retries Retries
	// Hedging starts backup attempts; nil disables hedging.
	Hedging Hedging
}

// Defaults of Config.
const (
	DefaultMaxResponseBody   int64 = 64 << 20
	DefaultFirstByteTimeout        = 60 * time.Second
	DefaultStreamIdleTimeout       = 60 * time.Second
	DefaultMaxAttempts             = 2
	DefaultMaxEventSize            = 1 << 20
)

// Proxy runs requests through the lifecycle. It is safe for concurrent use.
type Proxy struct {
	cfg Config
	obs Observer
	log *zap.Logger
}

// New validates cfg, fills defaults and returns a Proxy.
func New(cfg Config) (*Proxy, error) {
	if cfg.Transport == nil {
		return nil, errors.New("proxy: Transport is required")
	}
	if cfg.Balancer == nil {
		return nil, errors.New("proxy: Balancer is required")
	}
	if cfg.MaxRequestBody <= 0 {
		cfg.MaxRequestBody = DefaultMaxRequestBody
	}
	if cfg.MaxResponseBody <= 0 {
		cfg.MaxResponseBody = DefaultMaxResponseBody
	}
	if cfg.MaxEventSize <= 0 {
		cfg.MaxEventSize = DefaultMaxEventSize
	}
	if cfg.FirstByteTimeout <= 0 {
		cfg.FirstByteTimeout = DefaultFirstByteTimeout
	}
	if cfg.StreamIdleTimeout <= 0 {
		cfg.StreamIdleTimeout = DefaultStreamIdleTimeout
	}
	if cfg.StreamTimeout < 0 {
		return nil, fmt.Errorf("proxy: negative StreamTimeout %v", cfg.StreamTimeout)
	}
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = DefaultMaxAttempts
	}
	p := &Proxy{cfg: cfg, obs: cfg.Observer, log: cfg.Logger}
	if p.obs == nil {
		p.obs = nopObserver{}
	}
	if p.log == nil {
		p.log = zap.NewNop()
	}
	return p, nil
}

// ServeHTTP runs r through the lifecycle and writes the response to w. It
// always writes a response (unless the client is gone) and never returns
// an error: failures are classified into the returned Result.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) *Result {
	x := &exchange{p: p, w: w, r: r, start: time.Now(), res: &Result{}}
	x.run()
	x.res.Duration = time.Since(x.start)
	p.obs.RequestDone(x.res)
	return x.res
}

// exchange is the state of one request through the lifecycle steps.
type exchange struct {
	p     *Proxy
	w     http.ResponseWriter
	r     *http.Request
	start time.Time
	res   *Result
	body  []byte
	// outHeader is the outbound request header, prepared once and cloned
	// for each attempt.
	outHeader http.Header

	// ctx is the request's context, bounded by stream_timeout when set.
	ctx    context.Context
	cancel context.CancelCauseFunc
}

// run is the lifecycle: read, attempt until commit, relay, finish.
func (x *exchange) run() {
	if !x.read() {
		return
	}
	ctx, cancel := context.WithCancelCause(x.r.Context())
	defer cancel(nil)
	x.ctx, x.cancel = ctx, cancel
	if d := x.p.cfg.StreamTimeout; d > 0 {
		t := time.AfterFunc(d-time.Since(x.start), func() { cancel(errStreamTimeout) })
		defer t.Stop()
	}

	a, fail := x.attemptUntilCommit()
	if a == nil {
		x.fail(fail)
		return
	}
	x.relay(a)
}

// read is step 1: the bounded body read and the parse of the few fields the
// gateway uses. It writes the 400/413 itself and reports whether to go on.
func (x *exchange) read() bool {
	if d := x.p.cfg.StreamTimeout; d > 0 {
		// stream_timeout runs from the request's arrival: a body that
		// trickles in must not hold the request past it.
		rc := http.NewResponseController(x.w)
		if rc.SetReadDeadline(x.start.Add(d)) == nil {
			defer func() { _ = rc.SetReadDeadline(time.Time{}) }()
		}
	}
	body, err := ReadBody(x.r, x.p.cfg.MaxRequestBody)
	if err != nil {
		x.res.Outcome = OutcomeInvalidRequest
		if errors.Is(err, ErrBodyTooLarge) {
			x.writeError(&GatewayError{Status: http.StatusRequestEntityTooLarge, Type: TypeInvalidRequest,
				Code: "request_too_large", Message: err.Error()})
			return false
		}
		if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
			x.res.Outcome = OutcomeStreamTimeout
			x.writeError(&GatewayError{Status: http.StatusRequestTimeout, Type: TypeInvalidRequest,
				Code: "stream_timeout", Message: "request body not received within stream_timeout"})
			return false
		}
		if x.r.Context().Err() != nil {
			x.res.Outcome = OutcomeClientGone
			return false
		}
		x.writeError(&GatewayError{Status: http.StatusBadRequest, Type: TypeInvalidRequest,
			Code: "invalid_body", Message: err.Error()})
		return false
	}
	x.body = body
	if isJSONRequest(x.r) {
		info, err := ParseRequest(body)
		if err != nil {
			x.res.Outcome = OutcomeInvalidRequest
			x.writeError(&GatewayError{Status: http.StatusBadRequest, Type: TypeInvalidRequest,
				Code: "invalid_json", Message: err.Error()})
			return false
		}
		x.res.Info = info
	}
	x.prepareHeader()
	return true
}

// writeError writes a gateway error and records its status.
func (x *exchange) writeError(e *GatewayError) {
	x.res.Status = e.Status
	e.Write(x.w)
}

// checkDebug returns a debug log entry when debug logging is on.
func (p *Proxy) checkDebug(msg string) *zapcore.CheckedEntry {
	return p.log.Check(zapcore.DebugLevel, msg)
}

type nopObserver struct{}

func (nopObserver) AttemptDone(*AttemptReport)   {}
func (nopObserver) EventRelayed()                {}
func (nopObserver) RequestDone(*Result)          {}
func (nopObserver) Retry(string, AttemptOutcome) {}
func (nopObserver) RetryBudgetExhausted()        {}
func (nopObserver) Hedge(string)                 {}
