package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/api"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// budgetSettles waits until b has nothing charged: a body's charge is given
// back by context.AfterFunc, in its own goroutine, once the request's
// context ends. It fails the test if that does not happen within 5s.
func budgetSettles(t *testing.T, b *BodyBudget) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for b.InUse() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("body budget still has %d bytes charged after the request ended", b.InUse())
		}
		runtime.Gosched()
	}
}

// readsCounted is a request body that counts the reads made of it.
type readsCounted struct {
	r     io.Reader
	reads int
}

func (b *readsCounted) Read(p []byte) (int, error) { b.reads++; return b.r.Read(p) }

func newBudget(t *testing.T, size int64) *BodyBudget {
	t.Helper()
	b, err := NewBodyBudget(size, DefaultBodyBudgetWait)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A body that does not fit the budget waits the budget's wait, then gets
// 503 with Retry-After and the gateway's error body, before a byte of it is
// read and with no upstream call.
func TestBodyBudgetFullRefuses503BeforeReading(t *testing.T) {
	up := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	clock := clocktest.New(time.Time{})
	budget := newBudget(t, 1000)
	if err := budget.acquire(context.Background(), clock, 900); err != nil {
		t.Fatal(err)
	}
	p, _, _ := newTestProxy(t, Config{BodyBudget: budget, Clock: clock}, up)
	body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"` + strings.Repeat("x", 100) + `"}]}`
	r := post(body)
	counted := &readsCounted{r: strings.NewReader(body)}
	r.Body = io.NopCloser(counted)
	w := httptest.NewRecorder()
	done := make(chan *Result)
	go func() { done <- p.ServeHTTP(w, r) }()
	clock.WaitTimer(t, DefaultBodyBudgetWait)
	clock.Advance(DefaultBodyBudgetWait)
	res := <-done
	if w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") != "1" {
		t.Fatalf("status %d Retry-After %q, want 503 with Retry-After 1", w.Code, w.Header().Get("Retry-After"))
	}
	if _, typ, code := errorFields(t, w.Body.Bytes()); code != "body_memory_exhausted" || typ != TypeServer {
		t.Fatalf("error type %q code %q, want server_error body_memory_exhausted", typ, code)
	}
	if counted.reads != 0 || up.calls.Load() != 0 || res.Outcome != OutcomeRefused {
		t.Fatalf("body reads %d, upstream calls %d, outcome %v: want the request refused unread", counted.reads, up.calls.Load(), res.Outcome)
	}
	budget.release(900)
	budgetSettles(t, budget)
}

// A body that waits is admitted as soon as room frees within the wait.
func TestBodyBudgetWaitAdmitsWhenRoomFrees(t *testing.T) {
	up := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	clock := clocktest.New(time.Time{})
	budget := newBudget(t, 1000)
	if err := budget.acquire(context.Background(), clock, 900); err != nil {
		t.Fatal(err)
	}
	p, _, _ := newTestProxy(t, Config{BodyBudget: budget, Clock: clock}, up)
	body := `{"model":"m","stream":true,"prompt":"` + strings.Repeat("y", 200) + `"}`
	w := httptest.NewRecorder()
	done := make(chan *Result)
	go func() { done <- p.ServeHTTP(w, post(body)) }()
	clock.WaitTimer(t, DefaultBodyBudgetWait)
	budget.release(900)
	res := <-done
	if w.Code != 200 || res.Outcome != OutcomeSuccess || !bytes.Equal(up.bodies[0], []byte(body)) {
		t.Fatalf("status %d outcome %v upstream body %q", w.Code, res.Outcome, up.bodies)
	}
	budgetSettles(t, budget)
}

// A body larger than the whole budget can never fit: 413 at once, no wait.
func TestBodyLargerThanBudgetIs413(t *testing.T) {
	up := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	budget := newBudget(t, 100)
	p, _, _ := newTestProxy(t, Config{BodyBudget: budget, Clock: clocktest.New(time.Time{})}, up)
	w := httptest.NewRecorder()
	p.ServeHTTP(w, post(`{"prompt":"`+strings.Repeat("z", 200)+`"}`))
	if w.Code != http.StatusRequestEntityTooLarge || up.calls.Load() != 0 {
		t.Fatalf("status %d, upstream calls %d; want 413 and none", w.Code, up.calls.Load())
	}
	budgetSettles(t, budget)
}

type panicInRelay struct{ nopObserver }

func (panicInRelay) EventRelayed() { panic("observer bug") }

// The body's charge is held while attempts run and given back on every
// path: success, failed attempts, a body over the limit found while
// reading, invalid JSON, the client gone mid-body, and a panic.
func TestBodyBudgetReleasedOnEveryPath(t *testing.T) {
	body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"hello"}]}`
	cases := []struct {
		name     string
		handler  func(http.ResponseWriter, *http.Request)
		req      func() *http.Request
		observer Observer
		status   int
	}{
		{name: "success", handler: sseUpstream(chunkA, chunkEnd, done), req: func() *http.Request { return post(body) }, status: 200},
		{name: "upstream 503 on every attempt", handler: func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(503) },
			req: func() *http.Request { return post(body) }, status: 503},
		{name: "over the limit, undeclared length", handler: sseUpstream(done), req: func() *http.Request {
			r := post(strings.Repeat(" ", 5000) + body)
			r.ContentLength = -1
			r.Body = io.NopCloser(&readsCounted{r: strings.NewReader(strings.Repeat(" ", 5000) + body)})
			return r
		}, status: 413},
		{name: "invalid JSON", handler: sseUpstream(done), req: func() *http.Request { return post(`{"model":`) }, status: 400},
		{name: "client gone mid-body", handler: sseUpstream(done), req: func() *http.Request {
			ctx, cancel := context.WithCancel(context.Background())
			r := post(body).WithContext(ctx)
			r.Body = io.NopCloser(io.MultiReader(strings.NewReader(`{"model":`), readerFunc(func([]byte) (int, error) {
				cancel()
				return 0, io.ErrUnexpectedEOF
			})))
			return r
		}, status: 200 /* nothing written */},
		{name: "panic after commit", handler: sseUpstream(chunkA, chunkEnd, done), req: func() *http.Request { return post(body) },
			observer: panicInRelay{}, status: 200},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			budget := newBudget(t, 1<<20)
			var charged int64
			up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
				charged = budget.InUse()
				tc.handler(w, r)
			})
			p, _, _ := newTestProxy(t, Config{BodyBudget: budget, MaxRequestBody: 4096}, up)
			if tc.observer != nil {
				p.obs = tc.observer
			}
			w := httptest.NewRecorder()
			func() {
				defer func() { _ = recover() }()
				p.ServeHTTP(w, tc.req())
			}()
			if w.Code != tc.status {
				t.Fatalf("status %d, want %d", w.Code, tc.status)
			}
			if up.calls.Load() > 0 && charged != int64(len(body)+usageSlack) {
				t.Fatalf("%d bytes charged while the upstream was called, want the body's buffer, %d", charged, len(body)+usageSlack)
			}
			budgetSettles(t, budget)
		})
	}
}

