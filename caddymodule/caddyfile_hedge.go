package caddymodule

import (
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/llmproxy/caddy-llm-proxy/hedge"
)

// parseHedge parses a hedge block; d is at "hedge".
func parseHedge(d *caddyfile.Dispenser) (*HedgeConfig, error) {
	hc := new(HedgeConfig)
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	sawAfter := false
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		args := d.RemainingArgs()
		switch name {
		case "after":
			p, err := hedge.ParseAfter(args)
			if err != nil {
				return nil, d.Err(err.Error())
			}
			hc.After, hc.Percentile = caddy.Duration(p.Fixed), p.Percentile
			hc.Min, hc.Max, hc.Fallback = caddy.Duration(p.Min), caddy.Duration(p.Max), caddy.Duration(p.Fallback)
			sawAfter = true
		case "max_ratio":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			r, err := parseRatio(d, name, args[0])
			if err != nil {
				return nil, err
			}
			hc.MaxRatio = r
		case "min_per_sec":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			f, err := parseNonNegative(d, name, args[0])
			if err != nil {
				return nil, err
			}
			if f == 0 {
				f = -1 // "min_per_sec 0": no floor
			}
			hc.MinPerSec = f
		case "max_hedges":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			n, err := strconv.Atoi(args[0])
			if err != nil || n < 1 || n > 9 {
				return nil, d.Errf("bad max_hedges %q: want a whole number from 1 to 9", args[0])
			}
			hc.MaxHedges = n
		default:
			return nil, d.Errf("unrecognized hedge option %q", name)
		}
	}
	if !sawAfter {
		return nil, d.Err("hedge: after is required (after <duration> or after p<NN>)")
	}
	return hc, nil
}
