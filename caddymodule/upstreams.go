package caddymodule

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/llmproxy/caddy-llm-proxy/internal/h1"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// dialInfoKey is the context key under which Caddy's http transport looks
// for the dial information of the upstream (reverseproxy's unexported
// dialInfoCtxKey; caddy.CtxKey values compare by content).
const dialInfoKey caddy.CtxKey = "reverse_proxy.dial_info"

// DefaultUpstreamIdleTimeout is how long an idle keep-alive connection to an
// upstream is kept when the transport does not say (Caddy's own default is
// 2m). It sits below the keep-alive of the servers inference runs behind —
// uvicorn, under vLLM and SGLang, closes idle connections after 5s; Node.js
// after 5s — so the gateway closes an idle connection before the server
// does, instead of writing a request onto one the server is closing.
const DefaultUpstreamIdleTimeout = 4 * time.Second

// DefaultUpstreamMaxIdleConns is how many idle keep-alive connections to
// each upstream the default transport keeps (Caddy's own default is 32). An
// inference server runs hundreds of requests at once (vLLM's scheduler up
// to max_num_seqs, 256 by default), so with 32 a burst of 100 streams
// re-dialled 68 connections — a TCP (and TLS) handshake, two transport
// goroutines and their buffers — before each of those requests could
// start; 256 keeps one per request a server runs at once.
const DefaultUpstreamMaxIdleConns = 256

// DefaultUpstreamBufferSize is the read and write buffer of each upstream
// connection of the default transport, in bytes: an SSE chunk is a few
// hundred bytes, so net/http's 4 KiB buffers mostly sit empty for the whole
// life of a stream (docs/benchmarks.md: memory per open stream); larger
// writes, such as a prompt, bypass the buffer.
const DefaultUpstreamBufferSize = 1 << 10

// The values of the handler's upstream_client.
const (
	UpstreamClientBuiltin = "builtin"
	UpstreamClientNetHTTP = "net_http"
)

// newTarget turns a Caddy upstream into the pool's Target. Placeholders are
// not supported: an upstream's identity must not change between requests.
func newTarget(u *reverseproxy.Upstream) (upstream.Target, error) {
	na, err := caddy.ParseNetworkAddress(u.Dial)
	if err != nil {
		return upstream.Target{}, fmt.Errorf("upstream %q: %w", u.Dial, err)
	}
	if na.PortRangeSize() != 1 {
		return upstream.Target{}, fmt.Errorf("upstream %q: dial address must be exactly one socket", u.Dial)
	}
	if u.Host == nil {
		// Caddy fills Host for its own handler only; selection policies
		// call Available(), which needs one.
		u.Host = new(reverseproxy.Host)
	}
	addr := na.JoinHostPort(0)
	if na.IsUnixNetwork() {
		addr = na.Host
	}
	// Boxed once: WithValue of the struct itself boxed it on every
	// attempt, and a held stream's context kept the copy.
	var di any = reverseproxy.DialInfo{Upstream: u, Network: na.Network, Address: na.JoinHostPort(0), Host: na.Host, Port: fmt.Sprint(na.StartPort)}
	return upstream.Target{
		Addr:        addr,
		MaxRequests: u.MaxRequests,
		Dial:        func(ctx context.Context) context.Context { return context.WithValue(ctx, dialInfoKey, di) },
		Ref:         u,
	}, nil
}

// dynamicSource adapts a Caddy UpstreamSource to the pool, parsing each dial
// address once.
type dynamicSource struct {
	src    reverseproxy.UpstreamSource
	parsed sync.Map // dial + max_requests → upstream.Target
	n      atomic.Int64
}

// maxParsedDynamic bounds the parsed dynamic upstreams kept (the pool itself
// forgets churned addresses after a minute, or past 1,024).
const maxParsedDynamic = 4096

type sourceKey struct {
	dial string
	max  int
}

func (s *dynamicSource) upstreams(r *http.Request) ([]upstream.Target, error) {
	ups, err := s.src.GetUpstreams(r)
	if err != nil {
		return nil, err
	}
	out := make([]upstream.Target, 0, len(ups))
	for _, u := range ups {
		k := sourceKey{u.Dial, u.MaxRequests}
		if v, ok := s.parsed.Load(k); ok {
			out = append(out, v.(upstream.Target))
			continue
		}
		// A fresh Upstream: the source's value may be shared by other
		// handlers, and its Host must not be written concurrently.
		t, err := newTarget(&reverseproxy.Upstream{Dial: u.Dial, MaxRequests: u.MaxRequests})
		if err != nil {
			return nil, err
		}
		if s.n.Add(1) > maxParsedDynamic {
			// Pods that churn: forget every parse rather than grow.
			s.parsed.Clear()
			s.n.Store(1)
		}
		s.parsed.Store(k, t)
		out = append(out, t)
	}
	return out, nil
}

// dialFor decorates a probe's context with the dial info of an address.
func dialFor(ctx context.Context, addr string) context.Context {
	dial := addr
	if strings.HasPrefix(addr, "/") {
		dial = "unix/" + addr
	}
	t, err := newTarget(&reverseproxy.Upstream{Dial: dial})
	if err != nil {
		return ctx
	}
	return t.Dial(ctx)
}

