package proxy

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
	"github.com/llmproxy/caddy-llm-proxy/internal/h1"
)

// closingUpstream is a raw HTTP/1.1 server that answers the first request
// on each connection and closes the connection when a second one arrives
// on it, as uvicorn does with a keep-alive connection it is timing out.
func closingUpstream(t *testing.T) (addr string, requests *atomic.Int64) {
	return closingUpstreamAfter(t, 0)
}

// closingUpstreamAfter is closingUpstream whose second request on a
// connection is worked on for work before the connection dies.
func closingUpstreamAfter(t *testing.T, work time.Duration) (addr string, requests *atomic.Int64) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	requests = &atomic.Int64{}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				for n := 0; ; n++ {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					_, _ = io.Copy(io.Discard, req.Body)
					requests.Add(1)
					if n > 0 {
						time.Sleep(work) // the upstream at work, then it dies
						return           // closed as the request went out (work 0)
					}
					body := `{"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`
					_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "+
						itoa(len(body))+"\r\n\r\n"+body)
				}
			}()
		}
	}()
	return ln.Addr().String(), requests
}

func itoa(n int) string { return strconv.Itoa(n) }

func fmtInt(n int) string { return strconv.Itoa(n) }

// A request written onto a pooled connection that the upstream is closing
// reached the upstream: the transport does not send it again on its own.
// It fails as stale_connection (neutral for the breaker) and only the
// retry rules send it again, as a second attempt that is counted.
func TestRequestWrittenOnAClosingConnectionIsRetriedOnlyAsAnAttempt(t *testing.T) {
	d := &net.Dialer{}
	for _, tc := range []struct {
		name string
		rt   http.RoundTripper
	}{
		{"net/http", &http.Transport{}},
		{"h1", &h1.Transport{DialContext: d.DialContext}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr, requests := closingUpstream(t)
			t.Cleanup(func() { tc.rt.(interface{ CloseIdleConnections() }).CloseIdleConnections() })
			obs := &recordingObserver{}
			p, err := New(Config{Transport: schemeTransport{tc.rt}, Balancer: &listBalancer{addrs: []string{addr}}, Observer: obs})
			if err != nil {
				t.Fatal(err)
			}
			for i := range 2 { // the second request goes out on the pooled connection
				w := httptest.NewRecorder()
				res := p.ServeHTTP(w, post(`{"model":"m"}`))
				if res.Outcome != OutcomeSuccess || res.Attempts != i+1 || w.Code != 200 {
					t.Fatalf("request %d: outcome %v attempts %d code %d; attempts %v", i, res.Outcome, res.Attempts, w.Code, obs.outcomes())
				}
			}
			want := addr + "=success " + addr + "=stale_connection " + addr + "=success"
			if got := strings.Join(obs.outcomes(), " "); got != want {
				t.Fatalf("attempt reports %q, want %q", got, want)
			}
			if obs.stale != 1 || obs.retries != 1 || requests.Load() != 3 {
				t.Fatalf("stale connections %d, retries %d, upstream requests %d; want 1, 1 and 3", obs.stale, obs.retries, requests.Load())
			}
		})
	}
}

func TestUnavailableResponses(t *testing.T) {
	cases := []struct {
		name       string
		err        *UnavailableError
		code       string
		retryAfter string
		breaker    string
		outcome    Outcome
	}{
		{"every upstream busy", &UnavailableError{Busy: true, RetryAfter: 30e9, Reason: "all at max_requests"}, "upstreams_busy", "1", "", OutcomeNoUpstream},
		{"breakers open", &UnavailableError{CircuitOpen: true, RetryAfter: 5e9, Reason: "open"}, "circuit_open", "5", "open", OutcomeCircuitOpen},
		{"open wins over busy", &UnavailableError{CircuitOpen: true, Busy: true, RetryAfter: 2e9}, "circuit_open", "2", "open", OutcomeCircuitOpen},
		{"other", &UnavailableError{RetryAfter: 3e9}, "no_upstream", "3", "", OutcomeNoUpstream},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			bal := balancerFunc(func(PickRequest) (Upstream, error) { return Upstream{}, tc.err })
			p, _ := New(Config{Transport: http.DefaultTransport, Balancer: bal})
			w := httptest.NewRecorder()
			res := p.ServeHTTP(w, post(`{}`))
			if w.Code != 503 || res.Outcome != tc.outcome || !strings.Contains(w.Body.String(), `"code":"`+tc.code+`"`) ||
				w.Header().Get("Retry-After") != tc.retryAfter || w.Header().Get("X-Circuit-Breaker") != tc.breaker {
				t.Fatalf("code %d outcome %v headers %v body %s", w.Code, res.Outcome, w.Header(), w.Body)
			}
		})
	}
}

