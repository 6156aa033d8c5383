package caddymodule

import (
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// parseFleet parses the fleet line of the global option and its block:
//
//	fleet redis <url> {
//	    password <secret>|{env.X}
//	    db <n>
//	    key_prefix <prefix>
//	    op_timeout <duration>
//	    refresh <duration>
//	    instance_id <id>
//	    expected_instances <n>
//	    min_reporters <n>
//	}
//
// The block is optional. The URL is redis://, rediss://,
// redis+sentinel://host:port[,host:port]/<master> or
// redis+cluster://host:port[,host:port].
func parseFleet(d *caddyfile.Dispenser, fc *FleetConfig) error {
	const usage = "want: fleet redis <url> { … }"
	if !d.NextArg() || d.Val() != "redis" {
		return d.Err(usage)
	}
	if !d.NextArg() {
		return d.Err(usage)
	}
	fc.Redis = d.Val()
	if d.NextArg() {
		return d.Err(usage)
	}
	seen := map[string]bool{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		if seen[opt] {
			return d.Errf("fleet option %s already specified", opt)
		}
		seen[opt] = true
		if !d.NextArg() {
			return d.Errf("want: %s <value>", opt)
		}
		v := d.Val()
		if d.NextArg() {
			return d.Errf("want: %s <value>", opt)
		}
		var err error
		switch opt {
		case "password":
			fc.Password = v
		case "db":
			n, aerr := strconv.Atoi(v)
			if aerr != nil || n < 0 {
				return d.Errf("bad db %q: want a database number from 0", v)
			}
			fc.DB = n
		case "key_prefix":
			fc.KeyPrefix = v
		case "op_timeout":
			var dur caddy.Duration
			dur, err = parseFleetDuration(d, opt, v)
			fc.OpTimeout = dur
		case "refresh":
			var dur caddy.Duration
			dur, err = parseFleetDuration(d, opt, v)
			fc.Refresh = dur
		case "instance_id":
			fc.InstanceID = v
		case "expected_instances":
			fc.ExpectedInstances, err = parseCount(d, opt, v)
		case "min_reporters":
			fc.MinReporters, err = parseCount(d, opt, v)
		default:
			return d.Errf("unrecognized fleet option %q", opt)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func parseFleetDuration(d *caddyfile.Dispenser, name, v string) (caddy.Duration, error) {
	dur, err := parsePositiveDuration(d, name, v)
	return caddy.Duration(dur), err
}
