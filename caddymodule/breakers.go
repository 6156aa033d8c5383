package caddymodule

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// BreakerConfig configures the circuit breakers, one per upstream (or per
// upstream and model). Breakers are on by default with the defaults below;
// state is kept across config reloads, and new settings apply to it.
type BreakerConfig struct {
	// Disabled turns breakers off ("breaker off"). Default: false.
	Disabled bool `json:"disabled,omitempty"`

	// Scope is "upstream" (one breaker per upstream dial address) or
	// "model" (one per upstream and requested model, for servers that host
	// several models). Default: "upstream".
	Scope string `json:"scope,omitempty"`

	// ConsecutiveFailures opens the breaker after this many failures in a
	// row. Default: 3; -1 disables the rule.
	ConsecutiveFailures int `json:"consecutive_failures,omitempty"`

	// Failures opens the breaker when this many failures fall within
	// FailuresWindow. Default: 0 (rule off).
	Failures int `json:"failures,omitempty"`

	// FailuresWindow is the rolling window of the Failures rule.
	// Default: 30s.
	FailuresWindow caddy.Duration `json:"failures_window,omitempty"`

	// FailureRatio opens the breaker when failures/requests over
	// RatioWindow reach it, once MinRequests requests were seen.
	// Default: 0 (rule off).
	FailureRatio float64 `json:"failure_ratio,omitempty"`

	// MinRequests is the least number of requests in RatioWindow before a
	// ratio rule may fire. Default: 20.
	MinRequests int `json:"min_requests,omitempty"`

	// RatioWindow is the rolling window of FailureRatio and SlowRatio.
	// Default: 30s.
	RatioWindow caddy.Duration `json:"window,omitempty"`

	// SlowTTFT makes a successful attempt whose time to first token is
	// above it count as a failure (a degraded server answers 200 while its
	// TTFT climbs). Default: 0 (off).
	SlowTTFT caddy.Duration `json:"slow_ttft,omitempty"`

	// SlowRatio opens the breaker when slow calls/requests over RatioWindow
	// reach it (requires SlowTTFT). Default: 0 (rule off).
	SlowRatio float64 `json:"slow_ratio,omitempty"`

	// MinOpen is the least time an open breaker stays open, even if a
	// probe succeeds. Default: 10s.
	MinOpen caddy.Duration `json:"min_open,omitempty"`

	// OpenFor is the cooldown before half-open; it doubles (with ±20%
	// jitter) on each consecutive re-open, up to MaxOpen. Default: 10s.
	OpenFor caddy.Duration `json:"open_for,omitempty"`

	// MaxOpen caps the grown cooldown and a Retry-After extension.
	// Default: 5m.
	MaxOpen caddy.Duration `json:"max_open,omitempty"`

	// HalfOpenProbes is how many probe requests may be in flight at once
	// while half-open. Default: 1.
	HalfOpenProbes int `json:"half_open_probes,omitempty"`

	// RecoverySuccesses is how many consecutive probe successes close the
	// breaker. Default: 2.
	RecoverySuccesses int `json:"recovery_successes,omitempty"`

	// Probe, when set, makes the gateway probe an open upstream itself
	// once its cooldown is over, instead of risking a user request: users
	// are routed elsewhere until RecoverySuccesses probes succeed.
	// Default: none (user requests are the probes).
	Probe *ActiveProbe `json:"probe,omitempty"`
}

// ActiveProbe is a synthetic request sent to an open upstream.
type ActiveProbe struct {
	// URI is the path of a GET probe, e.g. "/health". Default: "/health"
	// when Chat is empty.
	URI string `json:"uri,omitempty"`

	// Chat is a JSON body POSTed to /v1/chat/completions instead of the
	// GET; the probe succeeds on a 2xx with a complete body. Keep it small
	// (max_tokens 1). Default: none.
	Chat string `json:"chat,omitempty"`

	// Interval is the time between probes while the breaker is open.
	// Default: 5s.
	Interval caddy.Duration `json:"interval,omitempty"`
}

// settings converts the config into breaker settings; probeTimeout is the
// handler's first_byte_timeout, so a hanging probe fails at the same time a
// hanging user attempt would.
func (c *BreakerConfig) settings(probeTimeout time.Duration) breaker.Settings {
	if c == nil {
		c = &BreakerConfig{}
	}
	return breaker.Settings{
		ConsecutiveFailures: c.ConsecutiveFailures,
		Failures:            c.Failures,
		FailuresWindow:      time.Duration(c.FailuresWindow),
		FailureRatio:        c.FailureRatio,
		MinRequests:         c.MinRequests,
		RatioWindow:         time.Duration(c.RatioWindow),
		SlowTTFT:            time.Duration(c.SlowTTFT),
		SlowRatio:           c.SlowRatio,
		MinOpen:             time.Duration(c.MinOpen),
		OpenFor:             time.Duration(c.OpenFor),
		MaxOpen:             time.Duration(c.MaxOpen),
		HalfOpenProbes:      c.HalfOpenProbes,
		RecoverySuccesses:   c.RecoverySuccesses,
		ProbeTimeout:        probeTimeout,
		ActiveProbing:       c.Probe != nil,
	}
}