func TestUsageAndContentEventsReported(t *testing.T) {
	usage := func(p, c int) string {
		return "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":" + fmtInt(p) + ",\"completion_tokens\":" + fmtInt(c) + "}}\n\n"
	}
	t.Run("streamed usage chunk", func(t *testing.T) {
		up := newUpstream(t, sseUpstream(": ping\n\n", chunkA, chunkB, chunkEnd, usage(5, 3), done))
		p, _, _ := newTestProxy(t, Config{}, up)
		res := p.ServeHTTP(httptest.NewRecorder(), post(`{"stream":true}`))
		if res.Usage != (Usage{PromptTokens: 5, CompletionTokens: 3, Reported: true}) || res.ContentEvents != 4 || res.Events != 6 {
			t.Fatalf("usage %+v content events %d events %d", res.Usage, res.ContentEvents, res.Events)
		}
	})
	t.Run("cumulative usage on every chunk: the last counts", func(t *testing.T) {
		up := newUpstream(t, sseUpstream(usage(5, 1), usage(5, 2), usage(5, 3), done))
		p, _, _ := newTestProxy(t, Config{}, up)
		res := p.ServeHTTP(httptest.NewRecorder(), post(`{"stream":true}`))
		if res.Usage != (Usage{PromptTokens: 5, CompletionTokens: 3, Reported: true}) {
			t.Fatalf("usage %+v", res.Usage)
		}
	})
	t.Run("no usage", func(t *testing.T) {
		up := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
		p, _, _ := newTestProxy(t, Config{}, up)
		res := p.ServeHTTP(httptest.NewRecorder(), post(`{"stream":true}`))
		if res.Usage.Reported || res.ContentEvents != 2 {
			t.Fatalf("usage %+v content events %d", res.Usage, res.ContentEvents)
		}
	})
	t.Run("non-streaming body", func(t *testing.T) {
		up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"x"},"finish_reason":"stop"}],"usage":{"prompt_tokens":7,"completion_tokens":2}}`)
		})
		p, _, _ := newTestProxy(t, Config{}, up)
		res := p.ServeHTTP(httptest.NewRecorder(), post(`{}`))
		if res.Usage != (Usage{PromptTokens: 7, CompletionTokens: 2, Reported: true}) {
			t.Fatalf("usage %+v", res.Usage)
		}
	})
}

type testIdentifier struct{ err error }

func (i testIdentifier) Identify(r *http.Request, _ RequestInfo) (Identity, error) {
	return Identity{Tenant: r.Header.Get("X-Test-Tenant")}, i.err
}

type testAdmitter struct {
	err      error
	admitted atomic.Int64
	released atomic.Int64
	last     atomic.Pointer[Result]
}

func (a *testAdmitter) Admit(_ context.Context, id Identity, _ RequestInfo) (Admission, error) {
	if a.err != nil {
		return nil, a.err
	}
	a.admitted.Add(1)
	return admissionFunc(func(res *Result) { a.released.Add(1); a.last.Store(res) }), nil
}

type admissionFunc func(*Result)

func (f admissionFunc) Release(res *Result) { f(res) }

func TestAdmissionIsReleasedOnceWithUsage(t *testing.T) {
	up := newUpstream(t, sseUpstream(chunkA, chunkEnd, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2}}\n\n", done))
	adm := &testAdmitter{}
	p, _, _ := newTestProxy(t, Config{Identifier: testIdentifier{}, Admitter: adm}, up)
	r := post(`{"stream":true}`)
	r.Header.Set("X-Test-Tenant", "acme")
	res := p.ServeHTTP(httptest.NewRecorder(), r)
	if adm.admitted.Load() != 1 || adm.released.Load() != 1 {
		t.Fatalf("admitted %d released %d", adm.admitted.Load(), adm.released.Load())
	}
	got := adm.last.Load()
	if got.Identity.Tenant != "acme" || got.Usage.CompletionTokens != 2 || got.Outcome != OutcomeSuccess || res != got {
		t.Fatalf("released with %+v", got)
	}
}

func TestRefusalsAreWrittenWithoutCallingAnUpstream(t *testing.T) {
	limit := &GatewayError{Status: 429, Type: TypeRateLimit, Code: "tenant_rate_limited", Message: "requests per minute",
		RetryAfter: 7, Header: http.Header{"X-Ratelimit-Remaining-Requests": {"0"}}}
	cases := []struct {
		name    string
		cfg     Config
		code    int
		outcome Outcome
	}{
		{"identifier refuses", Config{Identifier: testIdentifier{err: &GatewayError{Status: 401, Type: TypeInvalidRequest, Code: "invalid_api_key"}}}, 401, OutcomeRefused},
		{"admitter refuses", Config{Admitter: &testAdmitter{err: limit}}, 429, OutcomeRefused},
		{"admitter fails", Config{Admitter: &testAdmitter{err: io.ErrUnexpectedEOF}}, 500, OutcomeInternalError},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			up := newUpstream(t, sseUpstream(chunkA, done))
			p, _, obs := newTestProxy(t, tc.cfg, up)
			w := httptest.NewRecorder()
			res := p.ServeHTTP(w, post(`{}`))
			if w.Code != tc.code || res.Outcome != tc.outcome || up.calls.Load() != 0 || len(obs.results) != 1 {
				t.Fatalf("code %d outcome %v upstream calls %d", w.Code, res.Outcome, up.calls.Load())
			}
			if tc.code == 429 && (w.Header().Get("Retry-After") != "7" || w.Header().Get("X-Ratelimit-Remaining-Requests") != "0") {
				t.Fatalf("headers %v", w.Header())
			}
		})
	}
}

// A reused connection that dies after the upstream worked on the request is
// the upstream's failure: it is not resent (that would run the generation
// twice) and counts against the upstream.
func TestConnectionDyingAfterTheUpstreamWorkedIsNotResent(t *testing.T) {
	addr, requests := closingUpstreamAfter(t, 300*time.Millisecond)
	pooled := &http.Transport{}
	t.Cleanup(pooled.CloseIdleConnections)
	obs := &recordingObserver{}
	p, err := New(Config{Transport: schemeTransport{pooled}, Balancer: &listBalancer{addrs: []string{addr}}, Observer: obs, MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		p.ServeHTTP(httptest.NewRecorder(), post(`{"model":"m"}`))
	}
	if obs.stale != 0 || requests.Load() != 2 {
		t.Fatalf("stale connections %d, upstream requests %d; want 0 and 2 (no resend)", obs.stale, requests.Load())
	}
	if got := strings.Join(obs.outcomes(), " "); got != addr+"=success "+addr+"=connect_error" {
		t.Fatalf("attempt reports %q, want success then connect_error", got)
	}
}

// abortBalancer panics with http.ErrAbortHandler on every pick.
type abortBalancer struct{}

func (abortBalancer) Pick(http.ResponseWriter, *http.Request, PickRequest) (Upstream, error) {
	panic(http.ErrAbortHandler)
}

// A step's http.ErrAbortHandler, raised on the step worker, still aborts
// the client's connection through net/http (it must reach net/http from
// ServeHTTP, on the handler's goroutine), and the process survives.
func TestAbortHandlerFromAStepAbortsTheConnection(t *testing.T) {
	p, err := New(Config{Transport: schemeTransport{http.DefaultTransport}, Balancer: abortBalancer{}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { p.ServeHTTP(w, r) }))
	defer front.Close()
	resp, err := http.Post(front.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m"}`))
	if err == nil {
		resp.Body.Close()
		t.Fatalf("status %d: the connection was not aborted", resp.StatusCode)
	}
	if !errors.Is(err, io.EOF) && !strings.Contains(err.Error(), "EOF") {
		t.Logf("client error: %v", err)
	}
}

