package h1

import (
	"bufio"
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
}

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
func (c *conn) roundTrip(ctx context.Context, req *http.Request, trace *httptrace.ClientTrace) (*http.Response, error) {
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
	werr := c.writeRequest(req)
	if trace != nil && trace.WroteRequest != nil {
		trace.WroteRequest(httptrace.WroteRequestInfo{Err: werr})
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
	if d := c.t.ResponseHeaderTimeout; d > 0 && (werr == nil || errors.Is(werr, errAnsweredEarly)) {
		_ = c.nc.SetReadDeadline(c.t.clock().Add(d))
	}
	resp, err := c.readResponse(req, trace)
	if err != nil {
		if werr != nil && !errors.Is(werr, errAnsweredEarly) {
			return fail(werr)
		}
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() && c.t.ResponseHeaderTimeout > 0 && !c.aborted.Load() {
			err = fmt.Errorf("h1: timeout awaiting response headers: %w", err)
		}
		return fail(err)
	}
	if c.t.ResponseHeaderTimeout > 0 {
		_ = c.nc.SetReadDeadline(time.Time{})
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

// writeRequest writes the request line, headers and body.
func (c *conn) writeRequest(req *http.Request) error {
	defer closeBody(req)
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}
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
	bw := getWriter(w)
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
// for an answer, or for the server's close, and stops if there is one.
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
		if !alive(a.nc) {
			return written, errAnsweredEarly
		}
	}
}

// validRequest refuses what net/http refuses to write: a method that is
// not a token, a bad Host, a header name or value a server could read as
// something else (response splitting).
func validRequest(req *http.Request) error {
	if !validMethod(req.Method) {
		return fmt.Errorf("h1: invalid method %q", req.Method)
	}
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}
	if !httpguts.ValidHostHeader(host) {
		return fmt.Errorf("h1: invalid Host header %q", host)
	}
	for k, vv := range req.Header {
		if !httpguts.ValidHeaderFieldName(k) {
			return fmt.Errorf("h1: invalid header field name %q", k)
		}
		for _, v := range vv {
			if !httpguts.ValidHeaderFieldValue(v) {
				return fmt.Errorf("h1: invalid header field value for %q", k)
			}
		}
	}
	return nil
}

func validMethod(m string) bool {
	return strings.IndexFunc(m, func(r rune) bool { return !httpguts.IsTokenRune(r) }) < 0 // "" is GET
}