// caddySelector adapts a Caddy selection policy (round_robin, first,
// ip_hash, header, cookie, weighted_round_robin, ...) to the pool.
type caddySelector struct{ sel reverseproxy.Selector }

func (s caddySelector) Select(cs []upstream.Candidate, r *http.Request, w http.ResponseWriter) int {
	var buf [16]*reverseproxy.Upstream
	pool := reverseproxy.UpstreamPool(buf[:0])
	for _, c := range cs {
		pool = append(pool, c.Target.Ref.(*reverseproxy.Upstream))
	}
	chosen := s.sel.Select(pool, r, w)
	if chosen == nil {
		return -1
	}
	return slices.Index(pool, chosen)
}

// loadSelector returns the handler's selection policy: least_queue or
// prefix_cache (the pool's own, not Caddy modules), a loaded Caddy policy,
// or the default
// (least_queue with saturation, else least_conn).
func (h *Handler) loadSelector(ctx caddy.Context) (upstream.Selector, error) {
	if h.LoadBalancing == nil || h.LoadBalancing.SelectionPolicyRaw == nil {
		if h.Saturation != nil {
			return upstream.LeastQueue{}, nil
		}
		return selector(nil), nil
	}
	if pc, ok, err := prefixCacheConfig(h.LoadBalancing.SelectionPolicyRaw); ok || err != nil {
		if err != nil {
			return nil, err
		}
		return pc.selector(), nil
	}
	lq, err := leastQueue(h.LoadBalancing.SelectionPolicyRaw)
	if err != nil {
		return nil, err
	}
	if lq {
		return upstream.LeastQueue{}, nil
	}
	mod, err := ctx.LoadModule(h.LoadBalancing, "SelectionPolicyRaw")
	if err != nil {
		return nil, fmt.Errorf("loading selection policy: %w", err)
	}
	return selector(mod), nil
}

// selector returns the pool's selection policy for a loaded Caddy policy:
// least_conn and random_choose count Caddy's own reverse_proxy requests, so
// they are replaced by the pool's versions that count this gateway's
// attempts in flight.
func selector(mod any) upstream.Selector {
	switch sel := mod.(type) {
	case nil, *reverseproxy.LeastConnSelection:
		return upstream.LeastConn{}
	case *reverseproxy.RandomChoiceSelection:
		return upstream.RandomChoose{Choose: sel.Choose}
	default:
		return caddySelector{sel: mod.(reverseproxy.Selector)}
	}
}

// transport is Caddy's http transport and the gateway's own HTTP/1.1
// client for plain http:// upstreams when the transport's config and the
// handler's upstream_client allow it.
type transport struct {
	*reverseproxy.HTTPTransport
	// h1 carries http:// requests, nil when the config needs net/http
	// (see plainHTTP1).
	h1 *h1.Transport
}

// RoundTrip sends req on h1 when it is plain HTTP/1.1, else on Caddy's
// transport.
func (t *transport) RoundTrip(req *http.Request) (*http.Response, error) {
	if t.plain(req) {
		return t.h1.RoundTrip(req)
	}
	return t.HTTPTransport.RoundTrip(req)
}

// plain sets req's scheme and reports whether h1 carries it.
func (t *transport) plain(req *http.Request) bool {
	t.SetScheme(req)
	return t.h1 != nil && req.URL.Scheme == "http"
}

// Cleanup closes the idle connections of h1 (which the handler owns
// whatever the config) and, for the handler's own default transport,
// Caddy's.
func (t *transport) cleanup(own bool) error {
	if t.h1 != nil {
		t.h1.Close()
	}
	if own {
		return t.HTTPTransport.Cleanup()
	}
	return nil
}

// plainHTTP1 reports whether a transport's http:// requests can go over
// the gateway's own HTTP/1.1 client (internal/h1) instead of net/http's:
// one goroutine per stream where net/http keeps three, and no buffers while
// a connection is idle. It cannot when the config asks for what only
// net/http does here: h2c or HTTP/3, a forward proxy (configured, or in
// HTTP_PROXY), a cap on connections per host, or compressed responses.
// TLS needs no check: https:// requests still go to net/http.
func plainHTTP1(t *reverseproxy.HTTPTransport) bool {
	for _, v := range t.Versions {
		if v == "h2c" || v == "3" {
			return false
		}
	}
	if len(t.NetworkProxyRaw) != 0 || t.ForwardProxyURL != "" ||
		os.Getenv("HTTP_PROXY") != "" || os.Getenv("http_proxy") != "" {
		return false
	}
	if t.MaxConnsPerHost > 0 || (t.Compression != nil && *t.Compression) {
		return false
	}
	return t.Transport != nil && t.Transport.DialContext != nil
}

