package caddymodule

import (
	"encoding/json"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/dustin/go-humanize"

	"github.com/llmproxy/caddy-llm-proxy/proxy"
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
//	    to <upstreams...>
//	    dynamic <source> [...]
//	    lb_policy <name> [<options...>]
//	    transport http { ... }
//	    max_request_body <size>
//	    first_byte_timeout <duration>
//	    stream_idle_timeout <duration>
//	    stream_timeout <duration>
//	    max_attempts <n>
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
//	        probe {
//	            uri <path>
//	            chat <json>
//	            interval <duration>
//	        }
//	        scope upstream|model
//	    }
//	}
//
// Upstreams are "host:port", "http://host:port", "https://host[:port]"
// (enables TLS on the http transport), "h2c://host:port" or
// "unix//path". dynamic, lb_policy and transport take the same modules and
// grammar as reverse_proxy. Sizes accept units ("16MiB", "512KB").
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // directive name
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
		case "max_request_body", "first_byte_timeout", "stream_idle_timeout", "stream_timeout", "max_attempts":
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
	if h.Hedge != nil {
		attempts := h.MaxAttempts
		if attempts == 0 {
			attempts = proxy.DefaultMaxAttempts
		}
		if hedges := max(h.Hedge.MaxHedges, 1); hedges >= attempts {
			return d.Errf("hedge: %d backup(s) need max_attempts of at least %d (it is %d): every backup is an attempt", hedges, hedges+1, attempts)
		}
	}
	if err := applySchemes(d, schemes, &transport); err != nil {
		return err
	}
	if transport != nil {
		h.TransportRaw = caddyconfig.JSONModuleObject(transport, "protocol", "http", nil)
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

// parseBreaker parses "breaker off" or a breaker block; d is at "breaker".
func parseBreaker(d *caddyfile.Dispenser) (*BreakerConfig, error) {
	bc := new(BreakerConfig)
	if d.NextArg() {
		if d.Val() != "off" {
			return nil, d.Errf("unexpected breaker argument %q: want off or a block", d.Val())
		}
		if d.NextArg() {
			return nil, d.ArgErr()
		}
		bc.Disabled = true
		return bc, nil
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		args := d.RemainingArgs()
		switch name {
		case "consecutive_failures":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			if args[0] == "off" {
				bc.ConsecutiveFailures = -1
				continue
			}
			n, err := parseCount(d, name, args[0])
			if err != nil {
				return nil, err
			}
			bc.ConsecutiveFailures = n
		case "failures":
			if len(args) != 3 || args[1] != "within" {
				return nil, d.Errf("want: failures <n> within <duration>")
			}
			n, err := parseCount(d, name, args[0])
			if err != nil {
				return nil, err
			}
			dur, err := parsePositiveDuration(d, "failures window", args[2])
			if err != nil {
				return nil, err
			}
			bc.Failures, bc.FailuresWindow = n, caddy.Duration(dur)
		case "failure_ratio":
			if len(args) != 1 && len(args) != 3 && len(args) != 5 {
				return nil, d.Errf("want: failure_ratio <ratio> [min_requests <n>] [window <duration>]")
			}
			r, err := parseRatio(d, name, args[0])
			if err != nil {
				return nil, err
			}
			bc.FailureRatio = r
			for i := 1; i+1 < len(args); i += 2 {
				switch args[i] {
				case "min_requests":
					n, err := parseCount(d, "min_requests", args[i+1])
					if err != nil {
						return nil, err
					}
					bc.MinRequests = n
				case "window":
					dur, err := parsePositiveDuration(d, "window", args[i+1])
					if err != nil {
						return nil, err
					}
					bc.RatioWindow = caddy.Duration(dur)
				default:
					return nil, d.Errf("unexpected failure_ratio option %q: want min_requests or window", args[i])
				}
			}
		case "slow_ratio":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			r, err := parseRatio(d, name, args[0])
			if err != nil {
				return nil, err
			}
			bc.SlowRatio = r
		case "min_requests":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			n, err := parseCount(d, name, args[0])
			if err != nil {
				return nil, err
			}
			bc.MinRequests = n
		case "window", "slow_ttft", "min_open", "open_for", "max_open":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			dur, err := parsePositiveDuration(d, name, args[0])
			if err != nil {
				return nil, err
			}
			*map[string]*caddy.Duration{"window": &bc.RatioWindow, "slow_ttft": &bc.SlowTTFT,
				"min_open": &bc.MinOpen, "open_for": &bc.OpenFor, "max_open": &bc.MaxOpen}[name] = caddy.Duration(dur)
		case "half_open_probes", "recovery_successes":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			n, err := parseCount(d, name, args[0])
			if err != nil {
				return nil, err
			}
			if name == "half_open_probes" {
				bc.HalfOpenProbes = n
			} else {
				bc.RecoverySuccesses = n
			}
		case "scope":
			if len(args) != 1 || (args[0] != "upstream" && args[0] != "model") {
				return nil, d.Errf("want: scope upstream|model")
			}
			bc.Scope = args[0]
		case "probe":
			if len(args) != 0 {
				return nil, d.ArgErr()
			}
			p, err := parseProbe(d)
			if err != nil {
				return nil, err
			}
			bc.Probe = p
		default:
			return nil, d.Errf("unrecognized breaker option %q", name)
		}
	}
	if err := bc.settings(0).Validate(); err != nil {
		return nil, d.Errf("breaker: %v", err)
	}
	return bc, nil
}

// parseProbe parses a probe block; d is at "probe".
func parseProbe(d *caddyfile.Dispenser) (*ActiveProbe, error) {
	p := new(ActiveProbe)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		args := d.RemainingArgs()
		if len(args) != 1 {
			return nil, d.ArgErr()
		}
		switch name {
		case "uri":
			if !strings.HasPrefix(args[0], "/") {
				return nil, d.Errf("probe uri %q must start with /", args[0])
			}
			p.URI = args[0]
		case "chat":
			if !json.Valid([]byte(args[0])) {
				return nil, d.Errf("probe chat body is not valid JSON: %s", args[0])
			}
			p.Chat = args[0]
		case "interval":
			dur, err := parsePositiveDuration(d, "probe interval", args[0])
			if err != nil {
				return nil, err
			}
			p.Interval = caddy.Duration(dur)
		default:
			return nil, d.Errf("unrecognized probe option %q", name)
		}
	}
	if p.URI != "" && p.Chat != "" {
		return nil, d.Err("probe: use uri or chat, not both")
	}
	return p, nil
}

func parseCount(d *caddyfile.Dispenser, name, v string) (int, error) {
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > 1_000_000 {
		return 0, d.Errf("bad %s %q: want a whole number from 1", name, v)
	}
	return n, nil
}

func parseRatio(d *caddyfile.Dispenser, name, v string) (float64, error) {
	r, err := strconv.ParseFloat(v, 64)
	if err != nil || !(r > 0 && r <= 1) {
		return 0, d.Errf("bad %s %q: want a ratio in (0, 1], such as 0.5", name, v)
	}
	return r, nil
}

func parseNonNegative(d *caddyfile.Dispenser, name, v string) (float64, error) {
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || !(f >= 0 && f <= 1e9) {
		return 0, d.Errf("bad %s %q: want a non-negative number", name, v)
	}
	return f, nil
}

func parsePositiveDuration(d *caddyfile.Dispenser, name, v string) (time.Duration, error) {
	dur, err := caddy.ParseDuration(v)
	if err != nil || dur <= 0 {
		return 0, d.Errf("bad %s %q: want a positive duration such as 10s", name, v)
	}
	return dur, nil
}