// breakerEntry is a breaker with what the gateway keeps beside it. Entries
// live in breakerPool, reference-counted by the configs that use them, so an
// open breaker stays open across reloads.
type breakerEntry struct {
	b        *breaker.Breaker
	key      string
	upstream string
	model    string
	// pool is the identity of the upstream pool whose handler created it:
	// a reloaded dynamic pool holds its breakers by it.
	pool string

	mu        sync.Mutex
	gen       uint64  // the config generation whose settings apply
	prober    *prober // the latest config's active probe; nil when off
	probing   bool    // a probe loop is running
	destroyed bool    // no config uses the entry any more
	stop      chan struct{}
}

// Destruct stops the entry's probe loop when no config uses it any more.
func (e *breakerEntry) Destruct() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.destroyed = true
	e.prober = nil
	// The breaker is gone from every config: so is its gauge.
	metrics.breakerState.DeleteLabelValues(e.upstream, breakerModelLabel(e.model))
	if e.stop != nil {
		close(e.stop)
		e.stop = nil
	}
	return nil
}

// breakerPool holds *breakerEntry by key: the upstream's dial address, or
// "address|model" with scope model.
var breakerPool = caddy.NewUsagePool()

// current holds what breaker listeners need from the latest config (logger,
// events app): listeners outlive the config that created their breaker.
var current struct {
	sync.Mutex
	logger *zap.Logger
	events *caddyevents.App
	ctx    caddy.Context
}

func setCurrent(ctx caddy.Context, logger *zap.Logger, events *caddyevents.App) {
	current.Lock()
	defer current.Unlock()
	current.logger, current.events, current.ctx = logger, events, ctx
}

// breakerFor returns the entry for an upstream (and model, with scope
// model), taking a reference for this handler on first use; nil when
// breakers are off.
func (h *Handler) breakerFor(addr, model string) *breakerEntry {
	if h.breakerSettings == nil {
		return nil
	}
	key := addr
	if h.Breaker != nil && h.Breaker.Scope == "model" {
		model = breakerModel(model)
		key = addr + "|" + model
	}
	return h.breakerForKey(key, addr, model)
}

// maxBreakerModels bounds the model names that get breakers of their own
// under scope model, beyond those an upstream has served (which always do):
// the name comes from clients.
const maxBreakerModels = 256

var breakerModels = struct {
	sync.Map
	n atomic.Int64
}{}

// breakerModel returns the model part of a scope-model breaker key: the
// name itself while fewer than maxBreakerModels unserved names were seen
// (and always for served ones), else "other".
func breakerModel(model string) string {
	if model == "" {
		return "unknown"
	}
	if modelLabel(model) == model {
		return model
	}
	if _, ok := breakerModels.Load(model); ok {
		return model
	}
	if breakerModels.n.Add(1) > maxBreakerModels {
		breakerModels.n.Add(-1)
		return "other"
	}
	if _, loaded := breakerModels.LoadOrStore(model, struct{}{}); loaded {
		breakerModels.n.Add(-1)
	}
	return model
}

// breakerForKey returns the entry for key, taking this handler's reference
// on first use.
func (h *Handler) breakerForKey(key, addr, model string) *breakerEntry {
	if v, ok := h.breakers.Load(key); ok {
		return v.(*breakerEntry)
	}
	h.stateMu.Lock()
	defer h.stateMu.Unlock()
	if v, ok := h.breakers.Load(key); ok {
		return v.(*breakerEntry)
	}
	if h.cleaned {
		// A request still running on a replaced config: use the current
		// entry if there is one, but take no reference (nobody would
		// release it) and impose none of this old config's settings.
		e, _ := poolPeek(breakerPool, key).(*breakerEntry)
		return e
	}
	v, loaded, _ := breakerPool.LoadOrNew(key, func() (caddy.Destructor, error) {
		e := &breakerEntry{key: key, upstream: addr, model: model, pool: h.poolKey}
		e.b = breaker.New(key, *h.breakerSettings, breaker.WithListener(e.transition))
		metrics.breakerState.WithLabelValues(addr, breakerModelLabel(model)).Set(0)
		return e, nil
	})
	e := v.(*breakerEntry)
	e.adopt(h, loaded)
	h.breakers.Store(key, e)
	h.breakerKeys = append(h.breakerKeys, key)
	return e
}

