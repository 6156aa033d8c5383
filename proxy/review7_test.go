package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// abortBalancer panics with http.ErrAbortHandler on every pick.
type abortBalancer struct{}

func (abortBalancer) Pick(http.ResponseWriter, *http.Request, PickRequest) (Upstream, error) {
	panic(http.ErrAbortHandler)
}

// A step's http.ErrAbortHandler, raised on the step worker, still aborts
// the client's connection through net/http (it must reach net/http from
// ServeHTTP, on the handler's goroutine), and the process survives.
func TestReview7AbortHandlerFromAStepAbortsTheConnection(t *testing.T) {
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
func TestReview7ConcurrentMixedPathsAllReturn(t *testing.T) {
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
