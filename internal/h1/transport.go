// Package h1 is an HTTP/1.1 client for upstream streams that runs each
// request on its caller's goroutine.
//
// net/http's Transport gives every connection a reader and a writer
// goroutine and keeps both, with their buffers, for as long as a response
// streams. A gateway holding thousands of token streams open pays that per
// stream: at 1,000 held streams it was two of the four goroutine stacks and
// about a third of the memory each stream cost. Here the caller writes the
// request and reads the response itself; the only goroutine a request may
// start is the one that closes its connection when its context ends.
//
// It speaks HTTP/1.1 over the connections DialContext returns (plain TCP or
// a Unix socket; no TLS, no HTTP/2, no forward proxy), keeps idle
// connections per host for reuse, and reports GetConn, GotConn, WroteRequest
// and GotFirstResponseByte to an httptrace.ClientTrace in the request's
// context. Response bodies are framed as RFC 9112 §6.3 says: chunked,
// Content-Length, or read until the server closes.
//
// It is never more lenient than net/http: response heads are read by
// net/http's own parser (http.ReadResponse), which also decides the
// framing; only the body reader is its own, because net/http's chunked
// reader needs a bufio.Reader held for the body's whole life, and a held
// stream here holds no buffer between events. That reader makes net/http's
// checks (CRLF line ends only, no CR inside a line, lines and the trailer
// section within the read buffer, bounded extension overhead), and
// FuzzDifferential holds the two clients to the same answers over real
// sockets. Where it refuses more (101 Switching Protocols, a status code
// below 100), RFC 9110 agrees. A response it refuses fails with an error
// that wraps ErrMalformedResponse.
package h1

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"sync"
	"time"

	"golang.org/x/net/http/httpguts"
)

// Defaults of Transport's zero fields.
const (
	// DefaultMaxIdlePerHost is how many idle connections per host are kept
	// when MaxIdlePerHost is 0 (net/http's DefaultMaxIdleConnsPerHost).
	DefaultMaxIdlePerHost = 2
	// DefaultReadBufferSize is the response read buffer, in bytes, when
	// ReadBufferSize is 0 (net/http's).
	DefaultReadBufferSize = 4 << 10
	// DefaultMaxResponseHeaderBytes bounds the status line and headers of a
	// response when MaxResponseHeaderBytes is 0 (net/http's transport: 10 MiB).
	DefaultMaxResponseHeaderBytes = 10 << 20
	// writeBufferSize is the buffer the request head is written through; a
	// body larger than what is left of it is written straight to the
	// connection.
	writeBufferSize = 4 << 10
)

// Transport is an http.RoundTripper for http:// upstreams. Its zero value
// is not usable: DialContext is required. Safe for concurrent use.
type Transport struct {
	// DialContext opens a connection to addr (the request URL's host) on
	// network "tcp". Required. Caddy's dialer reads the upstream's dial
	// address from the context and may dial a Unix socket instead.
	DialContext func(ctx context.Context, network, addr string) (net.Conn, error)
	// IdleTimeout is how long an idle connection is kept before it is
	// closed; 0 keeps it until it is reused, found closed, or evicted.
	IdleTimeout time.Duration
	// MaxIdlePerHost bounds the idle connections kept per host; 0 means
	// DefaultMaxIdlePerHost, a negative value keeps none. When the bound is
	// reached the oldest idle connection is closed.
	MaxIdlePerHost int
	// DisableKeepAlives sends every request on a new connection with
	// "Connection: close".
	DisableKeepAlives bool
	// ResponseHeaderTimeout bounds the wait for the response head after
	// the request is written; 0 means no bound beyond the context's.
	ResponseHeaderTimeout time.Duration
	// MaxResponseHeaderBytes bounds the status line and headers of a
	// response (1xx heads included); 0 means DefaultMaxResponseHeaderBytes.
	MaxResponseHeaderBytes int64
	// ReadBufferSize is the size in bytes of each connection's read buffer
	// while a response is read; 0 means DefaultReadBufferSize, and a size
	// below 16 means 16 (bufio's minimum, as net/http). An idle connection
	// holds none. A chunk-size line and a trailer section must fit in it,
	// as in net/http.
	ReadBufferSize int

	// heads holds the *bufio.Reader a response head is read through,
	// bufs the *[]byte read buffers of bodies; both of ReadBufferSize.
	heads, bufs sync.Pool

	mu     sync.Mutex
	idle   map[string][]*conn // per host, oldest first
	sweep  *time.Timer        // armed while any connection is idle
	closed bool
	now    func() time.Time // time.Now; tests replace it
}

