package h1

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
)

// BenchmarkStream sends one streamed request (a 10-event SSE response over
// loopback) per op through internal/h1 and through net/http's Transport
// configured as the gateway's default (1 KiB buffers), for allocations and
// bytes per request side by side.
func BenchmarkStream(b *testing.B) {
	events := bytes.Repeat([]byte("data: {\"choices\":[{\"delta\":{\"content\":\"tok\"}}]}\n\n"), 10)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = w.Write(events)
	}))
	defer srv.Close()
	body := []byte(`{"model":"m","stream":true,"messages":[{"role":"user","content":"hello"}]}`)
	d := &net.Dialer{}
	for _, tc := range []struct {
		name string
		rt   http.RoundTripper
	}{
		{"h1", &Transport{DialContext: d.DialContext, ReadBufferSize: 1 << 10, MaxIdlePerHost: 4}},
		{"net_http", &http.Transport{DialContext: d.DialContext, ReadBufferSize: 1 << 10, WriteBufferSize: 1 << 10,
			MaxIdleConnsPerHost: 4, DisableCompression: true}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			buf := make([]byte, 1<<10)
			b.ReportAllocs()
			for b.Loop() {
				req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/chat/completions", bytes.NewReader(body))
				resp, err := tc.rt.RoundTrip(req)
				if err != nil {
					b.Fatal(err)
				}
				for {
					if _, err := resp.Body.Read(buf); err != nil {
						break
					}
				}
				_ = resp.Body.Close()
			}
		})
	}
}
