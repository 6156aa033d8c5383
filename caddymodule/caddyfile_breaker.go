package caddymodule

import (
	"encoding/json"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

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
		case "max_ejection":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			r, err := parseRatio(d, name, args[0])
			if err != nil {
				return nil, err
			}
			bc.MaxEjection = r
		case "panic_threshold":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			if args[0] == "off" {
				bc.PanicThreshold = -1
				continue
			}
			r, err := parseRatio(d, name, args[0])
			if err != nil {
				return nil, err
			}
			bc.PanicThreshold = r
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
	if err := bc.validate(); err != nil {
		return nil, d.Err(err.Error())
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
