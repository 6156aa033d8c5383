package proxy

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/internal/h1"
)

// rawUpstream answers every request on every connection with response, as
// it is, and closes.
func rawUpstream(t *testing.T, response string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				req, err := http.ReadRequest(bufio.NewReader(c))
				if err != nil {
					return
				}
				_, _ = io.Copy(io.Discard, req.Body)
				_, _ = io.WriteString(c, response)
			}()
		}
	}()
	return ln.Addr().String()
}

// upstreamClients are the two clients a handler may send http:// requests
// through (upstream_client builtin and net_http).
func upstreamClients(t *testing.T) map[string]http.RoundTripper {
	d := &net.Dialer{}
	hc, nh := &h1.Transport{DialContext: d.DialContext}, &http.Transport{}
	t.Cleanup(hc.CloseIdleConnections)
	t.Cleanup(nh.CloseIdleConnections)
	return map[string]http.RoundTripper{"builtin": hc, "net_http": nh}
}

// A malformed upstream response is its own failure class: the attempt's
// outcome is malformed_response (a failure of the upstream, retried), never
// connect_error, and the client's 502 says so in its code.
func TestMalformedUpstreamResponseIsItsOwnFailureClass(t *testing.T) {
	for name, resp := range map[string]string{
		"bad status line":         "HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n",
		"bad Content-Length":      "HTTP/1.1 200 OK\r\nContent-Length: 1x\r\n\r\n{}",
		"conflicting lengths":     "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
		"header without colon":    "HTTP/1.1 200 OK\r\nContent-Type application/json\r\n\r\n",
		"broken chunked encoding": "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\ndata: {}\n\n\r\n0\r\n\r\n",
		"bare LF chunk line":      "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n2\n{}\r\n0\r\n\r\n",
	} {
		for client, rt := range upstreamClients(t) {
			t.Run(name+"/"+client, func(t *testing.T) {
				addr := rawUpstream(t, resp)
				obs := &recordingObserver{}
				p, err := New(Config{Transport: schemeTransport{rt}, Balancer: &listBalancer{addrs: []string{addr}}, Observer: obs, MaxAttempts: 2})
				if err != nil {
					t.Fatal(err)
				}
				w := httptest.NewRecorder()
				res := p.ServeHTTP(w, post(`{"model":"m","stream":true}`))
				want := addr + "=malformed_response " + addr + "=malformed_response"
				if got := strings.Join(obs.outcomes(), " "); got != want {
					t.Fatalf("attempts %q, want %q", got, want)
				}
				if w.Code != 502 || res.Outcome != OutcomeUpstreamError || !strings.Contains(w.Body.String(), `"code":"malformed_response"`) {
					t.Fatalf("code %d outcome %v body %s", w.Code, res.Outcome, w.Body)
				}
				if !AttemptMalformedResponse.UpstreamFault() || !AttemptMalformedResponse.Retryable() {
					t.Fatal("malformed_response must count against the upstream and be retried")
				}
			})
		}
	}
}

// A client that sent no User-Agent has none sent to the upstream by either
// client (as Caddy's reverse_proxy), and one it sent is kept.
func TestNoUserAgentIsAddedForTheClient(t *testing.T) {
	for client, rt := range upstreamClients(t) {
		t.Run(client, func(t *testing.T) {
			var got []string
			var had bool
			up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
				got, had = r.Header["User-Agent"]
				w.Header().Set("Content-Type", "application/json")
				_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"x"},"finish_reason":"stop"}]}`)
			})
			p, err := New(Config{Transport: schemeTransport{rt}, Balancer: &listBalancer{addrs: []string{up.addr()}}})
			if err != nil {
				t.Fatal(err)
			}
			req := post(`{}`)
			req.Header.Del("User-Agent")
			if p.ServeHTTP(httptest.NewRecorder(), req); had {
				t.Fatalf("upstream got User-Agent %q", got)
			}
			req = post(`{}`)
			req.Header.Set("User-Agent", "openai-python/1.0")
			if p.ServeHTTP(httptest.NewRecorder(), req); len(got) != 1 || got[0] != "openai-python/1.0" {
				t.Fatalf("upstream got User-Agent %q", got)
			}
		})
	}
}
