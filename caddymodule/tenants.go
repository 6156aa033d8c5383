package caddymodule

import (
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/llmproxy/caddy-llm-proxy/admission"
)

// TenantsConfig says how requests are mapped to tenants. Identity comes from
// credentials only: an API key (Authorization: Bearer, api-key or x-api-key)
// names its tenant; a header names the tenant only when the peer is one of
// TrustedProxies.
type TenantsConfig struct {
	// Keys maps API keys to tenants. Default: none.
	Keys []TenantKey `json:"keys,omitempty"`

	// KeysFile is a file of more keys, one per line:
	// `<key>|sha256:<hex> <tenant> [<tier>]`; blank lines and lines
	// starting with # are skipped. It is read when the config loads.
	// Default: none.
	KeysFile string `json:"keys_file,omitempty"`

	// Header is a request header that names the tenant when the peer
	// address is in TrustedProxies (a gateway or auth proxy in front);
	// from any other peer it is ignored and stripped. Default: none.
	Header string `json:"header,omitempty"`

	// TrustedProxies are the CIDR ranges (or single addresses) whose
	// Header is believed. Default: none.
	TrustedProxies []string `json:"trusted_proxies,omitempty"`

	// Unknown is what happens to a request with no key or an unknown key:
	// "deny" (401, code invalid_api_key) or the name of a tier under
	// which it is admitted as tenant "unknown". Default: "deny".
	Unknown string `json:"unknown,omitempty"`
}

// TenantKey is one API key and the tenant it names.
type TenantKey struct {
	// SHA256 is the hex sha256 of the key. The Caddyfile adapter stores
	// every literal key this way, so the config (and the admin API's
	// /config/) never holds a key. Exclusive with Key.
	SHA256 string `json:"sha256,omitempty"`

	// Key is an environment placeholder such as {env.TENANT_KEY}, read
	// when the config loads; a literal key must be given as SHA256 (the
	// Caddyfile adapter hashes literal keys itself), so that no config
	// holds one.
	Key string `json:"key,omitempty"`

	// Tenant is the tenant id. Required.
	Tenant string `json:"tenant"`

	// Tier overrides the tenant's tier for this key. Default: the
	// tenant's tier.
	Tier string `json:"tier,omitempty"`
}

// TierConfig is a class of tenants: a priority and limits that apply to
// each of its tenants separately (every tenant has its own counters).
// Limits left at 0 are not enforced.
type TierConfig struct {
	// Name names the tier. Required. A tier named "default" is the tier of
	// tenants that no tenant block lists.
	Name string `json:"name"`

	// Priority orders the pool's queue, higher first. Below 0 the tier is
	// sheddable: refused at once (429 saturated) when the pool is
	// saturated, never queued. Default: 0.
	Priority int `json:"priority,omitempty"`

	// MaxConcurrent caps a tenant's requests in flight. Default: 0 (none).
	MaxConcurrent int `json:"max_concurrent,omitempty"`

	// RPM caps a tenant's requests per rolling minute. Default: 0 (none).
	RPM int `json:"rpm,omitempty"`

	// TPM caps a tenant's tokens per rolling minute: reserved at
	// admission (prompt estimate + max_tokens), settled with the
	// upstream's usage. Default: 0 (none).
	TPM int `json:"tpm,omitempty"`

	// DefaultMaxTokens is the completion reservation of a request that
	// names no max_tokens. Default: 1024.
	DefaultMaxTokens int `json:"default_max_tokens,omitempty"`

	// Queue caps how many of this tier's requests may wait in a pool's
	// queue. Default: 100.
	Queue int `json:"queue,omitempty"`

	// QueueTimeout bounds a queued request's wait; past it the request
	// gets 429 queue_timeout and is never sent. Default: 30s.
	QueueTimeout caddy.Duration `json:"queue_timeout,omitempty"`

	// TTFTSLO is the tenant breaker's time-to-first-token objective
	// (measured from the committed attempt's start): a request above
	// TTFTSLO + TTFTPer1kPrompt × prompt tokens / 1000 is a slow call.
	// Default: 0 (none).
	TTFTSLO caddy.Duration `json:"ttft_slo,omitempty"`

	// TTFTPer1kPrompt lengthens TTFTSLO for long prompts. Default: 0.
	TTFTPer1kPrompt caddy.Duration `json:"ttft_per_1k_prompt_tokens,omitempty"`

	// QueueWaitSLO makes a queue wait above it a slow call. Default: 0 (none).
	QueueWaitSLO caddy.Duration `json:"queue_wait_slo,omitempty"`

	// FailClosed refuses the tier's requests with 503 fleet_unavailable
	// and a Retry-After while the fleet's Redis cannot be reached (local
	// mode, or an operation that failed or timed out), instead of
	// admitting them on this gateway's share of the limits (rpm, tpm and
	// max_concurrent ÷ the fleet's expected_instances). Without a fleet it
	// changes nothing. Default: false (fail open).
	FailClosed bool `json:"fail_closed,omitempty"`

	// Breaker holds the tenant breaker's thresholds (the upstream
	// breaker's fields; probe and scope do not apply). Default: none — the
	// tenant breaker is on with the breaker defaults when TTFTSLO or
	// QueueWaitSLO is set, off otherwise; {"disabled": true} turns it off.
	Breaker *BreakerConfig `json:"breaker,omitempty"`
}

