package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// Issue 19: breakers that never make a partial outage worse than no
// gateway. Every test here runs the gateway at its defaults (no breaker or
// retries block) in front of three mock replicas.

// outcome of one request of an open-loop run.
type loopResult struct {
	at     time.Duration // when it started, since the run's start
	status int           // 0: transport error
}

// openLoop sends a small streamed chat completion every 1/perSec for d,
// each with the X-Mock-Fault header fault(at) (the fault of the moment the
// request starts), and returns every request's result once all ended.
func openLoop(ctx context.Context, c *http.Client, url string, perSec float64, d time.Duration, fault func(at time.Duration) string) []loopResult {
	n := int(perSec * d.Seconds())
	out := make([]loopResult, n)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range n {
		at := time.Duration(float64(i) / perSec * float64(time.Second))
		if w := time.Until(start.Add(at)); w > 0 {
			time.Sleep(w)
		}
		wg.Go(func() {
			out[i].at = at
			r, err := doPlain(ctx, c, url, chatBody("Hi.", true), "X-Mock-Fault: "+fault(at), "X-Mock-Tokens: 2", "X-Mock-TTFT: 0s")
			if err == nil {
				out[i].status = r.Status
			}
		})
	}
	wg.Wait()
	return out
}

// served is the share of the results that started in [from, to) and got
// a 200.
func served(rs []loopResult, from, to time.Duration) (share float64, n int) {
	ok := 0
	for _, r := range rs {
		if r.at >= from && r.at < to {
			n++
			if r.status == http.StatusOK {
				ok++
			}
		}
	}
	if n == 0 {
		return 0, 0
	}
	return float64(ok) / float64(n), n
}

// evidenceOf returns each breaker's state and evidence from the admin API.
func evidenceOf(t *testing.T, gw *gateway) map[string][2]string {
	t.Helper()
	status, body := gw.admin(http.MethodGet, "/llm_proxy/breakers")
	if status != http.StatusOK {
		t.Fatalf("GET /llm_proxy/breakers: %d %s", status, body)
	}
	var vs []struct {
		Key, State, Evidence string
	}
	if err := json.Unmarshal(body, &vs); err != nil {
		t.Fatal(err)
	}
	out := map[string][2]string{}
	for _, v := range vs {
		out[v.Key] = [2]string{v.State, v.Evidence}
	}
	return out
}

// Three replicas fail half of all requests at random, then none: the
// gateway at its defaults serves at least 45% during (direct serves 50%;
// the old breakers served 4–22%), and at least 98% from 4 s after.
func TestUniformHalfFailureThenRecovery(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet))
	c := newClient(t)
	ctx := testContext(t, 60*time.Second)
	const during, after = 8 * time.Second, 8 * time.Second
	rs := openLoop(ctx, c, gw.URL+"/v1/chat/completions", 40, during+after, func(at time.Duration) string {
		if at < during {
			return "status=503,fraction=0.5"
		}
		return "none"
	})
	d, nd := served(rs, 0, during)
	a, na := served(rs, during+4*time.Second, during+after)
	t.Logf("served %.1f%% of %d at 50%% failure, %.1f%% of %d from 4s after recovery; %d upstream attempts for %d requests",
		100*d, nd, 100*a, na, fleetRequests(fleet), len(rs))
	t.Logf("breakers at the end: %v", evidenceOf(t, gw))
	if d < 0.45 {
		t.Errorf("served %.1f%% at 50%% uniform failure, want ≥ 45%%", 100*d)
	}
	if a < 0.98 {
		t.Errorf("served %.1f%% from 4s after recovery, want ≥ 98%%", 100*a)
	}
	// Amplification within the budget: 1.1 × requests + 3 + 3 per second.
	if n, bound := fleetRequests(fleet), 1.1*float64(len(rs))+3+3*(during+after).Seconds(); float64(n) > bound {
		t.Errorf("%d upstream attempts for %d requests, over the budget's bound %.0f", n, len(rs), bound)
	}
}

