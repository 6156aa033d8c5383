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
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// newTransport is a transport dialling over loopback, closed (its idle
// connections with it) before the test's servers stop.
func newTransport(t *testing.T) *Transport {
	d := &net.Dialer{}
	tr := &Transport{DialContext: d.DialContext, MaxIdlePerHost: 4}
	t.Cleanup(tr.Close)
	return tr
}

// countingServer is an httptest server that counts the connections it
// accepted.
func countingServer(t *testing.T, h http.HandlerFunc) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	var conns atomic.Int32
	s := httptest.NewUnstartedServer(h)
	s.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			conns.Add(1)
		}
	}
	s.Start()
	t.Cleanup(s.Close)
	return s, &conns
}

// rawServer accepts connections on loopback and runs serve on each.
func rawServer(t *testing.T, serve func(c net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { _ = ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				serve(c)
			}()
		}
	}()
	return ln.Addr().String()
}

// cannedServer answers the first request on each connection with the
// bytes of response, as they are, and stops.
func cannedServer(t *testing.T, response string) string {
	t.Helper()
	return rawServer(t, func(c net.Conn) {
		_, _ = readRequest(t, bufio.NewReader(c))
		_, _ = io.WriteString(c, response)
	})
}

// readRequest reads one request (head and body) from br.
func readRequest(t *testing.T, br *bufio.Reader) (*http.Request, []byte) {
	t.Helper()
	req, err := http.ReadRequest(br)
	if err != nil {
		return nil, nil
	}
	b, _ := io.ReadAll(req.Body)
	return req, b
}

func get(t *testing.T, tr http.RoundTripper, url string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	return tr.RoundTrip(req)
}

func mustBody(t *testing.T, resp *http.Response) string {
	t.Helper()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading body: %v", err)
	}
	_ = resp.Body.Close()
	return string(b)
}

// TestStreamedEventsArriveAsWritten reads each SSE event of a chunked
// response before the server writes the next: nothing is held back.
func TestStreamedEventsArriveAsWritten(t *testing.T) {
	next := make(chan struct{})
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 3 {
			fmt.Fprintf(w, "data: %d\n\n", i)
			w.(http.Flusher).Flush()
			<-next
		}
	})
	tr := newTransport(t)
	resp, err := get(t, tr, s.URL+"/v1/chat/completions")
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" || resp.ContentLength != -1 ||
		len(resp.TransferEncoding) != 1 || resp.TransferEncoding[0] != "chunked" {
		t.Fatalf("head: %d %v cl=%d te=%v", resp.StatusCode, resp.Header, resp.ContentLength, resp.TransferEncoding)
	}
	br := bufio.NewReader(resp.Body)
	for i := range 3 {
		line, err := br.ReadString('\n')
		if err != nil || line != fmt.Sprintf("data: %d\n", i) {
			t.Fatalf("event %d: %q, %v", i, line, err)
		}
		_, _ = br.ReadString('\n')
		next <- struct{}{}
	}
	if rest, err := io.ReadAll(br); err != nil || len(rest) != 0 {
		t.Fatalf("after the last event: %q, %v", rest, err)
	}
	if n := tr.idleCount(s.Listener.Addr().String()); n != 1 {
		t.Fatalf("idle connections after the stream ended: %d, want 1", n)
	}
}

// TestKeepAliveReusesOneConnection sends requests one after another over
// one connection, and the trace says which was reused.
func TestKeepAliveReusesOneConnection(t *testing.T) {
	s, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "%s %s %s", r.Method, r.URL.RequestURI(), b)
	})
	tr := newTransport(t)
	var reused []bool
	trace := &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) { reused = append(reused, i.Reused) }}
	for i := range 3 {
		req, _ := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace),
			http.MethodPost, s.URL+"/v1/x?i="+fmt.Sprint(i), strings.NewReader("body"))
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := mustBody(t, resp), fmt.Sprintf("POST /v1/x?i=%d body", i); got != want {
			t.Fatalf("body %q, want %q", got, want)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Fatalf("server accepted %d connections, want 1", n)
	}
	if fmt.Sprint(reused) != "[false true true]" {
		t.Fatalf("GotConn reused: %v", reused)
	}
}

