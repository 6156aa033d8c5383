package e2e

import (
	"encoding/json"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
	"github.com/llmproxy/caddy-llm-proxy/internal/redistest"
)

// TestPrometheusEvaluatesTheDashboardAndRules (issue 13 item 3): a real
// Prometheus scrapes a real gateway every second and evaluates
// deploy/prometheus/recording.yml and alerts.yml while 14s of load with an
// outage run through it — a replica answering 503 for 7s (its breaker opens,
// retries happen and spend the budget), a replica cutting a quarter of its
// streams after commit, hedged straggling replicas that close idle
// keep-alive connections, a pool whose only upstream refuses connections
// (every breaker open: 503 circuit_open), a dead pool with a fallback
// (degraded answers), tenants of three tiers at an admission capacity (a
// queue, rpm refusals, shedding, a tenant breaker tripped by an objective),
// saturation scraping, the fleet's Redis blackholed for 2s (local mode
// and back), and a pool with lb_policy prefix_cache in front of replicas
// that model vLLM's prefix cache, sent multi-turn chat conversations and
// completions sharing a long document (two APIs; hits, misses, and the
// servers' own hit ratios through saturation scraping). Then every query
// of deploy/grafana/llm-proxy.json (variables as "All", $__rate_interval
// 5s) and every recording rule is evaluated through
// Prometheus' HTTP API over the run: each must be valid and return data,
// every rule must evaluate without error, each template variable must list
// values, the panels that show the outage (and the prefix cache's hits)
// must show it (non-zero), the API and prefix-routing breakdowns must have a
// series for each API and result the load produced, and the alerts whose
// condition it meets must be pending.
func TestPrometheusEvaluatesTheDashboardAndRules(t *testing.T) {
	t.Parallel()
	const loadFor = 14 * time.Second
	ctx := testContext(t, 90*time.Second)

	rs := redistest.Start(t, redistest.Options{})
	px := redistest.NewProxy(t, rs.Addr())

	quick := mockllm.Behavior{TTFT: mockllm.Fixed(40 * time.Millisecond), Tokens: 8, TokenInterval: 15 * time.Millisecond}
	cutting := quick
	cutting.Fault = mockllm.Fault{Kind: mockllm.FaultCut, After: 3, Fraction: 0.25}
	fleetA := startFleet(t, mockllm.FleetConfig{Replicas: 3, Capacity: 2, Behavior: quick, PerReplica: map[int]mockllm.Behavior{1: cutting}})
	fleetB := startFleet(t, mockllm.FleetConfig{Replicas: 3,
		Behavior:    mockllm.Behavior{TTFT: mockllm.LogNormal(60*time.Millisecond, 0.9), Tokens: 6, TokenInterval: 10 * time.Millisecond},
		IdleTimeout: 300 * time.Millisecond, IdleCloseRace: 200 * time.Millisecond})
	spare := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{Model: "mock-small", TTFT: mockllm.Fixed(20 * time.Millisecond), Tokens: 4, TokenInterval: 5 * time.Millisecond}})
	// Replicas with vLLM's prefix cache (1ms of prefill per missed 64-byte
	// block) behind lb_policy prefix_cache.
	fleetE := startFleet(t, mockllm.FleetConfig{Replicas: 3,
		Behavior:    mockllm.Behavior{TTFT: mockllm.Fixed(20 * time.Millisecond), Tokens: 4, TokenInterval: 5 * time.Millisecond},
		PrefixCache: mockllm.PrefixCacheConfig{Blocks: 4000, PrefillPerBlock: time.Millisecond}})
	deadC, deadD := freePort(t), freePort(t)
	for deadD == deadC {
		deadD = freePort(t)
	}

	gold, free, batch := newKey("promgold"), newKey("promfree"), newKey("prombatch")
	globals := fmt.Sprintf(`llm_proxy {
		fleet redis redis://%s {
			refresh 200ms
			op_timeout 50ms
			instance_id gw-prom
		}
		tenants {
			key %s acme tier gold
			key %s freeloader tier free
			key %s slowjob tier batch
		}
		tier gold {
			priority 10
			queue_timeout 5s
			queue_wait_slo 2s
		}
		tier free {
			priority -1
			rpm 60
		}
		tier batch {
			priority 0
			ttft_slo 1ms
		}
	}`, px.Addr(), gold, free, batch)
	site := fmt.Sprintf(`
	handle_path /a/* {
		llm_proxy %s {
			max_attempts 3
			first_byte_timeout 2s
			retries {
				bucket 2 0.5
			}
			breaker {
				consecutive_failures 3
				min_open 500ms
				open_for 1s
				max_open 2s
			}
			admission {
				capacity 4
			}
			saturation {
				interval 250ms
			}
		}
	}
	handle_path /b/* {
		llm_proxy %s {
			retries {
				ratio 0.5
			}
			hedge {
				after 80ms
				max_ratio 0.5
				min_per_sec 10
			}
		}
	}
	handle_path /c/* {
		llm_proxy 127.0.0.1:%d {
			max_attempts 1
			breaker {
				consecutive_failures 2
				min_open 500ms
				open_for 1s
				max_open 2s
			}
		}
	}
	handle_path /d/* {
		llm_proxy 127.0.0.1:%d {
			max_attempts 1
			breaker {
				consecutive_failures 2
				min_open 500ms
				open_for 1s
				max_open 2s
			}
			fallback spare {
				to %s
				model mock-small
				max_output_tokens 64
			}
		}
	}
	handle_path /e/* {
		llm_proxy %s {
			lb_policy prefix_cache
			saturation {
				interval 250ms
			}
		}
	}`, upstreams(fleetA), upstreams(fleetB), deadC, deadD, upstreams(spare), upstreams(fleetE))
	gw := startGatewayWith(t, gatewayOptions{Globals: globals, Site: site})
	if !waitFor(10*time.Second, func() bool { return gw.fleet().Mode == "fleet" }) {
		t.Fatalf("the gateway is not in fleet mode after 10s: %+v", gw.fleet())
	}

	prom := startPrometheus(t, strings.TrimPrefix(gw.AdminURL, "http://"),
		deployDir+"/prometheus/recording.yml", deployDir+"/prometheus/alerts.yml")
	if !waitFor(10*time.Second, func() bool {
		h, _, err := prom.targetHealth(ctx)
		return err == nil && h == "up"
	}) {
		h, lastErr, err := prom.targetHealth(ctx)
		t.Fatalf("prometheus does not scrape the gateway's %s/metrics: health %q, last error %q (%v)", gw.AdminURL, h, lastErr, err)
	}

	// The load, with the outage on a timeline.
	start := time.Now()
	c := newClient(t)
	var wg sync.WaitGroup
	var sent, transportErrs atomic.Int64
	statuses := sync.Map{} // "path status" -> *atomic.Int64
	count := func(path string, status int) {
		v, _ := statuses.LoadOrStore(fmt.Sprintf("%s %d", path, status), new(atomic.Int64))
		v.(*atomic.Int64).Add(1)
	}
	// loop sends next()'s requests (a path under the gateway and a body)
	// until the load ends, pause() apart; the statuses are counted by name.
	loop := func(name, key string, pause func() time.Duration, next func() (path, body string)) {
		wg.Go(func() {
			for time.Since(start) < loadFor && ctx.Err() == nil {
				sent.Add(1)
				path, body := next()
				s, err := doStream(ctx, c, gw.URL+path, body, bearer(key))
				if err != nil {
					transportErrs.Add(1)
				} else {
					count(name, s.Status)
				}
				time.Sleep(pause())
			}
		})
	}
	worker := func(path, key string, pause func() time.Duration) {
		loop(path, key, pause, func() (string, string) {
			return path + "/v1/chat/completions", chatOf("Tell me about dashboards.", true, nil)
		})
	}
	fixed := func(d time.Duration) func() time.Duration { return func() time.Duration { return d } }
	for range 3 {
		worker("/a", gold, fixed(10*time.Millisecond))
	}
	for range 2 {
		worker("/a", free, fixed(50*time.Millisecond))
	}
	worker("/a", batch, fixed(100*time.Millisecond))
	for i := range 2 {
		rng := rand.New(rand.NewPCG(uint64(i), 13))
		var mu sync.Mutex
		worker("/b", gold, func() time.Duration {
			mu.Lock()
			defer mu.Unlock()
			// Around the replicas' 300ms keep-alive: some reuse a
			// connection safely, some cross its close.
			return time.Duration(rng.Int64N(int64(350 * time.Millisecond)))
		})
	}
	worker("/c", gold, fixed(100*time.Millisecond))
	worker("/d", gold, fixed(150*time.Millisecond))
	// The prefix cache: conversations of three turns, one after another
	// (a miss, then hits on the replica holding the conversation), and
	// completions of questions about one shared 3,000-character document
	// (hits after the first).
	var conv *conversation
	turn := 0
	loop("/e chat", gold, fixed(20*time.Millisecond), func() (string, string) {
		k := turn % 3
		if k == 0 {
			conv = newConversation("prom", turn/3)
		} else {
			conv.answered(k - 1)
		}
		turn++
		return "/e/v1/chat/completions", conv.ask(k)
	})
	doc := "Document: " + strings.Repeat("Dashboards draw what Prometheus scraped. ", 3000/41+1)
	question := 0
	loop("/e completions", gold, fixed(40*time.Millisecond), func() (string, string) {
		question++
		b, _ := json.Marshal(map[string]any{"model": "mock-llama", "stream": true, "max_tokens": 8,
			"prompt": fmt.Sprintf("%s\nQuestion %d: what does panel %d show?", doc[:3000], question, question)})
		return "/e/v1/completions", string(b)
	})
	wg.Go(func() {
		at := func(d time.Duration) bool {
			select {
			case <-time.After(time.Until(start.Add(d))):
				return true
			case <-ctx.Done():
				return false
			}
		}
		if !at(2 * time.Second) {
			return
		}
		outage := quick
		outage.Fault = mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503}
		fleetA.Replica(2).SetBehavior(outage)
		if !at(5 * time.Second) {
			return
		}
		px.Blackhole()
		if !at(7 * time.Second) {
			return
		}
		px.Pass()
		if !at(9 * time.Second) {
			return
		}
		fleetA.Replica(2).SetBehavior(quick)
	})
	wg.Wait()
	end := time.Now()
	var summary []string
	statuses.Range(func(k, v any) bool {
		summary = append(summary, fmt.Sprintf("%s: %d", k, v.(*atomic.Int64).Load()))
		return true
	})
	slices.Sort(summary)
	t.Logf("load: %d requests in %v (%d transport errors); by path and status: %s", sent.Load(), end.Sub(start).Round(time.Millisecond), transportErrs.Load(), strings.Join(summary, ", "))
	if transportErrs.Load() > 0 {
		t.Errorf("%d requests failed at the transport (the gateway must answer every request)", transportErrs.Load())
	}

	// Two more scrapes and rule evaluations after the load.
	time.Sleep(2500 * time.Millisecond)
	now := time.Now()
	from := start.Add(-2 * time.Second)

	// Every rule of both files evaluated, without an error.
	rules, err := prom.rules(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var recorded []string
	alerts := 0
	for _, r := range rules {
		if r.Health != "ok" || r.LastError != "" || r.LastEvaluation.Before(start) {
			t.Errorf("%s rule %s: health %q, last error %q, last evaluated %v: %s", r.Type, r.Name, r.Health, r.LastError, r.LastEvaluation, r.Query)
		}
		switch r.Type {
		case "recording":
			recorded = append(recorded, r.Name)
		case "alerting":
			alerts++
		}
	}
	if len(recorded) < 10 || alerts < 9 {
		t.Fatalf("prometheus loaded %d recording and %d alerting rules from deploy/prometheus, want every one: %v", len(recorded), alerts, rules)
	}
	// The outage is seen by the alerts whose conditions it meets (their
	// for: durations are longer than the run, so pending counts).
	for _, name := range []string{"LLMProxyBreakerOpen", "LLMProxyPoolUnavailable", "LLMProxyRetryBudgetExhausted"} {
		i := slices.IndexFunc(rules, func(r promRule) bool { return r.Name == name })
		if i < 0 {
			t.Errorf("alert %s is not loaded", name)
		} else if s := rules[i].State; s != "pending" && s != "firing" {
			t.Errorf("alert %s is %q after the outage, want pending or firing", name, s)
		}
	}

	// Every recorded series has data over the run.
	for _, name := range slices.Compact(slices.Sorted(slices.Values(recorded))) {
		series, err := prom.queryRange(ctx, name, from, now, time.Second)
		switch {
		case err != nil:
			t.Errorf("recording rule %s: %v", name, err)
		case len(series) == 0:
			t.Errorf("recording rule %s returned no data over the run", name)
		}
	}

	// Every dashboard query: valid at an instant (/api/v1/query) and with
	// data over the run (/api/v1/query_range, as the panel draws it).
	queries, vars := readDashboard(t, deployDir+"/grafana/llm-proxy.json")
	maxOf := map[string]float64{}         // panel title -> largest value of any of its queries
	maxOfQuery := map[string]float64{}    // panel title and refId -> largest value of the query
	labelsOf := map[string][]promSeries{} // panel title and refId -> the query's series
	for _, q := range queries {
		expr := grafanaExpr(q.Expr, 5*time.Second)
		if _, err := prom.query(ctx, expr); err != nil {
			t.Errorf("row %q, panel %q, query %s: %v\n\t%s", q.Row, q.Panel, q.RefID, err, expr)
			continue
		}
		series, err := prom.queryRange(ctx, expr, from, now, time.Second)
		if err != nil {
			t.Errorf("row %q, panel %q, query %s: %v\n\t%s", q.Row, q.Panel, q.RefID, err, expr)
			continue
		}
		if len(series) == 0 {
			t.Errorf("row %q, panel %q, query %s returned no data over the run:\n\t%s", q.Row, q.Panel, q.RefID, expr)
			continue
		}
		labelsOf[q.Panel+" "+q.RefID] = series
		for _, s := range series {
			if v, ok := s.maxValue(); ok {
				if old, seen := maxOf[q.Panel]; !seen || v > old {
					maxOf[q.Panel] = v
				}
				if old, seen := maxOfQuery[q.Panel+" "+q.RefID]; !seen || v > old {
					maxOfQuery[q.Panel+" "+q.RefID] = v
				}
			}
		}
	}
	if testing.Verbose() {
		for _, p := range slices.Sorted(maps.Keys(maxOf)) {
			t.Logf("panel %q: largest value %.4g", p, maxOf[p])
		}
	}
	// The panels that show the outage show it.
	for _, panel := range []string{
		"Breakers not closed",
		"Breaker transitions",
		"Short-circuits/s",
		"Every breaker open (503 circuit_open)/s",
		"Retries/s by upstream and reason",
		"Retry budget exhausted/s",
		"Streams cut after commit",
		"Hedges/s by outcome",
		"Hedge win ratio",
		"Queue wait p50 / p99 by tier",
		"Refusals by tier and code",
		"Tenant breakers not closed",
		"Estimated share of tokens",
		"KV-cache usage",
		"Fleet degraded (local mode)",
		"Redis errors/s",
		"Probe leases",
		"Degraded answers/s by fallback",
		"Degraded share of traffic",
		"Requests by API",
		"Prefix routing by result",
	} {
		v, ok := maxOf[panel]
		switch {
		case !ok && !slices.ContainsFunc(queries, func(q dashboardQuery) bool { return q.Panel == panel }):
			t.Errorf("the dashboard has no panel %q", panel)
		case v <= 0:
			t.Errorf("panel %q shows nothing above 0 over a run with an outage (largest value %v)", panel, v)
		}
	}

	// The prefix cache's panel draws the servers' own hit ratios (query A)
	// and the gateway's guess (query B), each above 0: later turns and the
	// shared document hit.
	for _, ref := range []string{"A", "B"} {
		const panel = "Prefix-cache hit ratio: each server vs the gateway's guess"
		if v, ok := maxOfQuery[panel+" "+ref]; !ok || v <= 0 || v > 1 {
			t.Errorf("panel %q, query %s: largest value %v (found %v), want a hit ratio in (0, 1] over a run with prefix-cache hits", panel, ref, v, ok)
		}
	}
	// The breakdowns have a series for each API and result the load made.
	for _, w := range []struct {
		panel, ref, label string
		values            []string
	}{
		{"Requests by API", "A", "api", []string{"chat", "completions"}},
		{"Requests by API", "B", "api", []string{"chat"}}, // /a's 429s, /c's 503s
		{"Prefix routing by result", "A", "result", []string{"hit", "miss"}},
		{"Prefix-cache hit ratio: each server vs the gateway's guess", "A", "upstream", fleetE.Addrs()},
	} {
		var got []string
		for _, s := range labelsOf[w.panel+" "+w.ref] {
			got = append(got, s.Metric[w.label])
		}
		for _, v := range w.values {
			if !slices.Contains(got, v) {
				t.Errorf("panel %q, query %s: series by %s %q, want %q among them", w.panel, w.ref, w.label, got, v)
			}
		}
	}

	// Every template variable lists values, as Grafana asks for them.
	want := map[string][]string{
		"upstream": slices.Concat(fleetA.Addrs(), fleetB.Addrs(), fleetE.Addrs(), []string{fmt.Sprintf("127.0.0.1:%d", deadC)}),
		"model":    {"mock-llama"},
		"tier":     {"gold", "free", "batch"},
	}
	for _, v := range vars {
		vals, err := prom.labelValues(ctx, v.Label, grafanaExpr(v.Selector, 5*time.Second), from, now)
		if err != nil {
			t.Errorf("variable %s: %v", v.Name, err)
			continue
		}
		for _, w := range want[v.Name] {
			if !slices.Contains(vals, w) {
				t.Errorf("variable %s (label_values(%s, %s)) lists %q, want %q among them", v.Name, v.Selector, v.Label, vals, w)
			}
		}
	}
	if t.Failed() {
		for _, name := range []string{"/a 200", "/b 200", "/c 503", "/d 200", "/e chat 200", "/e completions 200"} {
			if _, ok := statuses.Load(name); !ok {
				t.Logf("no request got %q: the scenario did not run as planned", name)
			}
		}
	}
}
