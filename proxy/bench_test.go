package proxy

import (
	"bytes"
	"io"
	"net/http"
	"runtime"
	"strings"
	"testing"
)

// memTransport answers every request with an SSE body of n events from
// memory, so the benchmark measures the gateway, not the network.
type memTransport struct {
	stream []byte
}

func (m memTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	return &http.Response{
		StatusCode: 200,
		Header:     http.Header{"Content-Type": {"text/event-stream"}},
		Body:       io.NopCloser(bytes.NewReader(m.stream)),
		Request:    r,
	}, nil
}

// discardWriter is a flushing ResponseWriter that drops the body.
type discardWriter struct{ h http.Header }

func (d *discardWriter) Header() http.Header         { return d.h }
func (d *discardWriter) Write(b []byte) (int, error) { return len(b), nil }
func (d *discardWriter) WriteHeader(int)             {}
func (d *discardWriter) Flush()                      {}

type oneBalancer struct{}

func (oneBalancer) Pick(http.ResponseWriter, *http.Request, PickRequest) (Upstream, error) {
	return Upstream{Addr: "mem:1"}, nil
}

func benchStream(events int) []byte {
	var b strings.Builder
	for range events {
		b.WriteString(chunkA)
	}
	b.WriteString(chunkEnd + done)
	return []byte(b.String())
}

// BenchmarkRelay measures the relay path: one op is one streamed request
// of 1,000 events. It reports events/s and the marginal allocations per
// relayed event (allocations of a 1,000-event stream minus a 10-event one,
// divided by the difference), which steady state should hold at 0.
func BenchmarkRelay(b *testing.B) {
	const events = 1000
	run := func(n int) func() {
		p, err := New(Config{Transport: memTransport{benchStream(n)}, Balancer: oneBalancer{}})
		if err != nil {
			b.Fatal(err)
		}
		body := []byte(`{"model":"m","stream":true}`)
		return func() {
			r, _ := http.NewRequest(http.MethodPost, "http://gw/v1/chat/completions", bytes.NewReader(body))
			w := &discardWriter{h: http.Header{}}
			if res := p.ServeHTTP(w, r); res.Outcome != OutcomeSuccess {
				b.Fatalf("outcome %v", res.Outcome)
			}
		}
	}
	long, short := run(events), run(10)
	allocs := func(f func()) float64 {
		var m0, m1 runtime.MemStats
		runtime.ReadMemStats(&m0)
		for range 20 {
			f()
		}
		runtime.ReadMemStats(&m1)
		return float64(m1.Mallocs-m0.Mallocs) / 20
	}
	perEvent := (allocs(long) - allocs(short)) / float64(events-10)

	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		long()
	}
	b.ReportMetric(float64(events*b.N)/b.Elapsed().Seconds(), "events/s")
	b.ReportMetric(perEvent, "allocs/event")
}
