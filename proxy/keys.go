package proxy

import (
	"net/http"
	"net/netip"
	"strings"

	"github.com/llmproxy/caddy-llm-proxy/admission"
)

// KeyLookup maps a presented API key to its tenant and tier ("" tier: the
// tenant's own). *admission.Directory implements it (hashed keys, constant
// time). Implementations must be safe for concurrent use, allocate nothing
// and never keep or log the key.
type KeyLookup interface {
	// Lookup returns the tenant and tier of key, ok false when unknown.
	Lookup(key string) (tenant, tier string, ok bool)
}

// KeyIdentifier is the Identifier of DESIGN §3 step 2: the tenant comes
// from the request's credentials, never from anything else the client
// sends (a tenant header from an untrusted peer or a body field).
//
// The key is taken from Authorization: Bearer <key> (the scheme matched
// case-insensitively), else from the api-key header (Azure OpenAI's),
// else from x-api-key. A peer whose address (the connection's, never
// X-Forwarded-For) is in TrustedProxies may instead name the tenant in
// TenantHeader; that header, when present, wins over a key (the proxy in
// front has authenticated the caller). Requests with no key, or a key
// Keys does not know, get tenant admission.UnknownTenant in UnknownTier,
// or a 401 when UnknownTier is "".
//
// Keys never appear in an Identity, an error or a log line. The zero
// value refuses every request with a 401 (it knows no keys).
type KeyIdentifier struct {
	// Keys looks up presented keys; nil knows none.
	Keys KeyLookup
	// TenantHeader, when set, is a header that names the tenant of
	// requests from TrustedProxies. It is removed from the outbound
	// request of any other peer.
	TenantHeader string
	// TrustedProxies are the peer address ranges whose TenantHeader is
	// believed.
	TrustedProxies []netip.Prefix
	// Resolve, when set, returns the effective tier of a tenant (tier is
	// the key's own tier, "" for the tenant's): ok false when it names
	// none. A key whose tenant has no tier is a configuration error (500);
	// a header-named tenant without one is treated as unknown. nil keeps
	// the tier as the key gave it.
	Resolve func(tenant, tier string) (effective string, ok bool)
	// UnknownTier is the tier of requests with no key or an unknown key
	// (tenant admission.UnknownTenant); "" refuses them with 401.
	UnknownTier string
}

// Identify returns the tenant and tier of r's credentials.
func (k *KeyIdentifier) Identify(r *http.Request, _ RequestInfo) (Identity, error) {
	var id Identity
	trusted := k.trusted(r)
	if k.TenantHeader != "" && !trusted {
		id.StripHeader = k.TenantHeader
	}
	if k.TenantHeader != "" && trusted {
		if tenant := strings.TrimSpace(r.Header.Get(k.TenantHeader)); tenant != "" {
			if tier, ok := k.resolve(tenant, ""); ok {
				id.Tenant, id.Tier = tenant, tier
				return id, nil
			}
			return k.unknown(id, "tenant header names no configured tenant")
		}
	}
	key := presentedKey(r.Header)
	if key == "" {
		return k.unknown(id, "missing API key")
	}
	if k.Keys == nil {
		return k.unknown(id, "invalid API key")
	}
	tenant, tier, ok := k.Keys.Lookup(key)
	if !ok {
		return k.unknown(id, "invalid API key")
	}
	eff, ok := k.resolve(tenant, tier)
	if !ok {
		// Configuration validation should make this impossible.
		return Identity{}, &tierError{tenant: tenant, tier: tier}
	}
	id.Tenant, id.Tier = tenant, eff
	return id, nil
}

func (k *KeyIdentifier) resolve(tenant, tier string) (string, bool) {
	if k.Resolve == nil {
		return tier, true
	}
	return k.Resolve(tenant, tier)
}

// unknown admits a request without a known identity under UnknownTier, or
// refuses it with 401. msg never contains the key.
func (k *KeyIdentifier) unknown(id Identity, msg string) (Identity, error) {
	if k.UnknownTier == "" {
		return Identity{}, &GatewayError{Status: http.StatusUnauthorized, Type: TypeInvalidRequest,
			Code: admission.CodeUnknownKey, Message: msg}
	}
	id.Tenant, id.Tier = admission.UnknownTenant, k.UnknownTier
	return id, nil
}

// trusted reports whether r's peer (the connection's address) is in
// TrustedProxies.
func (k *KeyIdentifier) trusted(r *http.Request) bool {
	if len(k.TrustedProxies) == 0 {
		return false
	}
	var addr netip.Addr
	if ap, err := netip.ParseAddrPort(r.RemoteAddr); err == nil {
		addr = ap.Addr()
	} else if a, err := netip.ParseAddr(r.RemoteAddr); err == nil {
		addr = a
	} else {
		return false
	}
	addr = addr.Unmap()
	for _, p := range k.TrustedProxies {
		if p.Contains(addr) {
			return true
		}
	}
	return false
}

// presentedKey returns the API key of a request: Authorization: Bearer
// (scheme case-insensitive), else api-key, else x-api-key; "" when none.
func presentedKey(h http.Header) string {
	if auth := h.Get("Authorization"); auth != "" {
		const scheme = "bearer "
		if len(auth) > len(scheme) && strings.EqualFold(auth[:len(scheme)], scheme) {
			if key := strings.TrimSpace(auth[len(scheme):]); key != "" {
				return key
			}
		}
	}
	if key := strings.TrimSpace(h.Get("Api-Key")); key != "" {
		return key
	}
	return strings.TrimSpace(h.Get("X-Api-Key"))
}

// tierError says that a key's tenant has no tier. It names the tenant,
// never the key.
type tierError struct{ tenant, tier string }

func (e *tierError) Error() string {
	if e.tier != "" {
		return "tenant " + e.tenant + ": tier " + e.tier + " is not configured"
	}
	return "tenant " + e.tenant + ": no tier configured and no default tier"
}

// Interface guard.
var _ Identifier = (*KeyIdentifier)(nil)
