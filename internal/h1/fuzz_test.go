package h1

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptrace"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
)

// A script is what a scripted upstream answers, exchange by exchange, to
// a client over a real loopback socket. Its text is the bytes the upstream
// sends for each request, segments separated by segSep; a segment that
// ends in "<close>" or "<reset>" closes the connection after its bytes
// (a reset discards what the client has not read). The upstream writes
// each segment in pieces cut at random boundaries, with pauses between
// them, and closes a connection left idle for scriptIdle.
const (
	segSep     = "\n~~\n"
	scriptIdle = 150 * time.Millisecond
)

// Script flags.
const (
	flagHead      = 1 << iota // the second request is a HEAD
	flagLargeBody             // request bodies are 192 KiB (the answer watch runs)
	flagEarly                 // the upstream answers before reading the body
	flagSlowRead              // the client reads bodies 7 bytes at a time
	flagTinyBuf               // both clients read through 16-byte buffers
)

// exchange is what one client saw of one request.
type exchange struct {
	Status  int
	Header  http.Header
	Length  int64
	Body    string
	Trailer http.Header
	Err     bool
	// Reused is whether the request's first connection was a kept one;
	// Conns counts the connections it was sent on (net/http sends an
	// idempotent request again after a kept connection failed).
	Reused bool
	Conns  int
}

// scriptedUpstream serves a script on loopback; requests counts the
// requests it read.
type scriptedUpstream struct {
	ln       net.Listener
	segs     [][]byte
	rng      *rand.Rand
	early    bool
	mu       sync.Mutex
	requests int
	conns    map[net.Conn]bool
	wg       sync.WaitGroup
}

func startScripted(t testing.TB, script []byte, seed uint64, early bool) *scriptedUpstream {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &scriptedUpstream{ln: ln, segs: bytes.Split(script, []byte(segSep)), rng: rand.New(rand.NewPCG(seed, seed>>7)), early: early,
		conns: map[net.Conn]bool{}}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.mu.Lock()
			s.conns[c] = true
			s.mu.Unlock()
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				s.serve(c.(*net.TCPConn))
			}()
		}
	}()
	return s
}

// close stops the upstream: a connection still open (a write the client
// never reads, a client that keeps it idle) is closed too.
func (s *scriptedUpstream) close() {
	_ = s.ln.Close()
	s.mu.Lock()
	for c := range s.conns {
		_ = c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

// next takes the segment for the next request, and a random source for
// its pieces.
func (s *scriptedUpstream) next() ([]byte, []int, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := s.requests
	s.requests++
	if k >= len(s.segs) {
		return nil, nil, false
	}
	seg := s.segs[k]
	var cuts []int
	for i := 0; i < 4 && len(seg) > 1; i++ {
		cuts = append(cuts, s.rng.IntN(len(seg)))
	}
	return seg, cuts, true
}

func (s *scriptedUpstream) serve(c *net.TCPConn) {
	defer c.Close()
	br := bufio.NewReader(c)
	for {
		_ = c.SetReadDeadline(time.Now().Add(scriptIdle))
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		_ = c.SetReadDeadline(time.Time{})
		if !s.early {
			_, _ = io.Copy(io.Discard, req.Body)
		}
		seg, cuts, ok := s.next()
		if !ok {
			return
		}
		end := ""
		for _, d := range []string{"<close>", "<reset>"} {
			if bytes.HasSuffix(seg, []byte(d)) {
				seg, end = seg[:len(seg)-len(d)], d
			}
		}
		_ = c.SetWriteDeadline(time.Now().Add(time.Second))
		pos := 0
		for _, cut := range append(sortInts(cuts), len(seg)) {
			if cut <= pos {
				continue
			}
			if _, err := c.Write(seg[pos:cut]); err != nil {
				return
			}
			pos = cut
			time.Sleep(time.Millisecond)
		}
		if s.early {
			_ = c.SetReadDeadline(time.Now().Add(scriptIdle))
			_, _ = io.Copy(io.Discard, req.Body)
		}
		switch end {
		case "<close>":
			return
		case "<reset>":
			_ = c.SetLinger(0)
			return
		}
	}
}

func sortInts(v []int) []int {
	for i := range v {
		for j := i + 1; j < len(v); j++ {
			if v[j] < v[i] {
				v[i], v[j] = v[j], v[i]
			}
		}
	}
	return v
}

// runScript sends n requests through rt to a fresh scripted upstream and
// returns what it saw of each, and how many requests the upstream read.
func runScript(t testing.TB, rt http.RoundTripper, script []byte, seed uint64, n int, flags uint8) ([]exchange, int) {
	up := startScripted(t, script, seed, flags&flagEarly != 0)
	defer up.close()
	size := 64
	if flags&flagLargeBody != 0 {
		size = 192 << 10
	}
	var out []exchange
	for i := range n {
		method := http.MethodPost
		if i == 1 && flags&flagHead != 0 {
			method = http.MethodHead
		}
		out = append(out, doExchange(rt, "http://"+up.ln.Addr().String()+"/v1/chat/completions", method, size, flags&flagSlowRead != 0))
	}
	up.mu.Lock()
	defer up.mu.Unlock()
	return out, up.requests
}

func doExchange(rt http.RoundTripper, url, method string, size int, slow bool) exchange {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	var ex exchange
	ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) {
		if ex.Conns == 0 {
			ex.Reused = i.Reused
		}
		ex.Conns++
	}})
	var body io.Reader
	if method == http.MethodPost {
		body = bytes.NewReader(bytes.Repeat([]byte("p"), size))
	}
	req, _ := http.NewRequestWithContext(ctx, method, url, body)
	req.Header.Set("User-Agent", "")
	resp, err := rt.RoundTrip(req)
	if err != nil {
		ex.Err = true
		return ex
	}
	defer resp.Body.Close()
	var r io.Reader = resp.Body
	if slow {
		r = &smallReads{r: resp.Body}
	}
	b, err := io.ReadAll(r)
	ex.Status, ex.Header, ex.Length, ex.Body, ex.Trailer, ex.Err = resp.StatusCode, resp.Header, resp.ContentLength, string(b), resp.Trailer, err != nil
	return ex
}

