package e2e

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
	"github.com/llmproxy/caddy-llm-proxy/internal/redistest"
)

// Fleet-wide tenant limits (issue 10 item 5): three real gateways share
// one real Redis; a tenant's limits hold for the fleet, not per gateway.

// startFleetTenantGateways starts n gateways in one fleet with the given
// tenants and tiers (the inside of the llm_proxy global block, after the
// fleet line) in front of f.
func startFleetTenantGateways(t *testing.T, n int, redisAddr string, f *mockllm.Fleet, tenancy string, keys ...string) []*tenantGateway {
	t.Helper()
	var gws []*tenantGateway
	for i := range n {
		globals := fmt.Sprintf("llm_proxy {\n\tfleet redis redis://%s {\n\t\trefresh 200ms\n\t\top_timeout 50ms\n\t\tinstance_id gw-%d\n\t}\n%s\n}", redisAddr, i, tenancy)
		site := fmt.Sprintf("llm_proxy %s {\n\tmax_attempts 1\n}", upstreams(f))
		gws = append(gws, startTenantGateway(t, gatewayOptions{Globals: globals, Site: site}, keys...))
	}
	for i, g := range gws {
		var v fleetView
		if !waitFor(10*time.Second, func() bool { v = g.fleet(); return v.Mode == "fleet" && len(v.Instances) == n }) {
			t.Fatalf("gateway %d: fleet view %+v, want mode fleet with %d instances", i, v, n)
		}
	}
	return gws
}

