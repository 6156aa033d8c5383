package e2e

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// TestLeastConnReleasesEveryAttempt: the default least_conn policy counts
// the gateway's attempts in flight, so every attempt must give its count
// back however it ended (first-byte timeout, 5xx, reset, client gone,
// success). After every kind of attempt ending on replica 0 (forced with
// lb_policy first), a reload to least_conn (the in-flight counts live in
// state that survives reloads), concurrent streams still spread evenly
// over all three replicas, replica 0 included.
func TestLeastConnReleasesEveryAttempt(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3})
	site := func(policy string) string {
		// breaker off: replica 0 fails 15 times in a row on purpose.
		// min_per_sec 50: so do 15 quick retries, over the default floor
		// (3 at once, 3 a second).
		return "\tllm_proxy " + upstreams(fleet) + " {\n" + policy + "\t\tmax_attempts 3\n\t\tfirst_byte_timeout 300ms\n\t\tbreaker off\n\t\tretries {\n\t\t\tmin_per_sec 50\n\t\t}\n\t}"
	}
	gw := startGateway(t, site("\t\tlb_policy first\n"))
	c := newClient(t)

	// Failures on replica 0, each request failing over to replica 1.
	for _, spec := range []string{"hang", "status=503", "reset", "hang_after_headers", "error_event=0"} {
		f, err := mockllm.ParseFault(spec)
		if err != nil {
			t.Fatal(err)
		}
		fleet.Replica(0).SetBehavior(mockllm.Behavior{Fault: f})
		for range 3 {
			ctx := testContext(t, 30*time.Second)
			s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("Fail on zero.", true), "X-Mock-Tokens: 2", "X-Mock-Token-Interval: 0")
			checkCleanStream(t, s)
		}
	}
	// Clients that go away mid-stream.
	fleet.Replica(0).SetBehavior(mockllm.Behavior{})
	for range 3 {
		ctx, cancel := context.WithCancel(context.Background())
		resp := post(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("Leave early.", true), "X-Mock-Tokens: 50", "X-Mock-Token-Interval: 50ms")
		_, _, _ = readEvents(resp.Body, func(_ event, n int) bool { return n < 2 })
		cancel()
		resp.Body.Close()
	}
	if !waitFor(3*time.Second, func() bool {
		for _, r := range fleet.Stats().Replicas {
			if r.InFlight != 0 {
				return false
			}
		}
		return true
	}) {
		t.Fatalf("upstream requests still in flight: %+v", fleet.Stats().Replicas)
	}
	if t.Failed() {
		return
	}
	// Each of the 18 requests asks replica 0 first (lb_policy first) and
	// never twice: one written onto a kept connection that replica 0 had
	// closed fails as stale_connection (it may not have reached the mock)
	// and only the retry rules send it again, to the next replica.
	stale, _ := metricValue(gw.scrapeMetrics(), "caddy_llm_proxy_stale_connection_retries_total", map[string]string{"upstream": fleet.Replica(0).Addr()})
	if r := fleet.Replica(0).Stats(); r.Requests > 18 || r.Requests < 18-int64(stale) {
		t.Fatalf("replica 0 got %d requests, want 18 (lb_policy first), less at most the %v that failed as stale_connection", r.Requests, stale)
	}
	gw.reload(site("")) // default: least_conn

	// 30 long streams, started 25ms apart so that each pick sees the ones
	// before it, all in flight together: least_conn gives each replica 10.
	// A leaked count (3 per leaking path above) would starve replica 0.
	fleet.ResetStats()
	const n = 30
	var wg sync.WaitGroup
	errs := make(chan string, n)
	for range n {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			s, err := doStream(ctx, c, gw.URL+"/v1/chat/completions", chatBody("Spread us.", true), "X-Mock-Tokens: 20", "X-Mock-Token-Interval: 100ms")
			switch {
			case err != nil:
				errs <- err.Error()
			case s.Status != http.StatusOK || len(s.Events) == 0 || !s.Events[len(s.Events)-1].IsDone():
				errs <- "incomplete stream"
			}
		})
		time.Sleep(25 * time.Millisecond)
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Errorf("concurrent stream: %s", e)
	}
	for i, r := range fleet.Stats().Replicas {
		t.Logf("replica %d: %d requests", i, r.Requests)
		if r.Requests < 9 || r.Requests > 11 {
			t.Errorf("replica %d got %d of %d concurrent streams, want about %d (least_conn)", i, r.Requests, n, n/3)
		}
	}
}

// TestDynamicUpstreamsFromCaddySources: upstreams from Caddy's own dynamic
// sources (multi of two "a" sources, one per mock replica port) are
// balanced by the selection policy, and a replica that stops answering is
// failed over past.
func TestDynamicUpstreamsFromCaddySources(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2})
	port := func(i int) string {
		addr := fleet.Replica(i).Addr()
		return addr[strings.LastIndex(addr, ":")+1:]
	}
	gw := startGateway(t, `	llm_proxy {
		dynamic multi {
			a 127.0.0.1 `+port(0)+`
			a 127.0.0.1 `+port(1)+`
		}
		lb_policy round_robin
		max_attempts 2
	}`)
	c := newClient(t)
	for range 6 {
		ctx := testContext(t, 30*time.Second)
		s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("Dynamic.", true), "X-Mock-Tokens: 2", "X-Mock-Token-Interval: 0")
		checkCleanStream(t, s)
	}
	for i, r := range fleet.Stats().Replicas {
		if r.Requests != 3 {
			t.Fatalf("replica %d got %d of 6 round-robin requests, want 3", i, r.Requests)
		}
	}
	if err := fleet.Replica(1).Stop(); err != nil {
		t.Fatal(err)
	}
	for range 4 {
		ctx := testContext(t, 30*time.Second)
		s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("Dynamic.", true), "X-Mock-Tokens: 2", "X-Mock-Token-Interval: 0")
		checkCleanStream(t, s)
	}
	if n := fleet.Replica(0).Stats().Requests; n != 7 {
		t.Fatalf("with replica 1 stopped, replica 0 served %d requests in all, want 3 + 4", n)
	}
}
