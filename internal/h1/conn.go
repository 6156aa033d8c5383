package h1

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/http/httputil"
	"net/textproto"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/net/http/httpguts"
)

// conn is one connection to an upstream. It is owned by one request at a
// time: the request that took it writes, reads, and either returns it to
// the idle pool at the end of the response or closes it.
type conn struct {
	t   *Transport
	key string
	nc  net.Conn
	// src is what br reads from: nc, bounded while a head is read.
	src limitedConn
	br  *bufio.Reader // nil while idle
	// idleAt is when the connection was last returned to the pool.
	idleAt time.Time
	// reused is true once the connection has carried a request before.
	reused bool
	// keepAlive is false when the connection must close after this
	// request (the request, the transport or the response asked for it).
	keepAlive bool
	// ctx is the current request's context; aborted is set when its end
	// closed the connection.
	ctx     context.Context
	aborted atomic.Bool
	// out counts the bytes of the current request written to nc.
	out countingWriter
}

// countingWriter counts the bytes written through it.
type countingWriter struct {
	w io.Writer
	n int64
}

func (cw *countingWriter) Write(p []byte) (int, error) {
	n, err := cw.w.Write(p)
	cw.n += int64(n)
	return n, err
}

// errNotSent marks the failure of a request of which no byte reached the
// connection: the server cannot have seen it, so it may be sent again on
// another connection (as net/http retries a request "nothing written").
var errNotSent = errors.New("h1: request not sent")

// notSentError is a write failure with nothing written.
type notSentError struct{ err error }

func (e *notSentError) Error() string   { return e.err.Error() }
func (e *notSentError) Unwrap() []error { return []error{errNotSent, e.err} }

// headTimeout closes the connection of a response whose head did not
// come within ResponseHeaderTimeout.
func (c *conn) headTimeout() { _ = c.nc.Close() }

// abortErr is the error to report for a failed read or write: the cause of
// the request's context when its end closed the connection, else err.
func (c *conn) abortErr(err error) error {
	if c.aborted.Load() {
		if cause := context.Cause(c.ctx); cause != nil {
			return cause
		}
	}
	return err
}

// limitedConn reads from a connection, failing once n bytes are read while
// n is non-negative: the bound on a response head.
type limitedConn struct {
	nc net.Conn
	n  int64 // bytes left; -1 is no bound
}

var errHeaderTooLarge = errors.New("h1: response head exceeds MaxResponseHeaderBytes")

func (l *limitedConn) Read(p []byte) (int, error) {
	if l.n == 0 {
		return 0, errHeaderTooLarge
	}
	if l.n > 0 && int64(len(p)) > l.n {
		p = p[:l.n]
	}
	n, err := l.nc.Read(p)
	if l.n > 0 {
		l.n -= int64(n)
	}
	return n, err
}

// reqWriteExclude are the request headers written by the transport itself,
// not copied from req.Header (net/http's list).
var reqWriteExclude = map[string]bool{
	"Host": true, "User-Agent": true, "Content-Length": true,
	"Transfer-Encoding": true, "Trailer": true, "Connection": true,
}

// roundTrip writes req on c and reads the response head. On any error c is
// closed.
func (c *conn) roundTrip(ctx context.Context, req *http.Request, host string, trace *httptrace.ClientTrace) (*http.Response, error) {
	// The request's context ending closes the connection: a write or read
	// blocked on it returns at once, and nothing else can end it.
	c.ctx = ctx
	c.aborted.Store(false)
	stop := context.AfterFunc(ctx, func() {
		c.aborted.Store(true)
		_ = c.nc.Close()
	})
	fail := func(err error) (*http.Response, error) {
		stop()
		_ = c.nc.Close()
		return nil, c.abortErr(err)
	}
	werr := c.writeRequest(req, host)
	if trace != nil && trace.WroteRequest != nil {
		trace.WroteRequest(httptrace.WroteRequestInfo{Err: werr})
	}
	if werr != nil && c.out.n == 0 && !c.aborted.Load() {
		return fail(&notSentError{werr})
	}
	if werr != nil {
		// A server may answer before it has read the whole body (a 413,
		// a 503 from a full queue) and close: its answer is worth more
		// than the failed write. Only a write the server cut short (a
		// reset, a broken pipe) has such an answer to look for.
		if c.aborted.Load() || !(errors.Is(werr, syscall.EPIPE) || errors.Is(werr, syscall.ECONNRESET) ||
			errors.Is(werr, errAnsweredEarly)) {
			return fail(werr)
		}
		c.keepAlive = false
	}
	// The head's deadline is a timer that closes the connection, not a
	// read deadline: Caddy's dialer wraps connections (read_timeout) in
	// one that sets its own deadline on every Read, over ours.
	var headTimer *time.Timer
	if d := c.t.ResponseHeaderTimeout; d > 0 && (werr == nil || errors.Is(werr, errAnsweredEarly)) {
		headTimer = time.AfterFunc(d, c.headTimeout)
	}
	resp, err := c.readResponse(req, trace)
	if headTimer != nil && !headTimer.Stop() {
		if err == nil {
			_ = resp.Body.Close()
		}
		return fail(fmt.Errorf("h1: timeout awaiting response headers after %v", c.t.ResponseHeaderTimeout))
	}
	if err != nil {
		if werr != nil && !errors.Is(werr, errAnsweredEarly) {
			return fail(werr)
		}
		return fail(err)
	}
	b := resp.Body.(*body)
	b.stop = stop
	if b.state.Load() == bodyDone {
		// No body (HEAD, 204, 304, Content-Length: 0): the connection is
		// free now.
		b.releaseConn()
		resp.Body = http.NoBody
	}
	return resp, nil
}

