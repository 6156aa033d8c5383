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
	"net/http"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/llmproxy/caddy-llm-proxy/api"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
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
	// The report belongs to the attempt: it must not be kept after the call.
	Done func(*AttemptReport)
	// Saturation is the upstream's saturation score when it was picked
	// (1 is saturated), 0 when the balancer does not score.
	Saturation float64
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
	// response then carries X-Circuit-Breaker: open and code circuit_open.
	// It takes precedence over Busy.
	CircuitOpen bool
	// Busy is true when every upstream is at its max_requests: the 503
	// has code upstreams_busy, Retry-After: 1 (a slot frees as soon as any
	// stream ends) and no X-Circuit-Breaker header. RetryAfter is ignored.
	Busy bool
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
	// Prompt yields the request's prompt text in order (Info.PromptText of
	// the body sent), for policies that route by prompt prefix.
	Prompt func(yield func(string) bool)
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

// GapObserver is implemented by an Observer that records the inter-event
// gaps of committed streams. StreamGaps is called once per stream, when
// its relay starts; the recorder then gets one gap per read of events from
// the upstream (the time since the previous read, the first from commit;
// events that arrived together count once), from the relay's goroutine.
type GapObserver interface {
	StreamGaps(upstream, model string) GapRecorder
}

// GapRecorder receives a stream's gaps in seconds (prometheus.Observer is
// one, so that a stream costs no allocation). It must be safe for
// concurrent use by several streams.
type GapRecorder interface {
	Observe(seconds float64)
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
	// AttemptDone reports one finished attempt; a must not be kept after
	// the call.
	AttemptDone(a *AttemptReport)
	// EventRelayed is called once per SSE event written to the client.
	EventRelayed()
	// Retry is called when a retry is scheduled after upstream failed with reason.
	Retry(upstream string, reason AttemptOutcome)
	// RetryBudgetExhausted is called when the budget refuses a retry.
	RetryBudgetExhausted()
	// Hedge is called with HedgeFired, HedgeWon, HedgeLost or HedgeSuppressed.
	Hedge(outcome string)
	// RequestDone reports the finished request, once, on every path
	// (client gone and panics included).
	RequestDone(r *Result)
	// StaleConnection is called when an attempt failed on a reused
	// keep-alive connection that the upstream closed as the request went
	// out, before any response byte (outcome stale_connection): neutral for
	// the breaker, retried only under the retry rules, as the upstream
	// may have received the request.
	StaleConnection(upstream string)
}

// AttemptReport describes one finished upstream attempt.
type AttemptReport struct {
	// Upstream is the upstream's dial address.
	Upstream string
	// Model is the request's model, "" when absent.
	Model string
	// Outcome classifies how the attempt ended.
	Outcome AttemptOutcome
	// TTFT is the time from the attempt's start to its first generated
	// SSE event (or full JSON body); 0 when it never got that far.
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
	// API is the name of the API the request spoke ("chat",
	// "completions", "responses", "messages", "none"): the "api" metric
	// label and {http.llm_proxy.api}.
	API string
	// Upstream is the upstream that served the response, or the last one
	// tried; "" when none was.
	Upstream string
	// Saturation is that upstream's saturation score when it was picked
	// ({http.llm_proxy.saturation}).
	Saturation float64
	// Attempts is the number of upstream attempts started.
	Attempts int
	// Status is the HTTP status sent to the client.
	Status int
	// Outcome is the request's outcome.
	Outcome Outcome
	// Committed is true when an upstream's response reached the client
	// (its first event or whole body): an upstream produced tokens.
	Committed bool
	// TenantFault is true when the request failed through its tenant's own
	// fault (DESIGN §4, tenant column): an upstream 400, 401, 403, 404, 413
	// or 422 passed through, or an in-band 4xx-like error before commit.
	TenantFault bool
	// Streamed is true when the response was an SSE stream.
	Streamed bool
	// Hedged is true when a backup attempt was started.
	Hedged bool
	// TTFT is the time from the request's arrival to the first event (or
	// full body) written to the client; 0 when nothing was committed.
	TTFT time.Duration
	// AttemptTTFT is the committed attempt's time to first event (or full
	// body), from that attempt's start: what the upstream took, without
	// the queue wait, backoffs and failed attempts before it. The tenant
	// breaker's TTFT objective is measured on it. 0 when nothing was
	// committed.
	AttemptTTFT time.Duration
	// QueueWait is the time the request waited to be admitted (the pool's
	// priority queue), refused requests included; {http.llm_proxy.queue_ms}.
	QueueWait time.Duration
	// ResponseBytes is the size of a non-streamed response body sent to
	// the client (for the token estimate when the upstream reports no
	// usage); 0 for streams.
	ResponseBytes int
	// Decision is the time identify and admit took, queue wait excluded:
	// what deciding to admit or refuse costs the gateway.
	Decision time.Duration
	// Tokens is what the request is charged, prompt plus completion, as
	// Settlement computes it; {http.llm_proxy.tokens}.
	Tokens int
	// Duration is the time from the request's arrival to the end of the response.
	Duration time.Duration
	// Events is the number of SSE events relayed to the client.
	Events int
	// ContentEvents is the number of SSE data events (chunks) relayed,
	// comments, Messages pings, [DONE] and error events excluded: vLLM sends about one
	// token per chunk, so it estimates completion tokens when Usage is
	// not Reported.
	ContentEvents int
	// Usage is the token usage the upstream reported, if it did
	// (Usage.Reported). A Messages stream that ended before its
	// message_delta holds message_start's prompt count, not Reported.
	Usage Usage
	// Identity is who sent the request, as the Identifier found out
	// ({http.llm_proxy.tenant}, {http.llm_proxy.tier}).
	Identity Identity
	// Retries is the number of retries scheduled.
	Retries int
	// Fallback names the fallback pool the request was sent to, "" when it
	// stayed on the primary; DegradeReason is why (DegradeUnavailable,
	// DegradeSaturated); Degraded is the X-LLM-Proxy-Degraded value
	// ({http.llm_proxy.degraded}). Info then holds the request as the
	// fallback got it (its model, the clamped max_tokens).
	Fallback, DegradeReason, Degraded string
}

