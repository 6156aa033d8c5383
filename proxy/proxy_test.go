package proxy

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// schemeTransport sets the URL scheme as Caddy's http transport does.
type schemeTransport struct{ rt http.RoundTripper }

func (s schemeTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r.URL.Scheme = "http"
	return s.rt.RoundTrip(r)
}

// listBalancer offers upstreams in order, skipping tried ones.
type listBalancer struct {
	addrs    []string
	released atomic.Int64
}

func (b *listBalancer) Pick(_ http.ResponseWriter, _ *http.Request, req PickRequest) (Upstream, error) {
	tried := req.Tried
	for _, a := range b.addrs {
		seen := false
		for _, t := range tried {
			seen = seen || t == a
		}
		if !seen {
			return Upstream{Addr: a, Done: func(*AttemptReport) { b.released.Add(1) }}, nil
		}
	}
	if len(b.addrs) == 0 {
		return Upstream{}, ErrNoUpstream
	}
	return Upstream{Addr: b.addrs[0], Done: func(*AttemptReport) { b.released.Add(1) }}, nil
}

// recordingObserver keeps what the proxy reports.
type recordingObserver struct {
	mu        sync.Mutex
	attempts  []AttemptReport
	events    int
	results   []Result
	retries   int
	exhausted int
	hedges    map[string]int
	stale     int
	changed   chan struct{} // closed and replaced at every report
}

// note wakes waitFor; the caller holds mu.
func (o *recordingObserver) note() {
	if o.changed != nil {
		close(o.changed)
	}
	o.changed = make(chan struct{})
}

// waitFor waits until cond, called with mu held, holds.
func (o *recordingObserver) waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		o.mu.Lock()
		ok := cond()
		if o.changed == nil {
			o.changed = make(chan struct{})
		}
		ch := o.changed
		o.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatal("condition not met within 5s")
		}
	}
}

func (o *recordingObserver) AttemptDone(a *AttemptReport) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.attempts = append(o.attempts, *a)
	o.note()
}
func (o *recordingObserver) EventRelayed() { o.mu.Lock(); o.events++; o.mu.Unlock() }
func (o *recordingObserver) Retry(string, AttemptOutcome) {
	o.mu.Lock()
	o.retries++
	o.mu.Unlock()
}
func (o *recordingObserver) RetryBudgetExhausted() { o.mu.Lock(); o.exhausted++; o.mu.Unlock() }
func (o *recordingObserver) Hedge(outcome string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.hedges == nil {
		o.hedges = map[string]int{}
	}
	o.hedges[outcome]++
	o.note()
}
func (o *recordingObserver) StaleConnection(string) {
	o.mu.Lock()
	o.stale++
	o.mu.Unlock()
}
func (o *recordingObserver) RequestDone(r *Result) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.results = append(o.results, *r)
	o.note()
}

func (o *recordingObserver) outcomes() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	var s []string
	for _, a := range o.attempts {
		s = append(s, a.Upstream+"="+a.Outcome.String())
	}
	return s
}

// upstream is a test upstream that counts calls and remembers bodies.
type upstream struct {
	*httptest.Server
	calls  atomic.Int64
	mu     sync.Mutex
	bodies [][]byte
}

func newUpstream(t *testing.T, h func(w http.ResponseWriter, r *http.Request)) *upstream {
	u := &upstream{}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.calls.Add(1)
		b, _ := io.ReadAll(r.Body)
		u.mu.Lock()
		u.bodies = append(u.bodies, b)
		u.mu.Unlock()
		h(w, r)
	}))
	t.Cleanup(u.Close)
	return u
}

func (u *upstream) addr() string { return strings.TrimPrefix(u.URL, "http://") }

// sseUpstream streams the given events, flushing after each.
func sseUpstream(events ...string) func(http.ResponseWriter, *http.Request) {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for _, e := range events {
			_, _ = io.WriteString(w, e)
			w.(http.Flusher).Flush()
		}
	}
}

