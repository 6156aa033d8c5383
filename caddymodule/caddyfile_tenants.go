package caddymodule

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// parseTenants parses the tenants block of the global option; d is at
// "tenants".
//
//	tenants {
//	    key <key>|sha256:<hex>|{env.X} <tenant> [tier <tier>]
//	    keys_file <path>
//	    header <name> trusted_proxies <ranges...>
//	    unknown deny|<tier>
//	}
//
// A literal key is stored as its sha256, so the adapted JSON (and the admin
// API's /config/) never holds it.
func parseTenants(d *caddyfile.Dispenser, tc *TenantsConfig) error {
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		args := d.RemainingArgs()
		switch name {
		case "key":
			if len(args) != 2 && !(len(args) == 4 && args[2] == "tier") {
				return d.Err("want: key <key>|sha256:<hex>|{env.X} <tenant> [tier <tier>]")
			}
			k := TenantKey{Tenant: args[1]}
			if len(args) == 4 {
				k.Tier = args[3]
			}
			switch v := args[0]; {
			case strings.HasPrefix(v, "sha256:"):
				hexKey := strings.TrimPrefix(v, "sha256:")
				if b, err := hex.DecodeString(hexKey); err != nil || len(b) != 32 {
					return d.Errf("key for tenant %s: sha256 must be 64 hex digits", k.Tenant)
				}
				k.SHA256 = strings.ToLower(hexKey)
			case strings.HasPrefix(v, "{env.") && strings.HasSuffix(v, "}"):
				k.Key = v // from the environment when the config loads; anything else is hashed
			case v == "":
				return d.Errf("key for tenant %s is empty", k.Tenant)
			default:
				sum := sha256.Sum256([]byte(v))
				k.SHA256 = hex.EncodeToString(sum[:])
			}
			tc.Keys = append(tc.Keys, k)
		case "keys_file":
			if len(args) != 1 {
				return d.ArgErr()
			}
			tc.KeysFile = args[0]
		case "header":
			if len(args) < 3 || args[1] != "trusted_proxies" {
				return d.Err("want: header <name> trusted_proxies <ranges...>")
			}
			tc.Header, tc.TrustedProxies = args[0], args[2:]
			if _, err := tc.trustedPrefixes(); err != nil {
				return d.Err(err.Error())
			}
		case "unknown":
			if len(args) != 1 {
				return d.Err("want: unknown deny|<tier>")
			}
			tc.Unknown = args[0]
		default:
			return d.Errf("unrecognized tenants option %q", name)
		}
	}
	return nil
}

