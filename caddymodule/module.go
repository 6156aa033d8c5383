// Package caddymodule is the Caddy glue of llm_proxy: the handler module
// http.handlers.llm_proxy, the app module llm_proxy (global option), the
// admin API, JSON config, Caddyfile parsing, and the adapters from Caddy's
// selection policies, upstream sources and transport to the upstream pool.
// It translates config into an upstream.Pool and a proxy.Proxy and calls
// them; it holds no runtime policy.
package caddymodule

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/headers"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/api"
	"github.com/llmproxy/caddy-llm-proxy/internal/registry"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Handler is an LLM gateway: it proxies the streaming APIs inference
// servers speak (OpenAI Chat Completions and Completions, OpenAI
// Responses, Anthropic Messages; see API) to a pool of inference servers,
// relaying every SSE event as it arrives. Nothing reaches the client
// before the first generated event (or the full JSON body): lifecycle
// events (response.created, message_start, ...) are held until then, so a
// failed attempt before that point fails over to another upstream with the
// identical body; after it, a failure ends the stream with an error event
// in the client's own API.
type Handler struct {
	// Name names the handler (site) in the admin API and `caddy llm-proxy
	// status`: beside each breaker, the handlers whose requests it governs
	// ("handlers"), and beside each pool. The Caddyfile sets it from the
	// `name` subdirective, else from where the directive is (its file's
	// base name and line, "Caddyfile:12"). Default: the pool label (its
	// sorted dial addresses, or its dynamic source's digest); a fallback's
	// pool is named "<name> fallback <fallback name>".
	Name string `json:"name,omitempty"`

	// Upstreams is the static list of inference servers. Each "dial" is a
	// network address ("10.0.0.2:8000", "unix//run/vllm.sock"); placeholders
	// are not supported. Either this or dynamic_upstreams is required
	// (no default).
	Upstreams reverseproxy.UpstreamPool `json:"upstreams,omitempty"`

	// DynamicUpstreamsRaw is a Caddy upstream source module
	// (http.reverse_proxy.upstreams: a, srv, multi, ...) queried on each
	// request instead of the static list. Default: none.
	DynamicUpstreamsRaw json.RawMessage `json:"dynamic_upstreams,omitempty" caddy:"namespace=http.reverse_proxy.upstreams inline_key=source"`

	// LoadBalancing chooses among the upstreams that a request has not yet
	// tried. Default: least_queue when Saturation is configured, else
	// least_conn, counting the gateway's attempts in flight (LLM requests
	// vary in length by orders of magnitude, so load follows outstanding
	// requests, not request counts).
	LoadBalancing *LoadBalancing `json:"load_balancing,omitempty"`

	// TransportRaw configures how upstreams are reached. Only Caddy's
	// "http" transport (http.reverse_proxy.transport.http) is accepted: dial
	// timeouts, keep-alive, TLS to upstreams, h2c. Default: an http
	// transport with Caddy's defaults, except keep-alive idle connections
	// closed after 4s (DefaultUpstreamIdleTimeout), up to 256 of them kept
	// per upstream (DefaultUpstreamMaxIdleConns; Caddy's default is 32),
	// and 1 KiB read and write buffers per connection
	// (DefaultUpstreamBufferSize). A configured transport keeps its own
	// idle_timeout and max_idle_conns_per_host, else gets these two.
	// http:// requests go over the gateway's own HTTP/1.1 client with the
	// transport's dial, keep-alive, header and buffer settings, unless the
	// transport needs net/http's (h2c, HTTP/3, a forward proxy,
	// max_conns_per_host, compression; see plainHTTP1).
	TransportRaw json.RawMessage `json:"transport,omitempty" caddy:"namespace=http.reverse_proxy.transport inline_key=protocol"`

	// UpstreamClient chooses the HTTP/1.1 client of http:// upstreams:
	// "builtin" (the default) is the gateway's own (one goroutine and no
	// read buffer per waiting stream), "net_http" is net/http's, as in
	// Caddy's reverse_proxy: the operator's way back should the builtin
	// client ever disagree with an upstream. https:// and h2c upstreams
	// always use net/http's.
	UpstreamClient string `json:"upstream_client,omitempty"`

	// MaxRequestBody is the largest request body accepted, in bytes; a
	// larger one gets 413 without any upstream call (a declared
	// Content-Length over the limit is refused unread). Default: 16 MiB.
	MaxRequestBody int64 `json:"max_request_body,omitempty"`

	// FirstByteTimeout bounds the time from the start of an attempt to its
	// first generated SSE event (lifecycle events such as response.created
	// or message_start do not count), or, without streaming, its complete
	// body;
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

	// API is the streaming API the handler's requests speak: "chat",
	// "completions", "responses", "messages", "none" (status-code rules
	// only: no stream semantics, no usage), or "auto", which chooses by
	// the request path's suffix (/chat/completions, /completions,
	// /responses, /messages; any other path is "none", as
	// /v1/messages/count_tokens and /v1/embeddings are). Set it for servers
	// that serve an API on another path. Default: auto.
	API string `json:"api,omitempty"`

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

	// Admission sets the pool's capacity and priority queue. Tenants and
	// tiers come from the llm_proxy app (global option). Default: none (no
	// pool capacity; tenants' own limits still apply when configured).
	Admission *AdmissionConfig `json:"admission,omitempty"`

	// Fallbacks are the degradation ladder's pools, tried in order when
	// the primary cannot serve a request before commit (see
	// FallbackConfig). Each is a pool of its own, with its own breakers,
	// retry budget, capacity and saturation, under this handler's
	// settings. Default: none.
	Fallbacks []*FallbackConfig `json:"fallbacks,omitempty"`

	// Headers edits the headers of the requests sent to the primary pool's
	// upstreams ("request": header_up) and of the responses they answer
	// ("response": header_down, with its optional "require" of status
	// codes and headers), with reverse_proxy's operations (set, add,
	// delete, replace; placeholders, {env.*} included), e.g.
	// {"request": {"set": {"Authorization": ["Bearer {env.VLLM_API_KEY}"]}}}.
	// Request edits run once per request and pool, after the tenant is
	// identified and after the gateway's own headers (X-Forwarded-*,
	// X-LLM-Proxy-Tenant/-Tier, the tenant's keys removed), so they may
	// replace any of them; "Host" sets the outbound Host (deleting it, or
	// setting it to {http.reverse_proxy.upstream.hostport}, sends the
	// upstream's dial address; no other {http.reverse_proxy.upstream.*}
	// placeholder has a value here, and a config using one fails to
	// load). Response edits run once at commit, on the headers alone (no
	// event is held for them), after the gateway's own headers, and on
	// upstream error answers passed through; the gateway's own error
	// responses are not edited. Fallbacks do not inherit them (each has
	// its own). Default: none.
	Headers *headers.Handler `json:"headers,omitempty"`

	// ForwardTenantKeys keeps sending the client's Authorization, api-key
	// and x-api-key headers to the primary pool's upstreams when tenants
	// are configured (the global option's tenants block checks them), for
	// backends that check the same keys. Without tenants the gateway
	// checks no key and those headers are forwarded whatever this says.
	// Fallbacks do not inherit it. Default: false (a tenant's credential
	// stays at the gateway).
	ForwardTenantKeys bool `json:"forward_tenant_keys,omitempty"`

	// Saturation scrapes each upstream's Prometheus /metrics for its queue
	// depth and KV-cache usage, routes by them (least_queue), keeps
	// saturated upstreams out of the candidates, trips breakers on
	// sustained queue wait, and gives admission the pool signal. Default:
	// off ({} turns it on with the defaults documented on
	// SaturationConfig).
	Saturation *SaturationConfig `json:"saturation,omitempty"`

	pool *upstream.Pool
	// claims holds the handler's references outside its pool (its gate).
	claims       *registry.Claims
	proxy        *proxy.Proxy
	models       *proxy.Models // GET /v1/models with fallbacks
	transport    *transport
	ownTransport bool // the default transport, cleaned up by the handler
	logger       *zap.Logger
}