type readerFunc func([]byte) (int, error)

func (f readerFunc) Read(p []byte) (int, error) { return f(p) }

// errorFields decodes the gateway's OpenAI-shaped error body.
func errorFields(t *testing.T, body []byte) (message, typ, code string) {
	t.Helper()
	var e errorBody
	if err := json.Unmarshal(body, &e); err != nil {
		t.Fatalf("error body %q: %v", body, err)
	}
	return e.Error.Message, e.Error.Type, e.Error.Code
}

// A body of declared length is held in one buffer of its size: reading 4
// MiB allocates about 4 MiB (the 256 KiB first chunk and the Body aside),
// not the 2.5× that growing by append cost.
func TestReadBodyAllocatesDeclaredBodyOnce(t *testing.T) {
	payload := bytes.Repeat([]byte("a"), 4<<20)
	allocs := testing.Benchmark(func(b *testing.B) {
		b.ReportAllocs()
		for range b.N {
			r := httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(payload))
			got, err := ReadBody(r, DefaultMaxRequestBody)
			if err != nil || len(got) != len(payload) {
				b.Fatalf("read %d bytes, %v", len(got), err)
			}
		}
	}).AllocedBytesPerOp()
	if limit := int64(len(payload)) + firstChunk + 64<<10; allocs > limit {
		t.Fatalf("reading a %d-byte body allocated %d bytes, want at most %d", len(payload), allocs, limit)
	}
}