// TestRequestOnTheWire checks the bytes a request is written as.
func TestRequestOnTheWire(t *testing.T) {
	got := make(chan string, 4)
	addr := rawServer(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			var head bytes.Buffer
			for {
				line, err := br.ReadString('\n')
				if err != nil {
					return
				}
				head.WriteString(line)
				if line == "\r\n" {
					break
				}
			}
			h := head.String()
			var body []byte
			if i := strings.Index(h, "Content-Length: "); i >= 0 {
				var n int
				fmt.Sscanf(h[i+len("Content-Length: "):], "%d", &n)
				body = make([]byte, n)
				_, _ = io.ReadFull(br, body)
			} else if strings.Contains(h, "Transfer-Encoding: chunked") {
				for {
					line, _ := br.ReadString('\n')
					body = append(body, line...)
					if line == "0\r\n" {
						l2, _ := br.ReadString('\n')
						body = append(body, l2...)
						break
					}
				}
			}
			got <- h + string(body)
			_, _ = io.WriteString(c, "HTTP/1.1 204 No Content\r\n\r\n")
		}
	})
	tr := newTransport(t)
	send := func(req *http.Request) string {
		t.Helper()
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != 204 || resp.Body != http.NoBody {
			t.Fatalf("status %d body %T", resp.StatusCode, resp.Body)
		}
		return <-got
	}
	req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/v1/chat/completions?a=1", strings.NewReader(`{"x":1}`))
	req.Header.Set("Authorization", "Bearer k")
	req.Header.Set("Content-Type", "application/json")
	want := "POST /v1/chat/completions?a=1 HTTP/1.1\r\nHost: " + addr + "\r\nUser-Agent: Go-http-client/1.1\r\n" +
		"Content-Length: 7\r\nAuthorization: Bearer k\r\nContent-Type: application/json\r\n\r\n" + `{"x":1}`
	if w := send(req); w != want {
		t.Fatalf("request:\n%q\nwant\n%q", w, want)
	}
	// Unknown length: chunked. An empty User-Agent sends none; req.Host
	// overrides the URL's host.
	req, _ = http.NewRequest(http.MethodPost, "http://"+addr+"/p", io.MultiReader(strings.NewReader("ab"), strings.NewReader("c")))
	req.ContentLength = -1
	req.Host = "upstream.example"
	req.Header["User-Agent"] = []string{""}
	want = "POST /p HTTP/1.1\r\nHost: upstream.example\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n1\r\nc\r\n0\r\n\r\n"
	if w := send(req); w != want {
		t.Fatalf("chunked request:\n%q\nwant\n%q", w, want)
	}
	// A POST without a body says so; a request asking to close says so.
	req, _ = http.NewRequest(http.MethodPost, "http://"+addr+"/e", nil)
	req.Close = true
	want = "POST /e HTTP/1.1\r\nHost: " + addr + "\r\nUser-Agent: Go-http-client/1.1\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
	if w := send(req); w != want {
		t.Fatalf("empty POST:\n%q\nwant\n%q", w, want)
	}
}

// TestInvalidRequestIsRefusedUnwritten refuses a header a server could
// read as two (response splitting) before anything is dialled.
func TestInvalidRequestIsRefusedUnwritten(t *testing.T) {
	var dialled atomic.Int32
	d := &net.Dialer{}
	tr := &Transport{DialContext: func(ctx context.Context, n, a string) (net.Conn, error) {
		dialled.Add(1)
		return d.DialContext(ctx, n, a)
	}}
	s, _ := countingServer(t, func(http.ResponseWriter, *http.Request) { t.Error("the server saw the request") })
	req, _ := http.NewRequest(http.MethodGet, s.URL, nil)
	req.Header["X-Bad"] = []string{"a\r\nInjected: 1"}
	if _, err := tr.RoundTrip(req); err == nil || !strings.Contains(err.Error(), "invalid header") {
		t.Fatalf("err %v, want an invalid header error", err)
	}
	req.Header = http.Header{"Bad Name": {"x"}}
	if _, err := tr.RoundTrip(req); err == nil {
		t.Fatal("a header name with a space was sent")
	}
	req, _ = http.NewRequest(http.MethodGet, "https://example.com/", nil)
	if _, err := tr.RoundTrip(req); !errors.Is(err, errUnsupportedScheme) {
		t.Fatalf("https: %v", err)
	}
}