// LoadBalancing selects upstreams.
type LoadBalancing struct {
	// SelectionPolicyRaw is a Caddy selection policy module
	// (http.reverse_proxy.selection_policies: round_robin, least_conn,
	// random, random_choose, first, ip_hash, uri_hash, header, cookie,
	// query, weighted_round_robin, ...), or {"policy": "least_queue"}: the
	// gateway's own policy, not a Caddy module, which picks the upstream
	// with the lowest saturation score (see Saturation; without it the
	// score is the attempts in flight, as least_conn), or {"policy":
	// "prefix_cache", "block_chars": 256, "max_blocks": 8192,
	// "load_factor": 2}: the gateway's prefix-cache-aware policy (see
	// PrefixCacheConfig for its fields and defaults). least_conn and
	// random_choose count the gateway's own attempts in flight. With
	// Saturation configured, saturated upstreams are removed before any
	// policy chooses. Default: least_queue with Saturation, else
	// least_conn.
	SelectionPolicyRaw json.RawMessage `json:"selection_policy,omitempty" caddy:"namespace=http.reverse_proxy.selection_policies inline_key=policy"`
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.llm_proxy",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision builds the handler's upstream pool and lifecycle engine. It
// takes references to shared state (upstream entries, budgets, hedge caps)
// but changes nothing live: the pool's settings apply to shared entries
// when the llm_proxy app starts this config.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	appMod, err := ctx.App("llm_proxy")
	if err != nil {
		return err
	}
	app := appMod.(*App)
	if err := registerMetrics(ctx.GetMetricsRegistry()); err != nil {
		return fmt.Errorf("registering metrics: %w", err)
	}
	if err := h.check(); err != nil {
		return err
	}
	// The pool's identity, before loading the source clears its raw config.
	key := poolKeyOf(h.Upstreams, h.DynamicUpstreamsRaw)
	sel, err := h.loadSelector(ctx)
	if err != nil {
		return err
	}
	if h.transport, err = newTransport(ctx, h); err != nil {
		return err
	}
	if h.pool, err = h.newPool(ctx, app, key, h, h.Upstreams, sel); err != nil {
		return err
	}

	var identifier proxy.Identifier
	var admitter proxy.Admitter
	var ctl *admission.Controller
	if t := app.tenancy; t != nil {
		ctl = t.ctl
		identifier = &proxy.KeyIdentifier{
			Keys:           t.dir,
			TenantHeader:   t.header,
			TrustedProxies: t.trusted,
			UnknownTier:    t.unknown,
			Resolve: func(tenant, tier string) (string, bool) {
				ti, ok := ctl.Tier(tenant, tier)
				return ti.Name, ok
			},
		}
	}
	h.claims = new(registry.Claims)
	// A fallback that takes the primary's saturated overflow needs the
	// primary's gate (its capacity and saturation signal) to know when.
	// So does a fallback with a capacity of its own: the request's
	// admission, made at the primary's gate, is what moves to it.
	sg, want, err := h.Admission.gate(app, h.claims, key, h.pool, ctl, h.takesOverflow() || h.fallbackCapacity())
	if err != nil {
		return err
	}
	if sg != nil {
		admitter = proxy.NewTenantAdmitter(ctl, sg)
		app.adoptGate(sg, want)
	} else if ctl != nil {
		admitter = proxy.NewTenantAdmitter(ctl, nil)
	}

	fallbacks, err := h.provisionFallbacks(ctx, app, sel, ctl)
	if err != nil {
		return err
	}
	hdrs, err := poolHeaders(ctx, "llm_proxy", h.Headers, h.ForwardTenantKeys)
	if err != nil {
		return err
	}
	p, err := proxy.New(proxy.Config{
		Headers:           hdrs,
		Fallbacks:         fallbacks,
		Identifier:        identifier,
		Admitter:          admitter,
		RequestUsage:      app.tenancy != nil,
		Transport:         h.transport,
		Balancer:          h.pool,
		Observer:          requestObserver{models: app.registry().Models},
		Logger:            h.logger,
		TrustedProxy:      trustedProxy,
		MaxRequestBody:    h.MaxRequestBody,
		FirstByteTimeout:  time.Duration(h.FirstByteTimeout),
		StreamIdleTimeout: time.Duration(h.StreamIdleTimeout),
		StreamTimeout:     time.Duration(h.StreamTimeout),
		MaxAttempts:       h.MaxAttempts,
		Retries:           h.pool.Retries(),
		Hedging:           h.pool.Hedging(),
		BodyBudget:        app.bodies,
		API:               h.api(),
	})
	if err != nil {
		return err
	}
	h.proxy = p
	if len(fallbacks) > 0 {
		srcs := []proxy.ModelSource{{Name: "primary", Balancer: h.pool, Header: hdrs.Request}}
		for _, f := range fallbacks {
			srcs = append(srcs, proxy.ModelSource{Name: f.Name, Balancer: f.Balancer, Header: f.Headers.Request})
		}
		// The list outlives the config while the next one lists the same
		// pools (shared.live.Models).
		cache, err := shared.live.Models.Acquire(h.claims, proxy.ModelsKey(srcs), func() (*proxy.ModelCache, error) {
			return new(proxy.ModelCache), nil
		}, nil)
		if err != nil {
			return err
		}
		h.models = &proxy.Models{Sources: srcs, Transport: h.transport, Cache: cache}
	}
	return nil
}