const (
	chunkA   = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"},\"finish_reason\":null}]}\n\n"
	chunkB   = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"finish_reason\":null}]}\n\n"
	chunkEnd = "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n"
	done     = "data: [DONE]\n\n"
)

func newTestProxy(t *testing.T, cfg Config, ups ...*upstream) (*Proxy, *listBalancer, *recordingObserver) {
	t.Helper()
	b := &listBalancer{}
	for _, u := range ups {
		b.addrs = append(b.addrs, u.addr())
	}
	obs := &recordingObserver{}
	cfg.Transport = schemeTransport{http.DefaultTransport}
	cfg.Balancer = b
	cfg.Observer = obs
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p, b, obs
}

func post(body string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	return r
}

func TestStreamRelayedByteForByte(t *testing.T) {
	up := newUpstream(t, sseUpstream(": ping\n\n", chunkA, chunkB, chunkEnd, done))
	p, b, obs := newTestProxy(t, Config{}, up)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, post(`{"model":"m","stream":true}`))
	want := ": ping\n\n" + chunkA + chunkB + chunkEnd + done
	if got := w.Body.String(); got != want {
		t.Fatalf("body:\n%q\nwant\n%q", got, want)
	}
	if res.Outcome != OutcomeSuccess || res.Events != 5 || res.Attempts != 1 || res.Info.Model != "m" {
		t.Fatalf("result %+v", res)
	}
	if w.Header().Get("Cache-Control") != "no-cache" || w.Header().Get("X-Accel-Buffering") != "no" {
		t.Fatalf("SSE headers missing: %v", w.Header())
	}
	if b.released.Load() != 1 || obs.events != 5 {
		t.Fatalf("released %d, events %d", b.released.Load(), obs.events)
	}
}