// A body of unknown length arrives whole and over-limit bodies are refused,
// whatever the read sizes.
func TestReadBodyUndeclaredLength(t *testing.T) {
	for _, n := range []int{0, 1, firstChunk - usageSlack, firstChunk - usageSlack + 1, 3 * firstChunk, 1000} {
		payload := bytes.Repeat([]byte("b"), n)
		for _, limit := range []int64{int64(n), int64(n) + 1, DefaultMaxRequestBody} {
			r := httptest.NewRequest(http.MethodPost, "/", nil)
			r.Body, r.ContentLength = io.NopCloser(iotestHalf{bytes.NewReader(payload)}), -1
			got, err := ReadBody(r, limit)
			if err != nil || !bytes.Equal(got, payload) {
				t.Fatalf("n %d limit %d: read %d bytes, %v", n, limit, len(got), err)
			}
		}
		if n == 0 {
			continue
		}
		r := httptest.NewRequest(http.MethodPost, "/", nil)
		r.Body, r.ContentLength = io.NopCloser(iotestHalf{bytes.NewReader(payload)}), -1
		if _, err := ReadBody(r, int64(n-1)); !errors.Is(err, ErrBodyTooLarge) {
			t.Fatalf("n %d over limit %d: %v, want ErrBodyTooLarge", n, n-1, err)
		}
	}
}

// iotestHalf returns at most 7 bytes per Read.
type iotestHalf struct{ r io.Reader }

func (h iotestHalf) Read(p []byte) (int, error) { return h.r.Read(p[:min(len(p), 7)]) }

// A body the matcher buffered is taken by llm_proxy as it is: not read or
// charged again, byte-identical upstream.
func TestBufferedBodyIsNotReadTwice(t *testing.T) {
	up := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	budget := newBudget(t, 1<<20)
	p, _, _ := newTestProxy(t, Config{BodyBudget: budget}, up)
	body := `{"model":"llama-70b","stream":true,"prompt":"hi"}`
	ctx, cancel := context.WithCancel(context.Background())
	r := post(body).WithContext(ctx)
	counted := &readsCounted{r: strings.NewReader(body)}
	r.Body = io.NopCloser(counted)
	b, err := BufferBody(ctx, r, BodyLimits{Limit: 1 << 20, Budget: budget})
	if err != nil {
		t.Fatal(err)
	}
	if info, err := b.Parse(api.Chat); err != nil || info.Model != "llama-70b" {
		t.Fatalf("parse %+v %v", info, err)
	}
	reads, charged := counted.reads, budget.InUse()
	w := httptest.NewRecorder()
	p.ServeHTTP(w, r)
	if w.Code != 200 || counted.reads != reads || !bytes.Equal(up.bodies[0], []byte(body)) {
		t.Fatalf("status %d, reads %d then %d, upstream body %q", w.Code, reads, counted.reads, up.bodies)
	}
	if charged != int64(len(body)+usageSlack) {
		t.Fatalf("charged %d, want %d", charged, len(body)+usageSlack)
	}
	cancel()
	budgetSettles(t, budget)
}

