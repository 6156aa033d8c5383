package e2e

// End-to-end tests of saturation-aware routing (issue 9): the gateway
// scrapes each replica's vLLM /metrics, routes by queue depth and KV-cache
// usage (least_queue), keeps saturated replicas out, trips breakers on
// queue wait, survives a failing or hanging /metrics, reads both KV-cache
// names, keeps one scraper per replica across reloads, and gives admission
// the pool signal. Load that the gateway must learn of from /metrics alone
// is sent straight to a replica (directLoad), as other clients of a shared
// server would. Intervals are 100–200ms so that each test takes seconds.

import (
	"fmt"
	"math"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// TestSaturationDeepQueueIsAvoidedUntilItDrains: of three replicas, the
// first (capacity 1) has eight requests of another client queued. No
// request through the gateway reaches it while its queue drains, the other
// two serve them with the TTFT they had while the fleet was idle, and once
// its queue is empty it is back in rotation.
func TestSaturationDeepQueueIsAvoidedUntilItDrains(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3,
		Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(40 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	deep := fleet.Replica(0)
	others := []string{fleet.Replica(1).Addr(), fleet.Replica(2).Addr()}
	deep.SetCapacity(1)
	// stale_after 1s: a scrape late by a few intervals on a loaded machine
	// must not make the deep queue unknown (then scored on the gateway's
	// own count alone, which is 0 here).
	gw := startGateway(t, satSite(fleet, "interval 100ms\nstale_after 1s\nqueue_threshold 2\ntrip off"))
	gw.waitScraped(fleet, 5*time.Second)
	c := newClient(t)
	ctx := testContext(t, 40*time.Second)
	url := gw.URL + "/v1/chat/completions"

	var idle []userResult
	for i := range 9 {
		idle = append(idle, userStream(ctx, c, url, fmt.Sprintf("idle-%d", i)))
	}
	checkUsersServed(t, "idle fleet", idle)
	base := median(ttfts(idle, fleet.Addrs()...))

	const hold = 250 * time.Millisecond
	load := startDirectLoad(t, deep, 8, false, "", fmt.Sprintf("X-Mock-TTFT: %v", hold), "X-Mock-Tokens: 1")
	if v, ok := gw.waitSaturation(deep.Addr(), 3*time.Second, func(v satView) bool {
		w, known := v.signal("queue_depth").value()
		return known && w >= 5
	}); !ok {
		t.Fatalf("the gateway never saw replica 0's queue (mock: %d waiting); its snapshot: %+v", deep.Stats().Waiting, v)
	}

	// Requests one after the other until the mock's queue is empty.
	var during []userResult
	for i := 0; deep.Stats().Waiting > 0; i++ {
		during = append(during, userStream(ctx, c, url, fmt.Sprintf("during-%d", i)))
	}
	load.drain() // the last queued request has run
	checkUsersServed(t, "while replica 0 drains its queue", during)
	if len(during) < 10 {
		t.Fatalf("only %d requests were sent while replica 0 drained its queue; the test needs more", len(during))
	}
	// The queue was empty once the last of the other client's requests was
	// scheduled: its first token came hold later.
	var drained time.Time
	for _, rec := range deep.Stats().Recent {
		if strings.HasPrefix(rec.ID, "chatcmpl-direct-") {
			if at := rec.FirstEvent.Add(-hold); at.After(drained) {
				drained = at
			}
		}
	}
	for _, rec := range userRecords(deep, "during-") {
		if rec.Started.Before(drained) {
			t.Errorf("request %s reached replica 0 at %s, %v before its queue drained: a deep queue must be avoided",
				rec.ID, rec.Started.Format("15:04:05.000"), drained.Sub(rec.Started).Round(time.Millisecond))
		}
	}
	got := ttfts(during, others...)
	if len(got) == 0 {
		t.Fatalf("no request was served by replicas 1 and 2: %v", countByReplica(during))
	}
	t.Logf("TTFT idle median %v; while replica 0 drained (%d requests on replicas 1 and 2): median %v, max %v",
		base, len(got), median(got), got[len(got)-1])
	if m := median(got); m > base+50*time.Millisecond {
		t.Errorf("TTFT median on replicas 1 and 2 was %v while replica 0 drained its queue, %v idle: want it flat", m, base)
	}
	if m := got[len(got)-1]; m > base+250*time.Millisecond {
		t.Errorf("TTFT up to %v on replicas 1 and 2 while replica 0 drained its queue (idle median %v): want it flat", m, base)
	}

	// Drained and idle (the gateway sees it so): back in rotation.
	if v, ok := gw.waitSaturation(deep.Addr(), 3*time.Second, func(v satView) bool {
		w, wk := v.signal("queue_depth").value()
		r, rk := v.signal("running").value()
		return wk && rk && w == 0 && r == 0
	}); !ok {
		t.Fatalf("replica 0 never read idle after its queue drained: %+v (mock: %+v)", v, deep.Stats())
	}
	after := userBurst(ctx, c, url, "after", 9, 20*time.Millisecond, "X-Mock-Tokens: 5", "X-Mock-Token-Interval: 100ms")
	checkUsersServed(t, "after replica 0 drained its queue", after)
	if n := countByReplica(after)[deep.Addr()]; n == 0 {
		t.Errorf("replica 0 served none of 9 concurrent requests after its queue drained (%v): it must come back into rotation", countByReplica(after))
	}
}

// TestSaturationBurstWithinOneScrapeSpreadsEvenly: 60 streams sent at once
// onto three idle replicas, all between two scrapes (interval 10s), spread
// about evenly: each replica gets 20 ± 4, although every scrape said
// "idle". The attempts started since the scrape count as queue, as the
// access log's {http.llm_proxy.saturation} shows: each replica's first
// pick scores 0, the last ones of the burst score about 19 / 5.
func TestSaturationBurstWithinOneScrapeSpreadsEvenly(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3,
		Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(20 * time.Millisecond), Tokens: 8, TokenInterval: 150 * time.Millisecond}})
	logFile := filepath.Join(t.TempDir(), "access.log")
	gw := startGateway(t, fmt.Sprintf("\tlog {\n\t\toutput file %s\n\t\tformat json\n\t}\n", logFile)+
		"\tlog_append llm_upstream {http.llm_proxy.upstream}\n\tlog_append llm_saturation {http.llm_proxy.saturation}\n"+
		satSite(fleet, "interval 10s"))
	gw.waitScraped(fleet, 5*time.Second)
	var scrapes []int64
	for _, r := range fleet.Stats().Replicas {
		scrapes = append(scrapes, r.Scrapes)
	}
	tr := &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	c := &http.Client{Transport: tr}
	ctx := testContext(t, 30*time.Second)

	const n = 60
	rs := userBurst(ctx, c, gw.URL+"/v1/chat/completions", "burst", n, 0)
	checkUsersServed(t, "burst", rs)
	st := fleet.Stats().Replicas
	maxIn := 0
	for i, r := range st {
		if r.Scrapes != scrapes[i] {
			t.Fatalf("replica %d was scraped during the burst (%d scrapes before, %d after): the test needs the burst within one scrape interval", i, scrapes[i], r.Scrapes)
		}
		maxIn += r.MaxInFlight
	}
	if maxIn < n-3 {
		t.Fatalf("the replicas held at most %d of the %d streams at once (sum of their maxima): the burst was not in flight together", maxIn, n)
	}
	by := countByReplica(rs)
	t.Logf("burst of %d: %v", n, by)
	for i, a := range fleet.Addrs() {
		if got := by[a]; got < n/3-4 || got > n/3+4 {
			t.Errorf("replica %d served %d of %d streams sent within one scrape interval, want %d ± 4 (counts %v)", i, got, n, n/3, by)
		}
	}

	var entries []map[string]any
	if !waitFor(5*time.Second, func() bool { entries = readJSONLines(t, logFile); return len(entries) >= n }) {
		t.Fatalf("the access log has %d entries after 5s, want %d", len(entries), n)
	}
	scores := map[string][]float64{}
	for _, e := range entries {
		up, _ := e["llm_upstream"].(string)
		raw, _ := e["llm_saturation"].(string)
		v, err := strconv.ParseFloat(raw, 64)
		if err != nil || v < 0 {
			t.Errorf("access log entry: llm_saturation %q (upstream %q), want the chosen upstream's score", e["llm_saturation"], up)
			continue
		}
		scores[up] = append(scores[up], v)
	}
	for i, a := range fleet.Addrs() {
		lo, hi := slices.Min(append(scores[a], math.Inf(1))), slices.Max(append(scores[a], math.Inf(-1)))
		t.Logf("replica %d: %d picks scored %v to %v", i, len(scores[a]), lo, hi)
		if lo != 0 || hi < float64(by[a]-3)/5 || hi > float64(by[a])/5 {
			t.Errorf("replica %d: the %d picks of it scored %v to %v ({http.llm_proxy.saturation}), want 0 for the first and about (%d − 1) / 5 for the last: the burst's own attempts are its queue",
				i, len(scores[a]), lo, hi, by[a])
		}
	}
}

