package proxy

// Regression tests for defects found in review. Each comment says what the
// test asserts, then what the old bug was; each failed before its fix.

import (
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// slowClient blocks its second write until released, as a client that
// stops reading does.
type slowClient struct {
	*httptest.ResponseRecorder
	writes           int
	blocked, release chan struct{}
}

func (w *slowClient) Write(p []byte) (int, error) {
	w.writes++
	if w.writes == 2 {
		close(w.blocked)
		<-w.release
	}
	return w.ResponseRecorder.Write(p)
}

// A slow client is not the upstream's idle timeout: the idle timer is off
// while the gateway writes. The old bug: the timer ran while the gateway was
// blocked writing to a slow client, cancelled a healthy upstream and
// recorded idle_timeout, an upstream fault, on its breaker.
func TestSlowClientIsNotAnUpstreamIdleTimeout(t *testing.T) {
	rest := make(chan struct{})
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, chunkA+chunkB)
		w.(http.Flusher).Flush()
		await(t, rest, "rest")
		_, _ = io.WriteString(w, chunkEnd+done)
		w.(http.Flusher).Flush()
	})
	clk := clocktest.New(time.Time{})
	p, _, obs := newTestProxy(t, Config{Clock: clk, StreamIdleTimeout: 200 * time.Millisecond}, up)
	w := &slowClient{ResponseRecorder: httptest.NewRecorder(), blocked: make(chan struct{}), release: make(chan struct{})}
	served := serve(p, w, post(`{"model":"m","stream":true}`))
	await(t, w.blocked, "second write")
	clk.Advance(time.Minute) // the client takes a minute to read one event
	close(w.release)
	close(rest)
	res := result(t, served)
	if res.Outcome != OutcomeSuccess {
		t.Fatalf("outcome %v, attempts %v: a slow client was blamed on the upstream", res.Outcome, obs.outcomes())
	}
}

// panicBalancer panics on the hedge pick, as a third-party selection policy might.
type panicBalancer struct {
	released atomic.Int64
	done     chan struct{}
	addr     string
}

func (b *panicBalancer) Pick(_ http.ResponseWriter, _ *http.Request, req PickRequest) (Upstream, error) {
	if req.Hedge {
		panic("selector bug")
	}
	return Upstream{Addr: b.addr, Closed: true, Done: func(*AttemptReport) {
		if b.released.Add(1) == 1 {
			close(b.done)
		}
	}}, nil
}

// A panic on the request goroutine while an attempt runs ends that attempt
// exactly once (its permit and in-flight count go back) and still reports
// the request. The old bug: the running attempt was never ended.
func TestPanicBeforeCommitReleasesRunningAttempts(t *testing.T) {
	started := make(chan struct{})
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		close(started)
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
			sseUpstream(chunkEnd, done)(w, r)
		}
	})
	b := &panicBalancer{addr: up.addr(), done: make(chan struct{})}
	clk := clocktest.New(time.Time{})
	obs := &recordingObserver{}
	p, err := New(Config{Transport: schemeTransport{http.DefaultTransport}, Balancer: b, MaxAttempts: 3, Clock: clk,
		Observer: obs, Hedging: &fakeHedging{delay: 20 * time.Millisecond, allow: true}})
	if err != nil {
		t.Fatal(err)
	}
	panicked := make(chan any, 1)
	go func() {
		defer func() { panicked <- recover() }() // Caddy's server recovers handler panics
		p.ServeHTTP(httptest.NewRecorder(), post(`{"model":"m","stream":true}`))
	}()
	await(t, started, "attempt started")
	clk.WaitTimer(t, 20*time.Millisecond)
	clk.Advance(20 * time.Millisecond)
	if v := <-panicked; v == nil {
		t.Fatal("the balancer's panic was swallowed")
	}
	await(t, b.done, "the running attempt's Done")
	obs.waitFor(t, func() bool { return len(obs.attempts) == 1 })
	if n := b.released.Load(); n != 1 {
		t.Fatalf("attempt Done called %d times after a panic, want 1", n)
	}
	if len(obs.results) != 1 || obs.results[0].Outcome != OutcomeInternalError {
		t.Fatalf("RequestDone after a panic: %+v", obs.results)
	}
}

// A retry that backs off gives its pick back even when the Upstream has no
// Done (documented optional, "when set"). The old bug: retry() called Done
// unconditionally and panicked on a nil func.
func TestRetryBackoffWithoutDoneCallback(t *testing.T) {
	bad := newUpstream(t, func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(503) })
	good := newUpstream(t, sseUpstream(chunkEnd, done))
	addrs := []string{bad.addr(), good.addr()}
	bal := balancerFunc(func(req PickRequest) (Upstream, error) { return Upstream{Addr: addrs[min(len(req.Tried), 1)]}, nil })
	clk := clocktest.New(time.Time{})
	const backoff = 10 * time.Millisecond
	p, err := New(Config{Transport: schemeTransport{http.DefaultTransport}, Balancer: bal, Clock: clk,
		Retries: &fakeRetries{allow: true, backoff: backoff}})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan any, 1)
	var res *Result
	go func() {
		defer func() { served <- recover() }()
		res = p.ServeHTTP(httptest.NewRecorder(), post(`{"model":"m","stream":true}`))
	}()
	clk.WaitTimer(t, backoff) // with the bug, the panic comes before the backoff is armed
	clk.Advance(backoff)
	if v := <-served; v != nil {
		t.Fatalf("panic: %v", v)
	}
	if res.Outcome != OutcomeSuccess || res.Upstream != good.addr() {
		t.Fatalf("result %+v", res)
	}
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

// A 429 with Retry-After: 30 from the only upstream is not retried, because
// the wait does not fit: the upstream's Retry-After reaches Backoff. The old
// bug: the proxy never passed it to Backoff and retried the same upstream at
// once, relying on the balancer's breaker, which may be off.
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

// ReadBody allocates by what arrives, not by the declared Content-Length.
// The old bug: a declared length just under the limit made ReadBody
// allocate the whole limit before a byte arrived (1 byte sent cost 16 MiB).
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

// A panic after commit ends the committed attempt exactly once, neutral for
// its breaker. The old bug: it ended with its zero outcome, AttemptSuccess,
// so the breaker recorded a success for a stream that never finished.
func TestPanicAfterCommitIsNeutral(t *testing.T) {
	up := newUpstream(t, sseUpstream(chunkA, chunkB, chunkEnd, done))
	var calls atomic.Int64
	var got atomic.Value
	bal := balancerFunc(func(req PickRequest) (Upstream, error) {
		return Upstream{Addr: up.addr(), Done: func(r *AttemptReport) { calls.Add(1); got.Store(r.Outcome) }}, nil
	})
	p, _ := New(Config{Transport: schemeTransport{http.DefaultTransport}, Balancer: bal, Observer: panicObserver{}})
	func() {
		defer func() { _ = recover() }()
		p.ServeHTTP(httptest.NewRecorder(), post(`{"model":"m","stream":true}`))
	}()
	if n := calls.Load(); n != 1 {
		t.Fatalf("Done called %d times, want exactly 1", n)
	}
	if o := got.Load().(AttemptOutcome); o == AttemptSuccess || o.UpstreamFault() {
		t.Fatalf("attempt that panicked mid-relay reported %v to the breaker, want a neutral outcome", o)
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
