package caddymodule

import (
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// parseRetries parses a retries block; d is at "retries".
func parseRetries(d *caddyfile.Dispenser) (*RetryConfig, error) {
	rc := new(RetryConfig)
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		args := d.RemainingArgs()
		switch name {
		case "ratio":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			r, err := parseRatio(d, name, args[0])
			if err != nil {
				return nil, err
			}
			rc.Ratio = r
		case "window":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			dur, err := parsePositiveDuration(d, "retries window", args[0])
			if err != nil {
				return nil, err
			}
			rc.Window = caddy.Duration(dur)
		case "min_per_sec":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			f, err := parseNonNegative(d, name, args[0])
			if err != nil {
				return nil, err
			}
			rc.MinPerSec = f
		case "bucket":
			if len(args) != 2 {
				return nil, d.Errf("want: bucket <max_tokens> <refill_per_sec>")
			}
			maxTokens, err := parseNonNegative(d, "bucket max_tokens", args[0])
			if err != nil || maxTokens < 1 {
				return nil, d.Errf("bad bucket max_tokens %q: want a number ≥ 1", args[0])
			}
			refill, err := parseNonNegative(d, "bucket refill_per_sec", args[1])
			if err != nil || refill <= 0 {
				return nil, d.Errf("bad bucket refill_per_sec %q: want a positive number such as 0.5", args[1])
			}
			rc.Bucket = &TokenBucket{MaxTokens: maxTokens, RefillPerSec: refill}
		case "backoff":
			if len(args) != 2 {
				return nil, d.Errf("want: backoff <base> <cap>")
			}
			base, err := parsePositiveDuration(d, "backoff base", args[0])
			if err != nil {
				return nil, err
			}
			capD, err := parsePositiveDuration(d, "backoff cap", args[1])
			if err != nil {
				return nil, err
			}
			if capD < base {
				return nil, d.Errf("backoff cap %v is below its base %v", capD, base)
			}
			rc.BackoffBase, rc.BackoffCap = caddy.Duration(base), caddy.Duration(capD)
		default:
			return nil, d.Errf("unrecognized retries option %q", name)
		}
	}
	// The checks Provision makes too, so a Caddyfile error names its line.
	if _, err := rc.upstreamConfig(); err != nil {
		return nil, d.Err(err.Error())
	}
	return rc, nil
}
