package caddymodule

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// upstreamState is what the gateway tracks per upstream server. It lives in
// a package-level pool keyed by dial address, so it outlives a config
// reload and is shared by every handler that targets the same server.
type upstreamState struct {
	// inflight counts attempts in progress (for least_conn, random_choose).
	inflight atomic.Int64
}

func (*upstreamState) Destruct() error { return nil }

// upstreamStates holds an *upstreamState per static upstream dial address,
// reference-counted by the configs that use it (DESIGN §5).
var upstreamStates = caddy.NewUsagePool()

// dialInfoKey is the context key under which Caddy's http transport looks
// for the dial information of the upstream (reverseproxy's unexported
// dialInfoCtxKey; caddy.CtxKey values compare by content).
const dialInfoKey caddy.CtxKey = "reverse_proxy.dial_info"

// target is an upstream with everything an attempt needs, computed once.
type target struct {
	up    *reverseproxy.Upstream
	state *upstreamState
	di    reverseproxy.DialInfo
	// addr is the dial address without network ("10.0.0.1:8000"), the
	// upstream's identity in metrics and logs.
	addr string
	// lastSeen is when a dynamic source last returned it (unix ns).
	lastSeen atomic.Int64
}

// newTarget parses u's dial address. Placeholders are not supported: an
// upstream's identity must not change from request to request.
func newTarget(u *reverseproxy.Upstream, state *upstreamState) (*target, error) {
	na, err := caddy.ParseNetworkAddress(u.Dial)
	if err != nil {
		return nil, fmt.Errorf("upstream %q: %w", u.Dial, err)
	}
	if na.PortRangeSize() != 1 {
		return nil, fmt.Errorf("upstream %q: dial address must be exactly one socket", u.Dial)
	}
	if u.Host == nil {
		// Caddy fills Host for its own handler only; Available() needs one.
		u.Host = new(reverseproxy.Host)
	}
	addr := na.JoinHostPort(0)
	if na.IsUnixNetwork() {
		addr = na.Host
	}
	return &target{
		up:    u,
		state: state,
		addr:  addr,
		di: reverseproxy.DialInfo{
			Upstream: u,
			Network:  na.Network,
			Address:  na.JoinHostPort(0),
			Host:     na.Host,
			Port:     fmt.Sprint(na.StartPort),
		},
	}, nil
}

// balancer implements proxy.Balancer over the handler's static or dynamic
// upstreams, their circuit breakers and the selection policy.
type balancer struct {
	h *Handler
}

// candidate is an upstream that may take the next attempt.
type candidate struct {
	t  *target
	br *breakerEntry // nil when breakers are off
}

