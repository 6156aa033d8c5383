package proxy

// Regression tests for defects found in review: each failed before its fix.

import (
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

// slowClient blocks on its second write, as a client that stops reading does.
type slowClient struct {
	*httptest.ResponseRecorder
	writes int
	delay  time.Duration
}

func (w *slowClient) Write(p []byte) (int, error) {
	w.writes++
	if w.writes == 2 {
		time.Sleep(w.delay)
	}
	return w.ResponseRecorder.Write(p)
}

// The idle timer runs while the gateway is blocked writing to a slow
// client; it then cancels a healthy upstream (gaps ≤ 100ms < idle 200ms)
// and records idle_timeout, an upstream fault, on its breaker.
func TestSlowClientIsNotAnUpstreamIdleTimeout(t *testing.T) {
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, chunkA+chunkB)
		w.(http.Flusher).Flush()
		time.Sleep(100 * time.Millisecond)
		_, _ = io.WriteString(w, chunkEnd+done)
		w.(http.Flusher).Flush()
	})
	p, _, obs := newTestProxy(t, Config{StreamIdleTimeout: 200 * time.Millisecond}, up)
	w := &slowClient{ResponseRecorder: httptest.NewRecorder(), delay: 400 * time.Millisecond}
	res := p.ServeHTTP(w, post(`{"model":"m","stream":true}`))
	if res.Outcome != OutcomeSuccess {
		t.Fatalf("outcome %v, attempts %v: a slow client was blamed on the upstream (fault=%v)",
			res.Outcome, obs.outcomes(), obs.attempts[0].Outcome.UpstreamFault())
	}
}

// panicBalancer panics on the hedge pick, as a third-party selection policy might.
type panicBalancer struct {
	released atomic.Int64
	addr     string
}

func (b *panicBalancer) Pick(_ http.ResponseWriter, _ *http.Request, req PickRequest) (Upstream, error) {
	if req.Hedge {
		panic("selector bug")
	}
	return Upstream{Addr: b.addr, Closed: true, Done: func(*AttemptReport) { b.released.Add(1) }}, nil
}

// A panic on the request goroutine while an attempt runs leaves that
// attempt un-ended: its breaker permit and in-flight count are never given back.
func TestPanicBeforeCommitReleasesRunningAttempts(t *testing.T) {
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(200 * time.Millisecond)
		sseUpstream(chunkEnd, done)(w, r)
	})
	b := &panicBalancer{addr: up.addr()}
	p, err := New(Config{Transport: schemeTransport{http.DefaultTransport}, Balancer: b, MaxAttempts: 3,
		Hedging: &fakeHedging{delay: 20 * time.Millisecond, allow: true}})
	if err != nil {
		t.Fatal(err)
	}
	func() {
		defer func() { _ = recover() }() // Caddy's server recovers handler panics
		p.ServeHTTP(httptest.NewRecorder(), post(`{"model":"m","stream":true}`))
	}()
	time.Sleep(time.Second)
	if n := b.released.Load(); n != 1 {
		t.Fatalf("attempt Done called %d times after a panic, want 1", n)
	}
}

// Upstream.Done is documented optional ("when set"), but retry() calls it
// unconditionally when it backs off.
func TestRetryBackoffWithoutDoneCallback(t *testing.T) {
	bad := newUpstream(t, func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(503) })
	good := newUpstream(t, sseUpstream(chunkEnd, done))
	addrs := []string{bad.addr(), good.addr()}
	bal := balancerFunc(func(req PickRequest) (Upstream, error) { return Upstream{Addr: addrs[min(len(req.Tried), 1)]}, nil })
	p, err := New(Config{Transport: schemeTransport{http.DefaultTransport}, Balancer: bal,
		Retries: &fakeRetries{allow: true, backoff: 10 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if v := recover(); v != nil {
			t.Fatalf("panic: %v", v)
		}
	}()
	p.ServeHTTP(httptest.NewRecorder(), post(`{"model":"m","stream":true}`))
}

type balancerFunc func(PickRequest) (Upstream, error)

func (f balancerFunc) Pick(_ http.ResponseWriter, _ *http.Request, req PickRequest) (Upstream, error) {
	return f(req)
}

// raRetries honours the retryAfter it is given.
type raRetries struct{ seen atomic.Int64 }

func (*raRetries) Request()       {}
func (*raRetries) TryRetry() bool { return true }
func (r *raRetries) Backoff(n int, retryAfter, remaining time.Duration) (time.Duration, bool) {
	r.seen.Store(int64(retryAfter))
	if retryAfter > 2*time.Second {
		return 0, false
	}
	return max(retryAfter, time.Millisecond), true
}

// A 429 with Retry-After: 30 is retried on the same (only) upstream at once:
// the proxy never passes the upstream's Retry-After to Backoff; it relies on
// the balancer's breaker, which may be off.
func TestRetryAfterHonouredWhenRetryingTheSameUpstream(t *testing.T) {
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", "30")
		w.WriteHeader(http.StatusTooManyRequests)
	})
	rr := &raRetries{}
	p, _, _ := newTestProxy(t, Config{Retries: rr}, up)
	res := p.ServeHTTP(httptest.NewRecorder(), post(`{"model":"m"}`))
	if c := up.calls.Load(); c != 1 {
		t.Fatalf("upstream that asked for 30s got %d calls within %v (Backoff saw retryAfter=%v); status %d",
			c, res.Duration, time.Duration(rr.seen.Load()), res.Status)
	}
}

