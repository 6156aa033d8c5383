package caddymodule

import (
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// Values shared by the blocks' parsers.

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