// TestBodyFraming reads bodies delimited each way RFC 9112 §6.3 allows and
// checks which connections can carry another request.
func TestBodyFraming(t *testing.T) {
	cases := []struct {
		name, method, response, body string
		reusable                     bool
	}{
		{"content-length", "GET", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", "hello", true},
		{"chunked with trailer", "GET", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\nX-Trailer: t\r\n\r\n", "abcde", true},
		{"chunked overrides length", "GET", "HTTP/1.1 200 OK\r\nContent-Length: 99\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nz\r\n0\r\n\r\n", "z", true},
		{"read to close", "GET", "HTTP/1.1 200 OK\r\n\r\nuntil close", "until close", false},
		{"http/1.0", "GET", "HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", "ok", false},
		{"http/1.0 keep-alive", "GET", "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok", "ok", true},
		{"connection close", "GET", "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", "ok", false},
		{"204", "GET", "HTTP/1.1 204 No Content\r\n\r\n", "", true},
		{"304", "GET", "HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n", "", true},
		{"head", "HEAD", "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", "", true},
		{"1xx then final", "GET", "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx", "x", true},
		{"extra bytes", "GET", "HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nxJUNK", "x", false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var accepted atomic.Int32
			addr := rawServer(t, func(c net.Conn) {
				accepted.Add(1)
				br := bufio.NewReader(c)
				for {
					if req, _ := readRequest(t, br); req == nil {
						return
					}
					_, _ = io.WriteString(c, tc.response)
					if !tc.reusable && !strings.Contains(tc.name, "extra") {
						return // close after the response
					}
				}
			})
			tr := newTransport(t)
			for i := range 2 {
				req, _ := http.NewRequest(tc.method, "http://"+addr+"/", nil)
				resp, err := tr.RoundTrip(req)
				if err != nil {
					t.Fatalf("request %d: %v", i, err)
				}
				if got := mustBody(t, resp); got != tc.body {
					t.Fatalf("request %d: body %q, want %q", i, got, tc.body)
				}
			}
			want := int32(2)
			if tc.reusable {
				want = 1
			}
			if n := accepted.Load(); n != want {
				t.Fatalf("connections %d, want %d", n, want)
			}
		})
	}
}

// TestMalformedResponsesFail refuses responses net/http refuses, and
// closes their connections.
func TestMalformedResponsesFail(t *testing.T) {
	for name, response := range map[string]string{
		"not http":           "SSH-2.0-OpenSSH\r\n\r\n",
		"http/2 status line": "HTTP/2 200 OK\r\n\r\n",
		"bad code":           "HTTP/1.1 2x0 OK\r\n\r\n",
		"conflicting length": "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nx",
		"bad length":         "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
		"gzip coding":        "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
		"eof in head":        "HTTP/1.1 200 OK\r\nContent-",
		"switching":          "HTTP/1.1 101 Switching Protocols\r\n\r\n",
	} {
		t.Run(name, func(t *testing.T) {
			addr := cannedServer(t, response)
			tr := newTransport(t)
			resp, err := get(t, tr, "http://"+addr+"/")
			if err == nil {
				t.Fatalf("status %d, want an error", resp.StatusCode)
			}
			if n := tr.idleCount(addr); n != 0 {
				t.Fatalf("%d idle connections after a failure", n)
			}
		})
	}
}

// TestTruncatedBodiesFail reports a body cut short as an error, not as its
// end.
func TestTruncatedBodiesFail(t *testing.T) {
	for name, response := range map[string]string{
		"content-length": "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
		"chunked":        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
		"no last chunk":  "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n",
	} {
		t.Run(name, func(t *testing.T) {
			addr := cannedServer(t, response)
			tr := newTransport(t)
			resp, err := get(t, tr, "http://"+addr+"/")
			if err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadAll(resp.Body); err == nil {
				t.Fatal("a truncated body read to its end without an error")
			}
			if n := tr.idleCount(addr); n != 0 {
				t.Fatalf("%d idle connections after a truncated body", n)
			}
		})
	}
}

// TestClosingAStreamEarlyClosesItsConnection: the server sees its client
// go, and the connection is not pooled.
func TestClosingAStreamEarlyClosesItsConnection(t *testing.T) {
	gone := make(chan struct{})
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: 1\n\n")
		w.(http.Flusher).Flush()
		<-r.Context().Done()
		close(gone)
	})
	tr := newTransport(t)
	resp, err := get(t, tr, s.URL)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	if n, err := resp.Body.Read(buf); err != nil || string(buf[:n]) != "data: 1\n\n" {
		t.Fatalf("first read %q %v", buf[:n], err)
	}
	_ = resp.Body.Close()
	select {
	case <-gone:
	case <-time.After(10 * time.Second):
		t.Fatal("the server never saw the connection close")
	}
	if _, err := resp.Body.Read(buf); err == nil {
		t.Fatal("read after close succeeded")
	}
	if n := tr.idleCount(s.Listener.Addr().String()); n != 0 {
		t.Fatalf("idle connections %d after an early close", n)
	}
}

