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