// Pick removes the upstreams whose breaker refuses, prefers those the
// request has not tried, lets the selection policy choose, and takes the
// breaker's permit and an in-flight count, both given back by Done.
func (b balancer) Pick(w http.ResponseWriter, r *http.Request, req proxy.PickRequest) (proxy.Upstream, error) {
	h, info, tried := b.h, req.Info, req.Tried
	targets, err := h.targets(r)
	if err != nil {
		return proxy.Upstream{}, fmt.Errorf("%w: %v", proxy.ErrNoUpstream, err)
	}
	if len(targets) == 0 {
		return proxy.Upstream{}, fmt.Errorf("%w: the pool is empty", proxy.ErrNoUpstream)
	}
	now := time.Now()
	var earliest time.Time
	fresh := make([]candidate, 0, len(targets))
	var retried []candidate
	for _, t := range targets {
		if t.up.MaxRequests > 0 && t.state.inflight.Load() >= int64(t.up.MaxRequests) {
			continue // full: max_requests attempts in flight
		}
		c := candidate{t: t, br: h.breakerFor(t.addr, info.Model)}
		if c.br != nil {
			if req.Hedge && c.br.b.State() != breaker.Closed {
				continue // never hedge onto a recovering upstream
			}
			if at := c.br.b.RetryAt(); !at.IsZero() && at.After(now) {
				metrics.shortCircuited.WithLabelValues(t.addr).Inc()
				if earliest.IsZero() || at.Before(earliest) {
					earliest = at
				}
				continue
			}
		}
		if slices.Contains(tried, t.addr) {
			retried = append(retried, c)
		} else {
			fresh = append(fresh, c)
		}
	}
	if len(fresh) == 0 && !req.Hedge {
		// Every upstream that accepts was tried: allow them again. A
		// hedge only ever goes to another upstream.
		fresh = retried
	}
	for len(fresh) > 0 {
		pool := make(reverseproxy.UpstreamPool, len(fresh))
		for i, c := range fresh {
			pool[i] = c.t.up
		}
		chosen := h.selector.Select(pool, r, w)
		if chosen == nil {
			return proxy.Upstream{}, fmt.Errorf("%w: none of %d upstream(s) is available", proxy.ErrNoUpstream, len(pool))
		}
		i := slices.Index(pool, chosen)
		c := fresh[i]
		if c.br == nil {
			return c.upstream(nil), nil
		}
		if permit, ok := c.br.b.Allow(); ok {
			return c.upstream(&permit), nil
		}
		// Lost the race for a half-open probe slot: try the others.
		metrics.shortCircuited.WithLabelValues(c.t.addr).Inc()
		if at := c.br.b.RetryAt(); !at.IsZero() && (earliest.IsZero() || at.Before(earliest)) {
			earliest = at
		}
		fresh = slices.Delete(fresh, i, i+1)
	}
	return proxy.Upstream{}, &proxy.UnavailableError{
		RetryAfter:  max(earliest.Sub(now), 0),
		CircuitOpen: true,
		Reason:      fmt.Sprintf("the circuit breakers of all %d upstream(s) are open", len(targets)),
	}
}

// upstream hands c to the proxy for one attempt.
func (c candidate) upstream(permit *breaker.Permit) proxy.Upstream {
	t := c.t
	t.state.inflight.Add(1)
	di := t.di
	br := c.br
	return proxy.Upstream{
		Addr:    t.addr,
		Closed:  br == nil || br.b.State() == breaker.Closed,
		Context: func(ctx context.Context) context.Context { return context.WithValue(ctx, dialInfoKey, di) },
		// A half-open probe is settled by its first token: a healthy
		// stream longer than the probe timeout must not count as a hung
		// probe. Later, Done on a settled permit is a no-op.
		Committed: func(ttft time.Duration) {
			if permit != nil && permit.Probe() {
				br.record(permit, &proxy.AttemptReport{Upstream: t.addr, Outcome: proxy.AttemptSuccess, TTFT: ttft})
			}
		},
		Done: func(rep *proxy.AttemptReport) {
			t.state.inflight.Add(-1)
			if permit != nil {
				br.record(permit, rep)
			}
		},
	}
}

// targets returns the upstreams for r: the static ones, or those of the
// dynamic source.
func (h *Handler) targets(r *http.Request) ([]*target, error) {
	if h.dynamic == nil {
		return h.static, nil
	}
	ups, err := h.dynamic.GetUpstreams(r)
	if err != nil {
		return nil, fmt.Errorf("dynamic upstreams: %w", err)
	}
	now := time.Now().UnixNano()
	out := make([]*target, 0, len(ups))
	for _, u := range ups {
		t, err := h.dynamicTarget(u)
		if err != nil {
			return nil, err
		}
		t.lastSeen.Store(now)
		out = append(out, t)
	}
	h.sweepDynamic(now, out)
	return out, nil
}

// Bounds on the dynamic upstreams a handler remembers: addresses a source
// stopped returning (pods that churn) are forgotten after dynamicTTL, or
// at once when more than maxDynamicTargets are remembered.
const (
	dynamicTTL        = time.Minute
	maxDynamicTargets = 1024
	dynamicSweepEvery = 10 * time.Second
)