// TestCancellingTheContextUnblocks ends a request waiting for its head and
// a stream waiting for its next event, each with the context's cause.
func TestCancellingTheContextUnblocks(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	arrived := make(chan struct{}, 1)
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		if r.URL.Path == "/stream" {
			_, _ = io.WriteString(w, "data: 1\n\n")
			w.(http.Flusher).Flush()
		}
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	tr := newTransport(t)
	cause := errors.New("first byte timeout")

	ctx, cancel := context.WithCancelCause(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.URL+"/head", nil)
	errc := make(chan error, 1)
	go func() {
		_, err := tr.RoundTrip(req)
		errc <- err
	}()
	<-arrived
	cancel(cause)
	if err := <-errc; !errors.Is(err, cause) {
		t.Fatalf("waiting for the head: %v, want the cause", err)
	}

	ctx, cancel = context.WithCancelCause(context.Background())
	req, _ = http.NewRequestWithContext(ctx, http.MethodGet, s.URL+"/stream", nil)
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	<-arrived
	buf := make([]byte, 64)
	if _, err := resp.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	go cancel(cause)
	if _, err := resp.Body.Read(buf); !errors.Is(err, cause) {
		t.Fatalf("waiting for an event: %v, want the cause", err)
	}
	if n := tr.idleCount(s.Listener.Addr().String()); n != 0 {
		t.Fatalf("idle connections %d after a cancelled stream", n)
	}
}

// TestIdleConnectionClosedByTheServerIsNotUsed: uvicorn closes idle
// connections after 5 s; a request must not be written onto one it closed.
func TestIdleConnectionClosedByTheServerIsNotUsed(t *testing.T) {
	var accepted atomic.Int32
	closed := make(chan struct{}, 1)
	addr := rawServer(t, func(c net.Conn) {
		n := accepted.Add(1)
		br := bufio.NewReader(c)
		if req, _ := readRequest(t, br); req == nil {
			return
		}
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		if n == 1 {
			_ = c.Close() // the keep-alive timeout, as the client is idle
			closed <- struct{}{}
			return
		}
		_, _ = readRequest(t, br)
	})
	tr := newTransport(t)
	var reused []bool
	trace := &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) { reused = append(reused, i.Reused) }}
	for i := range 2 {
		req, _ := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace), http.MethodGet, "http://"+addr+"/", nil)
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if b := mustBody(t, resp); b != "ok" {
			t.Fatalf("body %q", b)
		}
		if i == 0 {
			<-closed
			// The FIN reaches the client's socket at once over loopback;
			// wait for it without sleeping on a guess.
			waitPeerClosed(t, tr, addr)
		}
	}
	if fmt.Sprint(reused) != "[false false]" || accepted.Load() != 2 {
		t.Fatalf("reused %v, accepted %d: want a new connection for the second request", reused, accepted.Load())
	}
}