// readResponse reads the response head (skipping 1xx heads) and frames
// its body.
func (c *conn) readResponse(req *http.Request, trace *httptrace.ClientTrace) (*http.Response, error) {
	limit := c.t.MaxResponseHeaderBytes
	if limit <= 0 {
		limit = DefaultMaxResponseHeaderBytes
	}
	c.src = limitedConn{nc: c.nc, n: limit}
	c.br = c.t.getHeadReader(&c.src)
	first := true
	for {
		if first {
			if _, err := c.br.Peek(1); err != nil {
				if errors.Is(err, io.EOF) {
					err = io.ErrUnexpectedEOF
				}
				return nil, err
			}
			first = false
			if trace != nil && trace.GotFirstResponseByte != nil {
				trace.GotFirstResponseByte()
			}
		}
		resp, err := readResponseHead(c.br, req)
		if err != nil {
			return nil, err
		}
		if resp.StatusCode >= 100 && resp.StatusCode < 200 {
			if resp.StatusCode == http.StatusSwitchingProtocols {
				return nil, errors.New("h1: upstream switched protocols, which is not supported")
			}
			if trace != nil && trace.Got1xxResponse != nil {
				if err := trace.Got1xxResponse(resp.StatusCode, textproto.MIMEHeader(resp.Header)); err != nil {
					return nil, err
				}
			}
			continue
		}
		c.src.n = -1
		b, err := frameBody(resp, req)
		if err != nil {
			return nil, err
		}
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

// readResponseHead reads one response head (status line and headers) from
// br and returns it with its body not yet framed (Body nil). req is the
// request it answers, set as Response.Request.
func readResponseHead(br *bufio.Reader, req *http.Request) (*http.Response, error) {
	tp := textproto.NewReader(br)
	line, err := tp.ReadLine()
	if err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	proto, status, ok := strings.Cut(line, " ")
	if !ok {
		return nil, fmt.Errorf("h1: malformed status line %q", line)
	}
	major, minor, ok := http.ParseHTTPVersion(proto)
	if !ok || major != 1 {
		return nil, fmt.Errorf("h1: malformed HTTP version %q", proto)
	}
	status = strings.TrimLeft(status, " ")
	code, _, _ := strings.Cut(status, " ")
	if len(code) != 3 {
		return nil, fmt.Errorf("h1: malformed status code %q", code)
	}
	n, err := strconv.Atoi(code)
	if err != nil || n < 100 || code[0] == '+' || code[0] == '-' {
		return nil, fmt.Errorf("h1: malformed status code %q", code)
	}
	h, err := tp.ReadMIMEHeader()
	if err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	if h == nil {
		h = textproto.MIMEHeader{}
	}
	return &http.Response{
		Status: status, StatusCode: n,
		Proto: proto, ProtoMajor: major, ProtoMinor: minor,
		Header: http.Header(h), Request: req,
	}, nil
}

// frameBody decides how the body of resp is delimited (RFC 9112 §6.3) and
// returns its reader, without a connection or buffer yet. It sets
// resp.ContentLength, resp.TransferEncoding and resp.Close.
func frameBody(resp *http.Response, req *http.Request) (*body, error) {
	h := resp.Header
	resp.Close = shouldClose(resp.ProtoMajor, resp.ProtoMinor, h)
	b := &body{}
	noBody := (req != nil && req.Method == http.MethodHead) || resp.StatusCode == http.StatusNoContent ||
		resp.StatusCode == http.StatusNotModified || resp.StatusCode < 200
	te := h.Values("Transfer-Encoding")
	if len(te) > 0 && !noBody {
		if len(te) != 1 || !strings.EqualFold(strings.TrimSpace(te[0]), "chunked") {
			return nil, fmt.Errorf("h1: unsupported transfer encoding %q", te)
		}
		if resp.ProtoMajor == 1 && resp.ProtoMinor == 0 {
			return nil, errors.New("h1: chunked encoding in an HTTP/1.0 response")
		}
		// Transfer-Encoding overrides Content-Length (RFC 9112 §6.3, 3).
		h.Del("Content-Length")
		h.Del("Transfer-Encoding")
		resp.TransferEncoding = []string{"chunked"}
		resp.ContentLength = -1
		b.mode = modeChunked
		return b, nil
	}
	cl := int64(-1)
	if vv := h.Values("Content-Length"); len(vv) > 0 {
		first := strings.TrimSpace(vv[0])
		for _, v := range vv[1:] {
			if strings.TrimSpace(v) != first {
				return nil, fmt.Errorf("h1: conflicting Content-Length headers %q", vv)
			}
		}
		n, err := strconv.ParseUint(first, 10, 63)
		if err != nil {
			return nil, fmt.Errorf("h1: bad Content-Length %q", first)
		}
		cl = int64(n)
	}
	if noBody {
		resp.ContentLength = 0
		if req != nil && req.Method == http.MethodHead && cl >= 0 {
			resp.ContentLength = cl
		}
		b.state.Store(bodyDone)
		return b, nil
	}
	resp.ContentLength = cl
	if cl == 0 {
		b.state.Store(bodyDone)
		return b, nil
	}
	if cl < 0 {
		// Delimited by the server closing the connection.
		resp.Close = true
		b.mode = modeClose
		return b, nil
	}
	b.mode, b.left = modeLength, cl
	return b, nil
}

// shouldClose reports whether the connection closes after this response.
func shouldClose(major, minor int, h http.Header) bool {
	conn := h.Values("Connection")
	has := func(tok string) bool {
		for _, v := range conn {
			if httpguts.HeaderValuesContainsToken([]string{v}, tok) {
				return true
			}
		}
		return false
	}
	if major == 1 && minor == 0 {
		return !has("keep-alive")
	}
	return has("close")
}
