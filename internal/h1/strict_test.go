package h1

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// netHTTP is net/http's client over loopback with h1's buffer size, the
// reference every strictness test compares with.
func netHTTP(t *testing.T, readBuf int) *http.Transport {
	tr := &http.Transport{ReadBufferSize: readBuf, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return tr
}

// TestInterimResponsesDuringALargeBodyWriteAreNotTheAnswer: a server that
// sends 100 Continue and 103 Early Hints while it is not yet reading a
// 16 MiB body, then reads it, gets the whole body and its 200 goes back.
func TestInterimResponsesDuringALargeBodyWriteAreNotTheAnswer(t *testing.T) {
	const size = 16 << 20
	addr := rawServer(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		time.Sleep(3 * answerPoll) // the client's write stalls
		_, _ = io.WriteString(c, "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n")
		time.Sleep(3 * answerPoll) // and finds the interim heads
		n, _ := io.Copy(io.Discard, req.Body)
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n"+strings.Repeat("x", 8-len("ok"))+"ok")
		_ = n
	})
	for _, tc := range []struct {
		name string
		rt   http.RoundTripper
	}{{"h1", newTransport(t)}, {"net_http", netHTTP(t, 0)}} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/", bytes.NewReader(make([]byte, size)))
			req.Header.Set("Expect", "100-continue")
			start := time.Now()
			resp, err := tc.rt.RoundTrip(req)
			if err != nil {
				t.Fatalf("after %v: %v", time.Since(start), err)
			}
			if resp.StatusCode != 200 || mustBody(t, resp) != "xxxxxxok" {
				t.Fatalf("status %d", resp.StatusCode)
			}
		})
	}
}

// deadlinePerRead is a connection that sets its own read deadline before
// every Read, as Caddy's dialer does for read_timeout.
type deadlinePerRead struct {
	net.Conn
	d time.Duration
}

func (c *deadlinePerRead) Read(p []byte) (int, error) {
	_ = c.SetReadDeadline(time.Now().Add(c.d))
	return c.Conn.Read(p)
}