// writeRequest writes the request line, headers (Host as host) and body.
func (c *conn) writeRequest(req *http.Request, host string) error {
	defer closeBody(req)
	method := req.Method
	if method == "" {
		method = http.MethodGet
	}
	hasBody := req.Body != nil && req.Body != http.NoBody
	var w io.Writer = c.nc
	if hasBody && (req.ContentLength < 0 || req.ContentLength > unwatchedBody) && rawConn(c.nc) != nil {
		// A server may answer without reading the body and keep the
		// connection open: a write would then block until the context
		// ends. Look for its answer whenever the write stalls.
		w = &answerWatch{nc: c.nc}
		defer func() { _ = c.nc.SetWriteDeadline(time.Time{}) }()
	}
	c.out = countingWriter{w: w}
	bw := getWriter(&c.out)
	defer putWriter(bw)
	uri := req.URL.RequestURI()
	_, _ = bw.WriteString(method)
	_ = bw.WriteByte(' ')
	_, _ = bw.WriteString(uri)
	_, _ = bw.WriteString(" HTTP/1.1\r\nHost: ")
	_, _ = bw.WriteString(host)
	_, _ = bw.WriteString("\r\n")
	if ua, ok := req.Header["User-Agent"]; !ok {
		_, _ = bw.WriteString("User-Agent: Go-http-client/1.1\r\n")
	} else if len(ua) > 0 && ua[0] != "" {
		_, _ = bw.WriteString("User-Agent: ")
		_, _ = bw.WriteString(ua[0])
		_, _ = bw.WriteString("\r\n")
	}
	if !c.keepAlive {
		_, _ = bw.WriteString("Connection: close\r\n")
	}
	chunked := false
	switch {
	case req.ContentLength > 0 && hasBody:
		_, _ = bw.WriteString("Content-Length: ")
		_, _ = bw.WriteString(strconv.FormatInt(req.ContentLength, 10))
		_, _ = bw.WriteString("\r\n")
	case hasBody:
		// Length unknown (-1, or 0 with a body that may not be empty).
		chunked = true
		_, _ = bw.WriteString("Transfer-Encoding: chunked\r\n")
	case req.Method == http.MethodPost || req.Method == http.MethodPut || req.Method == http.MethodPatch:
		_, _ = bw.WriteString("Content-Length: 0\r\n")
	}
	if err := req.Header.WriteSubset(bw, reqWriteExclude); err != nil {
		return err
	}
	_, _ = bw.WriteString("\r\n")
	if hasBody {
		if chunked {
			cw := httputil.NewChunkedWriter(bw)
			if _, err := io.Copy(cw, req.Body); err != nil {
				return err
			}
			if err := cw.Close(); err != nil {
				return err
			}
			_, _ = bw.WriteString("\r\n")
		} else {
			var src io.Reader = io.LimitReader(req.Body, req.ContentLength)
			if l, ok := req.Body.(interface{ Len() int }); ok && int64(l.Len()) == req.ContentLength {
				// Exactly ContentLength bytes: its WriteTo (a bytes.Reader,
				// the lifecycle's kept body) hands them over in one write.
				src = req.Body
			}
			n, err := io.Copy(bw, src)
			if err != nil {
				return err
			}
			if n != req.ContentLength {
				return fmt.Errorf("h1: request body is %d bytes, ContentLength says %d", n, req.ContentLength)
			}
		}
	}
	return bw.Flush()
}

// unwatchedBody is the largest request body written without answerWatch:
// a write this small completes into the socket buffers (the receiver's
// alone holds 128 KiB by default on Linux) whether or not the server
// reads, so it cannot stall, and the common request (a prompt of a few
// KiB) pays neither the watch's allocation nor its two deadline calls.
const unwatchedBody = 64 << 10

