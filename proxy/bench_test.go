package proxy

import (
	"bytes"
	"context"
	"io"
	"math"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
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

// BenchmarkRelayOneEventPerRead is BenchmarkRelay with the upstream's
// events arriving one per read, as from a network connection when the
// upstream flushes each token: no bursts to join, one write and one flush
// per event. ns/event is the cost of a relayed event in the gateway's own
// code (the transport and the client's writer cost nothing here).
func BenchmarkRelayOneEventPerRead(b *testing.B) {
	const events = 1000
	reads := make([]string, 0, events+2)
	for range events {
		reads = append(reads, chunkA)
	}
	reads = append(reads, chunkEnd, done)
	p, err := New(Config{Transport: readsTransport{reads}, Balancer: oneBalancer{}})
	if err != nil {
		b.Fatal(err)
	}
	body := []byte(`{"model":"m","stream":true}`)
	b.ReportAllocs()
	for b.Loop() {
		r, _ := http.NewRequest(http.MethodPost, "http://gw/v1/chat/completions", bytes.NewReader(body))
		w := &discardWriter{h: http.Header{}}
		if res := p.ServeHTTP(w, r); res.Outcome != OutcomeSuccess {
			b.Fatalf("outcome %v", res.Outcome)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(events*b.N), "ns/event")
}

// BenchmarkRelayWithTenants is BenchmarkRelay with a tenant identified by
// its key, admitted with a reservation and settled, and usage requested on
// the client's behalf: the usage-only chunk is read and dropped. The
// marginal allocations per relayed event must stay at 0.
func BenchmarkRelayWithTenants(b *testing.B) {
	const events = 1000
	c, err := admission.NewController(admission.Config{
		Tiers:   []admission.Tier{{Name: "gold", RPM: 1 << 30, TPM: 1 << 40, MaxConcurrent: 100}},
		Tenants: []admission.TenantConfig{{ID: "acme", Tier: "gold"}},
	}, clock.Real, nopAdmissionObserver{})
	if err != nil {
		b.Fatal(err)
	}
	dir, err := admission.NewDirectory([]admission.Key{{Hash: admission.HashKey("sk-acme"), Tenant: "acme"}})
	if err != nil {
		b.Fatal(err)
	}
	usage := "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1000}}\n\n"
	run := func(n int) func() {
		stream := benchStream(n)
		stream = append(stream[:len(stream)-len(done)], usage+done...)
		p, err := New(Config{Transport: memTransport{stream}, Balancer: oneBalancer{}, RequestUsage: true,
			Identifier: &KeyIdentifier{Keys: dir}, Admitter: NewTenantAdmitter(c, nil)})
		if err != nil {
			b.Fatal(err)
		}
		body := []byte(`{"model":"m","stream":true,"messages":[{"role":"user","content":"hello"}]}`)
		return func() {
			r, _ := http.NewRequest(http.MethodPost, "http://gw/v1/chat/completions", bytes.NewReader(body))
			r.Header.Set("Authorization", "Bearer sk-acme")
			w := &discardWriter{h: http.Header{}}
			if res := p.ServeHTTP(w, r); res.Outcome != OutcomeSuccess || res.Events != n+2 || !res.Usage.Reported {
				b.Fatalf("outcome %v events %d usage %+v", res.Outcome, res.Events, res.Usage)
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

// BenchmarkTenantHotPath measures admission's hot path per request at 8
// goroutines, without queueing: identify (key lookup), admit (reserve
// against rpm, tpm and max_concurrent) and settle. Without a gate it
// allocates nothing; with one, the gate allocates its release func.
func BenchmarkTenantHotPath(b *testing.B) {
	for _, gated := range []bool{false, true} {
		name := "controller"
		if gated {
			name = "controller+gate"
		}
		b.Run(name, func(b *testing.B) {
			c, err := admission.NewController(admission.Config{
				Tiers:   []admission.Tier{{Name: "gold", RPM: 1 << 30, TPM: 1 << 40, MaxConcurrent: 1 << 20}},
				Tenants: []admission.TenantConfig{{ID: "acme", Tier: "gold"}},
			}, clock.Real, nopAdmissionObserver{})
			if err != nil {
				b.Fatal(err)
			}
			var g *admission.Gate
			if gated {
				g = admission.NewGate(admission.GateConfig{Capacity: func() int { return 1 << 20 }}, clock.Real, nopAdmissionObserver{})
			}
			dir, err := admission.NewDirectory([]admission.Key{{Hash: admission.HashKey("sk-acme-0123456789"), Tenant: "acme"}})
			if err != nil {
				b.Fatal(err)
			}
			ident := &KeyIdentifier{Keys: dir, Resolve: func(tenant, tier string) (string, bool) {
				ti, ok := c.Tier(tenant, tier)
				return ti.Name, ok
			}}
			adm := NewTenantAdmitter(c, g)
			info := RequestInfo{N: 1, PromptTokens: 100, MaxTokens: 200, MaxTokensSet: true}
			b.SetParallelism(max(1, 8/runtime.GOMAXPROCS(0)))
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				r, _ := http.NewRequest(http.MethodPost, "http://gw/v1/chat/completions", nil)
				r.Header.Set("Authorization", "Bearer sk-acme-0123456789")
				ctx := context.Background()
				res := &Result{Info: info, Committed: true, Outcome: OutcomeSuccess,
					Usage: Usage{PromptTokens: 100, CompletionTokens: 50, Reported: true}}
				for pb.Next() {
					id, err := ident.Identify(r, info)
					if err != nil {
						b.Fatal(err)
					}
					a, err := adm.Admit(ctx, id, info)
					if err != nil {
						b.Fatal(err)
					}
					a.Release(res)
				}
			})
		})
	}
}

type nopAdmissionObserver struct{}

func (nopAdmissionObserver) Decision(string, string, string)                    {}
func (nopAdmissionObserver) QueueWait(string, string, time.Duration)            {}
func (nopAdmissionObserver) QueueDepth(string, int)                             {}
func (nopAdmissionObserver) Inflight(string, int)                               {}
func (nopAdmissionObserver) Tokens(string, string, string, string, string, int) {}
func (nopAdmissionObserver) TenantBreaker(string, string, breaker.Transition)   {}

// requestBench is one configuration of BenchmarkRequest: a proxy and the
// request it serves. The stream is short (10 events), so an op's cost is
// the request's, not its events'.
type requestBench struct {
	name string
	p    *Proxy
	// key is the client's Authorization, "" without tenants.
	key  string
	body []byte
}

// requestBenches are the configurations BenchmarkRequest and
// TestRequestAllocations run: the handler's defaults, and tenants with a
// pool gate (saturation's admission: a capacity and a saturation signal).
func requestBenches(tb testing.TB) []requestBench {
	const events = 10
	c, err := admission.NewController(admission.Config{
		Tiers:   []admission.Tier{{Name: "gold", RPM: 1 << 30, TPM: 1 << 40, MaxConcurrent: 1 << 20}},
		Tenants: []admission.TenantConfig{{ID: "acme", Tier: "gold"}},
	}, clock.Real, nopAdmissionObserver{})
	if err != nil {
		tb.Fatal(err)
	}
	dir, err := admission.NewDirectory([]admission.Key{{Hash: admission.HashKey("sk-acme"), Tenant: "acme"}})
	if err != nil {
		tb.Fatal(err)
	}
	gate := admission.NewGate(admission.GateConfig{Capacity: func() int { return 1 << 20 }, Saturated: func() bool { return false }},
		clock.Real, nopAdmissionObserver{})
	usage := "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":10}}\n\n"
	withUsage := benchStream(events)
	withUsage = append(withUsage[:len(withUsage)-len(done)], usage+done...)
	body := []byte(`{"model":"m","stream":true,"messages":[{"role":"user","content":"hello"}]}`)
	mk := func(cfg Config) *Proxy {
		cfg.Balancer = oneBalancer{}
		p, err := New(cfg)
		if err != nil {
			tb.Fatal(err)
		}
		return p
	}
	return []requestBench{
		{name: "defaults", p: mk(Config{Transport: memTransport{benchStream(events)}}), body: body},
		{name: "tenants+gate", key: "Bearer sk-acme", body: body,
			p: mk(Config{Transport: memTransport{withUsage}, RequestUsage: true,
				Identifier: &KeyIdentifier{Keys: dir}, Admitter: NewTenantAdmitter(c, gate)})},
	}
}

// serve runs one request through rb's proxy.
func (rb *requestBench) serve(tb testing.TB) {
	r, _ := http.NewRequest(http.MethodPost, "http://gw/v1/chat/completions", bytes.NewReader(rb.body))
	if rb.key != "" {
		r.Header.Set("Authorization", rb.key)
	}
	w := &discardWriter{h: http.Header{}}
	if res := rb.p.ServeHTTP(w, r); res.Outcome != OutcomeSuccess {
		tb.Fatalf("%s: outcome %v", rb.name, res.Outcome)
	}
}

// BenchmarkRequest measures a request's own cost (read, identify, admit,
// pick, attempt, commit, finish) on a 10-event stream, at the handler's
// defaults and with tenants and a pool gate.
func BenchmarkRequest(b *testing.B) {
	for _, rb := range requestBenches(b) {
		b.Run(rb.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				rb.serve(b)
			}
		})
	}
}