// lineName matches the name the Caddyfile adapter gives a handler without
// a name subdirective, "<file>:<line>": it moves with the directive's
// line, so it identifies no handler across reloads (upstream.Config.Named).
var lineName = regexp.MustCompile(`^[^\s:]+:[0-9]+$`)

// handlerName is the name the admin API gives the handler of a pool with
// key (see Handler.Name): its Name, else the primary pool's label; for a
// fallback's pool (owner a *FallbackConfig), that name then " fallback
// <fallback name>".
func (h *Handler) handlerName(key string, owner any) string {
	fc, fallback := owner.(*FallbackConfig)
	if h.Name == "" {
		return poolLabel(key) // a fallback's: "fallback <name> <its upstreams>"
	}
	if fallback {
		return h.Name + " fallback " + fc.Name
	}
	return h.Name
}

// newPool builds one of the handler's pools (the primary, or a fallback's)
// from its upstreams (static, or the dynamic source loaded from owner's
// DynamicUpstreamsRaw field) with the handler's breaker, retry, hedge and
// saturation settings, and hands it to the app.
func (h *Handler) newPool(ctx caddy.Context, app *App, key string, owner any, ups reverseproxy.UpstreamPool, sel upstream.Selector) (*upstream.Pool, error) {
	var source upstream.Source
	if raw := dynamicRaw(owner); raw != nil {
		mod, err := ctx.LoadModule(owner, "DynamicUpstreamsRaw")
		if err != nil {
			return nil, fmt.Errorf("loading dynamic upstream source: %w", err)
		}
		source = (&dynamicSource{src: mod.(reverseproxy.UpstreamSource)}).upstreams
	}
	var static []upstream.Target
	for _, u := range ups {
		t, err := newTarget(u)
		if err != nil {
			return nil, err
		}
		static = append(static, t)
	}
	sat, err := h.Saturation.upstreamConfig()
	if err != nil {
		return nil, err
	}
	if sat != nil {
		// Scrapes go over the handler's transport (TLS, dial timeouts),
		// dialled as the breaker's prober does.
		sat.Transport, sat.Dial = h.transport, dialFor
	}
	retry, err := h.Retries.upstreamConfig()
	if err != nil {
		return nil, err
	}
	hc, err := h.Hedge.upstreamConfig(h.maxAttempts())
	if err != nil {
		return nil, err
	}
	cfg := upstream.Config{
		Generation: app.gen,
		Key:        key,
		Handler:    h.handlerName(key, owner),
		Named:      h.Name != "" && !lineName.MatchString(h.Name),
		Static:     static,
		Source:     source,
		Selector:   sel,
		Retry:      retry,
		Hedge:      hc,
		Saturation: sat,
	}
	if h.Breaker == nil || !h.Breaker.Disabled {
		s := h.Breaker.settings(h.firstByteTimeout())
		cfg.Breaker = &s
		cfg.Ejection = h.Breaker.ejection()
		cfg.ScopeModel = h.Breaker != nil && h.Breaker.Scope == "model"
		if p := h.Breaker.prober(h.transport, h.firstByteTimeout()); p != nil {
			p.Dial = dialFor
			cfg.Prober = p
		}
	}
	pool, err := app.registry().NewPool(cfg)
	if err != nil {
		return nil, err
	}
	app.adopt(pool)
	return pool, nil
}