// dynamicSweep counts a handler's dynamic targets and times their sweeps.
type dynamicSweep struct {
	count atomic.Int64
	last  atomic.Int64 // unix ns of the last sweep
}

// sweepDynamic forgets dynamic targets (and releases their breakers) that
// the source no longer returns. current is the latest set returned.
func (h *Handler) sweepDynamic(now int64, current []*target) {
	sw := h.dynamicSweep
	last := sw.last.Load()
	over := sw.count.Load() > maxDynamicTargets
	if !over && now-last < int64(dynamicSweepEvery) {
		return
	}
	if !sw.last.CompareAndSwap(last, now) {
		return // another request sweeps
	}
	var gone []string
	h.dynamicTargets.Range(func(k, v any) bool {
		t := v.(*target)
		if now-t.lastSeen.Load() > int64(dynamicTTL) || (over && !slices.Contains(current, t)) {
			h.dynamicTargets.Delete(k)
			sw.count.Add(-1)
			gone = append(gone, t.addr)
		}
		return true
	})
	if len(gone) > 0 {
		h.releaseBreakersOf(gone)
	}
}

// dynamicTarget returns the target for a dynamic upstream, reusing the
// parsed form and state for addresses already seen by this handler.
func (h *Handler) dynamicTarget(u *reverseproxy.Upstream) (*target, error) {
	if v, ok := h.dynamicTargets.Load(u.Dial); ok {
		return v.(*target), nil
	}
	// A fresh Upstream: the source's value may be shared by other
	// handlers, and its Host must not be written concurrently.
	t, err := newTarget(&reverseproxy.Upstream{Dial: u.Dial, MaxRequests: u.MaxRequests}, new(upstreamState))
	if err != nil {
		return nil, err
	}
	v, loaded := h.dynamicTargets.LoadOrStore(u.Dial, t)
	if !loaded {
		h.dynamicSweep.count.Add(1)
	}
	return v.(*target), nil
}

// inflightOf returns the attempts in flight to u, for count-aware selection.
func (h *Handler) inflightOf(u *reverseproxy.Upstream) int64 {
	for _, t := range h.static {
		if t.up == u {
			return t.state.inflight.Load()
		}
	}
	if v, ok := h.dynamicTargets.Load(u.Dial); ok {
		return v.(*target).state.inflight.Load()
	}
	return 0
}

// parseUpstreamAddr turns a Caddyfile upstream ("host:port",
// "http://host:port", "https://host", "unix//path") into a dial address
// and the scheme it asked for ("" when none).
func parseUpstreamAddr(s string) (dial, scheme string, err error) {
	if i := strings.Index(s, "://"); i >= 0 {
		scheme, s = strings.ToLower(s[:i]), s[i+3:]
		switch scheme {
		case "http", "https", "h2c":
		default:
			return "", "", fmt.Errorf("upstream %q: unsupported scheme %q (use http, https or h2c)", s, scheme)
		}
		if strings.ContainsAny(s, "/?#") {
			return "", "", fmt.Errorf("upstream %q: an upstream address has no path, query or fragment", scheme+"://"+s)
		}
	}
	if strings.HasPrefix(s, "unix/") {
		return s, scheme, nil
	}
	if strings.ContainsAny(s, "/?#") {
		return "", "", fmt.Errorf("upstream %q: an upstream address has no path, query or fragment", s)
	}
	if _, _, splitErr := splitHostPort(s); splitErr != nil {
		port := "80"
		if scheme == "https" {
			port = "443"
		}
		s = s + ":" + port
	}
	na, err := caddy.ParseNetworkAddress(s)
	if err != nil {
		return "", "", fmt.Errorf("upstream %q: %w", s, err)
	}
	if na.PortRangeSize() != 1 {
		return "", "", fmt.Errorf("upstream %q: must be exactly one host and port", s)
	}
	return s, scheme, nil
}