// waitPeerClosed waits until the idle connection to addr has seen its
// peer's close.
func waitPeerClosed(t *testing.T, tr *Transport, addr string) {
	t.Helper()
	tr.mu.Lock()
	c := tr.idle[addr][0]
	tr.mu.Unlock()
	sc := c.nc.(*net.TCPConn)
	rc, _ := sc.SyscallConn()
	// A blocking wait for readability: the FIN makes the socket readable.
	var b [1]byte
	_ = rc.Read(func(fd uintptr) bool {
		_, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		return !errors.Is(err, syscall.EAGAIN)
	})
}

// TestIdleConnectionsExpireOnTheClock: an idle connection older than
// IdleTimeout is neither used nor kept, by the clock the transport reads.
func TestIdleConnectionsExpireOnTheClock(t *testing.T) {
	s, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })
	now := time.Unix(1000, 0)
	tr := newTransport(t)
	tr.IdleTimeout = time.Hour // the sweep timer never fires in the test
	tr.now = func() time.Time { return now }
	addr := s.Listener.Addr().String()
	for i := range 3 {
		resp, err := get(t, tr, s.URL)
		if err != nil {
			t.Fatal(err)
		}
		mustBody(t, resp)
		if i == 0 {
			now = now.Add(59 * time.Minute) // still fresh: reused
		}
		if i == 1 {
			now = now.Add(time.Hour) // expired: a new connection
		}
	}
	if n := conns.Load(); n != 2 {
		t.Fatalf("connections %d, want 2 (the expired one replaced)", n)
	}
	if n := tr.idleCount(addr); n != 1 {
		t.Fatalf("idle %d, want 1", n)
	}
	now = now.Add(time.Hour)
	tr.sweepIdle()
	if n := tr.idleCount(addr); n != 0 {
		t.Fatalf("idle %d after the sweep, want 0", n)
	}
	tr.Close()
}

// TestMaxIdlePerHostKeepsTheNewest closes the oldest idle connection past
// the bound.
func TestMaxIdlePerHostKeepsTheNewest(t *testing.T) {
	hold := make(chan struct{})
	var started sync.WaitGroup
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		started.Done()
		<-hold
		_, _ = io.WriteString(w, "ok")
	})
	tr := newTransport(t)
	tr.MaxIdlePerHost = 2
	var wg sync.WaitGroup
	started.Add(3)
	for range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := get(t, tr, s.URL)
			if err != nil {
				t.Error(err)
				return
			}
			mustBody(t, resp)
		}()
	}
	started.Wait()
	close(hold)
	wg.Wait()
	if n := tr.idleCount(s.Listener.Addr().String()); n != 2 {
		t.Fatalf("idle %d, want 2", n)
	}
}

// TestResponseHeaderTimeout fails a request whose head does not come in
// time, and the error says so.
func TestResponseHeaderTimeout(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	tr := newTransport(t)
	tr.ResponseHeaderTimeout = 50 * time.Millisecond
	if _, err := get(t, tr, s.URL); err == nil || !strings.Contains(err.Error(), "timeout awaiting response headers") {
		t.Fatalf("err %v", err)
	}
}