// dynamicRaw returns the DynamicUpstreamsRaw of a handler or fallback.
func dynamicRaw(owner any) json.RawMessage {
	switch o := owner.(type) {
	case *Handler:
		return o.DynamicUpstreamsRaw
	case *FallbackConfig:
		return o.DynamicUpstreamsRaw
	}
	return nil
}

// check refuses what the Caddyfile refuses, so that JSON configs get the
// same errors; Provision calls it before building anything.
func (h *Handler) check() error {
	if len(h.Upstreams) == 0 && h.DynamicUpstreamsRaw == nil {
		return errors.New("llm_proxy: no upstreams: set upstreams or dynamic_upstreams")
	}
	if len(h.Upstreams) > 0 && h.DynamicUpstreamsRaw != nil {
		return errors.New("llm_proxy: upstreams and dynamic_upstreams are mutually exclusive")
	}
	if h.MaxRequestBody < 0 {
		return fmt.Errorf("llm_proxy: negative max_request_body %d", h.MaxRequestBody)
	}
	if h.MaxAttempts < 0 || h.MaxAttempts > 10 {
		return fmt.Errorf("llm_proxy: max_attempts %d: want a whole number from 1 to 10", h.MaxAttempts)
	}
	if _, ok := api.ByName(h.API); !ok && h.API != "" && h.API != "auto" {
		return fmt.Errorf("llm_proxy: api %q: want auto, chat, completions, responses, messages or none", h.API)
	}
	for _, d := range []struct {
		name string
		v    caddy.Duration
	}{{"first_byte_timeout", h.FirstByteTimeout}, {"stream_idle_timeout", h.StreamIdleTimeout}, {"stream_timeout", h.StreamTimeout}} {
		if d.v < 0 {
			return fmt.Errorf("llm_proxy: negative %s %v", d.name, time.Duration(d.v))
		}
	}
	if err := h.Admission.validate(); err != nil {
		return err
	}
	if err := checkUpstreamPlaceholders(h.Headers); err != nil {
		return fmt.Errorf("llm_proxy: %w", err)
	}
	names := map[string]bool{}
	for _, fc := range h.Fallbacks {
		if err := fc.check(); err != nil {
			return err
		}
		if names[fc.Name] {
			return fmt.Errorf("llm_proxy: fallback %s named twice", fc.Name)
		}
		names[fc.Name] = true
	}
	if _, err := h.Saturation.upstreamConfig(); err != nil {
		return err
	}
	if h.LoadBalancing != nil && h.LoadBalancing.SelectionPolicyRaw != nil {
		if _, err := leastQueue(h.LoadBalancing.SelectionPolicyRaw); err != nil {
			return err
		}
		if _, _, err := prefixCacheConfig(h.LoadBalancing.SelectionPolicyRaw); err != nil {
			return err
		}
	}
	return h.Breaker.validate()
}