func TestFailoverOn503SendsIdenticalBody(t *testing.T) {
	bad := newUpstream(t, func(w http.ResponseWriter, r *http.Request) { http.Error(w, `{"error":{}}`, 503) })
	good := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	p, b, obs := newTestProxy(t, Config{MaxAttempts: 2}, bad, good)
	body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"` + strings.Repeat("x", 300<<10) + `"}]}`
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, post(body))
	if w.Code != 200 || res.Outcome != OutcomeSuccess || res.Attempts != 2 || res.Upstream != good.addr() {
		t.Fatalf("code %d result %+v", w.Code, res)
	}
	want := sha256.Sum256([]byte(body))
	for _, u := range []*upstream{bad, good} {
		if len(u.bodies) != 1 || sha256.Sum256(u.bodies[0]) != want {
			t.Fatalf("upstream %s did not get the identical body", u.addr())
		}
	}
	if got := fmt.Sprint(obs.outcomes()); got != fmt.Sprintf("[%s=http_5xx %s=success]", bad.addr(), good.addr()) {
		t.Fatalf("attempt outcomes %s", got)
	}
	if b.released.Load() != 2 {
		t.Fatalf("released %d permits, want 2", b.released.Load())
	}
}

func TestUpstream4xxPassesThroughWithoutRetry(t *testing.T) {
	body := `{"error":{"message":"context too long","type":"BadRequestError","code":400}}`
	bad := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(400)
		_, _ = io.WriteString(w, body)
	})
	other := newUpstream(t, sseUpstream(chunkA, done))
	p, _, _ := newTestProxy(t, Config{MaxAttempts: 3}, bad, other)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, post(`{"stream":true}`))
	if w.Code != 400 || w.Body.String() != body || res.Outcome != OutcomeClientError {
		t.Fatalf("code %d body %q outcome %v", w.Code, w.Body, res.Outcome)
	}
	if bad.calls.Load() != 1 || other.calls.Load() != 0 {
		t.Fatalf("calls %d/%d, want 1/0", bad.calls.Load(), other.calls.Load())
	}
}

func TestAllAttemptsFailPassesLast5xx(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", "7")
		http.Error(w, "overloaded", 503)
	}
	a, b := newUpstream(t, h), newUpstream(t, h)
	p, _, _ := newTestProxy(t, Config{MaxAttempts: 2}, a, b)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, post(`{}`))
	if w.Code != 503 || w.Header().Get("Retry-After") != "7" || res.Outcome != OutcomeUpstreamError || res.Attempts != 2 {
		t.Fatalf("code %d headers %v result %+v", w.Code, w.Header(), res)
	}
}

func TestInbandErrorBeforeFirstEvent(t *testing.T) {
	errEv := func(code int) string {
		return fmt.Sprintf("data: {\"error\":{\"object\":\"error\",\"message\":\"boom\",\"type\":\"X\",\"code\":%d}}\n\n", code)
	}
	t.Run("5xx fails over", func(t *testing.T) {
		bad := newUpstream(t, sseUpstream(errEv(500)))
		good := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
		p, _, _ := newTestProxy(t, Config{}, bad, good)
		w := httptest.NewRecorder()
		res := p.ServeHTTP(w, post(`{"stream":true}`))
		if res.Outcome != OutcomeSuccess || w.Body.String() != chunkA+chunkEnd+done {
			t.Fatalf("outcome %v body %q", res.Outcome, w.Body)
		}
	})
	t.Run("4xx is returned as its status", func(t *testing.T) {
		bad := newUpstream(t, sseUpstream(errEv(400)))
		good := newUpstream(t, sseUpstream(chunkA, done))
		p, _, _ := newTestProxy(t, Config{}, bad, good)
		w := httptest.NewRecorder()
		res := p.ServeHTTP(w, post(`{"stream":true}`))
		if w.Code != 400 || res.Outcome != OutcomeClientError || good.calls.Load() != 0 {
			t.Fatalf("code %d outcome %v good calls %d", w.Code, res.Outcome, good.calls.Load())
		}
		if !strings.Contains(w.Body.String(), `"message":"boom"`) || w.Header().Get("Content-Type") != "application/json" {
			t.Fatalf("body %q", w.Body)
		}
	})
}

func TestTruncatedStreamEndsWithErrorEvent(t *testing.T) {
	up := newUpstream(t, sseUpstream(chunkA, chunkB))
	other := newUpstream(t, sseUpstream(chunkA, done))
	p, _, obs := newTestProxy(t, Config{}, up, other)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, post(`{"stream":true}`))
	body := w.Body.String()
	if !strings.HasPrefix(body, chunkA+chunkB+"data: {\"error\":") || strings.Contains(body, "[DONE]") {
		t.Fatalf("body %q", body)
	}
	if res.Outcome != OutcomeTruncated || other.calls.Load() != 0 {
		t.Fatalf("outcome %v, other upstream called %d times", res.Outcome, other.calls.Load())
	}
	if got := obs.outcomes(); len(got) != 1 || !strings.HasSuffix(got[0], "=truncated") {
		t.Fatalf("attempts %v", got)
	}
}

func TestFinishReasonWithoutDoneIsSuccess(t *testing.T) {
	up := newUpstream(t, sseUpstream(chunkA, chunkEnd))
	p, _, _ := newTestProxy(t, Config{}, up)
	w := httptest.NewRecorder()
	if res := p.ServeHTTP(w, post(`{"stream":true}`)); res.Outcome != OutcomeSuccess {
		t.Fatalf("outcome %v", res.Outcome)
	}
}

func TestNothingCommittedBeforeFirstDataEvent(t *testing.T) {
	release := make(chan struct{})
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(200)
		_, _ = io.WriteString(w, ": ping\n\n")
		w.(http.Flusher).Flush()
		await(t, release, "release")
		_, _ = io.WriteString(w, chunkA+done)
	})
	asked := make(chan struct{}, 16)
	p, err := New(Config{Transport: readSignal{rt: schemeTransport{http.DefaultTransport}, reads: asked},
		Balancer: &listBalancer{addrs: []string{up.addr()}}})
	if err != nil {
		t.Fatal(err)
	}
	w := &watchWriter{ResponseRecorder: httptest.NewRecorder()}
	served := serve(p, w, post(`{"stream":true}`))
	// The proxy asks for more after it has the headers and the comment.
	select {
	case <-asked:
	case <-time.After(5 * time.Second):
		t.Fatal("the proxy did not read the upstream body")
	}
	if w.wrote.Load() {
		t.Fatal("response written before the first data event")
	}
	close(release)
	if res := result(t, served); res.Outcome != OutcomeSuccess {
		t.Fatalf("outcome %v", res.Outcome)
	}
}

// readSignal signals each Read call on response bodies that has been
// preceded by one that returned bytes.
type readSignal struct {
	rt    http.RoundTripper
	reads chan struct{}
}

func (s readSignal) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := s.rt.RoundTrip(r)
	if err == nil {
		resp.Body = &signalReads{ReadCloser: resp.Body, reads: s.reads}
	}
	return resp, err
}

type signalReads struct {
	io.ReadCloser
	reads chan struct{}
	got   bool
}

func (b *signalReads) Read(p []byte) (int, error) {
	if b.got {
		b.reads <- struct{}{}
	}
	n, err := b.ReadCloser.Read(p)
	b.got = b.got || n > 0
	return n, err
}

type watchWriter struct {
	*httptest.ResponseRecorder
	wrote atomic.Bool
}

func (w *watchWriter) WriteHeader(c int) { w.wrote.Store(true); w.ResponseRecorder.WriteHeader(c) }
func (w *watchWriter) Write(b []byte) (int, error) {
	w.wrote.Store(true)
	return w.ResponseRecorder.Write(b)
}

func TestFirstByteTimeoutFailsOverThen504(t *testing.T) {
	started := make(chan struct{}, 2)
	hang := func(w http.ResponseWriter, r *http.Request) { started <- struct{}{}; <-r.Context().Done() }
	a, b := newUpstream(t, hang), newUpstream(t, hang)
	clk := clocktest.New(time.Time{})
	const fbt = 50 * time.Millisecond
	p, rel, obs := newTestProxy(t, Config{Clock: clk, FirstByteTimeout: fbt, MaxAttempts: 2}, a, b)
	w := httptest.NewRecorder()
	served := serve(p, w, post(`{"stream":true}`))
	for range 2 {
		select {
		case <-started:
		case <-time.After(5 * time.Second):
			t.Fatal("attempt never reached its upstream")
		}
		clk.WaitTimer(t, fbt)
		clk.Advance(fbt)
	}
	res := result(t, served)
	if w.Code != 504 || res.Outcome != OutcomeTimeout || a.calls.Load() != 1 || b.calls.Load() != 1 {
		t.Fatalf("code %d outcome %v calls %d/%d", w.Code, res.Outcome, a.calls.Load(), b.calls.Load())
	}
	if !strings.Contains(w.Body.String(), `"type":"timeout_error"`) {
		t.Fatalf("body %q", w.Body)
	}
	if got := obs.outcomes(); len(got) != 2 || !strings.HasSuffix(got[0], "first_byte_timeout") {
		t.Fatalf("attempts %v", got)
	}
	if rel.released.Load() != 2 {
		t.Fatalf("released %d", rel.released.Load())
	}
}

func TestIdleTimeoutAfterCommit(t *testing.T) {
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		sseUpstream(chunkA)(w, r)
		<-r.Context().Done()
	})
	clk := clocktest.New(time.Time{})
	const idle = 50 * time.Millisecond
	p, _, _ := newTestProxy(t, Config{Clock: clk, StreamIdleTimeout: idle}, up)
	w := httptest.NewRecorder()
	served := serve(p, w, post(`{"stream":true}`))
	clk.WaitTimer(t, idle)
	clk.Advance(idle)
	res := result(t, served)
	if res.Outcome != OutcomeIdleTimeout || !strings.Contains(w.Body.String(), `"code":"stream_idle_timeout"`) {
		t.Fatalf("outcome %v body %q", res.Outcome, w.Body)
	}
}

func TestClientGoneIsNeutralAndCancelsUpstream(t *testing.T) {
	upstreamDone := make(chan struct{})
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		sseUpstream(chunkA)(w, r)
		<-r.Context().Done()
		close(upstreamDone)
	})
	p, _, obs := newTestProxy(t, Config{}, up)
	ctx, cancel := context.WithCancel(context.Background())
	r := post(`{"stream":true}`).WithContext(ctx)
	w := &cancelOnWrite{ResponseRecorder: httptest.NewRecorder(), cancel: cancel}
	res := p.ServeHTTP(w, r)
	select {
	case <-upstreamDone:
	case <-time.After(2 * time.Second):
		t.Fatal("upstream request not cancelled")
	}
	if res.Outcome != OutcomeClientGone {
		t.Fatalf("outcome %v", res.Outcome)
	}
	if got := obs.outcomes(); len(got) != 1 || !strings.HasSuffix(got[0], "=canceled") {
		t.Fatalf("attempts %v", got)
	}
}

// cancelOnWrite ends the client's context once the first event is written.
type cancelOnWrite struct {
	*httptest.ResponseRecorder
	cancel context.CancelFunc
}

func (w *cancelOnWrite) Write(b []byte) (int, error) {
	n, err := w.ResponseRecorder.Write(b)
	w.cancel()
	return n, err
}

func TestRequestValidation(t *testing.T) {
	up := newUpstream(t, sseUpstream(chunkA, done))
	p, _, _ := newTestProxy(t, Config{MaxRequestBody: 1024}, up)
	cases := []struct {
		name string
		req  *http.Request
		code int
	}{
		{"invalid JSON", post(`{"model":`), 400},
		{"not an object", post(`[1,2]`), 400},
		{"declared length over limit", post(strings.Repeat("x", 2000)), 413},
		{"chunked over limit", func() *http.Request {
			r := post("")
			r.Body = io.NopCloser(bytes.NewReader(bytes.Repeat([]byte("x"), 2000)))
			r.ContentLength = -1
			return r
		}(), 413},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			w := httptest.NewRecorder()
			res := p.ServeHTTP(w, tc.req)
			if w.Code != tc.code || res.Outcome != OutcomeInvalidRequest {
				t.Fatalf("code %d outcome %v body %s", w.Code, res.Outcome, w.Body)
			}
			if !strings.Contains(w.Body.String(), `"type":"invalid_request_error"`) {
				t.Fatalf("body %s", w.Body)
			}
		})
	}
	if up.calls.Load() != 0 {
		t.Fatalf("upstream called %d times", up.calls.Load())
	}
}

func TestHopHeadersRemovedAndForwardedSet(t *testing.T) {
	var got http.Header
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		got = r.Header.Clone()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[]}`)
	})
	p, _, _ := newTestProxy(t, Config{}, up)
	r := post(`{}`)
	r.Header.Set("Authorization", "Bearer sk-1")
	r.Header.Set("Connection", "X-Private")
	r.Header.Set("X-Private", "1")
	r.Header.Set("Proxy-Authorization", "secret")
	r.Header.Set("X-Forwarded-For", "6.6.6.6")
	w := httptest.NewRecorder()
	p.ServeHTTP(w, r)
	if w.Code != 200 || w.Body.String() != `{"choices":[]}` {
		t.Fatalf("code %d body %q", w.Code, w.Body)
	}
	if got.Get("Authorization") != "Bearer sk-1" || got.Get("X-Private") != "" || got.Get("Proxy-Authorization") != "" {
		t.Fatalf("headers %v", got)
	}
	if got.Get("X-Forwarded-For") != "192.0.2.1" || got.Get("X-Forwarded-Proto") != "http" {
		t.Fatalf("untrusted peer's X-Forwarded-For must be replaced: %v", got)
	}
}