// newH1 is the HTTP/1.1 client for t's http:// requests, with t's dialer
// (dial timeout, resolver, local address, read and write timeouts) and
// keep-alive, header and buffer settings.
func newH1(t *reverseproxy.HTTPTransport) *h1.Transport {
	rt := t.Transport
	return &h1.Transport{
		DialContext:            rt.DialContext,
		IdleTimeout:            rt.IdleConnTimeout,
		MaxIdlePerHost:         rt.MaxIdleConnsPerHost,
		DisableKeepAlives:      rt.DisableKeepAlives,
		ResponseHeaderTimeout:  rt.ResponseHeaderTimeout,
		MaxResponseHeaderBytes: rt.MaxResponseHeaderBytes,
		ReadBufferSize:         rt.ReadBufferSize,
	}
}

// newTransport loads the handler's http transport (Caddy's defaults when
// none is configured), with the gateway's default idle-connection timeout
// when the config sets none.
func newTransport(ctx caddy.Context, h *Handler) (*transport, error) {
	switch h.UpstreamClient {
	case "", UpstreamClientBuiltin, UpstreamClientNetHTTP:
	default:
		return nil, fmt.Errorf("upstream_client %q: want %s or %s", h.UpstreamClient, UpstreamClientBuiltin, UpstreamClientNetHTTP)
	}
	var t *reverseproxy.HTTPTransport
	if h.TransportRaw == nil {
		t = &reverseproxy.HTTPTransport{KeepAlive: &reverseproxy.KeepAlive{IdleConnTimeout: caddy.Duration(DefaultUpstreamIdleTimeout),
			MaxIdleConnsPerHost: DefaultUpstreamMaxIdleConns},
			ReadBufferSize: DefaultUpstreamBufferSize, WriteBufferSize: DefaultUpstreamBufferSize}
		if err := t.Provision(ctx); err != nil {
			return nil, fmt.Errorf("provisioning default http transport: %w", err)
		}
		h.ownTransport = true
	} else {
		var keep struct {
			KeepAlive *struct {
				IdleTimeout    json.RawMessage `json:"idle_timeout"`
				MaxIdlePerHost json.RawMessage `json:"max_idle_conns_per_host"`
			} `json:"keep_alive"`
		}
		_ = json.Unmarshal(h.TransportRaw, &keep)
		mod, err := ctx.LoadModule(h, "TransportRaw")
		if err != nil {
			return nil, fmt.Errorf("loading transport: %w", err)
		}
		var ok bool
		if t, ok = mod.(*reverseproxy.HTTPTransport); !ok {
			return nil, fmt.Errorf("transport %T: llm_proxy supports only the http transport", mod)
		}
		if t.ProxyProtocol != "" {
			// Caddy's dialer writes the PROXY header from the client
			// address that only reverse_proxy puts in the request's
			// context: every dial would fail. Refused here instead.
			return nil, fmt.Errorf("transport http: proxy_protocol %s is not supported by llm_proxy", t.ProxyProtocol)
		}
		if keep.KeepAlive == nil || keep.KeepAlive.IdleTimeout == nil {
			t.KeepAlive.IdleConnTimeout = caddy.Duration(DefaultUpstreamIdleTimeout)
			t.Transport.IdleConnTimeout = DefaultUpstreamIdleTimeout
		}
		if (keep.KeepAlive == nil || keep.KeepAlive.MaxIdlePerHost == nil) && t.Transport.MaxIdleConnsPerHost > 0 {
			t.KeepAlive.MaxIdleConnsPerHost = DefaultUpstreamMaxIdleConns
			t.Transport.MaxIdleConnsPerHost = DefaultUpstreamMaxIdleConns
		}
	}
	tr := &transport{HTTPTransport: t}
	if h.UpstreamClient != UpstreamClientNetHTTP && plainHTTP1(t) {
		tr.h1 = newH1(t)
	}
	return tr, nil
}

// parseUpstreamAddr turns a Caddyfile upstream ("host:port",
// "http://host:port", "https://host", "unix//path") into a dial address
// and the scheme it asked for ("" when none).
func parseUpstreamAddr(s string) (dial, scheme string, err error) {
	if i := strings.Index(s, "://"); i >= 0 {
		scheme, s = strings.ToLower(s[:i]), s[i+3:]
		switch scheme {
		case "http", "https", "h2c":
		default:
			return "", "", fmt.Errorf("upstream %q: unsupported scheme %q (use http, https or h2c)", s, scheme)
		}
		if strings.ContainsAny(s, "/?#") {
			return "", "", fmt.Errorf("upstream %q: an upstream address has no path, query or fragment", scheme+"://"+s)
		}
	}
	if strings.HasPrefix(s, "unix/") {
		return s, scheme, nil
	}
	if strings.ContainsAny(s, "/?#") {
		return "", "", fmt.Errorf("upstream %q: an upstream address has no path, query or fragment", s)
	}
	if _, _, splitErr := splitHostPort(s); splitErr != nil {
		port := "80"
		if scheme == "https" {
			port = "443"
		}
		s = s + ":" + port
	}
	na, err := caddy.ParseNetworkAddress(s)
	if err != nil {
		return "", "", fmt.Errorf("upstream %q: %w", s, err)
	}
	if na.PortRangeSize() != 1 {
		return "", "", fmt.Errorf("upstream %q: must be exactly one host and port", s)
	}
	return s, scheme, nil
}