// TestResponseHeaderTimeoutHoldsUnderAReadTimeout: a head trickled a byte
// at a time, each within the read timeout, still fails at the response
// header timeout.
func TestResponseHeaderTimeoutHoldsUnderAReadTimeout(t *testing.T) {
	addr := rawServer(t, func(c net.Conn) {
		_, _ = readRequest(t, bufio.NewReader(c))
		for _, b := range []byte("HTTP/1.1 200 OK\r\nX-Slow: " + strings.Repeat("a", 40) + "\r\nContent-Length: 0\r\n\r\n") {
			if _, err := c.Write([]byte{b}); err != nil {
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
	})
	d := &net.Dialer{}
	tr := &Transport{ResponseHeaderTimeout: 300 * time.Millisecond,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &deadlinePerRead{Conn: c, d: 10 * time.Second}, nil
		}}
	t.Cleanup(tr.Close)
	start := time.Now()
	_, err := get(t, tr, "http://"+addr+"/")
	if err == nil || !strings.Contains(err.Error(), "timeout awaiting response headers") {
		t.Fatalf("err %v after %v, want a response header timeout", err, time.Since(start))
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("failed after %v, want about 300ms", el)
	}
}

// TestChunkedEncodingNoMoreLenientThanNetHTTP: every chunked body that
// net/http refuses, h1 refuses, as a malformed response. (A trailer ended
// by bare LFs waits, in both, for a CRLF CRLF: the differential corpus has
// it.)
func TestChunkedEncodingNoMoreLenientThanNetHTTP(t *testing.T) {
	head := "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
	manyExt := strings.Repeat("1;"+strings.Repeat("e", 200)+"\r\nx\r\n", 100) + "0\r\n\r\n"
	for name, chunks := range map[string]string{
		"bare LF after size":       "3\nabc\r\n0\r\n\r\n",
		"bare LF after data":       "3\r\nabc\n0\r\n\r\n",
		"bare LF after last chunk": "3\r\nabc\r\n0\n\r\n",
		"CR in extension":          "3;a=\rb\r\nabc\r\n0\r\n\r\n",
		"space before extension":   "3 ;a=b\r\nabc\r\n0\r\n\r\n",
		"data not ended by CRLF":   "3\r\nabcd\r\n0\r\n\r\n",
		"trailer past the buffer":  "3\r\nabc\r\n0\r\nX-T: " + strings.Repeat("t", 8<<10) + "\r\n\r\n",
		"extension overhead":       manyExt,
		"chunk line over 4 KiB":    "3;" + strings.Repeat("e", 5000) + "\r\nabc\r\n0\r\n\r\n",
	} {
		t.Run(name, func(t *testing.T) {
			addr := rawServer(t, func(c net.Conn) {
				_, _ = readRequest(t, bufio.NewReader(c))
				_, _ = io.WriteString(c, head+chunks)
				// Hold the connection: a parser waiting for more bytes
				// must fail on its own, not at the close.
				time.Sleep(500 * time.Millisecond)
			})
			ref := netHTTP(t, 0)
			_, nerr := readAll(ref, "http://"+addr+"/")
			if nerr == nil {
				t.Fatalf("net/http accepts it: not a strictness case")
			}
			_, err := readAll(newTransport(t), "http://"+addr+"/")
			if !errors.Is(err, ErrMalformedResponse) {
				t.Fatalf("h1: %v; net/http: %v", err, nerr)
			}
		})
	}
}

// readAll sends a GET with a 5 s bound and reads the whole body.
func readAll(rt http.RoundTripper, url string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// TestRequestTargetWithAControlCharacterIsNotSent: a request-target with a
// control character is refused before anything is written, as net/http
// refuses it.
func TestRequestTargetWithAControlCharacterIsNotSent(t *testing.T) {
	var got atomic.Int32
	addr := rawServer(t, func(c net.Conn) {
		if req, _ := readRequest(t, bufio.NewReader(c)); req != nil {
			got.Add(1)
		}
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
	})
	for _, tc := range []struct {
		name string
		rt   http.RoundTripper
	}{{"h1", newTransport(t)}, {"net_http", netHTTP(t, 0)}} {
		t.Run(tc.name, func(t *testing.T) {
			u := &url.URL{Scheme: "http", Host: addr, Path: "/v1", RawQuery: "a=1\r\nX-Injected: 1"}
			req := &http.Request{Method: http.MethodGet, URL: u, Header: http.Header{}}
			if _, err := tc.rt.RoundTrip(req); err == nil {
				t.Fatal("sent")
			}
		})
	}
	if got.Load() != 0 {
		t.Fatalf("the server read %d requests", got.Load())
	}
}

// TestTinyReadBuffersLoseNoBytes: a ReadBufferSize below bufio's minimum
// reads bodies whole, as net/http does with it.
func TestTinyReadBuffersLoseNoBytes(t *testing.T) {
	body := strings.Repeat("0123456789", 20)
	for _, resp := range []string{
		"HTTP/1.1 200 OK\r\nContent-Length: 200\r\n\r\n" + body,
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nc8\r\n" + body + "\r\n0\r\n\r\n",
	} {
		addr := cannedServer(t, resp)
		for _, size := range []int{1, 8, 15} {
			tr := newTransport(t)
			tr.ReadBufferSize = size
			got, err := readAll(tr, "http://"+addr+"/")
			if err != nil || got != body {
				t.Fatalf("ReadBufferSize %d: %q, %v", size, got, err)
			}
		}
	}
}

// TestTrailersReachTheResponse: a chunked response's trailer fields are in
// Response.Trailer once the body is read, announced keys before, as
// net/http gives them.
func TestTrailersReachTheResponse(t *testing.T) {
	addr := cannedServer(t, "HTTP/1.1 200 OK\r\nTrailer: X-Usage\r\nTransfer-Encoding: chunked\r\n\r\n"+
		"3\r\nabc\r\n0\r\nX-Usage: 42\r\nX-Other: 1\r\n\r\n")
	for _, tc := range []struct {
		name string
		rt   http.RoundTripper
	}{{"h1", newTransport(t)}, {"net_http", netHTTP(t, 0)}} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := get(t, tc.rt, "http://"+addr+"/")
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := resp.Trailer["X-Usage"]; !ok {
				t.Fatalf("announced trailer missing before the body: %v", resp.Trailer)
			}
			if mustBody(t, resp) != "abc" {
				t.Fatal("body")
			}
			if resp.Trailer.Get("X-Usage") != "42" || resp.Trailer.Get("X-Other") != "1" {
				t.Fatalf("trailer %v", resp.Trailer)
			}
		})
	}
}

