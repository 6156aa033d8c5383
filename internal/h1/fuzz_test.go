package h1

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// scriptConn is a connection whose peer sends fixed bytes and then closes;
// what is written to it is discarded.
type scriptConn struct {
	r      *bytes.Reader
	closed bool
}

func (c *scriptConn) Read(p []byte) (int, error) {
	if c.closed {
		return 0, net.ErrClosed
	}
	return c.r.Read(p)
}
func (c *scriptConn) Write(p []byte) (int, error)      { return len(p), nil }
func (c *scriptConn) Close() error                     { c.closed = true; return nil }
func (c *scriptConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c *scriptConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c *scriptConn) SetDeadline(time.Time) error      { return nil }
func (c *scriptConn) SetReadDeadline(time.Time) error  { return nil }
func (c *scriptConn) SetWriteDeadline(time.Time) error { return nil }

// FuzzResponse reads arbitrary bytes as the response to a GET: the head
// parser, the body framing and the chunked decoder. It must not panic or
// hang, and whatever it accepts net/http's own reader must accept with the
// same status code and body.
func FuzzResponse(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
		"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n0\r\nT: 1\r\n\r\n",
		"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
		"HTTP/1.0 200 OK\r\n\r\nuntil close",
		"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 2\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
		"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
		"HTTP/1.1 200\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n",
		"HTTP/1.1 200 OK\r\nX: a\r\n b\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		tr := &Transport{DialContext: func(context.Context, string, string) (net.Conn, error) {
			return &scriptConn{r: bytes.NewReader(data)}, nil
		}, MaxResponseHeaderBytes: 64 << 10, ReadBufferSize: 64}
		req, _ := http.NewRequest(http.MethodGet, "http://upstream/", nil)
		resp, err := tr.RoundTrip(req)
		if err != nil {
			return
		}
		body, berr := io.ReadAll(resp.Body)
		_ = resp.Body.Close()

		ref, rerr := http.ReadResponse(bufio.NewReader(bytes.NewReader(data)), req)
		for rerr == nil && ref.StatusCode >= 100 && ref.StatusCode < 200 {
			// net/http's reader returns 1xx heads; its transport skips them.
			break
		}
		if rerr != nil {
			// net/http is stricter in places (it validates Content-Length
			// forms and header names the same way); the difference must
			// not be in the status line.
			if resp.StatusCode < 100 || resp.StatusCode > 999 {
				t.Fatalf("accepted status %d", resp.StatusCode)
			}
			return
		}
		if ref.StatusCode >= 200 && ref.StatusCode != resp.StatusCode {
			t.Fatalf("status %d, net/http reads %d", resp.StatusCode, ref.StatusCode)
		}
		if ref.StatusCode >= 200 && berr == nil {
			want, werr := io.ReadAll(ref.Body)
			if werr == nil && !bytes.Equal(body, want) {
				t.Fatalf("body %q, net/http reads %q", body, want)
			}
		}
	})
}
