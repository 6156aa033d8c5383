package proxy

import (
	"bytes"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// firstWriteRecorder signals once the first bytes reach the client.
type firstWriteRecorder struct {
	*httptest.ResponseRecorder
	once  sync.Once
	wrote chan struct{}
}

func (w *firstWriteRecorder) Write(b []byte) (int, error) {
	n, err := w.ResponseRecorder.Write(b)
	w.once.Do(func() { close(w.wrote) })
	return n, err
}

// goroutineStacks returns the stack of every goroutine, one string each.
func goroutineStacks() []string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Split(string(buf[:n]), "\n\n")
		}
		buf = make([]byte, 2*len(buf))
	}
}

// A held stream's relay runs on a goroutine of its own, not under the
// handler's frames, and the goroutine that ran the steps up to commit is
// gone: a goroutine keeps the largest stack it grew to, so this is what
// keeps a held stream at an 8 KB handler stack and a 4 KB relay stack
// instead of one 16 KB stack (ServeHTTP's comment; TestMemoryPerHeldStream
// measures it). The handler's goroutine only waits.
func TestHeldStreamRelaysOffTheHandlersGoroutine(t *testing.T) {
	release := make(chan struct{})
	var releaseOnce sync.Once
	// Released on every path: a failed check must not leave the upstream
	// (and httptest's Close) waiting for a minute.
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) })
	up := newUpstream(t, heldStream(release))
	p, err := New(Config{Transport: schemeTransport{http.DefaultTransport}, Balancer: addrBalancer{up.addr()}})
	if err != nil {
		t.Fatal(err)
	}
	w := &firstWriteRecorder{ResponseRecorder: httptest.NewRecorder(), wrote: make(chan struct{})}
	served := make(chan *Result)
	go func() { served <- p.ServeHTTP(w, post(`{"model":"m","stream":true}`)) }()
	select {
	case <-w.wrote:
	case <-time.After(10 * time.Second):
		t.Fatal("no event reached the client")
	}

	// The first write happens in commit, on the step worker, before it
	// starts the relay's goroutine and leaves run: wait until both have
	// happened rather than look at once (that raced, failing ~1 run in 8).
	var stacks []string
	deadline := time.Now().Add(5 * time.Second)
	for {
		stacks = goroutineStacks()
		relaying, inRun := false, false
		for _, g := range stacks {
			relaying = relaying || strings.Contains(g, "proxy.(*exchange).relay(")
			inRun = inRun || strings.Contains(g, "proxy.(*exchange).run(")
		}
		if (relaying && !inRun) || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	var handler, relay []string
	for _, g := range stacks {
		switch {
		case strings.Contains(g, "proxy.(*exchange).relay("):
			relay = append(relay, g)
		case strings.Contains(g, "proxy.(*Proxy).ServeHTTP("):
			handler = append(handler, g)
		}
		if strings.Contains(g, "proxy.(*exchange).run(") {
			t.Errorf("the steps' goroutine outlived the commit:\n%s", g)
		}
	}
	if len(relay) != 1 || len(handler) != 1 {
		t.Fatalf("%d goroutines relaying, %d in the handler; want 1 and 1", len(relay), len(handler))
	}
	if strings.Contains(relay[0], "ServeHTTP(") {
		t.Errorf("the relay runs under the handler's frames:\n%s", relay[0])
	}
	if !strings.Contains(handler[0], "sync.(*WaitGroup).Wait(") {
		t.Errorf("the handler's goroutine is not waiting for the lifecycle:\n%s", handler[0])
	}

	releaseOnce.Do(func() { close(release) })
	res := <-served
	if res.Outcome != OutcomeSuccess || !bytes.Contains(w.Body.Bytes(), []byte(done)) {
		t.Fatalf("outcome %v, body %q", res.Outcome, w.Body.String())
	}
}

type panicDoneObserver struct{ nopObserver }

func (panicDoneObserver) RequestDone(*Result) { panic("observer bug in RequestDone") }

// A panic in finish itself (here an observer's) is re-raised by ServeHTTP
// on the handler's goroutine, where Caddy recovers it, as a panic in any
// step is: finish runs on the lifecycle's goroutine, where it would end the
// process.
func TestPanicInFinishIsRaisedOnTheHandlersGoroutine(t *testing.T) {
	for _, body := range []string{`{"model":"m","stream":true}`, `{"model":"m"}`} {
		up := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
		p, err := New(Config{Transport: schemeTransport{http.DefaultTransport}, Balancer: addrBalancer{up.addr()},
			Observer: panicDoneObserver{}})
		if err != nil {
			t.Fatal(err)
		}
		var got any
		func() {
			defer func() { got = recover() }()
			p.ServeHTTP(httptest.NewRecorder(), post(body))
		}()
		if got != "observer bug in RequestDone" {
			t.Fatalf("%s: ServeHTTP raised %v, want the observer's panic", body, got)
		}
	}
}

// waitingStepWorkers returns how many of s's workers wait for a request
// (other tests' proxies have workers of their own).
func waitingStepWorkers(s *stepPool) int {
	n := 0
	work := fmt.Sprintf("proxy.(*stepPool).work(%p", s)
	for _, g := range goroutineStacks() {
		if strings.Contains(g, work) && strings.Contains(g, " [select") &&
			!strings.Contains(g, "proxy.(*exchange).run(") {
			n++
		}
	}
	return n
}

// waitFor waits until cond holds, failing the test after 5 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("still not: %s", what)
		}
		runtime.Gosched()
	}
}

// One request after another runs on one step worker, which keeps the
// stack it grew; a worker idle for stepWorkerIdle exits, and Close lets
// the idle ones go at once without refusing later requests.
func TestStepWorkersAreReusedAndLetGo(t *testing.T) {
	up := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	clk := clocktest.New(time.Time{})
	p, err := New(Config{Transport: schemeTransport{http.DefaultTransport}, Balancer: addrBalancer{up.addr()}, Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	serve := func() {
		t.Helper()
		w := httptest.NewRecorder()
		if res := p.ServeHTTP(w, post(`{"model":"m","stream":true}`)); res.Outcome != OutcomeSuccess {
			t.Fatalf("outcome %v: %s", res.Outcome, w.Body.String())
		}
	}
	for range 20 {
		serve()
		waitFor(t, "the worker waits again", func() bool { return p.steps.live.Load() == 1 && waitingStepWorkers(p.steps) == 1 })
	}

	clk.Advance(stepWorkerIdle - time.Millisecond)
	if n := p.steps.live.Load(); n != 1 {
		t.Fatalf("%d workers before the idle time is up, want 1", n)
	}
	clk.Advance(time.Millisecond)
	waitFor(t, "the idle worker exits", func() bool { return p.steps.live.Load() == 0 })

	serve()
	waitFor(t, "a new worker waits", func() bool { return waitingStepWorkers(p.steps) == 1 })
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "Close lets the worker go", func() bool { return p.steps.live.Load() == 0 })
	serve()
	waitFor(t, "a request after Close leaves no worker", func() bool { return p.steps.live.Load() == 0 })
}
