package proxy

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// stream_timeout's timer is stopped once ServeHTTP returns, on every kind of
// request.
func TestReview7StreamTimeoutTimerStoppedAtReturn(t *testing.T) {
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