// TestFleetTenantRPMHoldsAcrossTheFleet: a tenant with rpm 60 sends 90
// requests spread over three gateways within a few seconds: exactly 60
// are admitted in all (not 60 per gateway), the rest get 429 tenant_rpm.
func TestFleetTenantRPMHoldsAcrossTheFleet(t *testing.T) {
	t.Parallel()
	rs := redistest.Start(t, redistest.Options{})
	key := newKey("fleetrpm")
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(2 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	gws := startFleetTenantGateways(t, 3, rs.Addr(), fleet, fmt.Sprintf("\ttenants {\n\t\tkey %s acme tier sixty\n\t}\n\ttier sixty {\n\t\trpm 60\n\t}", key), key)
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	admitted, refused := 0, 0
	per := make([]int, len(gws))
	for i := range 90 {
		g := gws[i%len(gws)]
		r := mustSend(ctx, t, c, g.URL+"/v1/chat/completions", chatOf("one of ninety", false, nil), bearer(key))
		switch {
		case r.Status == http.StatusOK:
			admitted++
			per[i%len(gws)]++
		case r.Status == http.StatusTooManyRequests && errorCode(r.Body) == "tenant_rpm":
			refused++
		default:
			t.Fatalf("request %d on gateway %d: %d %s", i, i%len(gws), r.Status, r.Body)
		}
	}
	if admitted != 60 || refused != 30 {
		t.Fatalf("rpm 60 across three gateways: %d admitted (per gateway %v), %d refused; want 60 and 30", admitted, per, refused)
	}
	if got := fleetRequests(fleet); got != 60 {
		t.Errorf("the upstreams saw %d requests, want 60", got)
	}
}

// TestFleetTenantTPMReservesFleetWide: 20 concurrent requests of one
// tenant, each reserving about 300 tokens (max_tokens 280 + its prompt),
// spread over three gateways, on tpm 1000: only the 3 that fit the
// fleet-wide reservations are admitted, the other 17 get 429 tenant_tpm.
// The upstream holds the admitted ones (1.5s to the first token), so no
// settlement frees tokens while the others are decided.
func TestFleetTenantTPMReservesFleetWide(t *testing.T) {
	t.Parallel()
	rs := redistest.Start(t, redistest.Options{})
	key := newKey("fleettpm")
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(1500 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	gws := startFleetTenantGateways(t, 3, rs.Addr(), fleet, fmt.Sprintf("\ttenants {\n\t\tkey %s acme tier small\n\t}\n\ttier small {\n\t\ttpm 1000\n\t}", key), key)
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	var wg sync.WaitGroup
	replies := make([]reply, 20)
	body := chatOf("reserve", false, map[string]any{"max_tokens": 280})
	for i := range replies {
		wg.Go(func() { replies[i] = send(ctx, c, gws[i%len(gws)].URL+"/v1/chat/completions", body, bearer(key)) })
	}
	wg.Wait()
	admitted, refused := 0, 0
	for i, r := range replies {
		switch {
		case r.Err != nil:
			t.Fatalf("request %d: %v", i, r.Err)
		case r.Status == http.StatusOK:
			admitted++
		case r.Status == http.StatusTooManyRequests && errorCode(r.Body) == "tenant_tpm":
			refused++
		default:
			t.Fatalf("request %d: %d %s", i, r.Status, r.Body)
		}
	}
	if admitted != 3 || refused != 17 {
		t.Fatalf("tpm 1000 with ~300-token reservations over three gateways: %d admitted, %d refused; want 3 and 17", admitted, refused)
	}
}

// TestFleetTenantConcurrencyLeases: a tenant with max_concurrent 2 runs
// two 60s streams (122 tokens, one every 500ms: six times a lease's 10s
// time-to-live, so the heartbeat must renew them) on two gateways.
// Sampled every 500ms while both run, Redis holds exactly two leases for
// the tenant, a third request on the third gateway is refused with 429
// tenant_concurrency, and every gateway's admin view shows the fleet's 2
// in flight (the leases, not its own count); after the streams end the
// count is 0 in Redis and on every gateway, and a request fits again.
func TestFleetTenantConcurrencyLeases(t *testing.T) {
	t.Parallel()
	const streamFor = 60 * time.Second
	rs := redistest.Start(t, redistest.Options{})
	key := newKey("fleetslots")
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	gws := startFleetTenantGateways(t, 3, rs.Addr(), fleet, fmt.Sprintf("\ttenants {\n\t\tkey %s acme tier two\n\t}\n\ttier two {\n\t\tmax_concurrent 2\n\t}", key), key)
	c := newClient(t)
	ctx := testContext(t, streamFor+30*time.Second)
	leases := func() int {
		out, err := rs.Do("ZCARD", "llmproxy:{tenant:acme}:leases")
		if err != nil {
			t.Fatalf("ZCARD: %v", err)
		}
		n, err := strconv.Atoi(out)
		if err != nil {
			t.Fatalf("ZCARD answered %q", out)
		}
		return n
	}
	inflight := func() []int {
		var n []int
		for _, g := range gws {
			n = append(n, g.tenants()["acme"].Inflight) // no state yet: 0
		}
		return n
	}
	long := chatOf("a long one", true, nil)
	slow := []string{bearer(key), "X-Mock-Tokens: 122", "X-Mock-Token-Interval: 500ms"}
	var (
		mu      sync.Mutex
		ended   []time.Duration
		results = make([]reply, 2)
		wg      sync.WaitGroup
	)
	began := time.Now()
	for i := range 2 {
		wait := asyncSend(ctx, c, gws[i].URL+"/v1/chat/completions", long, slow...)
		wg.Go(func() {
			results[i] = wait()
			mu.Lock()
			ended = append(ended, time.Since(began))
			mu.Unlock()
		})
	}
	running := func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(ended) == 0
	}
	if !waitFor(5*time.Second, func() bool { return leases() == 2 }) {
		t.Fatalf("Redis holds %d leases for the tenant with two streams running, want 2", leases())
	}
	samples := 0
	// Both streams run until about streamFor after they began; stop
	// sampling a second early so that the last sample is not racing the
	// ends.
	for time.Since(began) < streamFor-time.Second {
		n := leases()
		if !running() {
			break // checked below: a stream ended early
		}
		at := time.Since(began).Round(time.Millisecond)
		if n != 2 {
			t.Fatalf("after %v: Redis holds %d leases with two streams running, want exactly 2", at, n)
		}
		r := mustSend(ctx, t, c, gws[2].URL+"/v1/chat/completions", chatOf("a third", false, nil), bearer(key))
		if r.Status != http.StatusTooManyRequests || errorCode(r.Body) != "tenant_concurrency" {
			t.Fatalf("after %v: a third request on another gateway got %d %s, want 429 tenant_concurrency", at, r.Status, r.Body)
		}
		// The admin view shows the fleet's in-flight count (its leases),
		// on the gateways that run a stream and on the one that does not.
		for i, g := range gws {
			v, listed := g.tenants()["acme"]
			if (listed || i < 2) && v.Inflight != 2 && running() {
				t.Fatalf("after %v: gateway %d's admin view shows %d in flight for the tenant (listed %v), want the fleet's 2", at, i, v.Inflight, listed)
			}
		}
		samples++
		time.Sleep(500 * time.Millisecond)
	}
	wg.Wait()
	for i, r := range results {
		if r.Err != nil || r.Status != http.StatusOK {
			t.Fatalf("stream %d: %d %v", i, r.Status, r.Err)
		}
	}
	if first := slices.Min(ended); first < streamFor-time.Second {
		t.Fatalf("a stream ended after %v, want both to run for about %v", first, streamFor)
	}
	if min := int((streamFor - 6*time.Second) / (700 * time.Millisecond)); samples < min {
		t.Errorf("%d samples over the streams, want at least %d (one every ~500ms)", samples, min)
	}
	if !waitFor(5*time.Second, func() bool { return leases() == 0 }) {
		t.Fatalf("Redis holds %d leases after both streams ended, want 0", leases())
	}
	if !waitFor(5*time.Second, func() bool { return !slices.ContainsFunc(inflight(), func(n int) bool { return n != 0 }) }) {
		t.Fatalf("in flight per gateway %v after the streams ended, want 0 everywhere", inflight())
	}
	if n := leases(); n != 0 {
		t.Fatalf("Redis holds %d leases after the gateways settled, want 0 (never negative, never left over)", n)
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if r := mustSend(cctx, t, c, gws[2].URL+"/v1/chat/completions", chatOf("now it fits", false, nil), bearer(key)); r.Status != http.StatusOK {
		t.Fatalf("after the streams ended: %d %s, want 200", r.Status, r.Body)
	}
	t.Logf("%d samples of exactly 2 leases and a refused third request over %v; streams ended after %v", samples, streamFor, ended)
}

// TestFleetTenantBreakerTripsOnceForTheFleet: a tenant whose own requests
// fail (the upstream answers 400: its fault) on two gateways trips its
// breaker for both when the fleet's count reaches the threshold — two
// failures on one gateway and one on the other — and another tenant is
// served by both.
func TestFleetTenantBreakerTripsOnceForTheFleet(t *testing.T) {
	t.Parallel()
	rs := redistest.Start(t, redistest.Options{})
	bad, good := newKey("tbbad"), newKey("tbgood")
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(2 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	tenancy := fmt.Sprintf("\ttenants {\n\t\tkey %s bad tier t\n\t\tkey %s good tier t\n\t}\n\ttier t {\n\t\tbreaker {\n\t\t\tconsecutive_failures 3\n\t\t\topen_for 30s\n\t\t}\n\t}", bad, good)
	gws := startFleetTenantGateways(t, 2, rs.Addr(), fleet, tenancy, bad, good)
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	url := func(i int) string { return gws[i].URL + "/v1/chat/completions" }
	for i, gw := range []int{0, 1, 0} {
		r := mustSend(ctx, t, c, url(gw), chatOf("its own fault", false, nil), bearer(bad), "X-Mock-Fault: status=400")
		if r.Status != http.StatusBadRequest {
			t.Fatalf("failure %d on gateway %d: %d %s", i, gw, r.Status, r.Body)
		}
	}
	for i := range gws {
		var r reply
		if !waitFor(5*time.Second, func() bool {
			r = mustSend(ctx, t, c, url(i), chatOf("after the trip", false, nil), bearer(bad))
			return r.Status == http.StatusTooManyRequests
		}) {
			t.Fatalf("gateway %d: %d %s, want 429 tenant_circuit_open (the fleet counted 3 failures)", i, r.Status, r.Body)
		}
		if code := errorCode(r.Body); code != "tenant_circuit_open" || r.Header.Get("X-Circuit-Breaker") != "open" {
			t.Fatalf("gateway %d: code %q, X-Circuit-Breaker %q", i, code, r.Header.Get("X-Circuit-Breaker"))
		}
		if r := mustSend(ctx, t, c, url(i), chatOf("another tenant", false, nil), bearer(good)); r.Status != http.StatusOK {
			t.Fatalf("gateway %d: the other tenant got %d %s", i, r.Status, r.Body)
		}
	}
	if v := gws[1].tenant("bad"); v.breakerState() != "open" {
		t.Fatalf("gateway 1's view of the tenant's breaker: %q", v.breakerState())
	}
}