// adopt applies h's settings and prober to the entry, unless a newer
// config already did: an old config still serving must not revert them.
func (e *breakerEntry) adopt(h *Handler, loaded bool) {
	e.mu.Lock()
	if e.gen > h.gen {
		e.mu.Unlock()
		return
	}
	e.gen = h.gen
	e.mu.Unlock()
	if loaded {
		// A reload: the new thresholds apply to the existing state.
		e.b.SetSettings(*h.breakerSettings)
	}
	e.setProber(h.newProber(e.upstream))
}

// poolPeek returns the value under key in a UsagePool without taking a
// reference, nil if absent.
func poolPeek(pool *caddy.UsagePool, key string) any {
	var found any
	pool.Range(func(k, v any) bool {
		if k == key {
			found = v
			return false
		}
		return true
	})
	return found
}

// releaseBreakers drops this handler's references (Cleanup).
func (h *Handler) releaseBreakers() {
	h.stateMu.Lock()
	defer h.stateMu.Unlock()
	h.cleaned = true
	for _, key := range h.breakerKeys {
		_, _ = breakerPool.Delete(key)
	}
	h.breakerKeys = nil
}

// releaseBreakersOf drops this handler's references to the breakers of
// the given upstreams (dynamic upstreams that are gone).
func (h *Handler) releaseBreakersOf(addrs []string) {
	h.stateMu.Lock()
	defer h.stateMu.Unlock()
	keep := h.breakerKeys[:0]
	for _, key := range h.breakerKeys {
		up, _, _ := strings.Cut(key, "|")
		if slices.Contains(addrs, up) {
			h.breakers.Delete(key)
			_, _ = breakerPool.Delete(key)
			continue
		}
		keep = append(keep, key)
	}
	h.breakerKeys = keep
}

// record gives the attempt's outcome to the breaker (DESIGN §3 table):
// upstream faults are failures and cancelled attempts are neutral. A 4xx
// is the client's fault: neutral too, so a stream of bad requests neither
// resets a failing upstream's run of failures nor dilutes its failure
// ratio; but a half-open probe answered with a 4xx proves the server is
// back, so there it is a success.
func (e *breakerEntry) record(p *breaker.Permit, rep *proxy.AttemptReport) {
	if rep == nil {
		p.Done(breaker.Neutral, 0, "")
		return
	}
	switch o := rep.Outcome; {
	case o == proxy.AttemptSuccess:
		p.Done(breaker.Success, rep.TTFT, "")
	case o == proxy.AttemptHTTP4xx || o == proxy.AttemptInbandError4xx:
		if p.Probe() {
			p.Done(breaker.Success, 0, "")
		} else {
			p.Done(breaker.Neutral, 0, "")
		}
	case o.UpstreamFault():
		p.Done(breaker.Failure, rep.TTFT, o.String())
	default: // cancelled, or the client's own stream_timeout
		p.Done(breaker.Neutral, 0, "")
	}
	if rep.RetryAfter > 0 {
		e.b.ExtendOpen(rep.RetryAfter, fmt.Sprintf("upstream answered %d with Retry-After %v", rep.Status, rep.RetryAfter))
	}
}

// transition is the breaker's listener: metrics, a log line, a Caddy event,
// and the start of active probing when it opens.
func (e *breakerEntry) transition(tr breaker.Transition) {
	metrics.breakerState.WithLabelValues(e.upstream, breakerModelLabel(e.model)).Set(float64(tr.To))
	metrics.breakerTransitions.WithLabelValues(e.upstream, tr.From.String(), tr.To.String()).Inc()

	current.Lock()
	logger, events, ctx := current.logger, current.events, current.ctx
	current.Unlock()
	if logger != nil {
		level := zapcore.InfoLevel
		if tr.To == breaker.Open {
			level = zapcore.WarnLevel
		}
		if ce := logger.Check(level, "circuit breaker "+tr.To.String()); ce != nil {
			fields := []zap.Field{
				zap.String("breaker", tr.Key),
				zap.String("upstream", e.upstream),
				zap.String("from", tr.From.String()),
				zap.String("to", tr.To.String()),
				zap.String("reason", tr.Reason),
				zap.Int("consecutive_failures", tr.ConsecutiveFailures),
				zap.Int("failures_in_window", tr.FailuresInWindow),
			}
			if !tr.OpenUntil.IsZero() {
				fields = append(fields, zap.Time("open_until", tr.OpenUntil))
			}
			ce.Write(fields...)
		}
	}
	if events != nil {
		events.Emit(ctx, "llm_proxy_breaker_"+tr.To.String(), map[string]any{
			"breaker":  tr.Key,
			"upstream": e.upstream,
			"model":    e.model,
			"from":     tr.From.String(),
			"to":       tr.To.String(),
			"reason":   tr.Reason,
		})
	}
	if tr.To == breaker.Open {
		e.startProbing()
	}
}