// Settlement returns what the request used, as its tenant is charged: the
// upstream's reported usage; else, for a committed response, the prompt
// estimate (Info.PromptTokens, or the upstream's own prompt count when a
// stream gave one without its final usage, as a Messages message_start
// does) plus one completion token per content event relayed (estimated is
// true; a non-streamed body without usage counts a token per four bytes
// of it); else, for a request that failed before any upstream produced a
// token, nothing.
func (r *Result) Settlement() (prompt, completion int, estimated bool) {
	prompt = r.Info.PromptTokens
	if r.Usage.PromptTokens > 0 {
		prompt = r.Usage.PromptTokens
	}
	switch {
	case r.Usage.Reported:
		return r.Usage.PromptTokens, r.Usage.CompletionTokens, false
	case r.Committed && !r.Streamed:
		// A whole body without usage: a token per four bytes of it (JSON
		// overhead included, so never under the text it holds).
		return prompt, (r.ResponseBytes + 3) / 4, true
	case r.Committed:
		return prompt, r.ContentEvents, true
	}
	return 0, 0, false
}

// Usage is the token usage of a response (api.Usage): the streamed usage
// chunk or terminal event, or the non-streaming body's, as the request's
// API reports it. When the upstream repeats cumulative usage (TGI, a
// Messages message_delta), the last value counts.
type Usage = api.Usage

// Config configures a Proxy. Zero durations take the documented defaults.
type Config struct {
	// Transport performs the round trips (Caddy's http transport). Required.
	Transport http.RoundTripper
	// Clock is the source of time and timers for every timeout, the hedge
	// delay and backoff sleeps; nil is the real clock.
	Clock clock.Clock
	// Identifier finds out who sent a request (step 2), e.g. a
	// *KeyIdentifier; nil identifies everyone as the zero Identity.
	Identifier Identifier
	// Admitter admits or refuses a request before any upstream is picked
	// (step 3), e.g. a *TenantAdmitter; nil admits everything.
	Admitter Admitter
	// Balancer picks upstreams. Required.
	Balancer Balancer
	// Observer receives measurements; nil discards them.
	Observer Observer
	// Logger receives debug and error logs; nil discards them.
	Logger *zap.Logger
	// RequestUsage asks upstreams for the real token usage of every stream:
	// a streamed request whose client did not set
	// stream_options.include_usage gets it set upstream (every other body
	// byte as the client sent it), and the usage-only chunk this adds is
	// read for Result.Usage and removed before it reaches that client. A
	// client that asked for usage gets its stream untouched. The glue turns
	// it on when tenants are configured, so that token limits settle on
	// real usage.
	RequestUsage bool
	// Headers is what the primary pool's attempts change in the request
	// and response headers (header_up, header_down, the client's keys);
	// each Fallback has its own. Default: the zero Headers.
	Headers Headers
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
	// generated SSE event (the API's commit point) or full JSON body;
	// default 60s.
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
	// Fallbacks are the degradation ladder's pools below the primary
	// (DESIGN §10), tried in order, only before commit; each gets up to
	// MaxAttempts attempts of its own. Default: none.
	Fallbacks []Fallback
	// API is the streaming API every request of this proxy speaks (the
	// handler's `api` option); nil chooses by the request path's suffix
	// (api.ForPath): /chat/completions, /completions, /responses,
	// /messages, anything else api.None.
	API api.API
	// BodyBudget, when set, is charged for every request body before it
	// is read (503 body_memory_exhausted when it has no room in time);
	// nil bounds bodies only by MaxRequestBody.
	BodyBudget *BodyBudget
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
	cfg     Config
	primary Pool // Config's Balancer, Retries and Hedging
	// saturatedRungs: some fallback takes the primary's saturated overflow.
	saturatedRungs bool
	clock          clock.Clock
	obs            Observer
	log            *zap.Logger
	// steps runs requests' steps up to commit; Close lets its workers go.
	steps *stepPool
}

