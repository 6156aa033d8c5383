// Package caddymodule is the Caddy glue of llm_proxy: module registration,
// JSON config, Caddyfile parsing, upstream pool and selection, metrics and
// placeholders. It translates config into a proxy.Proxy and calls it.
package caddymodule

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Handler is an LLM gateway: it proxies OpenAI-style requests
// (/v1/chat/completions, /v1/completions, ...) to a pool of inference
// servers, relaying every SSE event as it arrives. Nothing reaches the
// client before the first data event (or the full JSON body), so a failed
// attempt before that point fails over to another upstream with the
// identical body; after it, a failure ends the stream with an error event.
type Handler struct {
	// Upstreams is the static list of inference servers. Each "dial" is a
	// network address ("10.0.0.2:8000", "unix//run/vllm.sock"); placeholders
	// are not supported. Either this or dynamic_upstreams is required.
	Upstreams reverseproxy.UpstreamPool `json:"upstreams,omitempty"`

	// DynamicUpstreamsRaw is a Caddy upstream source module
	// (http.reverse_proxy.upstreams: a, srv, multi, ...) queried on each
	// request instead of the static list. Default: none.
	DynamicUpstreamsRaw json.RawMessage `json:"dynamic_upstreams,omitempty" caddy:"namespace=http.reverse_proxy.upstreams inline_key=source"`

	// LoadBalancing chooses among the upstreams that a request has not yet
	// tried. Default: least_conn, counting the gateway's attempts in flight
	// (LLM requests vary in length by orders of magnitude, so load follows
	// outstanding requests, not request counts).
	LoadBalancing *LoadBalancing `json:"load_balancing,omitempty"`

	// TransportRaw configures how upstreams are reached. Only Caddy's
	// "http" transport (http.reverse_proxy.transport.http) is accepted: dial
	// timeouts, keep-alive, TLS to upstreams, h2c. Default: an http
	// transport with Caddy's defaults.
	TransportRaw json.RawMessage `json:"transport,omitempty" caddy:"namespace=http.reverse_proxy.transport inline_key=protocol"`

	// MaxRequestBody is the largest request body accepted, in bytes; a
	// larger one gets 413 without any upstream call (a declared
	// Content-Length over the limit is refused unread). Default: 16 MiB.
	MaxRequestBody int64 `json:"max_request_body,omitempty"`

	// FirstByteTimeout bounds the time from the start of an attempt to its
	// first SSE data event (or, without streaming, its complete body);
	// past it the attempt fails and another upstream may be tried.
	// Default: 60s.
	FirstByteTimeout caddy.Duration `json:"first_byte_timeout,omitempty"`

	// StreamIdleTimeout is the longest gap allowed between two events of a
	// committed stream; past it the stream ends with an error event.
	// Default: 60s.
	StreamIdleTimeout caddy.Duration `json:"stream_idle_timeout,omitempty"`

	// StreamTimeout bounds the whole response, from the request's arrival
	// to the end of the stream. Default: 0, no bound.
	StreamTimeout caddy.Duration `json:"stream_timeout,omitempty"`

	// MaxAttempts is the most upstream attempts per request: the first
	// plus pre-commit failovers, each to an upstream not yet tried while
	// one exists. Default: 2.
	MaxAttempts int `json:"max_attempts,omitempty"`

	// Retries configures the retry budget and backoff. Default: on, with
	// the defaults documented on RetryConfig.
	Retries *RetryConfig `json:"retries,omitempty"`

	// Hedge turns on hedged requests. Default: off.
	Hedge *HedgeConfig `json:"hedge,omitempty"`

	// Breaker configures the circuit breakers. Default: on, with the
	// defaults documented on BreakerConfig; {"disabled": true} turns them off.
	Breaker *BreakerConfig `json:"breaker,omitempty"`

	breakerSettings *breaker.Settings // nil when breakers are off
	breakers        *sync.Map         // key → *breakerEntry referenced by this handler
	stateMu         *sync.Mutex       // guards breakerKeys, hedgeKeys and cleaned
	breakerKeys     []string
	// cleaned is set by Cleanup: requests still running on this handler
	// take no new references to shared state after it.
	cleaned bool
	// gen orders configs: state shared across reloads takes its settings
	// from the newest.
	gen uint64

	// poolKey identifies the upstream pool across reloads (its sorted dial
	// addresses, or its dynamic source's config): budgets and TTFT
	// statistics are kept per pool.
	poolKey   string
	budgetKey string
	retryGate *retryGate
	hedger    *hedger
	trackers  *sync.Map // key → *hedge.LatencyTracker referenced by this handler
	hedgeKeys []string

	static         []*target
	dynamic        reverseproxy.UpstreamSource
	dynamicTargets *sync.Map // dial address → *target
	dynamicSweep   *dynamicSweep
	selector       reverseproxy.Selector
	transport      *reverseproxy.HTTPTransport
	proxy          *proxy.Proxy
	logger         *zap.Logger
	stateKeys      []string
}