// TestSaturationHungMetricsGetsNoMoreThanFairShare: of three replicas, the
// first's /metrics never answers. Its signals read stale, it is scored on
// the gateway's own in-flight count, and of 30 concurrent streams it gets
// some but no more than its fair share (a hung scrape read as "idle" would
// herd traffic onto it); one scrape at a time is ever in flight to it.
func TestSaturationHungMetricsGetsNoMoreThanFairShare(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3,
		Behavior:          mockllm.Behavior{TTFT: mockllm.Fixed(20 * time.Millisecond), Tokens: 8, TokenInterval: 120 * time.Millisecond},
		PerReplicaMetrics: map[int]mockllm.MetricsMode{0: {Fault: mockllm.MetricsHang}}})
	hung := fleet.Replica(0)
	gw := startGateway(t, satSite(fleet, "interval 200ms\ntimeout 100ms"))
	for _, r := range fleet.Replicas()[1:] {
		if v, ok := gw.waitSaturation(r.Addr(), 5*time.Second, func(v satView) bool { return v.ScoreKnown }); !ok {
			t.Fatalf("replica %d has no fresh snapshot: %+v", r.Index(), v)
		}
	}
	if v, found, ok := gw.waitSatMetric(satStateMetric, hung.Addr(), "queue_depth", 5*time.Second, func(v float64) bool { return v == stateStale }); !ok {
		t.Fatalf("%s{signal=queue_depth} of the replica whose /metrics hangs = %v (series found: %v), want %d (stale)", satStateMetric, v, found, stateStale)
	}
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	const n = 30
	rs := userBurst(ctx, c, gw.URL+"/v1/chat/completions", "spread", n, 20*time.Millisecond)
	checkUsersServed(t, "30 concurrent streams", rs)
	by := countByReplica(rs)
	t.Logf("30 streams: %v (replica 0's /metrics hangs)", by)
	if got := by[hung.Addr()]; got < 1 || got > n/3+2 {
		t.Errorf("the replica whose /metrics hangs served %d of %d concurrent streams, want 1 to %d: at most its fair share (unknown is never idle), and not none (unknown is never full)",
			got, n, n/3+2)
	}

	v, ok := gw.saturation()[hung.Addr()]
	switch {
	case !ok:
		t.Errorf("the admin API lists no snapshot of the replica whose /metrics hangs")
	case v.ScoreKnown || v.LastError == "" || v.ScrapedAt != nil:
		t.Errorf("snapshot of the replica whose /metrics hangs: score_known %v, last_error %q, scraped_at %v; want unknown, the timeout, no scrape", v.ScoreKnown, v.LastError, v.ScrapedAt)
	}
	samples := gw.scrapeMetrics()
	if errs, found := metricValue(samples, scrapeErrMetric, map[string]string{"upstream": hung.Addr()}); !found || errs < 2 {
		t.Errorf("%s{upstream=%s} = %v (series found: %v), want the failed scrapes counted", scrapeErrMetric, hung.Addr(), errs, found)
	}
	st := hung.Stats()
	if st.Scrapes < 2 || st.MaxConcurrentScrapes != 1 {
		t.Errorf("the hung /metrics got %d scrapes, at most %d at once; want several, one at a time (each ends at its timeout)", st.Scrapes, st.MaxConcurrentScrapes)
	}
}

