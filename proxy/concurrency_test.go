package proxy

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// concurrentStreamsEnv names the environment variable that turns on
// TestConcurrentStreams: the number of concurrent streams (e.g. 100).
const concurrentStreamsEnv = "LLM_PROXY_CONCURRENT_STREAMS"

// TestConcurrentStreams runs N concurrent streaming clients in-process
// against an upstream with a 20 ms TTFT and 10 events 20 ms apart, in
// interleaved rounds: directly, through llm_proxy at its defaults, through
// llm_proxy with tenants and a pool gate, and through
// httputil.ReverseProxy. It logs each target's TTFT p50/p99 and the added
// TTFT over direct. Every handler runs under the pprof label
// target=<name>, so that `go test -cpuprofile` / `-memprofile` of this test
// split by target (`go tool pprof -tagfocus target=llm_proxy`), and
// `-trace` shows the scheduling of a 100-stream run. It is a measurement,
// not a test: it runs only when LLM_PROXY_CONCURRENT_STREAMS is set
// (LLM_PROXY_ROUND=3s by default, LLM_PROXY_ROUNDS=2).
func TestConcurrentStreams(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv(concurrentStreamsEnv))
	if n <= 0 {
		t.Skipf("a measurement: set %s=100 to run it", concurrentStreamsEnv)
	}
	round, _ := time.ParseDuration(os.Getenv("LLM_PROXY_ROUND"))
	if round <= 0 {
		round = 3 * time.Second
	}
	rounds, _ := strconv.Atoi(os.Getenv("LLM_PROXY_ROUNDS"))
	if rounds <= 0 {
		rounds = 2
	}
	const ttft, gap, events = 20 * time.Millisecond, 20 * time.Millisecond, 10
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = r.Body.Read(make([]byte, 512))
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(200)
		time.Sleep(ttft)
		for i := range events {
			if i > 0 {
				time.Sleep(gap)
			}
			_, _ = w.Write([]byte(chunkA))
			w.(http.Flusher).Flush()
		}
		_, _ = w.Write([]byte(chunkEnd + done))
	}))
	defer up.Close()
	upURL, _ := url.Parse(up.URL)
	upTransport := func() http.RoundTripper {
		return schemeTransport{&http.Transport{ReadBufferSize: 1 << 10, WriteBufferSize: 1 << 10,
			MaxIdleConnsPerHost: 2 * n, DisableCompression: true}}
	}
	proxyHandler := func(cfg Config) http.Handler {
		cfg.Transport = upTransport()
		cfg.Balancer = addrBalancer{upURL.Host}
		p, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { p.ServeHTTP(w, r) })
	}
	c, err := admission.NewController(admission.Config{
		Tiers:   []admission.Tier{{Name: "gold", RPM: 1 << 30, TPM: 1 << 40, MaxConcurrent: 1 << 20}},
		Tenants: []admission.TenantConfig{{ID: "acme", Tier: "gold"}},
	}, clock.Real, nopAdmissionObserver{})
	if err != nil {
		t.Fatal(err)
	}
	dir, err := admission.NewDirectory([]admission.Key{{Hash: admission.HashKey("sk-acme"), Tenant: "acme"}})
	if err != nil {
		t.Fatal(err)
	}
	gate := admission.NewGate(admission.GateConfig{Capacity: func() int { return 1 << 20 }, Saturated: func() bool { return false }},
		clock.Real, nopAdmissionObserver{})
	rp := httputil.NewSingleHostReverseProxy(upURL)
	rp.FlushInterval = -1
	rp.Transport = &http.Transport{MaxIdleConnsPerHost: 2 * n}
	targets := []struct {
		name string
		h    http.Handler
	}{
		{"direct", nil},
		{"llm_proxy", proxyHandler(Config{})},
		{"llm_proxy+tenants", proxyHandler(Config{Identifier: &KeyIdentifier{Keys: dir}, Admitter: NewTenantAdmitter(c, gate), RequestUsage: true})},
		{"httputil.ReverseProxy", rp},
	}
	urls := map[string]string{}
	for _, tg := range targets {
		if tg.h == nil {
			urls[tg.name] = up.URL
			continue
		}
		labels := pprof.Labels("target", tg.name)
		h := tg.h
		front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			pprof.Do(r.Context(), labels, func(context.Context) { h.ServeHTTP(w, r) })
		}))
		defer front.Close()
		urls[tg.name] = front.URL
	}
	body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"` + strings.Repeat("hello ", 100) + `"}]}`
	ttfts := map[string][]time.Duration{}
	for range rounds {
		for _, tg := range targets {
			ttfts[tg.name] = append(ttfts[tg.name], runStreams(t, urls[tg.name], body, n, round)...)
		}
	}
	pct := func(d []time.Duration, p float64) time.Duration {
		slices.Sort(d)
		return d[min(len(d)-1, int(p*float64(len(d))))]
	}
	d50, d99 := pct(ttfts["direct"], 0.5), pct(ttfts["direct"], 0.99)
	t.Logf("%d concurrent streams, %d rounds of %v, TTFT %v, %d events %v apart:", n, rounds, round, ttft, events, gap)
	t.Logf("  %-22s %8s %9s %9s %12s %12s", "target", "requests", "TTFT p50", "TTFT p99", "added p50", "added p99")
	for _, tg := range targets {
		d := ttfts[tg.name]
		p50, p99 := pct(d, 0.5), pct(d, 0.99)
		t.Logf("  %-22s %8d %9v %9v %12v %12v", tg.name, len(d), p50.Round(10*time.Microsecond), p99.Round(10*time.Microsecond),
			(p50 - d50).Round(10*time.Microsecond), (p99 - d99).Round(10*time.Microsecond))
	}
}

// runStreams runs n clients that stream from u, one request after another,
// for d, and returns the TTFT (to the first data line) of each request.
func runStreams(t *testing.T, u, body string, n int, d time.Duration) []time.Duration {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2 * n, DisableCompression: true}}
	defer client.CloseIdleConnections()
	var (
		mu  sync.Mutex
		all []time.Duration
		wg  sync.WaitGroup
	)
	stop := time.Now().Add(d)
	for range n {
		wg.Go(func() {
			var mine []time.Duration
			for time.Now().Before(stop) {
				start := time.Now()
				req, _ := http.NewRequest(http.MethodPost, u+"/v1/chat/completions", strings.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("Authorization", "Bearer sk-acme")
				resp, err := client.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				br := bufio.NewReader(resp.Body)
				first := time.Duration(0)
				for {
					line, err := br.ReadSlice('\n')
					if first == 0 && bytes.HasPrefix(line, []byte("data: ")) {
						first = time.Since(start)
					}
					if err != nil {
						break
					}
				}
				_ = resp.Body.Close()
				if first == 0 || resp.StatusCode != 200 {
					t.Error(fmt.Sprintf("%s: status %d, no event", u, resp.StatusCode))
					return
				}
				mine = append(mine, first)
			}
			mu.Lock()
			all = append(all, mine...)
			mu.Unlock()
		})
	}
	wg.Wait()
	return all
}