// answerPoll is how long a request write may stall before the connection
// is checked for the server's answer.
const answerPoll = 100 * time.Millisecond

// errAnsweredEarly ends a request write that stalled while the server had
// already answered: the answer is read instead, and the connection closed
// after it (the body was not all sent).
var errAnsweredEarly = errors.New("h1: server answered before reading the whole request body")

// answerWatch writes to a plain socket under a write deadline it renews
// every answerPoll: a write stalled past it (a server not reading) looks
// for a final answer, or for the server's close, and stops if there is
// one. Interim (1xx) heads are no answer: a server sends 100 Continue or
// 103 Early Hints and then reads the body, so the write goes on, as
// net/http's does.
// Only plain sockets are watched: a wrapper that sets its own write
// deadline (Caddy's write_timeout) would make its timeout look like ours.
type answerWatch struct {
	nc    net.Conn
	armed bool
}

func (a *answerWatch) Write(p []byte) (int, error) {
	written := 0
	for {
		if !a.armed {
			_ = a.nc.SetWriteDeadline(time.Now().Add(answerPoll))
			a.armed = true
		}
		n, err := a.nc.Write(p[written:])
		written += n
		if err == nil || !errors.Is(err, os.ErrDeadlineExceeded) {
			return written, err
		}
		a.armed = false
		if answered(a.nc) {
			return written, errAnsweredEarly
		}
	}
}

// interimOnly reports whether p, the start of what a server sent, holds
// only interim heads (1xx other than 101 Switching Protocols), the last one
// possibly incomplete; anything else is the start of a final answer (or of
// bytes the response reader will refuse).
func interimOnly(p []byte) bool {
	const statusLen = len("HTTP/1.1 100")
	for len(p) > 0 {
		if len(p) < statusLen {
			return strings.HasPrefix("HTTP/1.1 1", string(p[:min(len(p), len("HTTP/1.1 1"))])) ||
				strings.HasPrefix("HTTP/1.0 1", string(p[:min(len(p), len("HTTP/1.0 1"))]))
		}
		if string(p[:7]) != "HTTP/1." || p[8] != ' ' || p[9] != '1' || string(p[9:12]) == "101" {
			return false
		}
		end := bytes.Index(p, []byte("\n\r\n"))
		if lf := bytes.Index(p, []byte("\n\n")); lf >= 0 && (end < 0 || lf < end) {
			end = lf - 1
		}
		if end < 0 {
			return true // the head is still arriving
		}
		p = p[end+3:]
	}
	return true
}

// validRequest refuses what net/http refuses to write: a method that is
// not a token, a bad Host, a request-target with a control character, a
// header name or value a server could read as something else (response
// splitting). It returns the Host to send: as net/http, an IDNA name in
// its ASCII (punycode) form and an IPv6 zone removed (RFC 6874).
func validRequest(req *http.Request) (string, error) {
	if !validMethod(req.Method) {
		return "", fmt.Errorf("h1: invalid method %q", req.Method)
	}
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}
	host, err := httpguts.PunycodeHostPort(host)
	if err != nil {
		return "", fmt.Errorf("h1: invalid Host header: %w", err)
	}
	if !httpguts.ValidHostHeader(host) {
		// net/http sends an empty Host instead; refusing is stricter
		// and sends nothing the caller did not ask for.
		return "", fmt.Errorf("h1: invalid Host header %q", host)
	}
	if uri := req.URL.RequestURI(); strings.IndexFunc(uri, isCTL) >= 0 {
		return "", fmt.Errorf("h1: control character in request-target %q", uri)
	}
	for k, vv := range req.Header {
		if !httpguts.ValidHeaderFieldName(k) {
			return "", fmt.Errorf("h1: invalid header field name %q", k)
		}
		for _, v := range vv {
			if !httpguts.ValidHeaderFieldValue(v) {
				return "", fmt.Errorf("h1: invalid header field value for %q", k)
			}
		}
	}
	return removeZone(host), nil
}

func isCTL(r rune) bool { return r < ' ' || r == 0x7f }

// removeZone removes an IPv6 zone identifier from host (net/http's).
func removeZone(host string) string {
	if !strings.HasPrefix(host, "[") {
		return host
	}
	i := strings.LastIndex(host, "]")
	if i < 0 {
		return host
	}
	j := strings.LastIndex(host[:i], "%")
	if j < 0 {
		return host
	}
	return host[:j] + host[i:]
}

func validMethod(m string) bool {
	return strings.IndexFunc(m, func(r rune) bool { return !httpguts.IsTokenRune(r) }) < 0 // "" is GET
}