// TestHeadTooLarge fails a head over MaxResponseHeaderBytes.
func TestHeadTooLarge(t *testing.T) {
	addr := cannedServer(t, "HTTP/1.1 200 OK\r\nX-Big: "+strings.Repeat("a", 4096)+"\r\n\r\n")
	tr := newTransport(t)
	tr.MaxResponseHeaderBytes = 1024
	if _, err := get(t, tr, "http://"+addr+"/"); !errors.Is(err, errHeaderTooLarge) {
		t.Fatalf("err %v", err)
	}
	tr.MaxResponseHeaderBytes = 0 // 10 MiB
	resp, err := get(t, tr, "http://"+addr+"/")
	if err != nil || len(resp.Header.Get("X-Big")) != 4096 {
		t.Fatalf("with the default bound: %v", err)
	}
}

// TestAnswerBeforeTheBodyIsRead returns a server's early answer (a 413
// sent before reading a large body, then a close) instead of the failed
// write.
func TestAnswerBeforeTheBodyIsRead(t *testing.T) {
	addr := rawServer(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		tp := textproto.NewReader(br)
		_, _ = tp.ReadLine()
		_, _ = tp.ReadMIMEHeader()
		_, _ = io.WriteString(c, "HTTP/1.1 413 Request Entity Too Large\r\nContent-Length: 8\r\nConnection: close\r\n\r\ntoo big!")
		_ = c.(*net.TCPConn).CloseWrite()
		// Read a little, then stop reading and close with data unread:
		// the client's write fails (a reset) while it still has body to send.
		_, _ = br.Read(make([]byte, 1024))
	})
	tr := newTransport(t)
	req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/", bytes.NewReader(make([]byte, 8<<20)))
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatalf("err %v, want the 413", err)
	}
	if resp.StatusCode != 413 || mustBody(t, resp) != "too big!" || !resp.Close {
		t.Fatalf("status %d close %v", resp.StatusCode, resp.Close)
	}
}

// TestCloseKeepsStreamsAndPoolsNothing: after Close (a reload), a stream
// in flight finishes and its connection is closed, not kept.
func TestCloseKeepsStreamsAndPoolsNothing(t *testing.T) {
	next := make(chan struct{})
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "a")
		w.(http.Flusher).Flush()
		<-next
		_, _ = io.WriteString(w, "b")
	})
	tr := newTransport(t)
	resp, err := get(t, tr, s.URL)
	if err != nil {
		t.Fatal(err)
	}
	tr.Close()
	close(next)
	if b := mustBody(t, resp); b != "ab" {
		t.Fatalf("body %q", b)
	}
	if n := tr.idleCount(s.Listener.Addr().String()); n != 0 {
		t.Fatalf("idle %d after Close", n)
	}
}

// TestStreamsWaitingForEventsHoldNoBuffer holds 50 streams between events
// through WaitReadable: no read buffer is held while they wait, and each
// next event arrives whole.
func TestStreamsWaitingForEventsHoldNoBuffer(t *testing.T) {
	const streams = 50
	next := make(chan struct{})
	s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: 1\n\n")
		w.(http.Flusher).Flush()
		<-next
		_, _ = io.WriteString(w, "data: 2\n\n")
	})
	tr := newTransport(t)
	tr.MaxIdlePerHost = streams
	base := buffersHeld.Load()
	var wg sync.WaitGroup
	errs := make(chan error, streams)
	for range streams {
		resp, err := get(t, tr, s.URL)
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 64)
		if n, err := resp.Body.Read(buf); err != nil || string(buf[:n]) != "data: 1\n\n" {
			t.Fatalf("first event %q %v", buf[:n], err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := resp.Body.(*body).WaitReadable(); err != nil {
				errs <- err
				return
			}
			b, err := io.ReadAll(resp.Body)
			if err != nil || string(b) != "data: 2\n\n" {
				errs <- fmt.Errorf("second event %q %v", b, err)
			}
		}()
	}
	// Every stream is parked in WaitReadable (or about to be): none holds
	// a buffer. Bounded: the goroutines get there within a scheduling round.
	deadline := time.Now().Add(10 * time.Second)
	for buffersHeld.Load() != base {
		if time.Now().After(deadline) {
			t.Fatalf("%d buffers held by streams waiting for an event", buffersHeld.Load()-base)
		}
		runtime.Gosched()
	}
	close(next)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if n := tr.idleCount(s.Listener.Addr().String()); n != streams {
		t.Fatalf("idle %d, want %d", n, streams)
	}
	if held := buffersHeld.Load() - base; held != 0 {
		t.Fatalf("%d buffers held after the streams ended", held)
	}
}