// TenantOverride sets one tenant's tier and overrides the tier's limits for
// it (0 keeps the tier's value).
type TenantOverride struct {
	// ID is the tenant id. Required.
	ID string `json:"id"`
	// Tier is the tenant's tier. Default: the tier named "default".
	Tier string `json:"tier,omitempty"`
	// MaxConcurrent overrides the tier's max_concurrent. Default: 0 (the tier's).
	MaxConcurrent int `json:"max_concurrent,omitempty"`
	// RPM overrides the tier's rpm. Default: 0 (the tier's).
	RPM int `json:"rpm,omitempty"`
	// TPM overrides the tier's tpm. Default: 0 (the tier's).
	TPM int `json:"tpm,omitempty"`
}

// admissionConfig converts the tiers and tenants for the admission package.
func (a *App) admissionConfig() (admission.Config, error) {
	var cfg admission.Config
	for _, t := range a.Tiers {
		tier := admission.Tier{
			Name: t.Name, Priority: t.Priority, MaxConcurrent: t.MaxConcurrent, RPM: t.RPM, TPM: t.TPM,
			DefaultMaxTokens: t.DefaultMaxTokens, Queue: t.Queue, QueueTimeout: time.Duration(t.QueueTimeout),
			TTFTSLO: time.Duration(t.TTFTSLO), TTFTPer1kPrompt: time.Duration(t.TTFTPer1kPrompt),
			QueueWaitSLO: time.Duration(t.QueueWaitSLO), FailClosed: t.FailClosed,
		}
		switch b := t.Breaker; {
		case b != nil && b.Disabled:
			tier.TTFTSLO, tier.QueueWaitSLO = 0, 0 // no objectives without a breaker to act on them
		case b != nil:
			if b.Probe != nil || b.Scope != "" {
				return cfg, fmt.Errorf("tier %s: breaker: probe and scope do not apply to tenant breakers", t.Name)
			}
			if err := b.validate(); err != nil {
				return cfg, fmt.Errorf("tier %s: %w", t.Name, err)
			}
			s := b.settings(0)
			tier.Breaker = &s
		}
		cfg.Tiers = append(cfg.Tiers, tier)
	}
	for _, t := range a.TenantOverrides {
		cfg.Tenants = append(cfg.Tenants, admission.TenantConfig{ID: t.ID, Tier: t.Tier,
			MaxConcurrent: t.MaxConcurrent, RPM: t.RPM, TPM: t.TPM})
	}
	if tc := a.Tenants; tc != nil && tc.Unknown != "" && tc.Unknown != "deny" {
		cfg.UnknownTier = tc.Unknown
	}
	if err := cfg.Validate(); err != nil {
		return cfg, err
	}
	return cfg, nil
}

