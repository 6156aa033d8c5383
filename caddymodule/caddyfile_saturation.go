package caddymodule

import (
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// parseSaturation parses "saturation" with or without a block; d is at
// "saturation". Syntax:
//
//	saturation {
//	    metrics_path <path>
//	    interval <duration>
//	    timeout <duration>
//	    stale_after <duration>
//	    preset vllm|sglang|tgi
//	    metric queue_depth|running|kv_usage|queue_time|ttft <name>
//	    queue_threshold <n>
//	    kv_threshold <ratio>
//	    trip queue_wait_p99 <duration> [for <duration>]
//	    trip kv_usage <ratio> [for <duration>]
//	    trip ttft_p95 <duration> [for <duration>]
//	    trip off
//	    window <duration>
//	}
func parseSaturation(d *caddyfile.Dispenser) (*SaturationConfig, error) {
	sc := new(SaturationConfig)
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	seen := map[string]bool{}
	once := func(key string) error {
		if seen[key] {
			return d.Errf("saturation: %s already specified", key)
		}
		seen[key] = true
		return nil
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		args := d.RemainingArgs()
		switch name {
		case "metrics_path":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			if err := once(name); err != nil {
				return nil, err
			}
			if !strings.HasPrefix(args[0], "/") {
				return nil, d.Errf("saturation: metrics_path %q must start with /", args[0])
			}
			sc.MetricsPath = args[0]
		case "interval", "timeout", "stale_after", "window":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			if err := once(name); err != nil {
				return nil, err
			}
			dur, err := parsePositiveDuration(d, name, args[0])
			if err != nil {
				return nil, err
			}
			*map[string]*caddy.Duration{"interval": &sc.Interval, "timeout": &sc.Timeout,
				"stale_after": &sc.StaleAfter, "window": &sc.Window}[name] = caddy.Duration(dur)
		case "preset":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			if err := once(name); err != nil {
				return nil, err
			}
			if _, ok := saturationPresets[args[0]]; !ok {
				return nil, d.Errf("saturation: unknown preset %q: want vllm, sglang or tgi", args[0])
			}
			sc.Preset = args[0]
		case "metric":
			if len(args) != 2 {
				return nil, d.Errf("want: metric queue_depth|running|kv_usage|queue_time|ttft <name>")
			}
			sig, metric := args[0], args[1]
			if !slices.Contains(signalLabels(), sig) {
				return nil, d.Errf("saturation: unknown signal %q: want one of %s", sig, strings.Join(signalLabels(), ", "))
			}
			if err := once("metric " + sig); err != nil {
				return nil, err
			}
			if !metricName.MatchString(metric) {
				return nil, d.Errf("saturation: metric %s: %q is not a Prometheus metric name", sig, metric)
			}
			if sc.Metrics == nil {
				sc.Metrics = map[string]string{}
			}
			sc.Metrics[sig] = metric
		case "queue_threshold":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			if err := once(name); err != nil {
				return nil, err
			}
			n, err := strconv.ParseFloat(args[0], 64)
			if err != nil || !(n > 0 && n <= 1e6) {
				return nil, d.Errf("bad queue_threshold %q: want a positive number of waiting requests", args[0])
			}
			sc.QueueThreshold = n
		case "kv_threshold":
			if len(args) != 1 {
				return nil, d.ArgErr()
			}
			if err := once(name); err != nil {
				return nil, err
			}
			r, err := parseRatio(d, name, args[0])
			if err != nil {
				return nil, err
			}
			sc.KVThreshold = r
		case "trip":
			if err := parseTrip(d, sc, args, once); err != nil {
				return nil, err
			}
		default:
			return nil, d.Errf("unrecognized saturation option %q", name)
		}
	}
	if _, err := sc.upstreamConfig(); err != nil {
		return nil, d.Err(err.Error())
	}
	return sc, nil
}

// parseTrip parses the arguments of one trip line into sc.Trip.
func parseTrip(d *caddyfile.Dispenser, sc *SaturationConfig, args []string, once func(string) error) error {
	const want = "want: trip queue_wait_p99 <duration> [for <duration>], trip kv_usage <ratio> [for <duration>], trip ttft_p95 <duration> [for <duration>] or trip off"
	if len(args) == 0 {
		return d.Err(want)
	}
	if sc.Trip == nil {
		sc.Trip = new(SaturationTrip)
	}
	t := sc.Trip
	if args[0] == "off" {
		if len(args) != 1 {
			return d.Err(want)
		}
		if *t != (SaturationTrip{}) {
			return d.Err("saturation: trip off turns the saturation rules off: set no other trip rule")
		}
		t.Off = true
		return nil
	}
	if t.Off {
		return d.Errf("saturation: trip %s after trip off", args[0])
	}
	if (len(args) != 2 && len(args) != 4) || (len(args) == 4 && args[2] != "for") {
		return d.Err(want)
	}
	var hold caddy.Duration
	if len(args) == 4 {
		dur, err := parsePositiveDuration(d, "trip "+args[0]+" for", args[3])
		if err != nil {
			return err
		}
		hold = caddy.Duration(dur)
	}
	switch rule := args[0]; rule {
	case "queue_wait_p99", "ttft_p95":
		if err := once("trip " + rule); err != nil {
			return err
		}
		dur, err := parsePositiveDuration(d, "trip "+rule, args[1])
		if err != nil {
			return err
		}
		if rule == "queue_wait_p99" {
			t.QueueWaitP99, t.QueueWaitFor = caddy.Duration(dur), hold
		} else {
			t.TTFTP95, t.TTFTFor = caddy.Duration(dur), hold
		}
	case "kv_usage":
		if err := once("trip " + rule); err != nil {
			return err
		}
		r, err := parseRatio(d, "trip kv_usage", args[1])
		if err != nil {
			return err
		}
		t.KVUsage, t.KVFor = r, hold
	default:
		return d.Errf("saturation: unknown trip rule %q: %s", rule, want)
	}
	return nil
}