// errUnsupportedScheme is returned for a request that is not http://.
var errUnsupportedScheme = errors.New("h1: only http:// requests are supported")

// RoundTrip sends req on an idle connection to its host or a new one and
// reads the response head. The response body reads from the connection;
// reading it to its end returns the connection to the idle pool, closing it
// early closes the connection. req.Body is always closed.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	return t.roundTrip(req)
}

func (t *Transport) roundTrip(req *http.Request) (*http.Response, error) {
	if req.URL == nil || req.URL.Scheme != "http" {
		closeBody(req)
		return nil, errUnsupportedScheme
	}
	if req.URL.Host == "" {
		closeBody(req)
		return nil, errors.New("h1: request has no host")
	}
	host, err := validRequest(req)
	if err != nil {
		closeBody(req)
		return nil, err
	}
	ctx := req.Context()
	trace := httptrace.ContextClientTrace(ctx)
	key := req.URL.Host
	if trace != nil && trace.GetConn != nil {
		trace.GetConn(key)
	}
	var c *conn
	if !t.DisableKeepAlives {
		c = t.takeIdle(key)
	}
	resp, err := t.send(ctx, c, req, host, trace)
	if c != nil && errors.Is(err, errNotSent) && ctx.Err() == nil {
		// The kept connection failed before any byte of the request
		// left (the server closed it as it was taken): nothing reached
		// the server, so the request goes again on a new connection,
		// once. A request that was written is never sent again here:
		// the server may be working on it.
		if req, err = rewind(req); err != nil {
			return nil, err
		}
		return t.send(ctx, nil, req, host, trace)
	}
	return resp, err
}

// rewind returns req with its body from the start (GetBody), for sending
// it again.
func rewind(req *http.Request) (*http.Request, error) {
	if req.Body == nil || req.Body == http.NoBody {
		return req, nil
	}
	if req.GetBody == nil {
		return nil, errors.New("h1: kept connection closed before the request was sent, and the body cannot be read again")
	}
	body, err := req.GetBody()
	if err != nil {
		return nil, err
	}
	r := *req
	r.Body = body
	return &r, nil
}

// send writes req on c, or on a new connection when c is nil, and reads
// the response head.
func (t *Transport) send(ctx context.Context, c *conn, req *http.Request, host string, trace *httptrace.ClientTrace) (*http.Response, error) {
	key := req.URL.Host
	if c == nil {
		nc, err := t.DialContext(ctx, "tcp", key)
		if err != nil {
			closeBody(req)
			if ctx.Err() != nil {
				return nil, context.Cause(ctx)
			}
			return nil, err
		}
		c = &conn{t: t, key: key, nc: nc}
	}
	if trace != nil && trace.GotConn != nil {
		info := httptrace.GotConnInfo{Conn: c.nc, Reused: c.reused, WasIdle: c.reused}
		if c.reused {
			info.IdleTime = t.clock().Sub(c.idleAt)
		}
		trace.GotConn(info)
	}
	// The header is not copied (the transport writes its own Connection
	// field), so a close it asks for must be honoured here, as net/http
	// does, or the connection would be kept against the caller's word.
	c.keepAlive = !t.DisableKeepAlives && !req.Close &&
		!httpguts.HeaderValuesContainsToken(req.Header["Connection"], "close")
	return c.roundTrip(ctx, req, host, trace)
}

func (t *Transport) clock() time.Time {
	if t.now != nil {
		return t.now()
	}
	return time.Now()
}

func (t *Transport) maxIdle() int {
	if t.MaxIdlePerHost == 0 {
		return DefaultMaxIdlePerHost
	}
	return t.MaxIdlePerHost
}

// takeIdle returns the most recently used idle connection to key that is
// still open, closing the expired and closed ones it passes, or nil.
func (t *Transport) takeIdle(key string) *conn {
	now := t.clock()
	for {
		t.mu.Lock()
		list := t.idle[key]
		if len(list) == 0 {
			t.mu.Unlock()
			return nil
		}
		c := list[len(list)-1]
		list[len(list)-1] = nil
		t.idle[key] = list[:len(list)-1]
		t.mu.Unlock()
		if t.IdleTimeout > 0 && now.Sub(c.idleAt) >= t.IdleTimeout {
			_ = c.nc.Close()
			continue
		}
		// The server may have closed it while it sat idle (its own
		// keep-alive timeout, a restart): a request written onto it would
		// fail after the write, so look before using it.
		if !alive(c.nc) {
			_ = c.nc.Close()
			continue
		}
		c.reused = true
		return c
	}
}