// requestAllocs are the most allocations one request of requestBenches may
// make, the test's own (its request, writer and the in-memory upstream's
// response, about 12) included: 80 and 95 before issue 22's cuts (83 and
// 98 in BenchmarkRequest, which also counts the buffers a GC takes from
// the pools). A request measured 57 and 67 in every run on the
// development machine, and a fresh CI run of the same commit read 58 in
// each of its five rounds: one allocation comes or goes with the process
// (not found yet; every source of ours is per request and deterministic),
// so the limits allow it. The exchange's own context only with
// stream_timeout, an inline attempt's result without a channel and Caddy's
// dial info boxed once brought them to 50 and 60. Lower them when a change
// saves more, never raise them.
var requestAllocs = map[string]float64{"defaults": 51, "tenants+gate": 61}

// A request's allocations stay where issue 22 brought them, at the
// defaults and with tenants and a pool gate. Each count is the least of a
// few runs: goroutines that outlive a request (the drain of a finished
// body) allocate now and then, never less.
func TestRequestAllocations(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are meaningless under the race detector")
	}
	for _, rb := range requestBenches(t) {
		n := math.Inf(1)
		for range 5 {
			n = min(n, testing.AllocsPerRun(200, func() { rb.serve(t) }))
		}
		if limit := requestAllocs[rb.name]; n > limit {
			t.Errorf("%s: %.0f allocations per request, want at most %.0f", rb.name, n, limit)
		} else {
			t.Logf("%s: %.0f allocations per request (at most %.0f)", rb.name, n, limit)
		}
	}
}