// panicEvery panics on every third pick, else picks addr.
type panicEvery struct {
	addr string
	n    atomic.Int64
}

func (b *panicEvery) Pick(http.ResponseWriter, *http.Request, PickRequest) (Upstream, error) {
	if b.n.Add(1)%3 == 0 {
		panic("pick bug")
	}
	return Upstream{Addr: b.addr, Closed: true}, nil
}

// Many concurrent requests, streamed and not, some panicking before
// commit, some with their client gone: every ServeHTTP returns (or
// re-raises) and the workers settle (each path marks done exactly once: a
// miss hangs here, a double Done panics the process).
func TestConcurrentMixedPathsAllReturn(t *testing.T) {
	up := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	p, err := New(Config{Transport: schemeTransport{http.DefaultTransport}, Balancer: &panicEvery{addr: up.addr()},
		StreamTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var panics atomic.Int64
	for i := range 120 {
		wg.Go(func() {
			body := `{"model":"m","stream":true}`
			if i%2 == 0 {
				body = `{"model":"m"}`
			}
			r := post(body)
			if i%5 == 0 {
				ctx, cancel := contextWithCancel(r)
				cancel()
				r = r.WithContext(ctx)
			}
			defer func() {
				if recover() != nil {
					panics.Add(1)
				}
			}()
			p.ServeHTTP(httptest.NewRecorder(), r)
		})
	}
	ok := make(chan struct{})
	go func() { wg.Wait(); close(ok) }()
	select {
	case <-ok:
	case <-time.After(20 * time.Second):
		t.Fatal("a ServeHTTP never returned")
	}
	if panics.Load() == 0 {
		t.Fatal("no panic was re-raised")
	}
	_ = p.Close()
	waitFor(t, "the workers exit after Close", func() bool { return p.steps.live.Load() == 0 })
}

func contextWithCancel(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithCancel(r.Context())
}

// stream_timeout's timer is stopped once ServeHTTP returns, on every kind of
// request.
func TestStreamTimeoutTimerStoppedAtReturn(t *testing.T) {
	up := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	clk := clocktest.New(time.Time{})
	const st = 7 * time.Minute
	p, err := New(Config{Transport: schemeTransport{http.DefaultTransport}, Balancer: addrBalancer{up.addr()}, Clock: clk, StreamTimeout: st})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for _, body := range []string{`{"model":"m","stream":true}`, `{"model":"m"}`, `not json`} {
		p.ServeHTTP(httptest.NewRecorder(), post(body))
		if clk.ArmedFor(st) {
			t.Fatalf("%s: the stream_timeout timer is still armed after ServeHTTP returned", body)
		}
	}
}