// TestSaturationSingleReplicaWithFailingMetricsKeepsServing: a pool of one
// replica whose /metrics fails (500, or no answer) keeps serving at the
// latency of the replica itself: its signals read stale, and stale is not
// full: even a sheddable tier is served, past the queue threshold of
// concurrent requests.
func TestSaturationSingleReplicaWithFailingMetricsKeepsServing(t *testing.T) {
	t.Parallel()
	for _, spec := range []string{"status=500", "hang"} {
		t.Run(spec, func(t *testing.T) {
			t.Parallel()
			mode, err := mockllm.ParseMetricsMode(spec)
			if err != nil {
				t.Fatal(err)
			}
			fleet := startFleet(t, mockllm.FleetConfig{Metrics: mode,
				Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(30 * time.Millisecond), Tokens: 4, TokenInterval: 50 * time.Millisecond}})
			r := fleet.Replica(0)
			key := newKey("batch")
			gw := startTenantGateway(t, gatewayOptions{
				Globals: fmt.Sprintf("\tllm_proxy {\n\t\ttenants {\n\t\t\tkey %s batchy tier batch\n\t\t}\n\t\ttier batch {\n\t\t\tpriority -1\n\t\t}\n\t}", key),
				Site:    satSite(fleet, "interval 100ms\ntimeout 50ms"),
			}, key)
			if v, found, ok := gw.waitSatMetric(satStateMetric, r.Addr(), "queue_depth", 5*time.Second, func(v float64) bool { return v == stateStale }); !ok {
				t.Fatalf("%s{signal=queue_depth} = %v (series found: %v) with /metrics %s, want %d (stale)", satStateMetric, v, found, spec, stateStale)
			}
			c := newClient(t)
			ctx := testContext(t, 30*time.Second)
			url := gw.URL + "/v1/chat/completions"

			var direct []userResult
			for i := range 5 {
				direct = append(direct, userStream(ctx, c, r.URL()+"/v1/chat/completions", fmt.Sprintf("direct-%d", i)))
			}
			checkUsersServed(t, "straight to the replica", direct)
			base := median(ttfts(direct, r.Addr()))

			burst := userBurst(ctx, c, url, "burst", 8, 0, bearer(key))
			checkUsersServed(t, "8 concurrent requests through the gateway", burst)
			var seq []userResult
			for i := range 5 {
				seq = append(seq, userStream(ctx, c, url, fmt.Sprintf("seq-%d", i), bearer(key)))
			}
			checkUsersServed(t, "requests one after the other through the gateway", seq)
			got := ttfts(seq, r.Addr())
			if len(got) == 0 {
				t.Fatalf("no request through the gateway was served")
			}
			t.Logf("TTFT straight to the replica: median %v; through the gateway: median %v, max %v", base, median(got), got[len(got)-1])
			if m := median(got); m > base+60*time.Millisecond {
				t.Errorf("TTFT through the gateway: median %v, %v straight to the replica: a failing /metrics must not slow the pool", m, base)
			}
			if m := got[len(got)-1]; m > base+250*time.Millisecond {
				t.Errorf("TTFT through the gateway up to %v (%v straight to the replica): a failing /metrics must not slow the pool", m, base)
			}

			samples := gw.scrapeMetrics()
			for _, sig := range []string{"queue_depth", "running", "kv_usage"} {
				if v, found := satMetric(samples, satStateMetric, r.Addr(), sig); !found || v != stateStale {
					t.Errorf("%s{signal=%s} = %v (series found: %v), want %d (stale)", satStateMetric, sig, v, found, stateStale)
				}
			}
			if errs, found := metricValue(samples, scrapeErrMetric, map[string]string{"upstream": r.Addr()}); !found || errs < 2 {
				t.Errorf("%s = %v (series found: %v), want the failed scrapes counted", scrapeErrMetric, errs, found)
			}
			if got := admissionMetric(t, samples, "batch", "admitted"); got != 13 {
				t.Errorf("caddy_llm_proxy_admission_total{tier=batch,decision=admitted} = %v, want 13", got)
			}
		})
	}
}