// Three replicas at 20 requests/s all start answering 503 after 2 s (a bad
// deploy): within 2 s the pool has failed as a whole, and from then on the
// gateway answers by itself but for one probe per replica per second (the
// default pool probe interval); 4 s after the replicas recover at least 98%
// is served again.
func TestPoolThatFailsAsAWholeAnswers503AtOnce(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet))
	c := newClient(t)
	ctx := testContext(t, 60*time.Second)
	const down, up, end = 2 * time.Second, 7 * time.Second, 14 * time.Second
	// The upstream attempts from 2 s into the failure to its end.
	var from, to atomic.Int64
	start := time.Now()
	go func() {
		time.Sleep(time.Until(start.Add(down + 2*time.Second)))
		from.Store(fleetRequests(fleet))
		time.Sleep(time.Until(start.Add(up)))
		to.Store(fleetRequests(fleet))
	}()
	rs := openLoop(ctx, c, gw.URL+"/v1/chat/completions", 20, end, func(at time.Duration) string {
		if at >= down && at < up {
			return "status=503"
		}
		return "none"
	})
	before, _ := served(rs, 0, down)
	after, na := served(rs, up+4*time.Second, end)
	attempts := to.Load() - from.Load()
	t.Logf("served %.1f%% before; %d upstream attempts in the last %v of the failure (%d requests); %.1f%% of %d served from 4 s after recovery",
		100*before, attempts, up-down-2*time.Second, 20*int(up-down-2*time.Second)/int(time.Second), 100*after, na)
	if before < 0.98 {
		t.Errorf("served %.1f%% before the failure, want ≥ 98%%", 100*before)
	}
	// 3 replicas × 3 s × one probe a second, and a second's slack for the
	// sampling: 12. Without the pool-wide rule: about 20 × 1.2 a second.
	if attempts > 12 {
		t.Errorf("%d upstream attempts in the last %v of the failure, want only probes (≤ 12)", attempts, up-down-2*time.Second)
	}
	if after < 0.98 {
		t.Errorf("served %.1f%% from 4 s after recovery, want ≥ 98%%", 100*after)
	}
}

// An operator's failure_ratio under uniform partial failure: two replicas
// each failing half the requests, the breakers' own ratio rule set low
// (0.3 over 10). The rule fires on both, but the pool's cap (max_ejection:
// one of two) holds the second: /llm_proxy/pools never shows more ejected
// than allowed, at most one replica's caddy_llm_proxy_breaker_state reads
// open (2) — so LLMProxyPoolUnavailable (min by pool ≥ 1) stays quiet —
// and users are served about as a direct connection would serve them.
// Before, both breakers tripped within 50 ms: "ejected 2 of 1", both at 2.
func TestOperatorRatioRuleUnderUniformFailureStaysWithinTheCap(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet)+" {\n\t\tbreaker {\n\t\t\tfailure_ratio 0.3 min_requests 10\n\t\t}\n\t}")
	c := newClient(t)
	ctx := testContext(t, 60*time.Second)
	var worst atomic.Int64 // the most ejected seen in /llm_proxy/pools
	var pools sync.WaitGroup
	stop := make(chan struct{})
	pools.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			status, body := gw.admin(http.MethodGet, "/llm_proxy/pools")
			var ps []struct {
				Ejected int `json:"ejected"`
			}
			if status != http.StatusOK || json.Unmarshal(body, &ps) != nil {
				continue
			}
			for _, p := range ps {
				if int64(p.Ejected) > worst.Load() {
					worst.Store(int64(p.Ejected))
				}
			}
		}
	})
	rs := openLoop(ctx, c, gw.URL+"/v1/chat/completions", 40, 5*time.Second, func(time.Duration) string { return "status=503,fraction=0.5" })
	close(stop)
	pools.Wait()
	share, n := served(rs, 0, time.Hour)
	samples := gw.scrapeMetrics()
	open := 0
	for _, a := range fleet.Addrs() {
		v, found := metricValue(samples, "caddy_llm_proxy_breaker_state", map[string]string{"upstream": a})
		if !found {
			t.Fatalf("no caddy_llm_proxy_breaker_state series for %s", a)
		}
		if v == 2 {
			open++
		}
	}
	t.Logf("served %.1f%% of %d; most ejected seen %d; breakers %v", 100*share, n, worst.Load(), evidenceOf(t, gw))
	if worst.Load() > 1 {
		t.Errorf("/llm_proxy/pools showed %d ejected, over max_ejected 1", worst.Load())
	}
	if open > 1 {
		t.Errorf("%d of 2 breakers read open in caddy_llm_proxy_breaker_state: the pool looks unavailable while it serves", open)
	}
	if share < 0.40 {
		t.Errorf("served %.1f%% at 50%% uniform failure, want ≥ 40%% (a direct connection serves 50%%)", 100*share)
	}
}