// smallReads reads 7 bytes at a time: a slow reader.
type smallReads struct{ r io.Reader }

func (s *smallReads) Read(p []byte) (int, error) { return s.r.Read(p[:min(len(p), 7)]) }

// clients returns h1 and net/http set up alike: keep-alive, no
// compression, the same read buffer.
func clients(flags uint8) (*Transport, *http.Transport) {
	buf := 0
	if flags&flagTinyBuf != 0 {
		buf = 16
	}
	d := &net.Dialer{}
	return &Transport{DialContext: d.DialContext, ReadBufferSize: buf, MaxResponseHeaderBytes: 64 << 10},
		&http.Transport{DialContext: d.DialContext, ReadBufferSize: buf, DisableCompression: true, MaxResponseHeaderBytes: 64 << 10}
}

// stricter reports why h1 may refuse an exchange that net/http accepts,
// as RFC 9110/9112 allow, or "" when it may not:
//   - net/http sent the request again on a new connection after its kept
//     one failed (it does so for idempotent requests, here a HEAD): h1
//     never sends a written request again, the gateway's retry rules do
//     (RFC 9110 §9.2.2 allows an automatic retry, never requires it);
//   - 101 Switching Protocols: the gateway relays no upgraded connection;
//   - a status code below 100 (net/http reads "099" as 99): RFC 9110 §15
//     defines none.
func stricter(ref exchange) string {
	switch {
	case ref.Conns > 1:
		return "net/http resent an idempotent request"
	case ref.Status == http.StatusSwitchingProtocols:
		return "101 Switching Protocols is refused"
	case ref.Status > 0 && ref.Status < 100:
		return "a status code below 100 is refused"
	}
	return ""
}

// differ compares what h1 and net/http saw of one script, exchange by
// exchange, and returns the first disagreement that is not a documented
// strictness of h1.
func differ(got, want []exchange, gotReqs, wantReqs int) string {
	for i := range want {
		g, w := got[i], want[i]
		if (g.Err && !w.Err) || w.Conns > 1 {
			if why := stricter(w); why != "" {
				return "" // the rest follows from a different connection
			}
		}
		if !g.Err && w.Reused && !g.Reused {
			// net/http wrote onto a kept connection that h1 had judged
			// unusable (bytes past the last answer: a HEAD answered with
			// a body, a response smuggled after a Content-Length body).
			// Whether net/http's read loop saw those bytes first is a
			// race: losing it, net/http fails, or reads the smuggled
			// bytes as this answer. h1 dialled afresh and the upstream
			// answered that request; the rest follows from a different
			// connection.
			return ""
		}
		if g.Err && w.Err {
			// Both failed: h1 may stop sooner (refuse the head, or
			// deliver less of the body), never later.
			switch {
			case g.Status == 0:
				g.Status, g.Header, g.Length, g.Body, g.Trailer = w.Status, w.Header, w.Length, w.Body, w.Trailer
			case strings.HasPrefix(w.Body, g.Body):
				g.Body = w.Body
			}
		}
		if !reflect.DeepEqual(g, w) {
			return fmt.Sprintf("exchange %d:\n h1       %+v\n net/http %+v", i, g, w)
		}
	}
	if gotReqs != wantReqs {
		return fmt.Sprintf("upstream read %d requests from h1, %d from net/http", gotReqs, wantReqs)
	}
	return ""
}

// FuzzDifferential answers one script to h1 and to net/http's Transport
// over real loopback sockets and fails on any disagreement in status,
// headers, body, trailers, error-or-not, connection reuse or the requests
// the upstream read, except where h1 is documented as stricter (stricter).
// Its seed corpus (testdata/fuzz/FuzzDifferential) holds framing,
// smuggling and desync cases and every defect fixed in this package.
func FuzzDifferential(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello" + segSep + "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
		"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n0\r\n\r\n" + segSep + "HTTP/1.1 204 No Content\r\n\r\n",
	} {
		f.Add([]byte(s), uint64(1), uint8(2), uint8(0))
	}
	f.Fuzz(func(t *testing.T, script []byte, seed uint64, n uint8, flags uint8) {
		if len(script) > 16<<10 {
			return
		}
		n = n%3 + 1
		hc, nc := clients(flags)
		defer hc.Close()
		defer nc.CloseIdleConnections()
		got, gotReqs := runScript(t, hc, script, seed, int(n), flags)
		want, wantReqs := runScript(t, nc, script, seed, int(n), flags)
		if d := differ(got, want, gotReqs, wantReqs); d != "" {
			t.Fatalf("script %q flags %#x:\n%s", script, flags, d)
		}
	})
}

// TestScriptedUpstreamSplitsAndPauses: the harness itself cuts a segment
// into several writes (so the fuzzer exercises reads across boundaries).
func TestScriptedUpstreamSplitsAndPauses(t *testing.T) {
	hc, _ := clients(0)
	defer hc.Close()
	got, reqs := runScript(t, hc, []byte("HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello world"+segSep+"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n<close>"), 3, 3, 0)
	if got[0].Body != "hello world" || got[0].Reused || !got[1].Reused || got[1].Status != 200 || !got[2].Err || reqs != 3 {
		t.Fatalf("%+v, %d requests", got, reqs)
	}
	if !strings.Contains(fmt.Sprint(got[0].Header), "11") {
		t.Fatalf("header %v", got[0].Header)
	}
}