// prober sends synthetic probes to one upstream.
type prober struct {
	addr      string
	transport http.RoundTripper
	dial      func(context.Context) context.Context
	probe     ActiveProbe
	timeout   time.Duration
}

// newProber returns the handler's prober for addr, nil without active probing.
func (h *Handler) newProber(addr string) *prober {
	if h.Breaker == nil || h.Breaker.Probe == nil {
		return nil
	}
	p := *h.Breaker.Probe
	if p.Interval <= 0 {
		p.Interval = caddy.Duration(5 * time.Second)
	}
	if p.URI == "" && p.Chat == "" {
		p.URI = "/health"
	}
	t, _ := newTarget(&reverseproxy.Upstream{Dial: addr}, new(upstreamState))
	var dial func(context.Context) context.Context
	if t != nil {
		di := t.di
		dial = func(ctx context.Context) context.Context { return context.WithValue(ctx, dialInfoKey, di) }
	}
	return &prober{addr: addr, transport: h.transport, dial: dial, probe: p, timeout: h.firstByteTimeout()}
}

// setProber installs a config's prober. A breaker already open when active
// probing is turned on must start probing now: it will see no transition
// to open, and users are no longer allowed to probe it.
func (e *breakerEntry) setProber(p *prober) {
	e.mu.Lock()
	if e.destroyed {
		e.mu.Unlock()
		return
	}
	e.prober = p
	e.mu.Unlock()
	if p != nil && e.b.State() != breaker.Closed {
		e.startProbing()
	}
}

// startProbing starts the probe loop if active probing is on and no loop
// runs. The loop belongs to the entry, not to a config: it survives
// reloads and stops when the breaker closes or the entry is destroyed.
func (e *breakerEntry) startProbing() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.prober == nil || e.probing || e.destroyed {
		return
	}
	if e.stop == nil {
		e.stop = make(chan struct{})
	}
	e.probing = true
	go e.probeLoop(e.stop)
}

func (e *breakerEntry) probeLoop(stop <-chan struct{}) {
	for {
		// Deciding to stop and clearing probing happen under one lock, so
		// a re-open racing with the exit starts a new loop.
		e.mu.Lock()
		p := e.prober
		if p == nil || e.destroyed || e.b.State() == breaker.Closed {
			e.probing = false
			e.mu.Unlock()
			return
		}
		e.mu.Unlock()
		t := time.NewTimer(time.Duration(p.probe.Interval))
		select {
		case <-stop:
			t.Stop()
			e.mu.Lock()
			e.probing = false
			e.mu.Unlock()
			return
		case <-t.C:
		}
		if !e.b.ProbeDue() {
			continue
		}
		permit, ok := e.b.AllowProbe()
		if !ok {
			continue
		}
		if err := p.send(); err != nil {
			permit.Done(breaker.Failure, 0, "active probe: "+err.Error())
		} else {
			permit.Done(breaker.Success, 0, "")
		}
	}
}

// send runs one probe: success is a 2xx with a complete body within the
// first-byte timeout.
func (p *prober) send() error {
	ctx, cancel := context.WithTimeout(context.Background(), p.timeout)
	defer cancel()
	if p.dial != nil {
		ctx = p.dial(ctx)
	}
	method, path, body := http.MethodGet, p.probe.URI, io.Reader(nil)
	if p.probe.Chat != "" {
		method, path, body = http.MethodPost, "/v1/chat/completions", strings.NewReader(p.probe.Chat)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://"+p.addr+path, body)
	if err != nil {
		return err
	}
	req.URL.Scheme = "" // the transport sets http or https
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("User-Agent", "caddy-llm-proxy-probe")
	resp, err := p.transport.RoundTrip(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var buf bytes.Buffer
	if _, err := io.Copy(&buf, io.LimitReader(resp.Body, 1<<20)); err != nil {
		return fmt.Errorf("reading probe response: %w", err)
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("probe %s %s: status %d", method, path, resp.StatusCode)
	}
	return nil
}

// breakerModelLabel is the "model" label of breaker metrics: empty for
// per-upstream breakers (scope upstream), the capped model name otherwise.
func breakerModelLabel(model string) string {
	if model == "" {
		return ""
	}
	return modelLabel(model)
}