// closeSignal wraps response bodies and reports each Close.
type closeSignal struct {
	rt     http.RoundTripper
	closed chan struct{}
}

func (c closeSignal) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := c.rt.RoundTrip(r)
	if err == nil {
		resp.Body = &signalBody{ReadCloser: resp.Body, closed: c.closed}
	}
	return resp, err
}

type signalBody struct {
	io.ReadCloser
	closed chan struct{}
}

func (b *signalBody) Close() error {
	err := b.ReadCloser.Close()
	b.closed <- struct{}{}
	return err
}

func TestUpstreamConnectionReusedAfterDone(t *testing.T) {
	var newConns atomic.Int64
	up := &upstream{}
	answered := make(chan struct{}, 1)
	up.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sseUpstream(chunkA, chunkEnd, done)(w, r)
		// The chunked terminator follows [DONE] only once the client has
		// its answer, as from a server that flushes each event and then
		// finishes its handler.
		select {
		case <-answered:
		case <-time.After(5 * time.Second):
		}
	}))
	up.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			newConns.Add(1)
		}
	}
	up.Start()
	t.Cleanup(up.Close)
	closed := make(chan struct{}, 16)
	p, err := New(Config{
		Transport: closeSignal{rt: schemeTransport{http.DefaultTransport}, closed: closed},
		Balancer:  &listBalancer{addrs: []string{up.addr()}},
	})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		w := httptest.NewRecorder()
		if res := p.ServeHTTP(w, post(`{"stream":true}`)); res.Outcome != OutcomeSuccess {
			t.Fatalf("request %d: %v", i, res.Outcome)
		}
		answered <- struct{}{}
		select {
		case <-closed: // the background drain read the end and closed the body
		case <-time.After(3 * time.Second):
			t.Fatalf("request %d: the upstream body was never closed", i)
		}
	}
	if n := newConns.Load(); n != 1 {
		t.Fatalf("5 streams opened %d upstream connections, want 1 (reused)", n)
	}
}

