package caddymodule

import (
	"net"
	"path/filepath"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/dustin/go-humanize"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("llm_proxy", parseCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("llm_proxy", httpcaddyfile.Before, "reverse_proxy")
}

func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	handler := new(Handler)
	err := handler.UnmarshalCaddyfile(h.Dispenser)
	return handler, err
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	llm_proxy [<upstreams...>] {
//	    name <label>
//	    to <upstreams...>
//	    dynamic <source> [...]
//	    lb_policy <name> [<options...>]
//	    lb_policy prefix_cache {
//	        block_chars <n>
//	        max_blocks <n>
//	        load_factor <ratio>
//	    }
//	    transport http { ... }
//	    upstream_client builtin|net_http
//	    max_request_body <size>
//	    first_byte_timeout <duration>
//	    stream_idle_timeout <duration>
//	    stream_timeout <duration>
//	    max_attempts <n>
//	    api auto|chat|completions|responses|messages|none
//	    header_up   [+|-]<field> [<value|regexp> [<replacement>]]
//	    header_down [+|-]<field> [<value|regexp> [<replacement>]]
//	    forward_tenant_keys
//	    retries {
//	        ratio <ratio>
//	        window <duration>
//	        min_per_sec <n>
//	        bucket <max_tokens> <refill_per_sec>
//	        backoff <base> <cap>
//	    }
//	    hedge {
//	        after <duration> | after p<NN> [min <duration>] [max <duration>] [fallback <duration>]
//	        max_ratio <ratio>
//	        min_per_sec <n>
//	        max_hedges <n>
//	    }
//	    breaker off
//	    breaker {
//	        consecutive_failures <n>|off
//	        failures <n> within <duration>
//	        failure_ratio <ratio> [min_requests <n>] [window <duration>]
//	        slow_ttft <duration>
//	        slow_ratio <ratio>
//	        min_open <duration>
//	        open_for <duration>
//	        max_open <duration>
//	        half_open_probes <n>
//	        recovery_successes <n>
//	        max_ejection <ratio>
//	        panic_threshold <ratio>|off
//	        probe {
//	            uri <path>
//	            chat <json>
//	            interval <duration>
//	        }
//	        scope upstream|model
//	    }
//	    admission {
//	        capacity <n> | per_upstream <n>
//	        queue <n>
//	    }
//	    fallback <name> {
//	        to <upstreams...> | dynamic <source> [...]
//	        model <name>
//	        context_window <tokens>
//	        max_output_tokens <tokens>
//	        when unavailable|saturated ...
//	        tiers <names...>
//	        capacity <n> | per_upstream <n>
//	        header_up   [+|-]<field> [<value|regexp> [<replacement>]]
//	        header_down [+|-]<field> [<value|regexp> [<replacement>]]
//	        forward_tenant_keys
//	    }
//	    saturation {
//	        metrics_path <path>
//	        interval <duration>
//	        timeout <duration>
//	        stale_after <duration>
//	        preset vllm|sglang|tgi
//	        metric queue_depth|running|kv_usage|queue_time|ttft <name>
//	        queue_threshold <n>
//	        kv_threshold <ratio>
//	        trip queue_wait_p99 <duration> [for <duration>]
//	        trip kv_usage <ratio> [for <duration>]
//	        trip ttft_p95 <duration> [for <duration>]
//	        trip off
//	        window <duration>
//	    }
//	}
//
// Upstreams are "host:port", "http://host:port", "https://host[:port]"
// (enables TLS on the http transport), "h2c://host:port" or
// "unix//path". dynamic, lb_policy and transport take the same modules and
// grammar as reverse_proxy; lb_policy also takes the gateway's own
// policies: least_queue (the default when saturation is configured) and
// prefix_cache, whose optional block sets its block size, its blocks
// remembered per upstream and its load factor (see PrefixCacheConfig). "saturation"
// without a block takes every default. Sizes accept units ("16MiB",
// "512KB"). header_up and header_down are reverse_proxy's, for the primary
// pool; each fallback has its own (not inherited). forward_tenant_keys
// keeps the client's Authorization, api-key and x-api-key on requests to
// that pool when tenants are configured (they stay at the gateway by
// default).
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // directive name
	// The handler's name in the admin API, unless a name subdirective
	// gives one: where the directive is ("Caddyfile:12").
	h.Name = filepath.Base(d.File()) + ":" + strconv.Itoa(d.Line())
	var schemes []string
	addUpstreams := func(args []string) error {
		for _, a := range args {
			dial, scheme, err := parseUpstreamAddr(a)
			if err != nil {
				return d.Err(err.Error())
			}
			for _, u := range h.Upstreams {
				if u.Dial == dial {
					return d.Errf("upstream %s is listed twice", dial)
				}
			}
			h.Upstreams = append(h.Upstreams, &reverseproxy.Upstream{Dial: dial})
			schemes = append(schemes, scheme)
		}
		return nil
	}
	if err := addUpstreams(d.RemainingArgs()); err != nil {
		return err
	}
	var transport *reverseproxy.HTTPTransport

	seen := map[string]bool{}
	for d.NextBlock(0) {
		switch name := d.Val(); name {
		case "max_request_body", "first_byte_timeout", "stream_idle_timeout", "stream_timeout", "max_attempts", "api", "name", "forward_tenant_keys":
			if seen[name] {
				return d.Errf("%s already specified", name)
			}
			seen[name] = true
		}
		switch d.Val() {
		case "to":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.ArgErr()
			}
			if err := addUpstreams(args); err != nil {
				return err
			}

		case "dynamic":
			if !d.NextArg() {
				return d.ArgErr()
			}
			if h.DynamicUpstreamsRaw != nil {
				return d.Err("dynamic upstreams already specified")
			}
			name := d.Val()
			modID := "http.reverse_proxy.upstreams." + name
			unm, err := caddyfile.UnmarshalModule(d, modID)
			if err != nil {
				return err
			}
			source, ok := unm.(reverseproxy.UpstreamSource)
			if !ok {
				return d.Errf("module %s (%T) is not an UpstreamSource", modID, unm)
			}
			h.DynamicUpstreamsRaw = caddyconfig.JSONModuleObject(source, "source", name, nil)

		case "lb_policy":
			if !d.NextArg() {
				return d.ArgErr()
			}
			if h.LoadBalancing != nil {
				return d.Err("load balancing selection policy already specified")
			}
			name := d.Val()
			if name == leastQueuePolicy {
				// The pool's own policy, not a Caddy module.
				if d.NextArg() || d.NextBlock(d.Nesting()) {
					return d.Err("lb_policy least_queue takes no options")
				}
				h.LoadBalancing = &LoadBalancing{SelectionPolicyRaw: []byte(`{"policy":"least_queue"}`)}
				break
			}
			if name == prefixCachePolicy {
				raw, err := parsePrefixCache(d)
				if err != nil {
					return err
				}
				h.LoadBalancing = &LoadBalancing{SelectionPolicyRaw: raw}
				break
			}
			modID := "http.reverse_proxy.selection_policies." + name
			unm, err := caddyfile.UnmarshalModule(d, modID)
			if err != nil {
				return err
			}
			sel, ok := unm.(reverseproxy.Selector)
			if !ok {
				return d.Errf("module %s (%T) is not a reverseproxy.Selector", modID, unm)
			}
			h.LoadBalancing = &LoadBalancing{SelectionPolicyRaw: caddyconfig.JSONModuleObject(sel, "policy", name, nil)}

		case "transport":
			if !d.NextArg() {
				return d.ArgErr()
			}
			if transport != nil {
				return d.Err("transport already specified")
			}
			if d.Val() != "http" {
				return d.Errf("unsupported transport %q: llm_proxy supports only the http transport", d.Val())
			}
			unm, err := caddyfile.UnmarshalModule(d, "http.reverse_proxy.transport.http")
			if err != nil {
				return err
			}
			transport = unm.(*reverseproxy.HTTPTransport)

		case "upstream_client":
			if err := parseUpstreamClient(d, h); err != nil {
				return err
			}

		case "max_request_body":
			if !d.NextArg() {
				return d.ArgErr()
			}
			size, err := humanize.ParseBytes(d.Val())
			if err != nil || size == 0 || size > 1<<40 {
				return d.Errf("bad max_request_body %q: want a positive size such as 16MiB", d.Val())
			}
			h.MaxRequestBody = int64(size)
			if d.NextArg() {
				return d.ArgErr()
			}

		case "first_byte_timeout", "stream_idle_timeout", "stream_timeout":
			name := d.Val()
			if !d.NextArg() {
				return d.ArgErr()
			}
			dur, err := caddy.ParseDuration(d.Val())
			if err != nil || dur < 0 || (dur == 0 && name != "stream_timeout") {
				return d.Errf("bad %s %q: want a positive duration such as 30s", name, d.Val())
			}
			if d.NextArg() {
				return d.ArgErr()
			}
			switch name {
			case "first_byte_timeout":
				h.FirstByteTimeout = caddy.Duration(dur)
			case "stream_idle_timeout":
				h.StreamIdleTimeout = caddy.Duration(dur)
			case "stream_timeout":
				h.StreamTimeout = caddy.Duration(dur)
			}

		case "max_attempts":
			if !d.NextArg() {
				return d.ArgErr()
			}
			n, err := strconv.Atoi(d.Val())
			if err != nil || n < 1 || n > 10 {
				return d.Errf("bad max_attempts %q: want a whole number from 1 to 10", d.Val())
			}
			h.MaxAttempts = n
			if d.NextArg() {
				return d.ArgErr()
			}

		case "name":
			if !d.NextArg() {
				return d.ArgErr()
			}
			if h.Name = d.Val(); h.Name == "" || d.NextArg() {
				return d.Errf("name: want one non-empty label")
			}
		case "api":
			if !d.NextArg() {
				return d.ArgErr()
			}
			switch v := d.Val(); v {
			case "auto", "chat", "completions", "responses", "messages", "none":
				h.API = v
			default:
				return d.Errf("bad api %q: want auto, chat, completions, responses, messages or none", v)
			}
			if d.NextArg() {
				return d.ArgErr()
			}

		case "retries":
			if h.Retries != nil {
				return d.Err("retries already specified")
			}
			rc, err := parseRetries(d)
			if err != nil {
				return err
			}
			h.Retries = rc

		case "hedge":
			if h.Hedge != nil {
				return d.Err("hedge already specified")
			}
			hc, err := parseHedge(d)
			if err != nil {
				return err
			}
			h.Hedge = hc

		case "admission":
			if h.Admission != nil {
				return d.Err("admission already specified")
			}
			ac, err := parseAdmission(d)
			if err != nil {
				return err
			}
			h.Admission = ac

		case "saturation":
			if h.Saturation != nil {
				return d.Err("saturation already specified")
			}
			sc, err := parseSaturation(d)
			if err != nil {
				return err
			}
			h.Saturation = sc

		case "fallback":
			fc, err := parseFallback(d, &schemes)
			if err != nil {
				return err
			}
			for _, o := range h.Fallbacks {
				if o.Name == fc.Name {
					return d.Errf("fallback %s already specified", fc.Name)
				}
			}
			h.Fallbacks = append(h.Fallbacks, fc)

		case "header_up", "header_down":
			if err := parseHeaderOp(d, &h.Headers); err != nil {
				return err
			}

		case "forward_tenant_keys":
			if err := parseFlag(d); err != nil {
				return err
			}
			h.ForwardTenantKeys = true

		case "breaker":
			if h.Breaker != nil {
				return d.Err("breaker already specified")
			}
			bc, err := parseBreaker(d)
			if err != nil {
				return err
			}
			h.Breaker = bc

		default:
			return d.Errf("unrecognized llm_proxy subdirective %q", d.Val())
		}
	}

	if len(h.Upstreams) > 0 && h.DynamicUpstreamsRaw != nil {
		return d.Err("upstreams and dynamic upstreams cannot be used together")
	}
	if len(h.Upstreams) == 0 && h.DynamicUpstreamsRaw == nil {
		return d.Err("llm_proxy needs upstreams: list them after the directive, with to, or with dynamic")
	}
	// The checks Provision makes too, so a Caddyfile error names its line.
	if _, err := h.Hedge.upstreamConfig(h.maxAttempts()); err != nil {
		return d.Err(err.Error())
	}
	if err := applySchemes(d, schemes, &transport); err != nil {
		return err
	}
	if transport != nil {
		h.TransportRaw = caddyconfig.JSONModuleObject(transport, "protocol", "http", nil)
	}
	return nil
}