// Validate checks the configuration (Provision has checked it already).
func (h *Handler) Validate() error {
	if h.pool == nil {
		return errors.New("llm_proxy: not provisioned")
	}
	return nil
}

// maxAttempts returns max_attempts with its default.
func (h *Handler) maxAttempts() int {
	if h.MaxAttempts > 0 {
		return h.MaxAttempts
	}
	return proxy.DefaultMaxAttempts
}

// firstByteTimeout returns first_byte_timeout with its default.
func (h *Handler) firstByteTimeout() time.Duration {
	if h.FirstByteTimeout > 0 {
		return time.Duration(h.FirstByteTimeout)
	}
	return proxy.DefaultFirstByteTimeout
}

// Cleanup releases the handler's references to shared state. Streams still
// running on this handler keep working: they hold what they picked, and
// their contexts come from their requests.
func (h *Handler) Cleanup() error {
	if h.proxy != nil {
		_ = h.proxy.Close()
	}
	if h.claims != nil {
		h.claims.Release()
	}
	if h.pool != nil {
		h.pool.Release()
	}
	for _, fc := range h.Fallbacks {
		if fc.pool != nil {
			fc.pool.Release()
		}
	}
	if h.transport != nil {
		return h.transport.cleanup(h.ownTransport)
	}
	return nil
}