// TestInternationalHostIsSentInASCII: an IDNA host name goes out in its
// punycode form, as net/http sends it.
func TestInternationalHostIsSentInASCII(t *testing.T) {
	hosts := make(chan string, 2)
	addr := rawServer(t, func(c net.Conn) {
		req, _ := readRequest(t, bufio.NewReader(c))
		if req != nil {
			hosts <- req.Host
		}
		_, _ = io.WriteString(c, "HTTP/1.1 204 No Content\r\n\r\n")
	})
	for _, rt := range []http.RoundTripper{newTransport(t), netHTTP(t, 0)} {
		req, _ := http.NewRequest(http.MethodGet, "http://"+addr+"/", nil)
		req.Host = "bücher.example:8000"
		resp, err := rt.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if h := <-hosts; h != "xn--bcher-kva.example:8000" {
			t.Fatalf("Host %q", h)
		}
	}
}

// breakableConn fails every write, writing nothing, once broken; it is no
// syscall.Conn, so an idle one looks alive.
type breakableConn struct {
	net.Conn
	broken atomic.Bool
}

func (c *breakableConn) Write(p []byte) (int, error) {
	if c.broken.Load() {
		return 0, syscall.EPIPE
	}
	return c.Conn.Write(p)
}

// TestKeptConnectionDeadBeforeWritingIsRedialled: a kept connection that
// fails before any byte of the request is written costs nothing: the
// request goes once, on a new connection.
func TestKeptConnectionDeadBeforeWritingIsRedialled(t *testing.T) {
	var requests atomic.Int32
	s, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		_, _ = io.WriteString(w, "ok")
	})
	d := &net.Dialer{}
	var dialled []*breakableConn
	tr := &Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		bc := &breakableConn{Conn: c}
		dialled = append(dialled, bc)
		return bc, nil
	}}
	t.Cleanup(tr.Close)
	post := func() (*http.Response, error) {
		req, _ := http.NewRequest(http.MethodPost, s.URL, strings.NewReader(`{"prompt":"x"}`))
		return tr.RoundTrip(req)
	}
	resp, err := post()
	if err != nil || mustBody(t, resp) != "ok" {
		t.Fatal(err)
	}
	dialled[0].broken.Store(true)
	resp, err = post()
	if err != nil || mustBody(t, resp) != "ok" {
		t.Fatalf("second request on a kept connection dead before writing: %v", err)
	}
	if requests.Load() != 2 || conns.Load() != 2 {
		t.Fatalf("requests %d on %d connections, want 2 on 2", requests.Load(), conns.Load())
	}
}

// TestWrittenRequestIsNeverSentAgain: a POST written in full on a kept
// connection that then closes without a response byte fails; the client
// does not send it again (the server may be generating).
func TestWrittenRequestIsNeverSentAgain(t *testing.T) {
	var requests atomic.Int32
	addr := rawServer(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		for n := 0; ; n++ {
			if req, _ := readRequest(t, br); req == nil {
				return
			}
			requests.Add(1)
			if n > 0 {
				return // read in full, then closed unanswered
			}
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	})
	tr := newTransport(t)
	for i := range 2 {
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/", strings.NewReader(`{"prompt":"x"}`))
		resp, err := tr.RoundTrip(req)
		if i == 0 {
			if err != nil || mustBody(t, resp) != "ok" {
				t.Fatal(err)
			}
			continue
		}
		if err == nil {
			t.Fatal("the second request succeeded")
		}
	}
	if requests.Load() != 2 {
		t.Fatalf("the server read %d requests, want 2", requests.Load())
	}
}