// readResponse reads the response head (skipping 1xx heads) with
// net/http's own parser, http.ReadResponse, and frames its body as that
// parser decided: the head is held to exactly net/http's rules (status
// line, header syntax, Content-Length forms, Transfer-Encoding, Trailer).
// Only the body reader is replaced, by one that holds no buffer between
// events.
func (c *conn) readResponse(req *http.Request, trace *httptrace.ClientTrace) (*http.Response, error) {
	limit := c.t.MaxResponseHeaderBytes
	if limit <= 0 {
		limit = DefaultMaxResponseHeaderBytes
	}
	c.src = limitedConn{nc: c.nc, n: limit}
	c.br = c.t.getHeadReader(&c.src)
	if _, err := c.br.Peek(1); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	if trace != nil && trace.GotFirstResponseByte != nil {
		trace.GotFirstResponseByte()
	}
	for {
		resp, err := http.ReadResponse(c.br, req)
		if err != nil {
			return nil, headError(err)
		}
		if resp.StatusCode == http.StatusSwitchingProtocols {
			return nil, malformed(errors.New("upstream switched protocols, which is not supported"))
		}
		if resp.StatusCode < 100 {
			// net/http takes 000-099 for a final answer; RFC 9110 §15
			// has no such codes.
			return nil, malformed(fmt.Errorf("status code %d", resp.StatusCode))
		}
		if resp.StatusCode < 200 {
			if trace != nil && trace.Got1xxResponse != nil {
				if err := trace.Got1xxResponse(resp.StatusCode, textproto.MIMEHeader(resp.Header)); err != nil {
					return nil, err
				}
				// As net/http: once the caller sees 1xx heads, each
				// head gets the whole bound; else all share one.
				c.src.n = limit
			}
			continue
		}
		c.src.n = -1
		b := frameBody(resp)
		// The body reads through its own buffer, which it can let go
		// of between events; the head's reader goes back now.
		b.c = c
		b.adopt(c.br)
		c.t.putHeadReader(c.br)
		c.br = nil
		if resp.Close {
			c.keepAlive = false
		} else if !c.keepAlive {
			resp.Close = true
		}
		resp.Body = b
		return resp, nil
	}
}

// ErrMalformedResponse is wrapped by every error that reports an upstream
// response h1 refused to read: a bad status line or header, conflicting or
// unsupported framing, broken chunked encoding or trailers, a head over
// MaxResponseHeaderBytes. errors.Is tells it from an I/O failure (a reset,
// a timeout, a truncation), which does not wrap it.
var ErrMalformedResponse = errors.New("malformed response")

// malformedError is a refused response: ErrMalformedResponse and the
// reason.
type malformedError struct{ err error }

func (e *malformedError) Error() string   { return "h1: malformed response: " + e.err.Error() }
func (e *malformedError) Unwrap() []error { return []error{ErrMalformedResponse, e.err} }

// MalformedResponse reports true: a gateway tells a refused response from
// a failed connection by it without importing this package.
func (e *malformedError) MalformedResponse() bool { return true }

func malformed(err error) error { return &malformedError{err} }

// headError classifies an error of http.ReadResponse: the connection's own
// failures (timeouts, resets, a close before the head was whole) pass as
// they are; everything else is the parser refusing what it read.
func headError(err error) error {
	var ne net.Error
	var errno syscall.Errno
	switch {
	case errors.Is(err, errHeaderTooLarge):
		return malformed(err)
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, net.ErrClosed),
		errors.As(err, &ne), errors.As(err, &errno), errors.Is(err, os.ErrDeadlineExceeded):
		return err
	}
	return malformed(err)
}

// release returns c to the idle pool when its request and response allow
// keep-alive, its context has not closed it, and nothing was read past the
// response (bytes that answer nothing: such a connection cannot carry
// another request); it closes c otherwise.
func (c *conn) release(stop func() bool, clean bool) {
	c.ctx = nil // an idle connection keeps no request's context
	if !stop() || !c.keepAlive || !clean {
		_ = c.nc.Close()
		return
	}
	c.t.putIdle(c)
}

// frameBody returns the reader of resp's body as http.ReadResponse framed
// it (RFC 9112 §6.3), without a connection or buffer yet; a body with no
// bytes to read starts done.
func frameBody(resp *http.Response) *body {
	b := &body{resp: resp}
	switch {
	case resp.Body == http.NoBody:
		b.state.Store(bodyDone)
	case len(resp.TransferEncoding) > 0:
		// ReadResponse accepts "chunked" alone.
		b.mode = modeChunked
	case resp.ContentLength > 0:
		b.mode, b.left = modeLength, resp.ContentLength
	case resp.ContentLength == 0:
		b.state.Store(bodyDone)
	default:
		// Delimited by the server closing the connection (ReadResponse
		// sets resp.Close).
		b.mode = modeClose
	}
	return b
}