// A request that ends while its body waits for the budget is answered as
// one that waited for admission: 504 when stream_timeout ends it, nothing
// (client gone) when the client leaves; the body is never read.
func TestBodyBudgetWaitEndsWithTheRequest(t *testing.T) {
	for _, tc := range []struct {
		name    string
		timeout bool
		status  int
		outcome Outcome
	}{
		{name: "stream_timeout", timeout: true, status: http.StatusGatewayTimeout, outcome: OutcomeStreamTimeout},
		{name: "client gone", status: 200 /* nothing written */, outcome: OutcomeClientGone},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up := newUpstream(t, sseUpstream(done))
			clock := clocktest.New(time.Time{})
			budget := newBudget(t, 1000)
			if err := budget.acquire(context.Background(), clock, 1000); err != nil {
				t.Fatal(err)
			}
			p, _, _ := newTestProxy(t, Config{BodyBudget: budget, Clock: clock, StreamTimeout: 500 * time.Millisecond}, up)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			body := `{"model":"m"}`
			r := post(body).WithContext(ctx)
			counted := &readsCounted{r: strings.NewReader(body)}
			r.Body = io.NopCloser(counted)
			w := httptest.NewRecorder()
			done := make(chan *Result)
			go func() { done <- p.ServeHTTP(w, r) }()
			clock.WaitTimer(t, DefaultBodyBudgetWait)
			if tc.timeout {
				clock.Advance(500 * time.Millisecond)
			} else {
				cancel()
			}
			res := <-done
			if w.Code != tc.status || res.Outcome != tc.outcome || counted.reads != 0 || up.calls.Load() != 0 {
				t.Fatalf("status %d outcome %v, %d body reads, %d upstream calls; want %d %v and none", w.Code, res.Outcome, counted.reads, up.calls.Load(), tc.status, tc.outcome)
			}
			budget.release(1000)
			budgetSettles(t, budget)
		})
	}
}

// commitTransport answers with a stream whose events the test writes to
// pw, after reading the request's body whole as an upstream does; inUse
// is the body budget's charge while the round trip ran.
type commitTransport struct {
	pr     *io.PipeReader
	budget *BodyBudget
	inUse  chan int64
}

func (c commitTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	_, _ = io.Copy(io.Discard, r.Body)
	_ = r.Body.Close()
	c.inUse <- c.budget.InUse()
	return &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {"text/event-stream"}}, Body: c.pr, Request: r}, nil
}

// firstWriteWriter is a flushing writer that says when the first bytes
// reach the client.
type firstWriteWriter struct {
	discardWriter
	once  sync.Once
	wrote chan struct{}
}

func (w *firstWriteWriter) Write(b []byte) (int, error) {
	w.once.Do(func() { close(w.wrote) })
	return len(b), nil
}

// A committed stream gives its request body back at commit, not when it
// ends: its charge leaves the body budget while the stream still runs (no
// retry, hedge or fallback can send the body again).
func TestCommitReleasesTheRequestBody(t *testing.T) {
	budget, err := NewBodyBudget(1<<20, 0)
	if err != nil {
		t.Fatal(err)
	}
	pr, pw := io.Pipe()
	tr := commitTransport{pr: pr, budget: budget, inUse: make(chan int64, 1)}
	p, err := New(Config{Transport: tr, Balancer: oneBalancer{}, BodyBudget: budget})
	if err != nil {
		t.Fatal(err)
	}
	body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"` + strings.Repeat("x", 10000) + `"}]}`
	r, _ := http.NewRequest(http.MethodPost, "http://gw/v1/chat/completions", strings.NewReader(body))
	w := &firstWriteWriter{discardWriter: discardWriter{h: http.Header{}}, wrote: make(chan struct{})}
	duringStream := make(chan int64, 1)
	go func() {
		_, _ = pw.Write([]byte(chunkA))
		<-w.wrote // committed: the first event reached the client
		duringStream <- budget.InUse()
		_, _ = pw.Write([]byte(chunkEnd + done))
		_ = pw.Close()
	}()
	res := p.ServeHTTP(w, r)
	if res.Outcome != OutcomeSuccess {
		t.Fatalf("outcome %v", res.Outcome)
	}
	if n := <-tr.inUse; n < int64(len(body)) {
		t.Errorf("budget in use during the round trip: %d bytes, want at least the body's %d", n, len(body))
	}
	if n := <-duringStream; n != 0 {
		t.Errorf("budget in use while the committed stream runs: %d bytes, want 0", n)
	}
	if n := budget.InUse(); n != 0 {
		t.Errorf("budget in use after the request: %d bytes", n)
	}
}