// putIdle keeps c for reuse, or closes it when the transport keeps none.
func (t *Transport) putIdle(c *conn) {
	c.idleAt = t.clock()
	t.mu.Lock()
	if t.closed || t.maxIdle() < 0 || t.DisableKeepAlives {
		t.mu.Unlock()
		_ = c.nc.Close()
		return
	}
	if t.idle == nil {
		t.idle = make(map[string][]*conn)
	}
	list := append(t.idle[c.key], c)
	var evicted *conn
	if len(list) > t.maxIdle() {
		evicted = list[0]
		copy(list, list[1:])
		list[len(list)-1] = nil
		list = list[:len(list)-1]
	}
	t.idle[c.key] = list
	if t.IdleTimeout > 0 && t.sweep == nil {
		t.sweep = time.AfterFunc(t.IdleTimeout, t.sweepIdle)
	}
	t.mu.Unlock()
	if evicted != nil {
		_ = evicted.nc.Close()
	}
}

// sweepIdle closes the connections idle for IdleTimeout or longer and arms
// itself for the next one to expire, so an idle connection the server
// closes does not sit half-closed until the host is used again.
func (t *Transport) sweepIdle() {
	now := t.clock()
	var expired []*conn
	t.mu.Lock()
	t.sweep = nil
	next := time.Duration(-1)
	for key, list := range t.idle {
		kept := list[:0]
		for _, c := range list {
			if age := now.Sub(c.idleAt); age >= t.IdleTimeout {
				expired = append(expired, c)
			} else {
				kept = append(kept, c)
				if left := t.IdleTimeout - age; next < 0 || left < next {
					next = left
				}
			}
		}
		clear(list[len(kept):])
		if len(kept) == 0 {
			delete(t.idle, key)
		} else {
			t.idle[key] = kept
		}
	}
	if next >= 0 && !t.closed {
		t.sweep = time.AfterFunc(next, t.sweepIdle)
	}
	t.mu.Unlock()
	for _, c := range expired {
		_ = c.nc.Close()
	}
}

// CloseIdleConnections closes every idle connection. Connections in use are
// not affected and return to the pool when their responses end.
func (t *Transport) CloseIdleConnections() {
	t.mu.Lock()
	idle := t.idle
	t.idle = nil
	// A sweep that already fired clears sweep itself; clearing it here
	// too would let putIdle arm a second chain beside it.
	if t.sweep != nil && t.sweep.Stop() {
		t.sweep = nil
	}
	t.mu.Unlock()
	for _, list := range idle {
		for _, c := range list {
			_ = c.nc.Close()
		}
	}
}

// Close closes every idle connection and keeps none from now on: a
// connection whose response ends later is closed. Requests still work, each
// on a new connection.
func (t *Transport) Close() {
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
	t.CloseIdleConnections()
}

// idleCount is the number of idle connections to key (tests).
func (t *Transport) idleCount(key string) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.idle[key])
}

func closeBody(req *http.Request) {
	if req.Body != nil {
		_ = req.Body.Close()
	}
}

// writerPool holds the buffered writers requests are written through,
// held only while a request is written.
var writerPool sync.Pool // *bufio.Writer of writeBufferSize

func getWriter(w io.Writer) *bufio.Writer {
	if v := writerPool.Get(); v != nil {
		bw := v.(*bufio.Writer)
		bw.Reset(w)
		return bw
	}
	return bufio.NewWriterSize(w, writeBufferSize)
}

func putWriter(bw *bufio.Writer) {
	bw.Reset(nil)
	writerPool.Put(bw)
}

// minReadBufferSize is bufio's smallest buffer: net/http's
// ReadBufferSize below it reads through 16 bytes.
const minReadBufferSize = 16

// readBufferSize is ReadBufferSize or its default, at least
// minReadBufferSize: the head's bufio.Reader never has less, and the body
// takes over the bytes it read past the head.
func (t *Transport) readBufferSize() int {
	if t.ReadBufferSize > 0 {
		return max(t.ReadBufferSize, minReadBufferSize)
	}
	return DefaultReadBufferSize
}

func (t *Transport) getHeadReader(r io.Reader) *bufio.Reader {
	if v := t.heads.Get(); v != nil {
		br := v.(*bufio.Reader)
		br.Reset(r)
		return br
	}
	return bufio.NewReaderSize(r, t.readBufferSize())
}

func (t *Transport) putHeadReader(br *bufio.Reader) {
	br.Reset(nil)
	t.heads.Put(br)
}