// parseUpstreamClient parses "upstream_client builtin|net_http".
func parseUpstreamClient(d *caddyfile.Dispenser, h *Handler) error {
	if h.UpstreamClient != "" {
		return d.Err("upstream_client already specified")
	}
	if !d.NextArg() {
		return d.ArgErr()
	}
	switch v := d.Val(); v {
	case UpstreamClientBuiltin, UpstreamClientNetHTTP:
		h.UpstreamClient = v
	default:
		return d.Errf("upstream_client %q: want %s or %s", v, UpstreamClientBuiltin, UpstreamClientNetHTTP)
	}
	if d.NextArg() {
		return d.ArgErr()
	}
	return nil
}

// applySchemes reconciles upstream URL schemes with the transport, as
// reverse_proxy does: https enables TLS, h2c enables cleartext HTTP/2.
func applySchemes(d *caddyfile.Dispenser, schemes []string, transport **reverseproxy.HTTPTransport) error {
	var want string
	for i, s := range schemes {
		if s == "http" {
			s = ""
		}
		if i > 0 && s != want {
			return d.Errf("upstreams mix schemes (%q and %q): use one scheme for all", want, s)
		}
		want = s
	}
	switch want {
	case "https":
		if *transport == nil {
			*transport = new(reverseproxy.HTTPTransport)
		}
		if (*transport).TLS == nil {
			(*transport).TLS = new(reverseproxy.TLSConfig)
		}
	case "h2c":
		if *transport == nil {
			*transport = new(reverseproxy.HTTPTransport)
		}
		(*transport).Versions = []string{"h2c", "2"}
	}
	return nil
}

func splitHostPort(s string) (string, string, error) { return net.SplitHostPort(s) }

// Interface guard
var _ caddyfile.Unmarshaler = (*Handler)(nil)