// directory builds the key directory: literal and placeholder keys hashed
// here, sha256 keys as given, and the keys file.
func (tc *TenantsConfig) directory() ([]admission.Key, *admission.Directory, error) {
	var keys []admission.Key
	repl := caddy.NewReplacer()
	for i, k := range tc.Keys {
		if k.Tenant == "" {
			return nil, nil, fmt.Errorf("tenants: key %d: no tenant", i+1)
		}
		var h [32]byte
		switch {
		case k.SHA256 != "" && k.Key != "":
			return nil, nil, fmt.Errorf("tenants: key %d (tenant %s): sha256 and key are exclusive", i+1, k.Tenant)
		case k.SHA256 != "":
			b, err := hex.DecodeString(k.SHA256)
			if err != nil || len(b) != 32 {
				return nil, nil, fmt.Errorf("tenants: key %d (tenant %s): sha256 must be 64 hex digits", i+1, k.Tenant)
			}
			copy(h[:], b)
		case k.Key != "":
			if !strings.HasPrefix(k.Key, "{env.") || !strings.HasSuffix(k.Key, "}") {
				// A literal key in JSON would be shown by /config/.
				return nil, nil, fmt.Errorf("tenants: key %d (tenant %s): give a literal key as sha256 (the Caddyfile adapter does this itself); key takes only {env.NAME}", i+1, k.Tenant)
			}
			key := repl.ReplaceKnown(k.Key, "")
			if key == "" {
				// Never name the key: the placeholder is fine to show.
				return nil, nil, fmt.Errorf("tenants: key %d (tenant %s): %s is empty", i+1, k.Tenant, placeholderName(k.Key))
			}
			h = admission.HashKey(key)
		default:
			return nil, nil, fmt.Errorf("tenants: key %d (tenant %s): no key", i+1, k.Tenant)
		}
		keys = append(keys, admission.Key{Hash: h, Tenant: k.Tenant, Tier: k.Tier})
	}
	if tc.KeysFile != "" {
		fileKeys, err := readKeysFile(tc.KeysFile)
		if err != nil {
			return nil, nil, err
		}
		keys = append(keys, fileKeys...)
	}
	dir, err := admission.NewDirectory(keys)
	return keys, dir, err
}

// placeholderName shows a key's placeholder, never a literal key.
func placeholderName(k string) string {
	if strings.HasPrefix(k, "{") && strings.HasSuffix(k, "}") {
		return k
	}
	return "the key"
}

// readKeysFile reads a keys file (admission.ParseKeys: errors name the
// file and line, never the key).
func readKeysFile(path string) ([]admission.Key, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("tenants: keys_file: %w", err)
	}
	defer f.Close()
	keys, err := admission.ParseKeys(f, path)
	if err != nil {
		return nil, fmt.Errorf("tenants: keys_file %w", err)
	}
	return keys, nil
}

// trustedPrefixes parses trusted_proxies.
func (tc *TenantsConfig) trustedPrefixes() ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range tc.TrustedProxies {
		if p, err := netip.ParsePrefix(s); err == nil {
			out = append(out, p.Masked())
			continue
		}
		a, err := netip.ParseAddr(s)
		if err != nil {
			return nil, fmt.Errorf("tenants: trusted_proxies: %q is neither an address nor a CIDR range", s)
		}
		out = append(out, netip.PrefixFrom(a, a.BitLen()))
	}
	if tc.Header != "" && len(out) == 0 {
		return nil, errors.New("tenants: header needs trusted_proxies: a tenant header from any peer would let clients choose whom to charge")
	}
	return out, nil
}
