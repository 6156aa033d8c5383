package caddymodule

import (
	"slices"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// parseFallback parses one fallback block (the dispenser is on
// "fallback"). Syntax:
//
//	fallback <name> {
//	    to <upstreams...> | dynamic <source> [...]
//	    model <name>
//	    context_window <tokens>
//	    max_output_tokens <tokens>
//	    when unavailable|saturated ...
//	    tiers <names...>
//	    capacity <n> | per_upstream <n>
//	    header_up   [+|-]<field> [<value|regexp> [<replacement>]]
//	    header_down [+|-]<field> [<value|regexp> [<replacement>]]
//	    forward_tenant_keys
//	}
//
// Its upstreams use the handler's transport, so their scheme must be the
// handler's (schemes is appended to for that check). header_up,
// header_down and forward_tenant_keys are the fallback pool's own: the
// handler's do not apply to it.
func parseFallback(d *caddyfile.Dispenser, schemes *[]string) (*FallbackConfig, error) {
	if !d.NextArg() {
		return nil, d.Err("fallback needs a name: fallback <name> { ... }")
	}
	fc := &FallbackConfig{Name: d.Val()}
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		if name != "to" && name != "header_up" && name != "header_down" && seen[name] {
			return nil, d.Errf("fallback %s: %s already specified", fc.Name, name)
		}
		seen[name] = true
		switch name {
		case "to":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return nil, d.ArgErr()
			}
			for _, a := range args {
				dial, scheme, err := parseUpstreamAddr(a)
				if err != nil {
					return nil, d.Err(err.Error())
				}
				if slices.ContainsFunc(fc.Upstreams, func(u *reverseproxy.Upstream) bool { return u.Dial == dial }) {
					return nil, d.Errf("fallback %s: upstream %s is listed twice", fc.Name, dial)
				}
				fc.Upstreams = append(fc.Upstreams, &reverseproxy.Upstream{Dial: dial})
				*schemes = append(*schemes, scheme)
			}
		case "dynamic":
			if !d.NextArg() {
				return nil, d.ArgErr()
			}
			src := d.Val()
			modID := "http.reverse_proxy.upstreams." + src
			unm, err := caddyfile.UnmarshalModule(d, modID)
			if err != nil {
				return nil, err
			}
			source, ok := unm.(reverseproxy.UpstreamSource)
			if !ok {
				return nil, d.Errf("module %s (%T) is not an UpstreamSource", modID, unm)
			}
			fc.DynamicUpstreamsRaw = caddyconfig.JSONModuleObject(source, "source", src, nil)
		case "model":
			if !d.NextArg() {
				return nil, d.ArgErr()
			}
			fc.Model = d.Val()
			if d.NextArg() {
				return nil, d.ArgErr()
			}
		case "context_window", "max_output_tokens", "capacity", "per_upstream":
			args := d.RemainingArgs()
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			n, err := parseCount(d, name, args[0])
			if err != nil {
				return nil, err
			}
			switch name {
			case "context_window":
				fc.ContextWindow = n
			case "max_output_tokens":
				fc.MaxOutputTokens = n
			case "capacity":
				fc.Capacity = n
			case "per_upstream":
				fc.PerUpstream = n
			}
		case "when":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return nil, d.ArgErr()
			}
			fc.When = args
		case "tiers":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return nil, d.ArgErr()
			}
			fc.Tiers = args
		case "header_up", "header_down":
			if err := parseHeaderOp(d, &fc.Headers); err != nil {
				return nil, err
			}
		case "forward_tenant_keys":
			if err := parseFlag(d); err != nil {
				return nil, err
			}
			fc.ForwardTenantKeys = true
		default:
			return nil, d.Errf("fallback %s: unrecognized option %q", fc.Name, name)
		}
	}
	if err := fc.check(); err != nil {
		return nil, d.Err(err.Error())
	}
	return fc, nil
}