// LoadBalancing selects upstreams.
type LoadBalancing struct {
	// SelectionPolicyRaw is a Caddy selection policy module
	// (http.reverse_proxy.selection_policies: round_robin, least_conn,
	// random, random_choose, first, ip_hash, uri_hash, header, cookie,
	// query, weighted_round_robin, ...). least_conn and random_choose count
	// the gateway's own attempts in flight. Default: least_conn.
	SelectionPolicyRaw json.RawMessage `json:"selection_policy,omitempty" caddy:"namespace=http.reverse_proxy.selection_policies inline_key=policy"`
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.llm_proxy",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision sets up the handler: upstreams, selection, transport, metrics.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	h.gen = configGen.Add(1)
	h.dynamicTargets, h.dynamicSweep = new(sync.Map), new(dynamicSweep)
	h.breakers, h.stateMu = new(sync.Map), new(sync.Mutex)
	h.trackers = new(sync.Map)

	h.poolKey = poolKeyOf(h.Upstreams, h.DynamicUpstreamsRaw)
	if h.DynamicUpstreamsRaw != nil {
		mod, err := ctx.LoadModule(h, "DynamicUpstreamsRaw")
		if err != nil {
			return fmt.Errorf("loading dynamic upstream source: %w", err)
		}
		h.dynamic = mod.(reverseproxy.UpstreamSource)
	}
	for _, u := range h.Upstreams {
		key := u.Dial
		v, _, err := upstreamStates.LoadOrNew(key, func() (caddy.Destructor, error) { return new(upstreamState), nil })
		if err != nil {
			return err
		}
		h.stateKeys = append(h.stateKeys, key)
		t, err := newTarget(u, v.(*upstreamState))
		if err != nil {
			return err
		}
		h.static = append(h.static, t)
	}

	if err := h.provisionSelector(ctx); err != nil {
		return err
	}
	if err := h.provisionTransport(ctx); err != nil {
		return err
	}
	if err := registerMetrics(ctx.GetMetricsRegistry()); err != nil {
		return fmt.Errorf("registering metrics: %w", err)
	}
	if err := h.provisionBreakers(ctx); err != nil {
		return err
	}
	if err := h.provisionRetries(); err != nil {
		return err
	}
	if err := h.provisionHedging(); err != nil {
		return err
	}

	var hedging proxy.Hedging // a nil *hedger must stay a nil interface
	if h.hedger != nil {
		hedging = h.hedger
	}
	p, err := proxy.New(proxy.Config{
		Transport:         h.transport,
		Balancer:          balancer{h: h},
		Observer:          observer{},
		Logger:            h.logger,
		TrustedProxy:      trustedProxy,
		MaxRequestBody:    h.MaxRequestBody,
		FirstByteTimeout:  time.Duration(h.FirstByteTimeout),
		StreamIdleTimeout: time.Duration(h.StreamIdleTimeout),
		StreamTimeout:     time.Duration(h.StreamTimeout),
		MaxAttempts:       h.MaxAttempts,
		Retries:           h.retryGate,
		Hedging:           hedging,
	})
	if err != nil {
		return err
	}
	h.proxy = p
	return nil
}

