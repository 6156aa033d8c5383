package caddymodule

import (
	"fmt"
	"maps"
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
	hh, err := upstreamHostHeader(owner, hh)
	if err != nil {
		return out, err
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

// reverse_proxy's placeholders of the upstream an attempt goes to.
const (
	upstreamPlaceholders = "{http.reverse_proxy.upstream."
	upstreamHostport     = "{http.reverse_proxy.upstream.hostport}"
)

// upstreamHostHeader returns hh with reverse_proxy's `header_up Host
// {upstream_hostport}` (the idiom for an upstream that wants its own name)
// made a delete of Host, which sends the dial address as Host, as that
// placeholder does under reverse_proxy. The gateway edits headers once per
// request and pool, before an upstream is picked, so any other
// {http.reverse_proxy.upstream.*} placeholder has no value and is an error
// (it would be sent as written). hh itself is not changed.
func upstreamHostHeader(owner string, hh *headers.Handler) (*headers.Handler, error) {
	if up := hh.Request; up != nil {
		for k, vs := range up.Set {
			if strings.EqualFold(k, "Host") && len(vs) == 1 && vs[0] == upstreamHostport {
				c := *hh
				ops := *up
				ops.Set = maps.Clone(up.Set)
				delete(ops.Set, k)
				ops.Delete = append(ops.Delete[:len(ops.Delete):len(ops.Delete)], "Host")
				c.Request = &ops
				hh = &c
				break
			}
		}
	}
	check := func(dir string, ops *headers.HeaderOps) error {
		if ops == nil {
			return nil
		}
		var ss []string
		for k, vs := range ops.Add {
			ss = append(append(ss, k), vs...)
		}
		for k, vs := range ops.Set {
			ss = append(append(ss, k), vs...)
		}
		ss = append(ss, ops.Delete...)
		for k, rs := range ops.Replace {
			ss = append(ss, k)
			for _, r := range rs {
				ss = append(ss, r.Search, r.SearchRegexp, r.Replace)
			}
		}
		for _, s := range ss {
			if strings.Contains(s, upstreamPlaceholders) {
				return fmt.Errorf("%s: %s %q: {http.reverse_proxy.upstream.*} placeholders have no value here "+
					"(headers are edited once per request and pool, before an upstream is picked); "+
					"only header_up Host {upstream_hostport} is understood (it sends the upstream's address)", owner, dir, s)
			}
		}
		return nil
	}
	if err := check("header_up", hh.Request); err != nil {
		return nil, err
	}
	if hh.Response != nil {
		if err := check("header_down", hh.Response.HeaderOps); err != nil {
			return nil, err
		}
	}
	return hh, nil
}
