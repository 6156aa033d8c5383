package e2e

import (
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// The tests of this file check the retry budget, the backoff and the
// handling of Retry-After from the outside: through what each mock
// upstream received and when (its request records, matched to client
// requests by X-Request-Id, which the mock turns into the response id),
// the metrics and the admin API.

// upstreamAttempt is one request an upstream received: which replica, and
// the mock's record of it.
type upstreamAttempt struct {
	Replica int
	Rec     mockllm.RequestRecord
}

// attemptsByRequestID groups the requests the fleet received by the
// client's X-Request-Id (the mock's record id is "chatcmpl-" + that id),
// each group in arrival order.
func attemptsByRequestID(f *mockllm.Fleet) map[string][]upstreamAttempt {
	out := map[string][]upstreamAttempt{}
	for i, st := range f.Stats().Replicas {
		for _, rec := range st.Recent {
			id := strings.TrimPrefix(strings.TrimPrefix(rec.ID, "chatcmpl-"), "cmpl-")
			out[id] = append(out[id], upstreamAttempt{Replica: i, Rec: rec})
		}
	}
	for _, as := range out {
		slices.SortFunc(as, func(a, b upstreamAttempt) int { return a.Rec.Started.Compare(b.Rec.Started) })
	}
	return out
}

// metricSum scrapes the gateway and sums one metric's samples with labels.
func metricSum(gw *gateway, name string, labels map[string]string) float64 {
	gw.t.Helper()
	v, _ := metricValue(gw.scrapeMetrics(), name, labels)
	return v
}

// TestRetryBudgetBoundsAttemptsWhenEveryUpstream503s: 100 concurrent
// requests to three upstreams that all answer 503. With max_attempts 3 they
// would ask for 200 retries; the ratio budget (0.1 × requests plus a
// floor holding one second of min_per_sec and earning min_per_sec per
// second; issue 19: it used to be a reservoir of min_per_sec × window, 30
// retries at once) grants about 13 of them plus 3 a second, so the fleet
// receives at most 1.1 × 100 + the floor. Every request gets its 503 at once
// after its last attempt (a refused retry never sleeps), granted retries
// wait within their backoff ceilings and go to another upstream, and the
// refusals are counted.
func TestRetryBudgetBoundsAttemptsWhenEveryUpstream503s(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3, Behavior: mockllm.Behavior{
		Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: http.StatusServiceUnavailable},
	}})
	// breaker off: three 503s in a row would open every breaker, and the
	// gateway would then refuse requests itself (503 circuit_open) without
	// asking the budget, which would hide what this test measures.
	//
	// backoff 400ms 2s instead of the default 100ms: a request refused a
	// retry must get its 503 at once, and a longer base makes any sleep on
	// that path stand out from the loopback latency of a loaded machine.
	// The ceilings (400ms, then 800ms) stay under the cap, so no request
	// should take longer than cap + margin.
	const (
		requests  = 100
		ratio     = 0.1
		minPerSec = 3.0
		window    = 10 * time.Second
		base      = 400 * time.Millisecond
		backCap   = 2 * time.Second
	)
	created := time.Now() // the budget is created at provisioning, after this
	gw := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		max_attempts 3
		breaker off
		retries {
			ratio %g
			window %v
			min_per_sec %g
			backoff %v %v
		}
	}`, upstreams(fleet), ratio, window, minPerSec, base, backCap))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	type result struct {
		status     int
		body       []byte
		start, end time.Time
		err        error
	}
	results := make([]result, requests)
	release := make(chan struct{})
	var wg sync.WaitGroup
	for i := range requests {
		wg.Go(func() {
			<-release
			r := &results[i]
			r.start = time.Now()
			resp, err := doPlain(ctx, c, gw.URL+"/v1/chat/completions", chatBody("Is anyone up?", true),
				fmt.Sprintf("X-Request-Id: budget-%d", i))
			r.end = time.Now()
			if err != nil {
				r.err = err
				return
			}
			r.status, r.body = resp.Status, resp.Body
		})
	}
	close(release)
	wg.Wait()
	elapsed := time.Since(created)

	for i, r := range results {
		if r.err != nil {
			t.Fatalf("request %d: %v", i, r.err)
		}
		if r.status != http.StatusServiceUnavailable {
			t.Errorf("request %d: status %d, want the upstreams' 503: %s", i, r.status, r.body)
		}
	}

	// The bound of budget.Ratio: over a run of length T since the budget
	// was created, retries ≤ ratio × requests + max(1, min_per_sec) +
	// min_per_sec × T.
	maxRetries := ratio*requests + max(1, minPerSec) + minPerSec*elapsed.Seconds()
	total := fleetRequests(fleet)
	retries := total - requests
	t.Logf("%d requests, %d upstream attempts (%d retries; bound %.0f after %v)",
		requests, total, retries, maxRetries, elapsed.Round(time.Millisecond))
	if float64(retries) > maxRetries {
		t.Errorf("the fleet received %d requests for %d client requests: %d retries, over the budget's bound %.0f",
			total, requests, retries, maxRetries)
	}
	// The ratio's share and one second of the floor are granted at once,
	// and 100 failing requests ask for far more.
	if least := ratio*requests + minPerSec; float64(retries) < least {
		t.Errorf("only %d retries were granted, want at least ratio × requests + one second of the floor, %.0f", retries, least)
	}

	// Per request: distinct upstreams, granted retries within their
	// backoff ceiling, and the 503 at once after the last attempt.
	attempts := attemptsByRequestID(fleet)
	spent := 0 // requests that used all of max_attempts
	for i, r := range results {
		as := attempts[fmt.Sprintf("budget-%d", i)]
		if len(as) == 0 || len(as) > 3 {
			t.Errorf("request %d: %d upstream attempts, want 1 to 3", i, len(as))
			continue
		}
		if len(as) == 3 {
			spent++
		}
		seen := map[int]bool{}
		for k, a := range as {
			if seen[a.Replica] {
				t.Errorf("request %d: attempt %d went to replica %d again, want another upstream", i, k+1, a.Replica)
			}
			seen[a.Replica] = true
			if k == 0 {
				continue
			}
			// Retry k-1 waits in [0, min(cap, base·2^(k-1))].
			gap := a.Rec.Started.Sub(as[k-1].Rec.Ended)
			if ceiling := min(backCap, base<<(k-1)); gap > ceiling+300*time.Millisecond {
				t.Errorf("request %d: retry %d started %v after the failure, want within its backoff ceiling %v",
					i, k, gap.Round(time.Millisecond), ceiling)
			}
		}
		last := as[len(as)-1].Rec
		if last.Ended.IsZero() {
			t.Errorf("request %d: its last attempt has not ended: %+v", i, last)
			continue
		}
		if gap := r.end.Sub(last.Ended); gap > 250*time.Millisecond {
			t.Errorf("request %d (%d attempts): its 503 reached the client %v after the last upstream answered, want at once",
				i, len(as), gap.Round(time.Millisecond))
		}
		if d := r.end.Sub(r.start); d > backCap+time.Second {
			t.Errorf("request %d took %v, over the backoff cap %v plus a margin", i, d.Round(time.Millisecond), backCap)
		}
	}

	samples := gw.scrapeMetrics()
	exhausted, _ := metricValue(samples, "caddy_llm_proxy_retry_budget_exhausted_total", nil)
	scheduled, _ := metricValue(samples, "caddy_llm_proxy_retries_total", nil)
	t.Logf("retries_total %v, retry_budget_exhausted_total %v, requests that used 3 attempts %d", scheduled, exhausted, spent)
	if exhausted == 0 {
		t.Error("caddy_llm_proxy_retry_budget_exhausted_total = 0, want > 0")
	}
	if int64(scheduled) != retries {
		t.Errorf("caddy_llm_proxy_retries_total = %v, the fleet saw %d retries", scheduled, retries)
	}
	if v, _ := metricValue(samples, "caddy_llm_proxy_retries_total", map[string]string{"reason": "http_5xx"}); v != scheduled {
		t.Errorf("caddy_llm_proxy_retries_total{reason=http_5xx} = %v, want all %v", v, scheduled)
	}
	// Every request ends either refused by the budget or with its attempts
	// spent.
	if int(exhausted)+spent != requests {
		t.Errorf("%v refusals + %d requests with 3 attempts = %v, want %d (one or the other per request)",
			exhausted, spent, int(exhausted)+spent, requests)
	}
}

// TestRetryAfterKeepsUpstreamOutThenLetsItBack: of three upstreams, one
// answers a 429 with Retry-After: 2. For the next 2 s it receives no request
// while the other two serve every client request (the 429'd one included,
// retried elsewhere); after that it is used again.
func TestRetryAfterKeepsUpstreamOutThenLetsItBack(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3, PerReplica: map[int]mockllm.Behavior{
		0: {Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: http.StatusTooManyRequests, RetryAfter: 2}},
	}})
	limited := fleet.Replica(0)
	gw := startGateway(t, fmt.Sprintf("\tllm_proxy %s {\n\t\tlb_policy round_robin\n\t}", upstreams(fleet)))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	type result struct {
		start   time.Time
		replica string
		problem string
	}
	var (
		mu      sync.Mutex
		results []result
		wg      sync.WaitGroup
	)
	stop := make(chan struct{})
	for w := range 3 {
		wg.Go(func() {
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				r := result{start: time.Now()}
				s, err := doStream(ctx, c, gw.URL+"/v1/chat/completions", chatBody("Steady traffic.", true),
					fmt.Sprintf("X-Request-Id: ra-%d-%d", w, n), "X-Mock-TTFT: 20ms", "X-Mock-Tokens: 3", "X-Mock-Token-Interval: 0")
				switch {
				case err != nil:
					r.problem = err.Error()
				case s.Status != http.StatusOK || s.Err != nil || len(s.Events) == 0 || !s.Events[len(s.Events)-1].IsDone():
					r.problem = fmt.Sprintf("status %d, err %v: %q", s.Status, s.Err, raw(s.Events))
				default:
					r.replica = s.Header.Get(mockllm.HeaderReplica)
				}
				mu.Lock()
				results = append(results, r)
				mu.Unlock()
			}
		})
	}
	defer func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		wg.Wait()
	}()

	// The first request that reaches the limited upstream gets the 429;
	// from then on the upstream would serve (it is healthy again), so any
	// request it receives in the next 2 s was let through by the gateway.
	if !waitFor(10*time.Second, func() bool { return limited.Stats().Faults["status"] > 0 }) {
		t.Fatal("the limited upstream received no request in 10s")
	}
	limited.SetBehavior(mockllm.Behavior{})
	time.Sleep(100 * time.Millisecond) // let any request picked before the 429 land
	var hit mockllm.RequestRecord
	for _, rec := range limited.Stats().Recent {
		if rec.Status == http.StatusTooManyRequests {
			hit = rec // the last 429 starts the exclusion
		}
	}
	if hit.Ended.IsZero() {
		t.Fatalf("no finished 429 in the limited upstream's records: %+v", limited.Stats().Recent)
	}
	if v := gw.breaker(limited.Addr()); v.State != "open" || v.OpenUntil.Sub(hit.Ended) < 1900*time.Millisecond || v.OpenUntil.Sub(hit.Ended) > 2200*time.Millisecond {
		t.Errorf("breaker of the limited upstream: state %s, open until %v after the 429; want open for about 2s",
			v.State, v.OpenUntil.Sub(hit.Ended).Round(time.Millisecond))
	}
	time.Sleep(time.Until(hit.Ended.Add(3500 * time.Millisecond)))
	close(stop)
	wg.Wait()

	const slack = 50 * time.Millisecond // the gateway hears the 429 a loopback hop after the mock sent it
	excludedUntil := hit.Ended.Add(2 * time.Second)
	var back time.Time // the first request the limited upstream got after the 429
	for _, rec := range limited.Stats().Recent {
		switch {
		case !rec.Started.After(hit.Ended.Add(slack)):
		case rec.Started.Before(excludedUntil.Add(-slack)):
			t.Errorf("the limited upstream received %s %v after its 429 with Retry-After: 2",
				rec.ID, rec.Started.Sub(hit.Ended).Round(time.Millisecond))
		case back.IsZero():
			back = rec.Started
		}
	}
	switch {
	case back.IsZero():
		t.Errorf("the limited upstream received no request in the 1.5s after its Retry-After ended")
	case back.Sub(excludedUntil) > time.Second:
		t.Errorf("the limited upstream was used again %v after its Retry-After ended, want soon after",
			back.Sub(excludedUntil).Round(time.Millisecond))
	default:
		t.Logf("the limited upstream was used again %v after its 429", back.Sub(hit.Ended).Round(time.Millisecond))
	}

	served := map[string]int{}
	bad := 0
	for _, r := range results {
		if r.problem != "" {
			if bad++; bad <= 5 {
				t.Errorf("client request at %s: %s", r.start.Format("15:04:05.000"), r.problem)
			}
			continue
		}
		if r.start.After(hit.Ended) && r.start.Before(excludedUntil.Add(-slack)) {
			served[r.replica]++
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d client requests failed, want every one served", bad, len(results))
	}
	for i := 1; i < 3; i++ {
		if served[fleet.Replica(i).Addr()] == 0 {
			t.Errorf("upstream %d served no request while the limited one was out: %v", i, served)
		}
	}
	t.Logf("%d client requests; during the exclusion served by %v", len(results), served)
}

// TestRetryAfterBeyondBackoffCapReturns429AtOnce: a single upstream
// answers 429 with Retry-After: 30, longer than the backoff cap, so no
// upstream can serve in time: the client gets the 429 with Retry-After at
// once, without the gateway sleeping first, and the upstream is asked once.
// A breaker reset through the admin API between trials brings the
// upstream back for the next one.
//
// With the default backoff (base 100ms) a sleep before the refusal could
// hide inside the 100 ms bound; with base 1s it cannot.
func TestRetryAfterBeyondBackoffCapReturns429AtOnce(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, retries string }{
		{"default backoff", ""},
		{"backoff 1s 2s", "\n\t\tretries {\n\t\t\tbackoff 1s 2s\n\t\t}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{
				Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: http.StatusTooManyRequests, RetryAfter: 30},
			}})
			addr := fleet.Replica(0).Addr()
			gw := startGateway(t, fmt.Sprintf("\tllm_proxy %s {%s\n\t}", addr, tc.retries))
			c := newClient(t)
			ctx := testContext(t, 30*time.Second)

			const trials = 5
			for i := range trials {
				if i > 0 {
					if status, v := gw.breakerAction(addr, "reset"); status != http.StatusOK || v.State != "closed" {
						t.Fatalf("POST %s/reset: status %d, state %q", addr, status, v.State)
					}
				}
				before := fleetRequests(fleet)
				start := time.Now()
				r, err := doPlain(ctx, c, gw.URL+"/v1/chat/completions", chatBody("Too many?", true))
				elapsed := time.Since(start)
				if err != nil {
					t.Fatal(err)
				}
				if r.Status != http.StatusTooManyRequests {
					t.Fatalf("trial %d: status %d, want the upstream's 429: %s", i+1, r.Status, r.Body)
				}
				if ra, err := strconv.Atoi(r.Header.Get("Retry-After")); err != nil || ra < 1 {
					t.Errorf("trial %d: Retry-After %q, want whole seconds ≥ 1", i+1, r.Header.Get("Retry-After"))
				}
				if elapsed >= 100*time.Millisecond {
					t.Errorf("trial %d: the 429 took %v, want under 100ms (never sleep when no upstream can serve in time)",
						i+1, elapsed.Round(time.Millisecond))
				}
				if n := fleetRequests(fleet) - before; n != 1 {
					t.Errorf("trial %d: the upstream was asked %d times, want once", i+1, n)
				}
			}
		})
	}
}

// TestUpstream400sAreNeverRetriedOrHedged: with retries and hedging on
// (after 250ms, no rate cap to hide behind: long enough that twenty
// concurrent 400s under -race are answered before it), requests that upstreams answer
// with 400 cause exactly one upstream call each, streaming or not, and no
// hedge fires. A slow request afterwards does hedge and a request answered
// 503 everywhere is retried, so the configuration did allow both, and the
// hedge and retry counters hold exactly those.
func TestUpstream400sAreNeverRetriedOrHedged(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3})
	// max_ratio 1: the default 0.1 would refuse hedges to a pool with
	// fewer than ten requests in the window, whatever the status.
	gw := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		lb_policy round_robin
		max_attempts 3
		hedge {
			after 250ms
			max_ratio 1
		}
	}`, upstreams(fleet)))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	const requests = 20
	var wg sync.WaitGroup
	errs := make(chan error, requests)
	for i := range requests {
		wg.Go(func() {
			r, err := doPlain(ctx, c, gw.URL+"/v1/chat/completions", chatBody("Far too long a prompt.", i%2 == 0),
				fmt.Sprintf("X-Request-Id: bad-%d", i), "X-Mock-Fault: status=400")
			switch {
			case err != nil:
				errs <- err
			case r.Status != http.StatusBadRequest || !strings.Contains(string(r.Body), "maximum context length"):
				errs <- fmt.Errorf("request %d: status %d, want the upstream's 400: %s", i, r.Status, r.Body)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	attempts := attemptsByRequestID(fleet)
	for i := range requests {
		if as := attempts[fmt.Sprintf("bad-%d", i)]; len(as) != 1 {
			t.Errorf("request bad-%d reached %d upstreams, want exactly 1", i, len(as))
		}
	}
	if n := fleetRequests(fleet); n != requests {
		t.Errorf("the fleet got %d requests for %d client requests", n, requests)
	}
	samples := gw.scrapeMetrics()
	if v := metricValueOrZero(t, samples, "caddy_llm_proxy_upstream_attempts_total", map[string]string{"outcome": "http_4xx"}); v != requests {
		t.Errorf("caddy_llm_proxy_upstream_attempts_total{outcome=http_4xx} = %v, want %d", v, requests)
	}
	// retry_budget_exhausted_total has no labels: it is exposed from the
	// start, so its 0 can be checked now.
	if v := metricValueOrZero(t, samples, "caddy_llm_proxy_retry_budget_exhausted_total", nil); v != 0 {
		t.Errorf("caddy_llm_proxy_retry_budget_exhausted_total = %v after only 400s, want 0", v)
	}
	// hedges_total and retries_total are counter vectors: while nothing
	// was counted in them they are not exposed at all, which a renamed
	// metric would look like too. Each is checked after a control request
	// that counts exactly one known thing in it: the totals must then be
	// that thing alone, so the 400s counted nothing.

	// Control 1: a request slower than the hedge delay is hedged.
	s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("Slowly.", true),
		"X-Mock-TTFT: 1s", "X-Mock-Tokens: 2", "X-Mock-Token-Interval: 0")
	checkCleanStream(t, s)
	samples = gw.scrapeMetrics()
	if v := metricValueOrZero(t, samples, "caddy_llm_proxy_hedges_total", map[string]string{"outcome": "fired"}); v != 1 {
		t.Errorf("caddy_llm_proxy_hedges_total{outcome=fired} = %v after 400s and one 1s TTFT with hedge after 250ms, want 1 (the control's)", v)
	}
	if v := metricValueOrZero(t, samples, "caddy_llm_proxy_hedges_total", map[string]string{"outcome": "suppressed"}); v != 0 {
		t.Errorf("caddy_llm_proxy_hedges_total{outcome=suppressed} = %v, want 0", v)
	}

	// Control 2: a request that every upstream answers 503 is retried;
	// retries_total must count exactly its retries (its upstream calls
	// after the first).
	r, err := doPlain(ctx, c, gw.URL+"/v1/chat/completions", chatBody("Retry me.", false),
		"X-Request-Id: retry-control", "X-Mock-Fault: status=503")
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != http.StatusServiceUnavailable {
		t.Errorf("retry control: status %d, want the upstreams' 503: %s", r.Status, r.Body)
	}
	controlRetries := float64(len(attemptsByRequestID(fleet)["retry-control"]) - 1)
	if controlRetries < 1 {
		t.Fatalf("retry control: %v retries reached the fleet, want at least 1 (max_attempts 3)", controlRetries)
	}
	samples = gw.scrapeMetrics()
	if v := metricValueOrZero(t, samples, "caddy_llm_proxy_retries_total", nil); v != controlRetries {
		t.Errorf("caddy_llm_proxy_retries_total = %v after 400s and a control with %v retries, want %v (none for a 400)", v, controlRetries, controlRetries)
	}
	if v := metricValueOrZero(t, samples, "caddy_llm_proxy_retries_total", map[string]string{"reason": "http_5xx"}); v != controlRetries {
		t.Errorf("caddy_llm_proxy_retries_total{reason=http_5xx} = %v, want %v", v, controlRetries)
	}
}