// TestSaturationQueueWaitOpensBreakerWithoutFailingUsers: another client
// keeps six requests of 150ms on replica 0 (capacity 1), so its recent
// queue-wait p99 stays above 400ms (about 750ms; the threshold is above
// vLLM's first queue-time bucket, 300ms, where a replica that never queues
// reads). With round_robin and a queue threshold too high to remove it
// from the candidates, only the saturation breaker keeps users away: it
// opens (observed: no user request is let through as a probe) while every
// user request gets a clean 200, and it closes by observation once that
// load ends and the queue drains, after which replica 0 serves users
// again.
func TestSaturationQueueWaitOpensBreakerWithoutFailingUsers(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2,
		Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(20 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	sick := fleet.Replica(0)
	sick.SetCapacity(1)
	gw := startGateway(t, satSite(fleet,
		"interval 100ms\nstale_after 1s\nqueue_threshold 50\nwindow 1s\ntrip queue_wait_p99 400ms for 500ms",
		"lb_policy round_robin",
		"breaker {\nopen_for 500ms\nmin_open 500ms\nmax_open 1s\nrecovery_successes 3\n}"))
	gw.waitScraped(fleet, 5*time.Second)
	users := startLoad(t, gw.URL+"/v1/chat/completions", 2)

	load := startDirectLoad(t, sick, 6, true, "", "X-Mock-TTFT: 150ms", "X-Mock-Tokens: 1")
	loadStart := time.Now()
	var b satBreaker
	var opened time.Time
	if !waitFor(10*time.Second, func() bool {
		b = gw.satBreaker(sick.Addr())
		opened = time.Now()
		return b.State == "open"
	}) {
		t.Fatalf("replica 0's breaker is %s after 10s of queue wait above 400ms: %+v", b.State, b)
	}
	t.Logf("breaker open %v after the load started: %q", opened.Sub(loadStart).Round(time.Millisecond), b.LastFailure)
	if !b.Observed || !strings.Contains(b.LastFailure, "queue wait") {
		t.Errorf("replica 0's breaker opened with observed %v, last failure %q; want a saturation trip on queue wait", b.Observed, b.LastFailure)
	}
	if v, found := metricValue(gw.scrapeMetrics(), "caddy_llm_proxy_breaker_state", map[string]string{"upstream": sick.Addr()}); !found || v != 2 {
		t.Errorf("caddy_llm_proxy_breaker_state{upstream=%s} = %v (series found: %v), want 2 (open)", sick.Addr(), v, found)
	}

	time.Sleep(500 * time.Millisecond) // users meanwhile go to replica 1 only
	load.drain()
	stopped := time.Now()
	var lastNotClosed time.Time
	if !waitFor(10*time.Second, func() bool {
		at := time.Now()
		b = gw.satBreaker(sick.Addr())
		if b.State != "closed" {
			lastNotClosed = at
			return false
		}
		return true
	}) {
		t.Fatalf("replica 0's breaker is still %s 10s after its queue drained (mock: %d waiting): %+v", b.State, sick.Stats().Waiting, b)
	}
	closed := time.Now()
	t.Logf("breaker closed %v after the queue drained", closed.Sub(stopped).Round(time.Millisecond))
	if !waitFor(5*time.Second, func() bool { return servedBy(users.snapshot(), sick.Addr(), closed) >= 1 }) {
		t.Errorf("replica 0 served %d user requests in the 5s after its breaker closed, want it back in rotation", servedBy(users.snapshot(), sick.Addr(), closed))
	}
	// It stays closed while users keep coming (their waits are far below
	// 400ms): the waits from before the drain, still inside the window
	// when it closed, do not trip it again.
	time.Sleep(time.Until(closed.Add(2 * time.Second)))
	if b = gw.satBreaker(sick.Addr()); b.State != "closed" {
		t.Errorf("replica 0's breaker is %s 2s after it closed with its queue drained: %+v", b.State, b)
	}
	users.stop()

	results := users.snapshot()
	checkAllServed(t, results)
	if servedBy(results, sick.Addr(), time.Time{}) == 0 {
		t.Errorf("replica 0 served no user request before its breaker opened: round_robin should have sent it half")
	}
	for _, rec := range userRecords(sick, "load-") {
		if rec.Started.After(opened.Add(clockSlack)) && rec.Started.Before(lastNotClosed) {
			t.Errorf("user request %s reached replica 0 at %s while its saturation breaker was open or half-open (open seen %s, last seen not closed %s): no user request may be risked",
				rec.ID, rec.Started.Format("15:04:05.000"), opened.Format("15:04:05.000"), lastNotClosed.Format("15:04:05.000"))
		}
	}
	// The transitions as the metrics count them: one trip, one recovery.
	samples := gw.scrapeMetrics()
	tr := "caddy_llm_proxy_breaker_transitions_total"
	if n := metricValueOrZero(t, samples, tr, map[string]string{"upstream": sick.Addr(), "from": "closed", "to": "open"}); n != 1 {
		t.Errorf("%s{upstream=0,from=closed,to=open} = %v, want exactly one trip", tr, n)
	}
	if n := metricValueOrZero(t, samples, tr, map[string]string{"upstream": sick.Addr(), "from": "half_open", "to": "closed"}); n < 1 {
		t.Errorf("%s{upstream=0,from=half_open,to=closed} = %v, want the recovery counted", tr, n)
	}
}

// TestSaturationReadsOldAndNewKVCacheNames: three replicas publish their
// KV-cache usage under vLLM's current name (kv_cache_usage_perc), its V0
// name (gpu_cache_usage_perc) and not at all. Each holds one request of
// another client whose prompt fills about a third of its cache. The
// gateway reads the same usage as the mock from both names, reads the
// third's as missing (2), and routes by it: with kv_threshold 0.3 the two
// replicas whose usage it reads are saturated, so users go to the third,
// whose unknown KV usage drops out of its score.
func TestSaturationReadsOldAndNewKVCacheNames(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3, KVBlocks: 40,
		Behavior:          mockllm.Behavior{TTFT: mockllm.Fixed(20 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay},
		PerReplicaMetrics: map[int]mockllm.MetricsMode{0: {KV: mockllm.KVNew}, 1: {KV: mockllm.KVOld}, 2: {KV: mockllm.KVNone}}})
	const kvThreshold = 0.3
	gw := startGateway(t, satSite(fleet, fmt.Sprintf("interval 100ms\nstale_after 1s\nkv_threshold %v\ntrip off", kvThreshold)))
	gw.waitScraped(fleet, 5*time.Second)
	prompt := chatBody(strings.Repeat("Fill the cache. ", 60), false) // ≈ 240 prompt tokens: 15 blocks of 16
	for _, r := range fleet.Replicas() {
		startDirectLoad(t, r, 1, false, prompt, "X-Mock-TTFT: 30s")
	}
	if !waitFor(3*time.Second, func() bool {
		for _, r := range fleet.Stats().Replicas {
			if r.Running != 1 {
				return false
			}
		}
		return true
	}) {
		t.Fatalf("the held requests do not all run: %+v", fleet.Stats().Replicas)
	}

	for i, name := range []string{"kv_cache_usage_perc", "gpu_cache_usage_perc"} {
		r := fleet.Replica(i)
		st := r.Stats()
		want := float64(st.KVBlocksUsed) / float64(st.KVBlocks)
		if want < kvThreshold {
			t.Fatalf("replica %d holds %d of %d KV blocks (%.3f): the test needs more than kv_threshold %v", i, st.KVBlocksUsed, st.KVBlocks, want, kvThreshold)
		}
		if v, found, ok := gw.waitSatMetric(satValueMetric, r.Addr(), "kv_usage", 3*time.Second, func(v float64) bool { return math.Abs(v-want) < 1e-9 }); !ok {
			t.Errorf("replica %d (vllm:%s only): %s{signal=kv_usage} = %v (series found: %v), want the mock's %v", i, name, satValueMetric, v, found, want)
		}
		if v, found := satMetric(gw.scrapeMetrics(), satStateMetric, r.Addr(), "kv_usage"); !found || v != stateFresh {
			t.Errorf("replica %d (vllm:%s only): %s{signal=kv_usage} = %v (series found: %v), want %d (fresh)", i, name, satStateMetric, v, found, stateFresh)
		}
		v := gw.saturation()[r.Addr()]
		if kv, _ := v.signal("kv_usage").value(); !v.ScoreKnown || math.Abs(v.Score-want/kvThreshold) > 1e-6 || math.Abs(kv-want) > 1e-9 {
			t.Errorf("replica %d (vllm:%s only): admin snapshot kv_usage %v, score %v (known %v), want %v and %v (usage / kv_threshold)", i, name, kv, v.Score, v.ScoreKnown, want, want/kvThreshold)
		}
	}

	none := fleet.Replica(2)
	if v, found, ok := gw.waitSatMetric(satStateMetric, none.Addr(), "kv_usage", 3*time.Second, func(v float64) bool { return v == stateMissing }); !ok {
		t.Errorf("replica 2 (no KV-cache metric): %s{signal=kv_usage} = %v (series found: %v), want %d (missing)", satStateMetric, v, found, stateMissing)
	}
	samples := gw.scrapeMetrics()
	if v, found := satMetric(samples, satValueMetric, none.Addr(), "kv_usage"); found {
		t.Errorf("replica 2 (no KV-cache metric): %s{signal=kv_usage} = %v, want no series (never known)", satValueMetric, v)
	}
	if v, found := satMetric(samples, satValueMetric, none.Addr(), "running"); !found || v != 1 {
		t.Errorf("replica 2: %s{signal=running} = %v (series found: %v), want 1: its other signals are read", satValueMetric, v, found)
	}
	if v := gw.saturation()[none.Addr()]; v.signal("kv_usage").State != "missing" || !v.ScoreKnown || v.Score != 0 {
		t.Errorf("replica 2: admin snapshot kv_usage state %q, score %v (known %v); want missing, and a score of its queue alone (0)", v.signal("kv_usage").State, v.Score, v.ScoreKnown)
	}

	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	var rs []userResult
	for i := range 6 {
		rs = append(rs, userStream(ctx, c, gw.URL+"/v1/chat/completions", fmt.Sprintf("kv-%d", i)))
	}
	checkUsersServed(t, "with two replicas over kv_threshold", rs)
	if by := countByReplica(rs); by[none.Addr()] != len(rs) {
		t.Errorf("requests went to %v; want all %d on replica 2 (%s): the others are over kv_threshold by either KV-cache name", by, len(rs), none.Addr())
	}
}