// One replica of three refuses connections: users see everything served,
// its breaker opens on hard evidence, and it gets no user request after.
func TestOneDeadReplicaOfThree(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2})
	dead := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	gw := startGateway(t, fmt.Sprintf("\tllm_proxy %s %s", upstreams(fleet), dead))
	c := newClient(t)
	ctx := testContext(t, 60*time.Second)
	rs := openLoop(ctx, c, gw.URL+"/v1/chat/completions", 40, 5*time.Second, func(time.Duration) string { return "none" })
	share, n := served(rs, 0, time.Hour)
	ev := evidenceOf(t, gw)
	samples := gw.scrapeMetrics()
	refused := metricValueOrZero(t, samples, "caddy_llm_proxy_upstream_attempts_total", map[string]string{"upstream": dead})
	t.Logf("served %.1f%% of %d; %v attempts on the dead replica; breakers %v", 100*share, n, refused, ev)
	if share < 0.99 {
		t.Errorf("served %.1f%%, want ≥ 99%%", 100*share)
	}
	if ev[dead] != [2]string{"open", "hard"} {
		t.Errorf("the dead replica's breaker is %v, want open on hard evidence", ev[dead])
	}
	if refused > 6 {
		t.Errorf("%v attempts on the dead replica, want the 3 that discover it (and a probe or two)", refused)
	}
	for _, a := range fleet.Addrs() {
		if ev[a][0] != "closed" {
			t.Errorf("live replica %s: breaker %v, want closed", a, ev[a])
		}
	}
}

// Every replica refuses connections: after discovery the pool fails fast,
// at most 0.2 attempts per request, with the gateway's 503.
func TestEveryReplicaDead(t *testing.T) {
	t.Parallel()
	var addrs string
	for range 3 {
		addrs += fmt.Sprintf(" 127.0.0.1:%d", freePort(t))
	}
	gw := startGateway(t, "\tllm_proxy"+addrs)
	c := newClient(t)
	ctx := testContext(t, 60*time.Second)
	url := gw.URL + "/v1/chat/completions"
	// Discovery: a few requests open every breaker.
	for range 5 {
		if _, err := doPlain(ctx, c, url, chatBody("Hi.", true)); err != nil {
			t.Fatal(err)
		}
	}
	before := metricValueOrZero(t, gw.scrapeMetrics(), "caddy_llm_proxy_upstream_attempts_total", nil)
	rs := openLoop(ctx, c, url, 40, 3*time.Second, func(time.Duration) string { return "none" })
	attempts := metricValueOrZero(t, gw.scrapeMetrics(), "caddy_llm_proxy_upstream_attempts_total", nil) - before
	var unavailable int
	for _, r := range rs {
		if r.status == http.StatusServiceUnavailable {
			unavailable++
		}
	}
	t.Logf("%v attempts for %d requests after discovery; %d answered 503; breakers %v", attempts, len(rs), unavailable, evidenceOf(t, gw))
	if per := attempts / float64(len(rs)); per > 0.2 {
		t.Errorf("%.2f attempts per request after discovery, want ≤ 0.2", per)
	}
	// Every request but those that went as a half-open probe (a 502 after
	// the refused attempt) gets the gateway's 503 at once.
	if float64(len(rs)-unavailable) > attempts {
		t.Errorf("%d of %d requests answered 503 with %v attempts made, want all but the probes", unavailable, len(rs), attempts)
	}
}

// The retry budget keeps its promise in a burst: 100 requests at once, every
// replica failing every request, make at most 1.1 × 100 attempts plus the
// floor (3 at once, 3 more per second).
func TestRetryBudgetBurstAtTotalFailure(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet))
	c := newClient(t)
	ctx := testContext(t, 60*time.Second)
	start := time.Now()
	var wg sync.WaitGroup
	var failed atomic.Int64
	for range 100 {
		wg.Go(func() {
			r, err := doPlain(ctx, c, gw.URL+"/v1/chat/completions", chatBody("Hi.", true), "X-Mock-Fault: status=503")
			if err != nil || r.Status != http.StatusOK {
				failed.Add(1)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	n := fleetRequests(fleet)
	bound := 1.1*100 + 3 + 3*elapsed.Seconds()
	t.Logf("100 concurrent requests at 100%% failure: %d upstream attempts in %s (bound %.0f); %d failed", n, elapsed.Round(time.Millisecond), bound, failed.Load())
	if float64(n) > bound {
		t.Errorf("%d upstream attempts, over 1.1 × 100 + the floor (%.0f)", n, bound)
	}
	if failed.Load() != 100 {
		t.Errorf("%d of 100 failed, want all (every replica fails)", failed.Load())
	}
}
