package caddymodule

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/headers"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// FallbackConfig is one rung of the degradation ladder (DESIGN §10): a pool
// that serves the tiers allowed to degrade when the pools above it cannot,
// possibly with a smaller model and a clamped max_tokens. Fallbacks are
// tried in the order listed, only before anything reached the client. A
// tenant's own limit (rpm, tpm, max_concurrent, an open tenant breaker)
// never sends a request to a fallback: that 429 goes to the client.
type FallbackConfig struct {
	// Name names the fallback in the X-LLM-Proxy-Degraded header, the
	// caddy_llm_proxy_degraded_total metric and error messages: up to 64
	// letters, digits, '.', '_' or '-', not "primary". Required (no
	// default); unique within the handler.
	Name string `json:"name"`

	// Upstreams is the fallback's static list of servers, reached with the
	// handler's transport. Either this or dynamic_upstreams is required
	// (no default).
	Upstreams reverseproxy.UpstreamPool `json:"upstreams,omitempty"`

	// DynamicUpstreamsRaw is a Caddy upstream source module for the
	// fallback, as the handler's dynamic_upstreams. Default: none.
	DynamicUpstreamsRaw json.RawMessage `json:"dynamic_upstreams,omitempty" caddy:"namespace=http.reverse_proxy.upstreams inline_key=source"`

	// Model, when set, replaces the request body's "model" for this
	// fallback. The response's "model" field is passed through as the
	// upstream sent it. Default: "" (the client's model).
	Model string `json:"model,omitempty"`

	// ContextWindow is the fallback model's context in tokens: a request
	// whose prompt estimate (characters ÷ 4) leaves no room in it is never
	// sent here, and max_tokens is clamped to what the prompt leaves.
	// Default: 0 (no check).
	ContextWindow int `json:"context_window,omitempty"`

	// MaxOutputTokens caps max_tokens (or max_completion_tokens; set as
	// max_tokens when the client sent neither) for this fallback.
	// Default: 0 (no cap).
	MaxOutputTokens int `json:"max_output_tokens,omitempty"`

	// When lists what sends requests here: "unavailable" (no upstream of
	// the pools above can take the request: breakers open, attempts spent
	// on retryable failures, upstream 429) and "saturated" (the primary
	// has no free capacity now, by its admission capacity or its
	// saturation signal: an allowed tier comes here at once instead of
	// queueing). Default: ["unavailable"].
	When []string `json:"when,omitempty"`

	// Tiers lists the tiers that may degrade here. Default: every tier.
	Tiers []string `json:"tiers,omitempty"`

	// Capacity is the most requests in flight on this fallback; a request
	// that finds it full is not sent here. Exclusive with PerUpstream.
	// Default: 0 (no capacity of its own).
	Capacity int `json:"capacity,omitempty"`

	// PerUpstream sets the capacity to this many requests per fallback
	// upstream whose breaker is closed. Default: 0.
	PerUpstream int `json:"per_upstream,omitempty"`

	// Headers edits the headers of this fallback's requests and of the
	// responses it answers, as the handler's headers do for the primary
	// (header_up, header_down): a fallback pool has its own credentials,
	// e.g. {"request": {"set": {"X-Api-Key": ["{env.ANTHROPIC_API_KEY}"],
	// "Anthropic-Version": ["2023-06-01"]}}}. The handler's own headers
	// do not apply here. Default: none.
	Headers *headers.Handler `json:"headers,omitempty"`

	// ForwardTenantKeys keeps sending the client's Authorization, api-key
	// and x-api-key headers to this fallback's upstreams when tenants are
	// configured, as the handler's forward_tenant_keys does for the
	// primary (not inherited from it). Default: false.
	ForwardTenantKeys bool `json:"forward_tenant_keys,omitempty"`

	pool *upstream.Pool
}

// check validates the fallback's settings.
func (fc *FallbackConfig) check() error {
	switch {
	case fc == nil:
		return errors.New("llm_proxy: empty fallback")
	case fc.Name == "":
		return errors.New("llm_proxy: a fallback needs a name")
	case fc.Name == "primary" || !validFallbackName(fc.Name):
		return fmt.Errorf("llm_proxy: fallback name %q: want letters, digits, '.', '_' or '-', and not \"primary\" (the main pool's name in /v1/models)", fc.Name)
	case len(fc.Upstreams) == 0 && fc.DynamicUpstreamsRaw == nil:
		return fmt.Errorf("llm_proxy: fallback %s has no upstreams: set to or dynamic", fc.Name)
	case len(fc.Upstreams) > 0 && fc.DynamicUpstreamsRaw != nil:
		return fmt.Errorf("llm_proxy: fallback %s: upstreams and dynamic upstreams are mutually exclusive", fc.Name)
	case fc.ContextWindow < 0 || fc.MaxOutputTokens < 0 || fc.Capacity < 0 || fc.PerUpstream < 0:
		return fmt.Errorf("llm_proxy: fallback %s: negative context_window, max_output_tokens, capacity or per_upstream", fc.Name)
	case fc.Capacity > 0 && fc.PerUpstream > 0:
		return fmt.Errorf("llm_proxy: fallback %s: use capacity or per_upstream, not both", fc.Name)
	}
	if err := checkUpstreamPlaceholders(fc.Headers); err != nil {
		return fmt.Errorf("llm_proxy: fallback %s: %w", fc.Name, err)
	}
	_, err := fc.when()
	return err
}