// TestSaturationReloadKeepsOneScraperAndSnapshots: across five reloads
// (each changing the saturation settings) every replica keeps one scraper:
// its scrape rate stays one per interval, never two at once, and no scrape
// is added by a reload; and its snapshot carries over: right after each
// reload the admin API shows it fresh, scraped no earlier than before.
func TestSaturationReloadKeepsOneScraperAndSnapshots(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2})
	const interval = 200 * time.Millisecond
	site := func(i int) string {
		return satSite(fleet, fmt.Sprintf("interval %v\nqueue_threshold %d", interval, 5+i))
	}
	gw := startGateway(t, site(0))
	gw.waitScraped(fleet, 5*time.Second)
	count := func(name string) map[string]float64 {
		out := map[string]float64{}
		samples := gw.scrapeMetrics()
		for _, a := range fleet.Addrs() {
			out[a], _ = metricValue(samples, name, map[string]string{"upstream": a})
		}
		return out
	}
	durBefore := count(scrapeDurMetric + "_count")

	fleet.ResetStats()
	reloadStart := time.Now()
	for i := 1; i <= 5; i++ {
		before := gw.saturation()
		gw.reload(site(i))
		after := gw.saturation()
		for _, a := range fleet.Addrs() {
			b, v := before[a], after[a]
			switch {
			case v.ScrapedAt == nil || !v.ScoreKnown || v.signal("queue_depth").State != "fresh":
				t.Errorf("reload %d: the snapshot of %s was reset: %+v (before: %+v)", i, a, v, b)
			case b.ScrapedAt != nil && v.ScrapedAt.Before(*b.ScrapedAt):
				t.Errorf("reload %d: the snapshot of %s went back from a scrape at %s to one at %s", i, a, b.ScrapedAt.Format("15:04:05.000"), v.ScrapedAt.Format("15:04:05.000"))
			}
		}
		time.Sleep(150 * time.Millisecond) // a scrape or so between reloads
	}
	span := time.Since(reloadStart)
	for i, r := range fleet.Stats().Replicas {
		// One loop scrapes at most once per interval (its timer starts
		// after each scrape); a reload that started another, or restarted
		// it (the first scrape comes at once), adds scrapes.
		most := int64(span/interval) + 2
		t.Logf("replica %d: %d scrapes during %v of reloads (at most %d allowed)", i, r.Scrapes, span.Round(time.Millisecond), most)
		if r.Scrapes > most {
			t.Errorf("replica %d was scraped %d times during %v of reloads, want at most %d at one scrape per %v", i, r.Scrapes, span.Round(time.Millisecond), most, interval)
		}
	}

	fleet.ResetStats()
	const measure = 2 * time.Second
	time.Sleep(measure)
	for i, r := range fleet.Stats().Replicas {
		t.Logf("replica %d: %d scrapes in %v after the reloads, at most %d at once", i, r.Scrapes, measure, r.MaxConcurrentScrapes)
		if want := int64(measure / interval); r.Scrapes < want-4 || r.Scrapes > want+1 {
			t.Errorf("replica %d was scraped %d times in %v after 5 reloads, want about %d (one scraper, one scrape per %v)", i, r.Scrapes, measure, want, interval)
		}
		if r.MaxConcurrentScrapes != 1 {
			t.Errorf("replica %d had up to %d scrapes at once, want 1", i, r.MaxConcurrentScrapes)
		}
	}
	if n := len(gw.saturation()); n != 2 {
		t.Errorf("the admin API lists %d snapshots, want one per replica (2)", n)
	}
	durAfter := count(scrapeDurMetric + "_count")
	for _, a := range fleet.Addrs() {
		if durAfter[a] < durBefore[a]+5 {
			t.Errorf("%s_count{upstream=%s} went from %v to %v across the reloads: the scrapes must go on being counted", scrapeDurMetric, a, durBefore[a], durAfter[a])
		}
	}
}

