package proxy

import "net/http"

// Identity is who sent a request: the tenant its credentials belong to.
type Identity struct {
	// Tenant is the tenant id; "" when tenants are not configured.
	Tenant string
	// Tier is the tenant's tier, which carries its priority and limits;
	// "" when tiers are not configured.
	Tier string
}

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
	id, err := x.p.cfg.Identifier.Identify(x.r, x.res.Info)
	if err != nil {
		x.refusal = err
		return false
	}
	x.res.Identity = id
	x.prepareHeader()
	return true
}

// prepareHeader computes the outbound header once per exchange: hop-by-hop
// headers removed, X-Forwarded-* set by the trusted-proxy rule.
func (x *exchange) prepareHeader() {
	h := x.r.Header.Clone()
	removeHopHeaders(h)
	// The gateway must read the stream: ask for identity encoding (the
	// transport may still negotiate gzip itself and decode it).
	h.Del("Accept-Encoding")
	out := &http.Request{Header: h}
	trusted := x.p.cfg.TrustedProxy != nil && x.p.cfg.TrustedProxy(x.r)
	setForwarded(out, x.r, trusted)
	x.outHeader = h
}
