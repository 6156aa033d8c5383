package proxy

import "net/http"

// Identity is who sent a request: the tenant its credentials belong to.
type Identity struct {
	// Tenant is the tenant id; "" when tenants are not configured.
	Tenant string
	// Tier is the tenant's tier, which carries its priority and limits;
	// "" when tiers are not configured.
	Tier string
	// StripHeader, when set, is a client header that must not reach the
	// upstream: the configured tenant header, sent by a peer that is not
	// trusted to name a tenant.
	StripHeader string
}

// Headers the gateway sets on the outbound request when the tenant is
// known. Client copies are always removed: an upstream may trust them.
const (
	HeaderTenant = "X-LLM-Proxy-Tenant"
	HeaderTier   = "X-LLM-Proxy-Tier"
)

// The header map's keys of HeaderTenant and HeaderTier.
var (
	canonicalTenant = http.CanonicalHeaderKey(HeaderTenant)
	canonicalTier   = http.CanonicalHeaderKey(HeaderTier)
)

// Identifier finds out who sent a request (DESIGN §3 step 2): the tenant
// from its credentials (API key → tenant), never from a client-supplied
// header unless the peer is a trusted proxy. Implementations must be safe
// for concurrent use.
type Identifier interface {
	// Identify returns the request's identity. info is the parsed body. An
	// error refuses the request: a *GatewayError is written as it is (401
	// for an unknown key); any other error is answered with 500 and the
	// outcome internal_error.
	Identify(r *http.Request, info RequestInfo) (Identity, error)
}

// nopIdentifier identifies every request as the zero Identity.
type nopIdentifier struct{}

func (nopIdentifier) Identify(*http.Request, RequestInfo) (Identity, error) { return Identity{}, nil }

// identify is step 2: who sent the request. It then prepares the outbound
// header, which depends on whom the gateway trusts.
func (x *exchange) identify() bool {
	id, err := x.p.cfg.Identifier.Identify(x.r, x.result.Info)
	if err != nil {
		x.redactKeys()
		x.refusal = err
		return false
	}
	x.result.Identity = id
	x.prepareHeader()
	x.redactKeys()
	return true
}

// keyHeaders are the request headers besides Authorization that carry API
// keys (OpenAI's Azure form and Anthropic's).
var keyHeaders = []string{"Api-Key", "X-Api-Key"}

// redactKeys hides the key headers of the client's request once the
// outbound copy is made, for whatever reads the request after the handler
// (placeholders in log_append). Caddy's access log itself records a copy
// of the headers taken before any handler ran: only a log filter keeps
// these out of it (the README shows one); Caddy redacts Authorization
// itself. Only when keys identify tenants (a real Identifier).
func (x *exchange) redactKeys() {
	if _, nop := x.p.cfg.Identifier.(nopIdentifier); nop {
		return
	}
	for _, h := range keyHeaders {
		if _, ok := x.r.Header[h]; ok {
			x.r.Header[h] = []string{"REDACTED"}
		}
	}
}

// noUserAgent is the outbound User-Agent of a client that sent none
// (shared: nothing writes an outbound header's values).
var noUserAgent = []string{""}

// prepareHeader computes the outbound header once per exchange: hop-by-hop
// headers removed, X-Forwarded-* set by the trusted-proxy rule, client
// copies of our tenant headers replaced by ours; then the primary pool's
// edits (poolHeader), before redactKeys hides the client's keys.
func (x *exchange) prepareHeader() {
	h := x.r.Header.Clone()
	removeHopHeaders(h)
	id := &x.result.Identity
	delete(h, canonicalTenant)
	delete(h, canonicalTier)
	if id.StripHeader != "" {
		h.Del(id.StripHeader)
	}
	if id.Tenant != "" {
		h[canonicalTenant] = []string{id.Tenant}
		if id.Tier != "" {
			h[canonicalTier] = []string{id.Tier}
		}
	}
	// The gateway must read the stream: ask for identity encoding (the
	// transport may still negotiate gzip itself and decode it).
	h.Del("Accept-Encoding")
	if _, ok := h["User-Agent"]; !ok {
		// None from the client, none to the upstream, as Caddy's
		// reverse_proxy does: an empty value stops the transport's
		// default (Go-http-client/1.1).
		h["User-Agent"] = noUserAgent
	}
	out := &http.Request{Header: h}
	trusted := x.p.cfg.TrustedProxy != nil && x.p.cfg.TrustedProxy(x.r)
	setForwarded(out, x.r, trusted)
	keep := len(x.p.cfg.Fallbacks) > 0
	if keep {
		x.hdr = &headerState{base: h}
	}
	x.poolHeader(h, keep, &x.p.primary, -1)
}