// TestSaturationPoolSignalShedsSheddableAndQueuesHigherTier: the only
// replica (capacity 1) has four requests of another client, three of them
// queued, over queue_threshold 2: the pool is saturated by the signal
// alone (no admission capacity is set). A sheddable tier gets 429
// saturated at once without reaching the replica; a standard request waits
// in the gateway's queue, not the replica's, and is served as soon as a
// scrape shows the queue gone.
func TestSaturationPoolSignalShedsSheddableAndQueuesHigherTier(t *testing.T) {
	t.Parallel()
	keyB, keyS := newKey("batch"), newKey("std")
	fleet := startFleet(t, mockllm.FleetConfig{
		Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(20 * time.Millisecond), Tokens: 1, TokenInterval: mockllm.NoDelay}})
	r := fleet.Replica(0)
	r.SetCapacity(1)
	gw := startTenantGateway(t, gatewayOptions{
		Globals: fmt.Sprintf(`	llm_proxy {
		tenants {
			key %s batchy tier batch
			key %s stdy tier standard
		}
		tier batch {
			priority -1
		}
		tier standard {
			priority 0
			queue_timeout 10s
		}
	}`, keyB, keyS),
		Site: satSite(fleet, "interval 100ms\nstale_after 1s\nqueue_threshold 2\ntrip off"),
	}, keyB, keyS)
	gw.waitScraped(fleet, 5*time.Second)
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	url := gw.URL + "/v1/chat/completions"
	body := chatOf("pool signal", false, nil)

	hold := startDirectLoad(t, r, 4, false, "", "X-Mock-TTFT: 30s")
	if v, ok := gw.waitSaturation(r.Addr(), 3*time.Second, func(v satView) bool { return v.ScoreKnown && v.Score >= 1 }); !ok {
		t.Fatalf("the replica never read saturated (mock: %d waiting): %+v", r.Stats().Waiting, v)
	}

	shed := mustSend(ctx, t, c, url, body, bearer(keyB), "X-Request-Id: shed")
	checkRefusal(t, "a sheddable request at a pool saturated by its signal", shed, http.StatusTooManyRequests, "saturated", true, 60)
	if shed.Took > 300*time.Millisecond {
		t.Errorf("the sheddable request was refused after %v, want at once", shed.Took.Round(time.Millisecond))
	}
	queued := asyncSend(ctx, c, url, body, bearer(keyS), "X-Request-Id: queued")
	waitQueueDepth(t, gw.gateway, "standard", 1, 2*time.Second)
	time.Sleep(300 * time.Millisecond) // three scrapes, all saturated
	if _, ok := recordByID(fleet, "queued"); ok {
		t.Errorf("the standard request reached the replica while the pool was saturated; want it held in the gateway's queue")
	}

	cleared := time.Now()
	hold.stop() // the other client goes away: its queue is gone
	q := queued()
	if q.Err != nil || q.Status != http.StatusOK {
		t.Fatalf("the queued standard request: status %d, %v: %s", q.Status, q.Err, q.Body)
	}
	if d := time.Since(cleared); d > 1500*time.Millisecond {
		t.Errorf("the queued request was answered %v after the replica's queue went away, want within a few scrape intervals (100ms)", d.Round(time.Millisecond))
	}
	if rec, ok := recordByID(fleet, "queued"); !ok || rec.Started.Before(cleared) {
		t.Errorf("the queued request reached the replica at %v (recorded: %v), want after its queue went away at %s", rec.Started.Format("15:04:05.000"), ok, cleared.Format("15:04:05.000"))
	}
	if _, ok := recordByID(fleet, "shed"); ok {
		t.Errorf("the shed request reached the replica")
	}
	if r := mustSend(ctx, t, c, url, body, bearer(keyB)); r.Status != http.StatusOK {
		t.Errorf("a sheddable request once the signal cleared: status %d: %s", r.Status, r.Body)
	}

	samples := gw.scrapeMetrics()
	for _, m := range []struct {
		tier, decision string
	}{{"batch", "saturated"}, {"standard", "queued_admitted"}, {"batch", "admitted"}} {
		if got := admissionMetric(t, samples, m.tier, m.decision); got != 1 {
			t.Errorf("caddy_llm_proxy_admission_total{tier=%s,decision=%s} = %v, want 1", m.tier, m.decision, got)
		}
	}
}

