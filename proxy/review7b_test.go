package proxy

import (
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"
)

// stream_timeout's timer is stopped once ServeHTTP returns, on every kind of
// request.
func TestReview7StreamTimeoutTimerStoppedAtReturn(t *testing.T) {
	up := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	clk := newFakeClock()
	const st = 7 * time.Minute
	p, err := New(Config{Transport: schemeTransport{http.DefaultTransport}, Balancer: addrBalancer{up.addr()}, Clock: clk, StreamTimeout: st})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for _, body := range []string{`{"model":"m","stream":true}`, `{"model":"m"}`, `not json`} {
		p.ServeHTTP(httptest.NewRecorder(), post(body))
		clk.mu.Lock()
		armed := slices.ContainsFunc(clk.timers, func(ft *fakeTimer) bool { return ft.active && ft.d == st })
		clk.mu.Unlock()
		if armed {
			t.Fatalf("%s: the stream_timeout timer is still armed after ServeHTTP returned", body)
		}
	}
}