// Close lets the proxy's idle step workers (the goroutines that run
// requests up to commit) exit, as Caddy's Cleanup of the handler should;
// otherwise each exits after 5 s without a request. Requests served after
// Close still work. It returns nil.
func (p *Proxy) Close() error {
	p.steps.close()
	return nil
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
	if cfg.Clock == nil {
		cfg.Clock = clock.Real
	}
	if cfg.Identifier == nil {
		cfg.Identifier = nopIdentifier{}
	}
	if cfg.Admitter == nil {
		cfg.Admitter = nopAdmitter{}
	}
	names := make(map[string]bool, len(cfg.Fallbacks))
	for i, f := range cfg.Fallbacks {
		switch {
		case f.Name == "":
			return nil, fmt.Errorf("proxy: fallback %d has no name", i)
		case names[f.Name]:
			return nil, fmt.Errorf("proxy: fallback %q named twice", f.Name)
		case f.Balancer == nil:
			return nil, fmt.Errorf("proxy: fallback %q has no Balancer", f.Name)
		case f.ContextWindow < 0 || f.MaxOutputTokens < 0:
			return nil, fmt.Errorf("proxy: fallback %q: negative context_window or max_output_tokens", f.Name)
		}
		names[f.Name] = true
	}
	cfg.Fallbacks = slices.Clone(cfg.Fallbacks)
	p := &Proxy{cfg: cfg, clock: cfg.Clock, obs: cfg.Observer, log: cfg.Logger, steps: newStepPool(cfg.Clock)}
	p.primary = Pool{Balancer: cfg.Balancer, Retries: cfg.Retries, Hedging: cfg.Hedging, Headers: cfg.Headers}
	for i := range p.cfg.Fallbacks {
		p.saturatedRungs = p.saturatedRungs || p.cfg.Fallbacks[i].when()&WhenSaturated != 0
	}
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
// an error: failures are classified into the returned Result, which is
// also reported to Observer.RequestDone. A panic in a step is re-raised
// here, on the handler's goroutine, after the request is finished and
// reported.
//
// The lifecycle runs on goroutines of its own while the handler's waits:
// the steps up to commit on a step worker (stepPool), a committed stream's
// relay on a fresh goroutine. That is for memory: a goroutine keeps the
// largest stack it grew to, and a held stream lives for minutes. Under
// Caddy's and net/http's frames (≈ 5.2 KB) the request's deepest moment
// (the round trip, a pick, logging) would grow the handler's goroutine to
// 16 KB, kept for the stream's life. This way the handler's stays at 8 KB,
// the worker is free again at commit, and the relay's goroutine, which
// starts shallow, needs 4 KB: a held stream's stacks come to ≈ 14 KB
// instead of ≈ 18 KB (1,000 held streams through caddy: 41 against 44 KB of
// RSS a stream). Each hand-off readies the next goroutine on the same P
// (runnext), where it runs as soon as the current one blocks or exits.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) *Result {
	x := &exchange{p: p, w: w, r: r, start: p.clock.Now(), rung: rung{index: -1, pool: &p.primary}}
	x.api = p.cfg.API
	if x.api == nil {
		x.api = api.ForPath(r.URL.Path)
	}
	x.result.API = x.api.Name()
	x.ctx = r.Context()
	if d := p.cfg.StreamTimeout; d > 0 {
		// Only stream_timeout needs a context of the exchange's own. Without
		// it the request's serves: finish ends every attempt through its
		// own context, and nothing else outlives the request. A held stream
		// then keeps one cancel context, one children map and one done
		// channel fewer (≈ 0.45 KB).
		ctx, cancel := context.WithCancelCause(x.ctx)
		defer cancel(nil)
		x.ctx = ctx
		t := p.clock.AfterFunc(d, func() { cancel(errStreamTimeout) })
		defer t.Stop()
	}
	x.done.Add(1)
	p.steps.run(x)
	x.done.Wait()
	if x.panicked != nil {
		panic(x.panicked)
	}
	return &x.result
}

