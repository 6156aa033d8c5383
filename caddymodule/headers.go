package caddymodule

import (
	"fmt"
	"net/http"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/headers"

	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// poolHeaders provisions a pool's header operations (header_up and
// header_down, reverse_proxy's headers.Handler) and returns them as the
// proxy's Headers, with forward as its ForwardKeys. owner names the pool
// in errors.
func poolHeaders(ctx caddy.Context, owner string, hh *headers.Handler, forward bool) (proxy.Headers, error) {
	out := proxy.Headers{ForwardKeys: forward}
	if hh == nil {
		return out, nil
	}
	if err := hh.Provision(ctx); err != nil {
		return out, fmt.Errorf("%s: provisioning headers: %w", owner, err)
	}
	if up := hh.Request; up != nil {
		out.Request = func(r *http.Request, h http.Header) { up.ApplyTo(h, replacerOf(r)) }
	}
	if down := hh.Response; down != nil && down.HeaderOps != nil {
		out.Response = func(r *http.Request, status int, h http.Header) {
			if down.Require == nil || down.Require.Match(status, h) {
				down.ApplyTo(h, replacerOf(r))
			}
		}
	}
	return out, nil
}

// replacerOf returns the request's Caddy replacer, or a new one (global
// placeholders such as {env.*} only) for a request that has none.
func replacerOf(r *http.Request) *caddy.Replacer {
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		return repl
	}
	return caddy.NewReplacer()
}

// upstreamPlaceholder is the prefix of reverse_proxy's per-upstream
// placeholders ({upstream_hostport} in the Caddyfile).
const upstreamPlaceholder = "{http.reverse_proxy.upstream."

// checkUpstreamPlaceholders refuses reverse_proxy's per-upstream
// placeholders in request header operations (header_up): llm_proxy sets a pool's
// request headers once per request, before an upstream is picked, so they
// would reach the upstream unexpanded. (header_up -Host sends the
// upstream's dial address.)
func checkUpstreamPlaceholders(hh *headers.Handler) error {
	if hh == nil || hh.Request == nil {
		return nil
	}
	ops := hh.Request
	check := func(field, v string) error {
		if strings.Contains(v, upstreamPlaceholder) {
			return fmt.Errorf("header_up %s %q: the {upstream_*} placeholders are not available in llm_proxy (headers are set once per pool, before an upstream is picked); header_up -Host sends the upstream's address", field, v)
		}
		return nil
	}
	for _, h := range []http.Header{ops.Set, ops.Add} {
		for field, vs := range h {
			for _, v := range vs {
				if err := check(field, v); err != nil {
					return err
				}
			}
		}
	}
	for field, rs := range ops.Replace {
		for _, r := range rs {
			if err := check(field, r.Replace); err != nil {
				return err
			}
		}
	}
	return nil
}