func (h *Handler) provisionBreakers(ctx caddy.Context) error {
	if h.Breaker != nil && h.Breaker.Disabled {
		return nil
	}
	if h.Breaker != nil && h.Breaker.Scope != "" && h.Breaker.Scope != "upstream" && h.Breaker.Scope != "model" {
		return fmt.Errorf("breaker: unknown scope %q: want upstream or model", h.Breaker.Scope)
	}
	s := h.Breaker.settings(h.firstByteTimeout())
	if err := s.Validate(); err != nil {
		return fmt.Errorf("breaker: %w", err)
	}
	h.breakerSettings = &s
	eventsApp, err := ctx.App("events")
	if err != nil {
		return fmt.Errorf("loading events app: %w", err)
	}
	setCurrent(ctx, h.logger, eventsApp.(*caddyevents.App))
	h.holdBreakers()
	return nil
}

// holdBreakers takes this handler's references to its static upstreams'
// breakers now, so their state is held across a reload even for upstreams
// (and models) that see no traffic meanwhile.
func (h *Handler) holdBreakers() {
	if h.dynamic == nil && (h.Breaker == nil || h.Breaker.Scope != "model") {
		for _, t := range h.static {
			h.breakerFor(t.addr, "")
		}
		return
	}
	// Per-model breakers, or dynamic upstreams not known yet: hold the
	// existing entries of this pool's upstreams (dynamic: those the same
	// source config created before the reload).
	mine := func(e *breakerEntry) bool {
		if h.dynamic != nil {
			return e.pool == h.poolKey
		}
		return e.model != "" && slices.ContainsFunc(h.static, func(t *target) bool { return t.addr == e.upstream })
	}
	var held []*breakerEntry
	breakerPool.Range(func(_, v any) bool {
		if e := v.(*breakerEntry); mine(e) {
			held = append(held, e)
		}
		return true
	})
	for _, e := range held {
		h.breakerForKey(e.key, e.upstream, e.model)
	}
}

// firstByteTimeout returns first_byte_timeout with its default.
func (h *Handler) firstByteTimeout() time.Duration {
	if h.FirstByteTimeout > 0 {
		return time.Duration(h.FirstByteTimeout)
	}
	return proxy.DefaultFirstByteTimeout
}

func (h *Handler) provisionSelector(ctx caddy.Context) error {
	if h.LoadBalancing == nil || h.LoadBalancing.SelectionPolicyRaw == nil {
		h.selector = leastConn{inflight: h.inflightOf}
		return nil
	}
	mod, err := ctx.LoadModule(h.LoadBalancing, "SelectionPolicyRaw")
	if err != nil {
		return fmt.Errorf("loading selection policy: %w", err)
	}
	switch sel := mod.(type) {
	case *reverseproxy.LeastConnSelection:
		h.selector = leastConn{inflight: h.inflightOf}
	case *reverseproxy.RandomChoiceSelection:
		h.selector = randomChoose{choose: sel.Choose, inflight: h.inflightOf}
	default:
		h.selector = mod.(reverseproxy.Selector)
	}
	return nil
}

func (h *Handler) provisionTransport(ctx caddy.Context) error {
	if h.TransportRaw == nil {
		t := new(reverseproxy.HTTPTransport)
		if err := t.Provision(ctx); err != nil {
			return fmt.Errorf("provisioning default http transport: %w", err)
		}
		h.transport = t
		return nil
	}
	mod, err := ctx.LoadModule(h, "TransportRaw")
	if err != nil {
		return fmt.Errorf("loading transport: %w", err)
	}
	t, ok := mod.(*reverseproxy.HTTPTransport)
	if !ok {
		return fmt.Errorf("transport %T: llm_proxy supports only the http transport", mod)
	}
	h.transport = t
	return nil
}