// parseTier parses a tier block; d is at "tier".
//
//	tier <name> {
//	    priority <int>
//	    max_concurrent <n>
//	    rpm <n>
//	    tpm <n>
//	    default_max_tokens <n>
//	    queue <n>
//	    queue_timeout <duration>
//	    ttft_slo <duration> [per_1k_prompt_tokens <duration>]
//	    queue_wait_slo <duration>
//	    fail_closed
//	    breaker { … }
//	}
//
// fail_closed: while the fleet's Redis is away, the tier's requests get 503
// rather than running on this gateway's share of the limits.
func parseTier(d *caddyfile.Dispenser) (TierConfig, error) {
	var t TierConfig
	if !d.NextArg() {
		return t, d.Err("want: tier <name> { … }")
	}
	t.Name = d.Val()
	if d.NextArg() {
		return t, d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		if name == "breaker" {
			if t.Breaker != nil {
				return t, d.Err("breaker already specified")
			}
			bc, err := parseBreaker(d)
			if err != nil {
				return t, err
			}
			t.Breaker = bc
			continue
		}
		args := d.RemainingArgs()
		switch name {
		case "fail_closed":
			if len(args) != 0 {
				return t, d.ArgErr()
			}
			t.FailClosed = true
		case "priority":
			if len(args) != 1 {
				return t, d.ArgErr()
			}
			n, err := strconv.Atoi(args[0])
			if err != nil || n < -1000 || n > 1000 {
				return t, d.Errf("bad priority %q: want a whole number from -1000 to 1000 (below 0: sheddable)", args[0])
			}
			t.Priority = n
		case "max_concurrent", "rpm", "tpm", "default_max_tokens", "queue":
			if len(args) != 1 {
				return t, d.ArgErr()
			}
			n, err := parseLimit(d, name, args[0])
			if err != nil {
				return t, err
			}
			*map[string]*int{"max_concurrent": &t.MaxConcurrent, "rpm": &t.RPM, "tpm": &t.TPM,
				"default_max_tokens": &t.DefaultMaxTokens, "queue": &t.Queue}[name] = n
		case "queue_timeout", "queue_wait_slo":
			if len(args) != 1 {
				return t, d.ArgErr()
			}
			dur, err := parsePositiveDuration(d, name, args[0])
			if err != nil {
				return t, err
			}
			if name == "queue_timeout" {
				t.QueueTimeout = caddy.Duration(dur)
			} else {
				t.QueueWaitSLO = caddy.Duration(dur)
			}
		case "ttft_slo":
			if len(args) != 1 && !(len(args) == 3 && args[1] == "per_1k_prompt_tokens") {
				return t, d.Err("want: ttft_slo <duration> [per_1k_prompt_tokens <duration>]")
			}
			dur, err := parsePositiveDuration(d, name, args[0])
			if err != nil {
				return t, err
			}
			t.TTFTSLO = caddy.Duration(dur)
			if len(args) == 3 {
				per, err := parsePositiveDuration(d, "per_1k_prompt_tokens", args[2])
				if err != nil {
					return t, err
				}
				t.TTFTPer1kPrompt = caddy.Duration(per)
			}
		default:
			return t, d.Errf("unrecognized tier option %q", name)
		}
	}
	return t, nil
}

// parseTenant parses a tenant block; d is at "tenant".
//
//	tenant <id> {
//	    tier <name>
//	    max_concurrent <n>
//	    rpm <n>
//	    tpm <n>
//	}
func parseTenant(d *caddyfile.Dispenser) (TenantOverride, error) {
	var t TenantOverride
	if !d.NextArg() {
		return t, d.Err("want: tenant <id> { … }")
	}
	t.ID = d.Val()
	if d.NextArg() {
		return t, d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		args := d.RemainingArgs()
		if len(args) != 1 {
			return t, d.ArgErr()
		}
		switch name {
		case "tier":
			t.Tier = args[0]
		case "max_concurrent", "rpm", "tpm":
			n, err := parseLimit(d, name, args[0])
			if err != nil {
				return t, err
			}
			*map[string]*int{"max_concurrent": &t.MaxConcurrent, "rpm": &t.RPM, "tpm": &t.TPM}[name] = n
		default:
			return t, d.Errf("unrecognized tenant option %q", name)
		}
	}
	return t, nil
}

// parseLimit parses a positive whole-number limit.
func parseLimit(d *caddyfile.Dispenser, name, v string) (int, error) {
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > 1_000_000_000 {
		return 0, d.Errf("bad %s %q: want a whole number from 1", name, v)
	}
	return n, nil
}

// parseAdmission parses a handler's admission block; d is at "admission".
//
//	admission {
//	    capacity <n> | per_upstream <n>
//	    queue <n>
//	}
func parseAdmission(d *caddyfile.Dispenser) (*AdmissionConfig, error) {
	ac := new(AdmissionConfig)
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		args := d.RemainingArgs()
		if len(args) != 1 {
			return nil, d.ArgErr()
		}
		n, err := parseLimit(d, name, args[0])
		if err != nil {
			return nil, err
		}
		switch name {
		case "capacity":
			ac.Capacity = n
		case "per_upstream":
			ac.PerUpstream = n
		case "queue":
			ac.Queue = n
		default:
			return nil, d.Errf("unrecognized admission option %q", name)
		}
	}
	if err := ac.validate(); err != nil {
		return nil, d.Err(err.Error())
	}
	return ac, nil
}