// ServeHTTP proxies r and sets the {http.llm_proxy.*} placeholders.
//
// With fallbacks, GET /v1/models is answered by the gateway: the union of
// the models that its pools serve.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	if h.models != nil && proxy.IsModelsRequest(r) {
		h.models.ServeHTTP(w, r, h.proxy.Identifier())
		return nil
	}
	res := h.proxy.ServeHTTP(w, r)
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		// One provider, read only when a placeholder is (the access log's
		// fields, a header): setting the fifteen values cost about twenty
		// allocations and a breaker lookup per request.
		repl.Map(func(key string) (any, bool) { return h.placeholder(res, key) })
	}
	if res.Fallback != "" {
		degradedTotal.WithLabelValues(res.Fallback, res.DegradeReason, res.Identity.Tier).Inc()
	}
	h.logResult(res)
	return nil
}

// placeholder returns the value of the {http.llm_proxy.*} placeholder key
// for the finished request res; ok is false for any other key (and for
// saturation when the handler does not score, or no upstream was tried).
func (h *Handler) placeholder(res *proxy.Result, key string) (v any, ok bool) {
	name, ok := strings.CutPrefix(key, "http.llm_proxy.")
	if !ok {
		return nil, false
	}
	switch name {
	case "upstream":
		return res.Upstream, true
	case "attempts":
		return res.Attempts, true
	case "ttft_ms":
		return res.TTFT.Milliseconds(), true
	case "retries":
		return res.Retries, true
	case "hedged":
		return res.Hedged, true
	case "outcome":
		return res.Outcome.String(), true
	case "model":
		return res.Info.Model, true
	case "breaker_state":
		return h.poolOf(res.Fallback).BreakerState(res.Upstream, res.Info.Model), true
	case "degraded":
		return res.Degraded, true
	case "tenant":
		return res.Identity.Tenant, true
	case "tier":
		return res.Identity.Tier, true
	case "api":
		return res.API, true
	case "queue_ms":
		return res.QueueWait.Milliseconds(), true
	case "admission_us":
		return res.Decision.Microseconds(), true
	case "tokens":
		return res.Tokens, true
	case "saturation":
		if h.Saturation != nil && res.Upstream != "" {
			return strconv.FormatFloat(res.Saturation, 'f', 3, 64), true
		}
	}
	return nil, false
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
		writeResult(ce, res)
	}
}

// writeResult writes the line logResult checked. Its own function: its
// frame (the fields, ≈ 0.8 KB) is then on the handler's goroutine's stack
// only when a line is written, and a request at the default level does not
// grow that stack (ServeHTTP of package proxy says why that matters).
//
//go:noinline
func writeResult(ce *zapcore.CheckedEntry, res *proxy.Result) {
	ce.Write(
		zap.String("upstream", res.Upstream),
		zap.String("model", res.Info.Model),
		zap.String("tenant", res.Identity.Tenant),
		zap.String("tier", res.Identity.Tier),
		zap.String("outcome", res.Outcome.String()),
		zap.Int("status", res.Status),
		zap.Int("attempts", res.Attempts),
		zap.Duration("ttft", res.TTFT),
		zap.Duration("duration", res.Duration),
		zap.Int("events", res.Events),
		zap.String("degraded", res.Degraded),
	)
}

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

// api returns the API every request speaks, nil for auto (by path).
func (h *Handler) api() api.API {
	a, _ := api.ByName(h.API)
	return a
}
