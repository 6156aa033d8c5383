package proxy

import (
	"net"
	"net/http"
	"strings"
)

// hopHeaders are the hop-by-hop headers of RFC 9110 §7.6.1 that a proxy
// must not forward, as Go's httputil.ReverseProxy and Caddy's reverse_proxy
// remove them.
var hopHeaders = []string{
	"Connection",
	"Proxy-Connection",
	"Keep-Alive",
	"Proxy-Authenticate",
	"Proxy-Authorization",
	"Te",
	"Trailer",
	"Transfer-Encoding",
	"Upgrade",
}

// removeHopHeaders deletes hop-by-hop headers from h, including those that
// the Connection header names.
func removeHopHeaders(h http.Header) {
	for _, f := range h["Connection"] {
		for sf := range strings.SplitSeq(f, ",") {
			if sf = strings.TrimSpace(sf); sf != "" {
				h.Del(sf)
			}
		}
	}
	for _, k := range hopHeaders {
		h.Del(k)
	}
}

// setForwarded sets X-Forwarded-For/-Proto/-Host the way Caddy's
// reverse_proxy does: values from a trusted proxy are kept and extended,
// values from anyone else are replaced.
//
// The values share one backing array (one allocation for the three).
func setForwarded(out *http.Request, in *http.Request, trusted bool) {
	h := out.Header
	clientIP, _, err := net.SplitHostPort(in.RemoteAddr)
	if err != nil {
		clientIP = in.RemoteAddr
	}
	if trusted {
		if prior := h.Values("X-Forwarded-For"); len(prior) > 0 {
			clientIP = strings.Join(prior, ", ") + ", " + clientIP
		}
	}
	vals := make([]string, 3)
	vals[0] = clientIP
	h["X-Forwarded-For"] = vals[0:1:1]

	if !trusted || h.Get("X-Forwarded-Proto") == "" {
		vals[1] = "http"
		if in.TLS != nil {
			vals[1] = "https"
		}
		h["X-Forwarded-Proto"] = vals[1:2:2]
	}
	if !trusted || h.Get("X-Forwarded-Host") == "" {
		vals[2] = in.Host
		h["X-Forwarded-Host"] = vals[2:3:3]
	}
}

// copyResponseHeader copies an upstream response header to the client,
// without hop-by-hop headers. The copied values share one backing array
// (one allocation, however many headers); each key's slice is capped at
// its length, so appending to one never overwrites another.
func copyResponseHeader(dst, src http.Header) {
	n := 0
	for _, vv := range src {
		n += len(vv)
	}
	vals := make([]string, 0, n)
	for k, vv := range src {
		at := len(vals)
		vals = append(vals, vv...)
		dst[k] = vals[at:len(vals):len(vals)]
	}
	removeHopHeaders(dst)
}

// Headers is what a pool changes in the headers of its requests and of the
// responses it commits, beyond the gateway's own (Caddy's header_up and
// header_down, and whether the client's keys reach it). The zero value
// edits nothing and, when an Identifier checks keys, removes them.
type Headers struct {
	// Request, when set, edits the outbound request header h of the
	// pool's attempts: once per request and pool, after the tenant is
	// identified and after the gateway's own headers (hop-by-hop headers
	// removed, X-Forwarded-*, X-LLM-Proxy-Tenant/-Tier, the client's keys
	// removed), so it may override any of them. r is the client's request,
	// read-only (its context carries Caddy's replacer). h holds "Host" with
	// the client's Host on entry; the last value left there is the
	// outbound Host ("" or none: the upstream's dial address), as Caddy's
	// HeaderOps.ApplyToRequest has it.
	Request func(r *http.Request, h http.Header)
	// Response, when set, edits the response header h at commit, after the
	// gateway's own (x-ratelimit-*, Cache-Control, Content-Length) and
	// before the status line is written; status is the upstream's. It runs
	// once, on the headers alone: it never holds an event back. An
	// upstream's error answer passed through to the client gets it too;
	// responses the gateway writes itself (its errors) do not.
	Response func(r *http.Request, status int, h http.Header)
	// ForwardKeys keeps the client's Authorization, api-key and x-api-key
	// headers on the pool's requests although an Identifier checks them
	// (backends that check the same keys). Default false: with an
	// Identifier they stay at the gateway; without one they are forwarded
	// as any other header.
	ForwardKeys bool
}

// credentialHeaders are the request headers that carry a client's
// credentials: Authorization, and keyHeaders.
var credentialHeaders = [...]string{"Authorization", "Api-Key", "X-Api-Key"}

// headerState is the part of a request's outbound header that only some
// requests need: the header before any pool's edits, kept while a
// fallback may need it, and a Host that header_up set.
type headerState struct {
	base    http.Header
	host    string
	hostSet bool
}

// poolHeader makes outHeader the outbound header of the attempts of pool,
// the pool of rung: base with the client's keys removed (unless the pool
// forwards them or no Identifier checks them) and pool's Request edit
// applied. base is left unedited when keep (a fallback may need it), else
// edited in place. No attempt may be running: they share outHeader.
func (x *exchange) poolHeader(base http.Header, keep bool, pool *Pool, rung int) {
	h := base
	strip := x.withholdsKeys(pool)
	edit := pool.Headers.Request
	if keep && (strip || edit != nil) {
		h = h.Clone()
	}
	if strip {
		for _, k := range credentialHeaders {
			delete(h, k)
		}
	}
	if x.hdr != nil {
		x.hdr.hostSet = false
	}
	if edit != nil {
		h["Host"] = []string{x.r.Host}
		edit(x.r, h)
		var host string
		if vs := h["Host"]; len(vs) > 0 {
			host = vs[len(vs)-1]
		}
		delete(h, "Host")
		if host != x.r.Host {
			if x.hdr == nil {
				x.hdr = new(headerState)
			}
			x.hdr.host, x.hdr.hostSet = host, true
		}
	}
	x.outHeader, x.headerRung = h, int16(rung)
}

// withholdsKeys reports whether the client's keys stay at the gateway on
// pool's requests: an Identifier checks them and pool does not forward
// them.
func (x *exchange) withholdsKeys(pool *Pool) bool {
	_, nop := x.p.cfg.Identifier.(nopIdentifier)
	return !nop && !pool.Headers.ForwardKeys
}

// rungHeader makes outHeader the current rung's, when the ladder moved
// the request since it was made (no attempt runs then).
func (x *exchange) rungHeader() {
	if int(x.headerRung) != x.rung.index && x.hdr != nil && x.hdr.base != nil {
		x.poolHeader(x.hdr.base, true, x.rung.pool, x.rung.index)
	}
}

// outHost returns the Host that header_up set for the outbound request.
func (x *exchange) outHost() (string, bool) {
	if x.hdr == nil {
		return "", false
	}
	return x.hdr.host, x.hdr.hostSet
}

// headerDown applies the current pool's Response edit to h, the header of
// an upstream's answer with status, just before it is written.
func (x *exchange) headerDown(status int, h http.Header) {
	if down := x.rung.pool.Headers.Response; down != nil {
		down(x.r, status, h)
	}
}