// validFallbackName reports whether name may go into the degraded header
// and metric labels as it is.
func validFallbackName(name string) bool {
	for _, c := range name {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_', c == '-':
		default:
			return false
		}
	}
	return len(name) <= 64
}

// when returns the fallback's triggers.
func (fc *FallbackConfig) when() (proxy.FallbackWhen, error) {
	var w proxy.FallbackWhen
	for _, s := range fc.When {
		switch s {
		case proxy.DegradeUnavailable:
			w |= proxy.WhenUnavailable
		case proxy.DegradeSaturated:
			w |= proxy.WhenSaturated
		default:
			return 0, fmt.Errorf("llm_proxy: fallback %s: when %q: want unavailable or saturated", fc.Name, s)
		}
	}
	if w == 0 {
		w = proxy.WhenUnavailable
	}
	return w, nil
}

// fallbackCapacity reports whether a fallback has a capacity of its own.
func (h *Handler) fallbackCapacity() bool {
	return slices.ContainsFunc(h.Fallbacks, func(fc *FallbackConfig) bool { return fc.Capacity > 0 || fc.PerUpstream > 0 })
}

// takesOverflow reports whether a fallback takes the primary's saturated
// overflow.
func (h *Handler) takesOverflow() bool {
	return slices.ContainsFunc(h.Fallbacks, func(fc *FallbackConfig) bool { return slices.Contains(fc.When, proxy.DegradeSaturated) })
}

// provisionFallbacks builds each fallback's pool, gate and proxy.Fallback.
// A fallback's identity (its breakers' budget, its gate) is its name and
// upstream set within the ladder, so that a fallback listing the primary's
// own servers still has a capacity and budget of its own.
func (h *Handler) provisionFallbacks(ctx caddy.Context, app *App, sel upstream.Selector, ctl *admission.Controller) ([]proxy.Fallback, error) {
	var out []proxy.Fallback
	for _, fc := range h.Fallbacks {
		if err := app.checkTiers(fc); err != nil {
			return nil, err
		}
		key := "fallback " + fc.Name + " " + poolKeyOf(fc.Upstreams, fc.DynamicUpstreamsRaw)
		pool, err := h.newPool(ctx, app, key, fc, fc.Upstreams, sel)
		if err != nil {
			return nil, fmt.Errorf("fallback %s: %w", fc.Name, err)
		}
		fc.pool = pool
		ac := &AdmissionConfig{Capacity: fc.Capacity, PerUpstream: fc.PerUpstream}
		if h.Admission != nil {
			ac.Queue = h.Admission.Queue
		}
		sg, want, err := ac.gate(app, h.claims, key, pool, ctl, false)
		if err != nil {
			return nil, err
		}
		var g *admission.Gate
		if sg != nil {
			app.adoptGate(sg, want)
			g = sg
		}
		hdrs, err := poolHeaders(ctx, "llm_proxy: fallback "+fc.Name, fc.Headers, fc.ForwardTenantKeys)
		if err != nil {
			return nil, err
		}
		when, _ := fc.when()
		out = append(out, proxy.Fallback{
			Name:            fc.Name,
			Pool:            proxy.Pool{Balancer: pool, Retries: pool.Retries(), Hedging: pool.Hedging(), Gate: g, Headers: hdrs},
			Model:           fc.Model,
			ContextWindow:   fc.ContextWindow,
			MaxOutputTokens: fc.MaxOutputTokens,
			When:            when,
			Tiers:           fc.Tiers,
		})
	}
	return out, nil
}

// checkTiers refuses a fallback's tiers that the global option does not
// configure: a typo would otherwise keep that tier from ever degrading.
func (a *App) checkTiers(fc *FallbackConfig) error {
	if len(fc.Tiers) == 0 {
		return nil
	}
	if a.tenancy == nil {
		return fmt.Errorf("llm_proxy: fallback %s: tiers %v need tenants and tiers in the global llm_proxy option", fc.Name, fc.Tiers)
	}
	for _, name := range fc.Tiers {
		if !slices.ContainsFunc(a.tenancy.cfg.Tiers, func(t admission.Tier) bool { return t.Name == name }) {
			return fmt.Errorf("llm_proxy: fallback %s: tier %q is not configured", fc.Name, name)
		}
	}
	return nil
}

// poolOf returns the pool named by a Result's Fallback ("" the primary).
func (h *Handler) poolOf(fallback string) *upstream.Pool {
	for _, fc := range h.Fallbacks {
		if fc.Name == fallback && fc.pool != nil {
			return fc.pool
		}
	}
	return h.pool
}

// degradedTotal counts requests sent to a fallback.
var degradedTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
	Namespace: "caddy", Subsystem: "llm_proxy", Name: "degraded_total",
	Help: "Requests sent down the degradation ladder to a fallback pool, by fallback, reason (unavailable, saturated) and tier.",
}, []string{"fallback", "reason", "tier"})