// TestWaitingAndReadingAnEventDoesNotAllocate: once a stream is warm,
// WaitReadable and Read of each chunked event allocate nothing.
func TestWaitingAndReadingAnEventDoesNotAllocate(t *testing.T) {
	if testing.Short() {
		t.Skip("allocation count")
	}
	event := []byte("c\r\ndata: token\n\r\n")
	next := make(chan struct{})
	addr := rawServer(t, func(c net.Conn) {
		_, _ = readRequest(t, bufio.NewReader(c))
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		for range next {
			if _, err := c.Write(event); err != nil {
				return
			}
		}
	})
	tr := newTransport(t)
	resp, err := get(t, tr, "http://"+addr+"/")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	defer close(next)
	b := resp.Body.(*body)
	buf := make([]byte, 256)
	one := func() {
		next <- struct{}{}
		if err := b.WaitReadable(); err != nil {
			t.Fatal(err)
		}
		if n, err := b.Read(buf); err != nil || string(buf[:n]) != "data: token\n" {
			t.Fatalf("event %q %v", buf[:n], err)
		}
	}
	one()
	if n := testing.AllocsPerRun(200, one); n != 0 {
		t.Fatalf("%.1f allocations per event, want 0", n)
	}
}

// TestConnectionCloseHeaderClosesTheConnection: a request whose header
// says "Connection: close" (not req.Close) is sent with it and its
// connection is not kept, as net/http's Transport does; dropping the
// header kept a connection its user asked to close.
func TestConnectionCloseHeaderClosesTheConnection(t *testing.T) {
	var sawClose atomic.Bool
	s, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		sawClose.Store(r.Close)
		_, _ = io.WriteString(w, "ok")
	})
	tr := newTransport(t)
	for range 2 {
		req, _ := http.NewRequest(http.MethodGet, s.URL, nil)
		req.Header.Set("Connection", "close")
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		if !resp.Close || mustBody(t, resp) != "ok" || !sawClose.Load() {
			t.Fatalf("resp.Close %v, server saw close %v", resp.Close, sawClose.Load())
		}
	}
	if conns.Load() != 2 || tr.idleCount(s.Listener.Addr().String()) != 0 {
		t.Fatalf("connections %d idle %d, want 2 and 0", conns.Load(), tr.idleCount(s.Listener.Addr().String()))
	}
}

// TestAnswerBeforeTheBodyIsReadOnAnOpenConnection: a server that answers
// (a 503 from a full queue) without reading a large body and without
// closing. net/http reads while it writes and returns the answer; writing
// first and reading after blocked on the full socket until the context
// ended.
func TestAnswerBeforeTheBodyIsReadOnAnOpenConnection(t *testing.T) {
	hold := make(chan struct{})
	addr := rawServer(t, func(c net.Conn) {
		tp := textproto.NewReader(bufio.NewReader(c))
		_, _ = tp.ReadLine()
		_, _ = tp.ReadMIMEHeader()
		_, _ = io.WriteString(c, "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")
		<-hold // neither reads nor closes
	})
	defer close(hold)
	tr := newTransport(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/", bytes.NewReader(make([]byte, 64<<20)))
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatalf("err %v, want the 503", err)
	}
	if resp.StatusCode != 503 || mustBody(t, resp) != "busy" || !resp.Close {
		t.Fatalf("status %d close %v", resp.StatusCode, resp.Close)
	}
	if n := tr.idleCount(addr); n != 0 {
		t.Fatalf("idle %d: a connection with a body half sent was kept", n)
	}
}