// exchange is the state of one request through the lifecycle steps. The
// steps record facts here (what happened); finish classifies them once.
type exchange struct {
	p     *Proxy
	w     http.ResponseWriter
	r     *http.Request
	start time.Time
	// result is what the request reports: in the exchange, one
	// allocation for both.
	result Result
	body   []byte
	// api is what the request's API means (read chooses it).
	api api.API
	// stripUsage: read asked the upstream for usage on the client's
	// behalf, so the usage-only chunk is not relayed.
	stripUsage bool
	// discardAfter: the body was refused unread (the body budget), and is
	// read to nowhere once the refusal is written.
	discardAfter bool
	// readGone: the client was gone when reading failed (readErr).
	readGone bool
	// headerRung is the rung index (-1 the primary) whose pool outHeader
	// was made for.
	headerRung int16
	// held is the body read (and charged) by read, given back by finish;
	// nil when the matcher read it.
	held *Body
	// outHeader is the outbound request header of the pool of rung
	// headerRung, prepared once per pool and shared (read-only) by its
	// attempts; hdr holds what only some requests need besides it (nil
	// for most).
	outHeader http.Header
	hdr       *headerState

	// ctx is the request's context, bounded by stream_timeout when set.
	ctx context.Context
	// fbCharged is what the fallbacks' rewritten bodies hold of the body
	// budget, given back at commit or by finish.
	fbCharged int64

	// admission is what admit reserved, released by finish.
	admission Admission
	// out flushes the client's response once a stream is committed (a
	// value, not the pointer NewResponseController returns: one
	// allocation less per stream).
	out http.ResponseController

	// Facts for finish, each set by the step that saw it.
	readErr error    // read: the body could not be read
	jsonErr error    // read: the body is not a JSON object
	refusal error    // identify or admit said no
	rc      *race    // attempt: the attempts, once one was started
	failure *failure // attempt: why no attempt reached its commit point
	won     *attempt // commit: the attempt whose response reached the client

	// rung is the pool the request is served from (the primary until the
	// degradation ladder moves it; result.Degraded is then its
	// X-LLM-Proxy-Degraded value); notes say why fallbacks were passed
	// over.
	rung  rung
	notes []string
	// client is the request as the client sent it (its body after read's
	// usage edit, and its parse): each fallback's rewrite starts from it,
	// never from another fallback's. tried marks the fallbacks used.
	client   *clientRequest
	tried    uint64
	panicked any // finish: the value of a panic in a step
	// done is what ServeHTTP waits on: finish marks it done, on whichever
	// goroutine the lifecycle ended.
	done sync.WaitGroup
}

// run is the lifecycle (DESIGN §3), one step per call: read, identify,
// admit, pick and attempt until one reaches its commit point, commit,
// relay, and finish, which runs on every path. It runs on a goroutine of
// its own (see ServeHTTP) and hands a committed stream to stream.
func (x *exchange) run() {
	handed := false
	defer x.finishUnless(&handed)

	if !x.read() {
		return
	}
	decided := x.p.clock.Now()
	ok := x.identify() && x.admit()
	// The admission decision's own cost: identify and admit, less any
	// time spent waiting in the queue.
	x.result.Decision = max(x.since(decided)-x.result.QueueWait, 0)
	if !ok {
		return
	}
	a := x.attempt()
	for a == nil && x.degradable(x.failure) {
		if !x.degrade(DegradeUnavailable) && !x.backToPrimary() {
			break
		}
		a = x.attempt()
	}
	if a == nil {
		return
	}
	if x.commit(a) {
		// The last statement: nothing of run's can panic after it.
		handed = true
		go x.stream(a)
	}
}

// stream relays a committed stream (step 7) and finishes the request, on a
// goroutine whose stack holds only the relay's frames.
func (x *exchange) stream(a *attempt) {
	defer x.finishDeferred()
	x.relay(a)
}

// finishDeferred is finish as a deferred call: recover works only there.
func (x *exchange) finishDeferred() { x.finish(recover()) }

// finishUnless is finishDeferred unless *handed: the stream's goroutine
// then finishes the request.
func (x *exchange) finishUnless(handed *bool) {
	if !*handed {
		x.finish(recover())
	}
}

// Identifier returns the proxy's Identifier (step 2), for requests the
// gateway answers itself, such as the model list.
func (p *Proxy) Identifier() Identifier { return p.cfg.Identifier }

// since is the time elapsed since t on the proxy's clock.
func (x *exchange) since(t time.Time) time.Duration { return x.p.clock.Now().Sub(t) }

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
func (nopObserver) StaleConnection(string)       {}