// TestSaturationLowQueueWaitThresholdIsNotCrossedWithoutQueueing: vLLM's
// queue-time buckets start at 0.3s, so requests that never wait read an
// interpolated p99 of 0.297s. A 200ms threshold must not open the breaker
// of a replica that never queues (it did, and every request got 503).
// And a single replica's pool whose breaker the saturation rules opened
// still serves (saturation alone never refuses a request).
func TestSaturationLowQueueWaitThresholdIsNotCrossedWithoutQueueing(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 1,
		Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	r := fleet.Replica(0)
	gw := startGateway(t, satSite(fleet, "interval 100ms\nstale_after 1s\nwindow 1s\ntrip queue_wait_p99 200ms for 500ms"))
	gw.waitScraped(fleet, 5*time.Second)
	users := startLoad(t, gw.URL+"/v1/chat/completions", 1)
	time.Sleep(2 * time.Second)
	if b := gw.satBreaker(r.Addr()); b.State != "closed" {
		t.Errorf("breaker %s on a replica that never queues (mock: %d waiting): %+v", b.State, r.Stats().Waiting, b)
	}
	// Now it queues for real: capacity 1 and three clients' requests of
	// 400ms each wait about 0.8s, certainly above 200ms.
	r.SetCapacity(1)
	load := startDirectLoad(t, r, 3, true, "", "X-Mock-TTFT: 400ms", "X-Mock-Tokens: 1")
	var b satBreaker
	if !waitFor(10*time.Second, func() bool { b = gw.satBreaker(r.Addr()); return b.State != "closed" }) {
		t.Fatalf("breaker still closed after 10s of queue waits near 0.8s: %+v", b)
	}
	time.Sleep(500 * time.Millisecond) // tripped: the only replica still takes users
	load.stop()
	users.stop()
	checkAllServed(t, users.snapshot())
}