func TestSlowBodyEndsAtStreamTimeoutWithoutUpstream(t *testing.T) {
	up := newUpstream(t, sseUpstream(chunkA, done))
	p, _, _ := newTestProxy(t, Config{StreamTimeout: 300 * time.Millisecond}, up)
	gw := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { p.ServeHTTP(w, r) }))
	defer gw.Close()
	// A real connection deadline: the body read is real I/O.
	pr, pw := io.Pipe()
	rest := make(chan struct{})
	defer close(rest)
	go func() {
		_, _ = pw.Write([]byte(`{"model":`))
		<-rest // the rest never comes in time
		_ = pw.Close()
	}()
	start := time.Now()
	resp, err := http.Post(gw.URL, "application/json", pr)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestTimeout || time.Since(start) > 1500*time.Millisecond {
		t.Fatalf("status %d after %v, want 408 at stream_timeout", resp.StatusCode, time.Since(start))
	}
	if up.calls.Load() != 0 {
		t.Fatalf("upstream called %d times", up.calls.Load())
	}
}

func TestInbandRateLimitBeforeFirstTokenIs429(t *testing.T) {
	ev := "data: {\"error\":{\"message\":\"slow down\",\"type\":\"RateLimitError\",\"code\":429}}\n\n"
	a, b := newUpstream(t, sseUpstream(ev)), newUpstream(t, sseUpstream(ev))
	p, _, obs := newTestProxy(t, Config{MaxAttempts: 2}, a, b)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, post(`{"stream":true}`))
	if w.Code != 429 || res.Outcome != OutcomeRateLimited || !strings.Contains(w.Body.String(), `"type":"rate_limit_error"`) {
		t.Fatalf("code %d outcome %v body %s", w.Code, res.Outcome, w.Body)
	}
	if got := obs.outcomes(); len(got) != 2 || !strings.HasSuffix(got[0], "=inband_error_429") {
		t.Fatalf("attempts %v: an in-band 429 is retried elsewhere first", got)
	}
}

func TestStreamTimeoutIsNotTheUpstreamsFault(t *testing.T) {
	if AttemptStreamTimeout.UpstreamFault() || AttemptStreamTimeout.Retryable() {
		t.Fatal("stream_timeout is the client's deadline: neither an upstream fault nor retryable")
	}
}