// Validate checks the configuration.
func (h *Handler) Validate() error {
	// Provision has loaded (and cleared) DynamicUpstreamsRaw into h.dynamic.
	if len(h.Upstreams) == 0 && h.dynamic == nil {
		return errors.New("llm_proxy: no upstreams: set upstreams or dynamic_upstreams")
	}
	if len(h.Upstreams) > 0 && h.dynamic != nil {
		return errors.New("llm_proxy: upstreams and dynamic_upstreams are mutually exclusive")
	}
	if h.MaxRequestBody < 0 {
		return fmt.Errorf("llm_proxy: negative max_request_body %d", h.MaxRequestBody)
	}
	if h.MaxAttempts < 0 {
		return fmt.Errorf("llm_proxy: negative max_attempts %d", h.MaxAttempts)
	}
	for name, d := range map[string]caddy.Duration{"first_byte_timeout": h.FirstByteTimeout,
		"stream_idle_timeout": h.StreamIdleTimeout, "stream_timeout": h.StreamTimeout} {
		if d < 0 {
			return fmt.Errorf("llm_proxy: negative %s %v", name, time.Duration(d))
		}
	}
	return nil
}

// Cleanup releases the handler's references to shared upstream state.
// Streams still running on this handler keep working: they hold their own
// references and their contexts come from their requests.
func (h *Handler) Cleanup() error {
	for _, key := range h.stateKeys {
		_, _ = upstreamStates.Delete(key)
	}
	h.releaseBreakers()
	if h.budgetKey != "" {
		_, _ = budgetPool.Delete(h.budgetKey)
	}
	h.stateMu.Lock()
	h.cleaned = true
	for _, key := range h.hedgeKeys {
		_, _ = hedgePool.Delete(key)
	}
	h.hedgeKeys = nil
	h.stateMu.Unlock()
	return nil
}

// ServeHTTP proxies r and sets the {http.llm_proxy.*} placeholders.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	res := h.proxy.ServeHTTP(w, r)
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set("http.llm_proxy.upstream", res.Upstream)
		repl.Set("http.llm_proxy.attempts", res.Attempts)
		repl.Set("http.llm_proxy.ttft_ms", res.TTFT.Milliseconds())
		repl.Set("http.llm_proxy.retries", res.Retries)
		repl.Set("http.llm_proxy.hedged", res.Hedged)
		repl.Set("http.llm_proxy.outcome", res.Outcome.String())
		repl.Set("http.llm_proxy.model", res.Info.Model)
		repl.Set("http.llm_proxy.breaker_state", h.breakerState(res))
	}
	h.logResult(res)
	return nil
}

// breakerState is the state of the breaker of the upstream that served (or
// was tried last by) the request, "" without one.
func (h *Handler) breakerState(res *proxy.Result) string {
	if h.breakerSettings == nil || res.Upstream == "" {
		return ""
	}
	return h.breakerFor(res.Upstream, res.Info.Model).b.State().String()
}

// logResult logs requests that failed upstream; successes are the access
// log's business.
func (h *Handler) logResult(res *proxy.Result) {
	level := zapcore.DebugLevel
	switch res.Outcome {
	case proxy.OutcomeUpstreamError, proxy.OutcomeTimeout, proxy.OutcomeNoUpstream, proxy.OutcomeCircuitOpen, proxy.OutcomeTruncated,
		proxy.OutcomeIdleTimeout, proxy.OutcomeStreamTimeout, proxy.OutcomeInbandError:
		level = zapcore.WarnLevel
	}
	if ce := h.logger.Check(level, "llm request finished"); ce != nil {
		ce.Write(
			zap.String("upstream", res.Upstream),
			zap.String("model", res.Info.Model),
			zap.String("outcome", res.Outcome.String()),
			zap.Int("status", res.Status),
			zap.Int("attempts", res.Attempts),
			zap.Duration("ttft", res.TTFT),
			zap.Duration("duration", res.Duration),
			zap.Int("events", res.Events),
		)
	}
}

// configGen numbers provisioned handlers, newest highest.
var configGen atomic.Uint64

// poolKeyOf names an upstream pool by what it is made of.
func poolKeyOf(ups reverseproxy.UpstreamPool, dynamic json.RawMessage) string {
	if dynamic != nil {
		return "dynamic:" + string(dynamic)
	}
	dials := make([]string, len(ups))
	for i, u := range ups {
		dials[i] = u.Dial
	}
	slices.Sort(dials)
	return strings.Join(dials, ",")
}

// trustedProxy reports whether Caddy found the peer in trusted_proxies.
func trustedProxy(r *http.Request) bool {
	v, _ := caddyhttp.GetVar(r.Context(), caddyhttp.TrustedProxyVarKey).(bool)
	return v
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