type tinyBody struct{ sent bool }

func (b *tinyBody) Read(p []byte) (int, error) {
	if b.sent {
		return 0, io.ErrUnexpectedEOF // the client hangs up (or stalls) after a byte
	}
	b.sent = true
	p[0] = '{'
	return 1, nil
}

// A declared Content-Length just under the limit makes ReadBody allocate the
// whole limit before a byte arrives: 1 byte sent costs 16 MiB of heap.
func TestReadBodyDoesNotTrustDeclaredLength(t *testing.T) {
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
	r.Body = io.NopCloser(&tinyBody{})
	r.ContentLength = DefaultMaxRequestBody
	allocs := testing.Benchmark(func(b *testing.B) {
		b.ReportAllocs()
		for range b.N {
			r.Body = io.NopCloser(&tinyBody{})
			_, _ = ReadBody(r, DefaultMaxRequestBody)
		}
	}).AllocedBytesPerOp()
	if allocs > 1<<20 {
		t.Fatalf("ReadBody allocated %d bytes for a 1-byte body", allocs)
	}
}

type panicObserver struct{ nopObserver }

func (panicObserver) EventRelayed() { panic("observer bug") }

// A panic after commit ends the attempt with its zero outcome, AttemptSuccess,
// so the breaker records a success for a stream that was never finished.
func TestPanicAfterCommitIsNeutral(t *testing.T) {
	up := newUpstream(t, sseUpstream(chunkA, chunkB, chunkEnd, done))
	var got atomic.Value
	bal := balancerFunc(func(req PickRequest) (Upstream, error) {
		return Upstream{Addr: up.addr(), Done: func(r *AttemptReport) { got.Store(r.Outcome) }}, nil
	})
	p, _ := New(Config{Transport: schemeTransport{http.DefaultTransport}, Balancer: bal, Observer: panicObserver{}})
	func() {
		defer func() { _ = recover() }()
		p.ServeHTTP(httptest.NewRecorder(), post(`{"model":"m","stream":true}`))
	}()
	if o := got.Load(); o == AttemptSuccess {
		t.Fatalf("attempt that panicked mid-relay reported %v to the breaker", o)
	}
}

// panicTransport panics in RoundTrip, as a bug in the gateway would.
type panicTransport struct{}

func (panicTransport) RoundTrip(*http.Request) (*http.Response, error) { panic("transport bug") }

// A panic inside an attempt is the gateway's fault: retried, answered with
// 502, and neutral for the upstream.
func TestPanicInAttemptIsNeutralForTheUpstream(t *testing.T) {
	var outcomes []AttemptOutcome
	bal := balancerFunc(func(req PickRequest) (Upstream, error) {
		return Upstream{Addr: "u:1", Done: func(r *AttemptReport) { outcomes = append(outcomes, r.Outcome) }}, nil
	})
	p, _ := New(Config{Transport: panicTransport{}, Balancer: bal, MaxAttempts: 2})
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, post(`{}`))
	if w.Code != 502 || res.Attempts != 2 || len(outcomes) != 2 || outcomes[0].UpstreamFault() {
		t.Fatalf("code %d attempts %d outcomes %v", w.Code, res.Attempts, outcomes)
	}
}
