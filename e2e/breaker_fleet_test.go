package e2e

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// The scenarios of this file run three mock upstreams behind the real
// gateway with short breaker timings (cooldowns of one or two seconds), and
// check from the outside, through the mock's request records, the admin
// API and the metrics, what the breakers let through and when.

// clockSlack absorbs the distance between the gateway's decision (a trip,
// the end of a cooldown) and the moment the mock records a request that
// the decision let through or kept away: one loopback hop on a loaded
// machine.
const clockSlack = 25 * time.Millisecond

// loadResult is one request of a loadGen, as its client saw it.
type loadResult struct {
	Start, End time.Time
	Status     int
	// Replica is the upstream that served it (X-Mock-Replica).
	Replica string
	// Problem is empty for a complete, clean stream.
	Problem string
}

// loadGen sends streaming requests from a few workers, each one after the
// other, until stopped: steady user traffic through the gateway.
type loadGen struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	results []loadResult
}

// startLoad starts workers that send short streams to url until stop (or
// the end of the test).
func startLoad(t *testing.T, url string, workers int, headers ...string) *loadGen {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	l := &loadGen{cancel: cancel}
	c := newClient(t)
	body := chatBody("Keep the traffic going.", true)
	for w := range workers {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			for n := 0; ctx.Err() == nil; n++ {
				hs := append([]string{fmt.Sprintf("X-Request-Id: load-%d-%d", w, n)}, headers...)
				r := loadResult{Start: time.Now()}
				s, err := doStream(ctx, c, url, body, hs...)
				r.End = time.Now()
				switch {
				case ctx.Err() != nil:
					return // stopped mid-request: not a result
				case err != nil:
					r.Problem = err.Error()
				default:
					r.Status, r.Replica = s.Status, s.Header.Get(mockllm.HeaderReplica)
					r.Problem = streamProblem(s)
				}
				l.mu.Lock()
				l.results = append(l.results, r)
				l.mu.Unlock()
			}
		}()
	}
	t.Cleanup(l.stop)
	return l
}

// streamProblem says what is wrong with a stream that should be complete
// and clean; "" when nothing is.
func streamProblem(s *stream) string {
	switch {
	case s.Status != http.StatusOK:
		return fmt.Sprintf("status %d: %q", s.Status, raw(s.Events))
	case s.Err != nil || len(s.Tail) > 0:
		return fmt.Sprintf("stream ended with %v (tail %q)", s.Err, s.Tail)
	case len(s.Events) < 2 || !s.Events[len(s.Events)-1].IsDone():
		return fmt.Sprintf("no [DONE] at the end: %q", raw(s.Events))
	}
	for _, e := range s.Events {
		if _, isErr := e.ErrorObject(); isErr {
			return fmt.Sprintf("error event %q", e.Raw)
		}
	}
	return ""
}

// stop ends the load and waits for the workers.
func (l *loadGen) stop() {
	l.cancel()
	l.wg.Wait()
}

// snapshot returns the results so far.
func (l *loadGen) snapshot() []loadResult {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.results)
}

// servedBy counts the results served by addr that started after from.
func servedBy(results []loadResult, addr string, from time.Time) int {
	n := 0
	for _, r := range results {
		if r.Replica == addr && r.Start.After(from) {
			n++
		}
	}
	return n
}

// checkAllServed fails the test for every result that is not a clean
// stream served by one of the replicas.
func checkAllServed(t *testing.T, results []loadResult) {
	t.Helper()
	bad := 0
	for _, r := range results {
		if r.Problem != "" {
			if bad++; bad <= 5 {
				t.Errorf("client request at %s failed: %s", r.Start.Format("15:04:05.000"), r.Problem)
			}
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d client requests failed, want all served", bad, len(results))
	}
}

// recordsBetween returns the requests a replica received whose Started is
// in (from, to]; a zero to means no upper bound.
func recordsBetween(recs []mockllm.RequestRecord, from, to time.Time) []mockllm.RequestRecord {
	var out []mockllm.RequestRecord
	for _, r := range recs {
		if r.Started.After(from) && (to.IsZero() || !r.Started.After(to)) {
			out = append(out, r)
		}
	}
	return out
}

// waitEnded returns records as the replica holds them once each has ended,
// waiting up to 2s: the gateway re-opens a breaker as it abandons a probe,
// and the mock records the probe's end once it sees the connection go, a
// moment later (fresh CI runs read it a few ms too soon). A probe that
// still hangs comes back unended, and the caller's check fails on it.
func waitEnded(r *mockllm.Replica, records []mockllm.RequestRecord) []mockllm.RequestRecord {
	waitFor(2*time.Second, func() bool {
		for _, rec := range recordsByID(r.Stats().Recent, records) {
			if rec.Ended.IsZero() {
				return false
			}
		}
		return true
	})
	return recordsByID(r.Stats().Recent, records)
}

// checkNoOverlap fails the test when two of the requests (in arrival
// order) were in progress at the same time at the upstream, or one has not
// ended.
func checkNoOverlap(t *testing.T, what string, recs []mockllm.RequestRecord) {
	t.Helper()
	for i, r := range recs {
		if r.Ended.IsZero() {
			t.Errorf("%s %d (%s, started %s) has not ended", what, i+1, r.ID, r.Started.Format("15:04:05.000"))
			continue
		}
		if i > 0 && r.Started.Before(recs[i-1].Ended) {
			t.Errorf("%s %d (%s) started at %s while %s %d (%s) was still in flight until %s: want at most one at a time",
				what, i+1, r.ID, r.Started.Format("15:04:05.000"), what, i, recs[i-1].ID, recs[i-1].Ended.Format("15:04:05.000"))
		}
	}
}

// recordsByID returns the current records of the requests in want.
func recordsByID(recs, want []mockllm.RequestRecord) []mockllm.RequestRecord {
	var out []mockllm.RequestRecord
	for _, w := range want {
		for _, r := range recs {
			if r.ID == w.ID {
				out = append(out, r)
			}
		}
	}
	return out
}

func fmtRecords(recs []mockllm.RequestRecord) string {
	var b strings.Builder
	for _, r := range recs {
		fmt.Fprintf(&b, "\n  %s %s %s → %s %s (%v)", r.ID, r.Path, r.Started.Format("15:04:05.000"),
			r.Ended.Format("15:04:05.000"), r.Outcome, r.Ended.Sub(r.Started).Round(time.Millisecond))
	}
	return b.String()
}

// TestHangingUpstreamTripsAndIsProbedOneAtATimeUntilItRecovers: of three
// upstreams, one accepts requests and holds them without a byte. With
// first_byte_timeout 500ms its breaker opens after consecutive_failures;
// from then until the cooldown it receives no user request; after the
// cooldown exactly one probe at a time (it hangs, fails, re-opens); the
// clients meanwhile are all served by the other two. Once it answers again
// the breaker closes after recovery_successes probes and it serves traffic
// again (admin API closed, breaker_state 0).
func TestHangingUpstreamTripsAndIsProbedOneAtATimeUntilItRecovers(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3, PerReplica: map[int]mockllm.Behavior{
		0: {Fault: mockllm.Fault{Kind: mockllm.FaultHang}},
	}})
	sick := fleet.Replica(0)
	gw := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		lb_policy round_robin
		first_byte_timeout 500ms
		max_attempts 2
		breaker {
			consecutive_failures 3
			open_for 2s
			min_open 1s
			max_open 2500ms
			recovery_successes 2
		}
	}`, upstreams(fleet)))

	load := startLoad(t, gw.URL+"/v1/chat/completions", 3, "X-Mock-Tokens: 3", "X-Mock-Token-Interval: 10ms")

	// The trip.
	tripped, ok := gw.waitBreaker(sick.Addr(), 15*time.Second, func(v breakerView) bool { return v.State == "open" })
	if !ok {
		t.Fatalf("the hanging upstream's breaker is %+v after 15s, want open", tripped)
	}
	tripAt, openUntil := tripped.Since, tripped.OpenUntil
	if tripped.ConsecutiveFailures < 3 || !strings.Contains(tripped.LastFailure, "timeout") {
		t.Errorf("tripped breaker: consecutive_failures %d, last_failure %q; want ≥ 3 first-byte timeouts",
			tripped.ConsecutiveFailures, tripped.LastFailure)
	}
	if d := openUntil.Sub(tripAt); d < time.Second || d > 2500*time.Millisecond {
		t.Errorf("open_until is %v after the trip, want the cooldown: 2s ± 20%% (at least min_open 1s)", d)
	}
	t.Logf("tripped at %s, open until %s (%v), %d requests at the upstream so far",
		tripAt.Format("15:04:05.000"), openUntil.Format("15:04:05.000"), openUntil.Sub(tripAt).Round(time.Millisecond), sick.Stats().Requests)

	// The first probe after the cooldown hangs too, fails at
	// first_byte_timeout and re-opens the breaker.
	reopened, ok := gw.waitBreaker(sick.Addr(), 10*time.Second, func(v breakerView) bool { return v.Reopens >= 1 && v.State == "open" })
	if !ok {
		t.Fatalf("breaker %+v: want it re-opened by a failed probe within 10s", reopened)
	}
	recs := sick.Stats().Recent
	if early := recordsBetween(recs, tripAt.Add(clockSlack), openUntil.Add(-clockSlack)); len(early) > 0 {
		t.Errorf("the upstream received %d request(s) while its breaker was open (%s to %s):%s",
			len(early), tripAt.Format("15:04:05.000"), openUntil.Format("15:04:05.000"), fmtRecords(early))
	}
	probes := recordsBetween(recs, openUntil.Add(-clockSlack), reopened.Since)
	if len(probes) != 1 {
		t.Errorf("the upstream received %d requests between the cooldown's end and the re-open, want exactly 1 probe:%s",
			len(probes), fmtRecords(probes))
	}
	probes = waitEnded(sick, probes)
	checkNoOverlap(t, "probe", probes)
	for _, p := range probes {
		if d := reopened.Since.Sub(p.Started); d < 400*time.Millisecond || d > 1500*time.Millisecond {
			t.Errorf("the breaker re-opened %v after the probe started, want about first_byte_timeout (500ms)", d)
		}
	}

	// Recovery: the next probes succeed; recovery_successes of them close
	// the breaker.
	sick.SetBehavior(mockllm.Behavior{})
	healedAt := time.Now()
	closed, ok := gw.waitBreaker(sick.Addr(), 10*time.Second, func(v breakerView) bool { return v.State == "closed" })
	if !ok {
		t.Fatalf("breaker %+v 10s after the upstream recovered, want closed", closed)
	}
	recs = sick.Stats().Recent
	if early := recordsBetween(recs, reopened.Since.Add(clockSlack), reopened.OpenUntil.Add(-clockSlack)); len(early) > 0 {
		t.Errorf("the upstream received %d request(s) during the second cooldown:%s", len(early), fmtRecords(early))
	}
	recovery := recordsBetween(recs, reopened.Since, closed.Since)
	if len(recovery) != 2 {
		t.Errorf("the upstream received %d requests between the re-open and the close, want recovery_successes = 2 probes:%s",
			len(recovery), fmtRecords(recovery))
	}
	// A probe is settled by its first token (a healthy stream may then run
	// for as long as it likes), so the next probe may start once the
	// previous one has produced its first event, never before.
	for i := 1; i < len(recovery); i++ {
		prev, r := recovery[i-1], recovery[i]
		if prev.FirstEvent.IsZero() || r.Started.Before(prev.FirstEvent) {
			t.Errorf("recovery probe %d (%s) started at %s before probe %d's first event (%s): want one awaiting its first token at a time",
				i+1, r.ID, r.Started.Format("15:04:05.000"), i, prev.FirstEvent.Format("15:04:05.000"))
		}
	}
	// Both probes were served in full.
	waitFor(5*time.Second, func() bool {
		for _, r := range recordsByID(sick.Stats().Recent, recovery) {
			if r.Ended.IsZero() {
				return false
			}
		}
		return true
	})
	for _, r := range recordsByID(sick.Stats().Recent, recovery) {
		if r.Outcome != mockllm.OutcomeCompleted {
			t.Errorf("recovery probe %s: outcome %q, want completed", r.ID, r.Outcome)
		}
	}
	if closed.ConsecutiveFailures != 0 || closed.FailuresInWindow != 0 {
		t.Errorf("closed breaker: consecutive_failures %d, failures_in_window %d; want 0 and 0 (fresh windows)",
			closed.ConsecutiveFailures, closed.FailuresInWindow)
	}

	// Traffic returns.
	if !waitFor(5*time.Second, func() bool { return servedBy(load.snapshot(), sick.Addr(), closed.Since) >= 3 }) {
		t.Errorf("the recovered upstream served %d client requests in the 5s after its breaker closed, want ≥ 3",
			servedBy(load.snapshot(), sick.Addr(), closed.Since))
	}
	load.stop()
	results := load.snapshot()
	checkAllServed(t, results)

	// Between the trip and the recovery, every client was served by the
	// other two.
	for _, r := range results {
		if r.Replica == sick.Addr() && r.Start.After(tripAt) && r.End.Before(healedAt) {
			t.Errorf("a client request (%s → %s) was served by the hanging upstream while it hung",
				r.Start.Format("15:04:05.000"), r.End.Format("15:04:05.000"))
		}
	}
	// The breaker exists and went through open and half-open: its series
	// must be there, and read 0 (closed), not be missing.
	if v, found := metricValue(gw.scrapeMetrics(), "caddy_llm_proxy_breaker_state", map[string]string{"upstream": sick.Addr()}); !found || v != 0 {
		t.Errorf("caddy_llm_proxy_breaker_state{upstream=%s} = %v (found %v) after recovery, want a series reading 0", sick.Addr(), v, found)
	}
	for i := 1; i < 3; i++ {
		if v := gw.breaker(fleet.Replica(i).Addr()); v.State != "closed" || v.ConsecutiveFailures != 0 || v.FailuresInWindow != 0 {
			t.Errorf("healthy upstream %d's breaker: %+v, want closed with no failures", i, v)
		}
	}
	t.Logf("%d client requests, all served; %d reached the sick upstream", len(results), sick.Stats().Requests)
}

// TestAllUpstreams503TripBreakersThenFailFastWithoutTouchingThem: three upstreams
// answer every request with 503. Once the nine failures have opened the
// three breakers, requests get the gateway's own 503 with Retry-After
// (whole seconds, at least 1) and X-Circuit-Breaker: open, answered in
// under 10ms (the median of 20 client-side round trips; the largest must
// stay under 100ms), and no upstream sees a request until a cooldown is
// over.
func TestAllUpstreams503TripBreakersThenFailFastWithoutTouchingThem(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3, Behavior: mockllm.Behavior{
		Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503},
	}})
	gw := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		lb_policy round_robin
		max_attempts 1
		breaker {
			consecutive_failures 3
			open_for 2s
			min_open 1s
		}
	}`, upstreams(fleet)))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	url := gw.URL + "/v1/chat/completions"
	body := chatBody("Everything is down.", true)

	for i := range 9 {
		r, err := doPlain(ctx, c, url, body)
		if err != nil {
			t.Fatal(err)
		}
		if r.Status != http.StatusServiceUnavailable || r.Header.Get("X-Circuit-Breaker") != "" {
			t.Fatalf("request %d: status %d, X-Circuit-Breaker %q; want the upstream's own 503", i+1, r.Status, r.Header.Get("X-Circuit-Breaker"))
		}
	}
	var earliest time.Time
	for i := range 3 {
		addr := fleet.Replica(i).Addr()
		if n := fleet.Replica(i).Stats().Requests; n != 3 {
			t.Errorf("upstream %d got %d requests, want 3 (round robin)", i, n)
		}
		v := gw.breaker(addr)
		if v.State != "open" {
			t.Fatalf("upstream %d's breaker is %+v after 3 failures, want open", i, v)
		}
		if earliest.IsZero() || v.OpenUntil.Before(earliest) {
			earliest = v.OpenUntil
		}
	}

	// Fail fast: 20 requests, timed from the client.
	const n = 20
	rtts := make([]time.Duration, 0, n)
	for i := range n {
		start := time.Now()
		r, err := doPlain(ctx, c, url, body)
		rtt := time.Since(start)
		if err != nil {
			t.Fatal(err)
		}
		rtts = append(rtts, rtt)
		if r.Status != http.StatusServiceUnavailable || r.Header.Get("X-Circuit-Breaker") != "open" {
			t.Fatalf("request %d: status %d, X-Circuit-Breaker %q; want 503 and open: %s", i+1, r.Status, r.Header.Get("X-Circuit-Breaker"), r.Body)
		}
		ra, err := strconv.Atoi(r.Header.Get("Retry-After"))
		left := int(math.Ceil(time.Until(earliest).Seconds()))
		if err != nil || ra < 1 || ra > max(left, 1)+1 {
			t.Errorf("request %d: Retry-After %q, want whole seconds ≥ 1 until the first cooldown ends (%ds)", i+1, r.Header.Get("Retry-After"), left)
		}
		if i == 0 {
			openAIError(t, r.Body)
		}
	}
	if got := fleetRequests(fleet); got != 9 {
		t.Errorf("the upstreams got %d requests in all, want still 9", got)
	}
	sorted := slices.Sorted(slices.Values(rtts))
	median, worst := sorted[n/2], sorted[n-1]
	t.Logf("short-circuited 503: median %v, max %v over %d requests", median, worst, n)
	if median >= 10*time.Millisecond {
		t.Errorf("median round trip of a short-circuited request %v, want under 10ms", median)
	}
	if worst >= 100*time.Millisecond {
		t.Errorf("slowest round trip of a short-circuited request %v, want under 100ms", worst)
	}

	// Nothing reaches an upstream until the first cooldown is over.
	for time.Until(earliest) > clockSlack {
		r, err := doPlain(ctx, c, url, body)
		if err != nil {
			t.Fatal(err)
		}
		if got := fleetRequests(fleet); got != 9 {
			t.Fatalf("an upstream got a request %v before the first cooldown ends (%d in all): status %d, X-Circuit-Breaker %q",
				time.Until(earliest).Round(time.Millisecond), got, r.Status, r.Header.Get("X-Circuit-Breaker"))
		}
		time.Sleep(50 * time.Millisecond)
	}
	// Then a probe goes through: the upstream answers (its own 503).
	if !waitFor(3*time.Second, func() bool {
		_, err := doPlain(ctx, c, url, body)
		return err == nil && fleetRequests(fleet) > 9
	}) {
		t.Errorf("no request reached an upstream within 3s after the first cooldown")
	}
}

// TestActiveHealthProbesKeepUsersAwayUntilRecovered: with
// `probe { uri /health interval 200ms }`, a tripped upstream gets no user
// request at all while its breaker is open or half-open: only GET /health
// probes from the gateway, none before the cooldown. A failing probe
// re-opens it; once /health answers 200 again (and completions work), the
// breaker closes after recovery_successes probes and users come back.
func TestActiveHealthProbesKeepUsersAwayUntilRecovered(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3, PerReplica: map[int]mockllm.Behavior{
		0: {Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503}, HealthStatus: 503},
	}})
	sick := fleet.Replica(0)
	gw := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		lb_policy round_robin
		max_attempts 2
		breaker {
			consecutive_failures 3
			open_for 1s
			min_open 1s
			max_open 1500ms
			recovery_successes 2
			probe {
				uri /health
				interval 200ms
			}
		}
	}`, upstreams(fleet)))
	load := startLoad(t, gw.URL+"/v1/chat/completions", 3, "X-Mock-Tokens: 3", "X-Mock-Token-Interval: 10ms")

	tripped, ok := gw.waitBreaker(sick.Addr(), 15*time.Second, func(v breakerView) bool { return v.State == "open" })
	if !ok {
		t.Fatalf("breaker %+v after 15s, want open", tripped)
	}
	// No probe before the cooldown is over.
	time.Sleep(time.Until(tripped.OpenUntil.Add(-100 * time.Millisecond)))
	if hc := sick.Stats().HealthChecks; hc != 0 {
		t.Errorf("%d health probes before the cooldown ended, want none", hc)
	}
	// The first probe fails (503) and re-opens the breaker.
	reopened, ok := gw.waitBreaker(sick.Addr(), 5*time.Second, func(v breakerView) bool { return v.Reopens >= 1 && v.State == "open" })
	if !ok {
		t.Fatalf("breaker %+v: want it re-opened by a failed health probe within 5s of the cooldown (active probing broken?); %d health checks seen",
			reopened, sick.Stats().HealthChecks)
	}
	if !strings.Contains(reopened.LastFailure, "probe") {
		t.Errorf("last_failure %q, want the failed active probe", reopened.LastFailure)
	}
	failedProbes := sick.Stats().HealthChecks
	if failedProbes != 1 {
		t.Errorf("%d health probes before the re-open, want 1", failedProbes)
	}

	sick.SetBehavior(mockllm.Behavior{})
	closed, ok := gw.waitBreaker(sick.Addr(), 10*time.Second, func(v breakerView) bool { return v.State == "closed" })
	if !ok {
		t.Fatalf("breaker %+v 10s after /health recovered, want closed; %d health checks seen", closed, sick.Stats().HealthChecks)
	}
	if got := sick.Stats().HealthChecks - failedProbes; got != 2 {
		t.Errorf("%d successful health probes closed the breaker, want recovery_successes = 2", got)
	}
	if d := closed.Since.Sub(reopened.OpenUntil); d < 0 || d > time.Second {
		t.Errorf("closed %v after the second cooldown ended, want within two probe intervals or so", d)
	}
	// Not one user request while open or half-open.
	if users := recordsBetween(sick.Stats().Recent, tripped.Since.Add(clockSlack), closed.Since); len(users) > 0 {
		t.Errorf("the upstream got %d completion request(s) while its breaker was open or half-open, want none (probes are GET /health):%s",
			len(users), fmtRecords(users))
	}
	if !waitFor(5*time.Second, func() bool { return servedBy(load.snapshot(), sick.Addr(), closed.Since) >= 3 }) {
		t.Errorf("the recovered upstream served %d client requests in the 5s after its breaker closed, want ≥ 3",
			servedBy(load.snapshot(), sick.Addr(), closed.Since))
	}
	load.stop()
	checkAllServed(t, load.snapshot())

	samples := gw.scrapeMetrics()
	for _, tr := range []struct {
		from, to string
		want     float64
	}{{"closed", "open", 1}, {"open", "half_open", 2}, {"half_open", "open", 1}, {"half_open", "closed", 1}} {
		got, _ := metricValue(samples, "caddy_llm_proxy_breaker_transitions_total",
			map[string]string{"upstream": sick.Addr(), "from": tr.from, "to": tr.to})
		if got != tr.want {
			t.Errorf("breaker_transitions_total{%s→%s} = %v, want %v", tr.from, tr.to, got, tr.want)
		}
	}
}

// TestHangingActiveProbeFailsAtFirstByteTimeoutAlone: mockllm's /health
// cannot hang, so the probe is a chat completion (`probe { chat … }`) to a
// replica whose fault is hang. The probe counts as a failure at
// first_byte_timeout (500ms) and re-opens the breaker, and while it hangs
// no second probe (and no user request) is in flight to that upstream.
func TestHangingActiveProbeFailsAtFirstByteTimeoutAlone(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3, PerReplica: map[int]mockllm.Behavior{
		0: {Fault: mockllm.Fault{Kind: mockllm.FaultHang}},
	}})
	sick := fleet.Replica(0)
	gw := startGateway(t, fmt.Sprintf(`	llm_proxy %s {
		lb_policy round_robin
		first_byte_timeout 500ms
		max_attempts 2
		breaker {
			consecutive_failures 3
			open_for 1s
			min_open 1s
			max_open 1500ms
			probe {
				chat `+"`"+`{"model":"mock-llama","messages":[{"role":"user","content":"ping"}],"max_tokens":1}`+"`"+`
				interval 200ms
			}
		}
	}`, upstreams(fleet)))
	load := startLoad(t, gw.URL+"/v1/chat/completions", 3, "X-Mock-Tokens: 3", "X-Mock-Token-Interval: 10ms")

	tripped, ok := gw.waitBreaker(sick.Addr(), 15*time.Second, func(v breakerView) bool { return v.State == "open" })
	if !ok {
		t.Fatalf("breaker %+v after 15s, want open", tripped)
	}
	// Sample the admin API while the probes run: never more than one.
	maxProbes := 0
	second, ok := gw.waitBreaker(sick.Addr(), 8*time.Second, func(v breakerView) bool {
		maxProbes = max(maxProbes, v.ProbesInFlight)
		return v.Reopens >= 2 && v.State == "open"
	})
	if !ok {
		t.Fatalf("breaker %+v: want two failed probes within 8s of the trip (active probing broken?)", second)
	}
	load.stop()
	if maxProbes > 1 {
		t.Errorf("the admin API showed %d probes in flight, want at most 1", maxProbes)
	}
	if !strings.Contains(second.LastFailure, "probe") {
		t.Errorf("last_failure %q, want a failed probe", second.LastFailure)
	}
	// Every request the upstream got after the trip is a probe: POST
	// /v1/chat/completions from the gateway's prober, one at a time, each
	// abandoned at first_byte_timeout.
	probes := recordsBetween(sick.Stats().Recent, tripped.Since.Add(clockSlack), time.Time{})
	if len(probes) != 2 {
		t.Errorf("the upstream got %d requests after the trip, want 2 probes:%s", len(probes), fmtRecords(probes))
	}
	probes = waitEnded(sick, probes)
	checkNoOverlap(t, "probe", probes)
	for _, p := range probes {
		if ua := p.Headers["user-agent"]; ua != "caddy-llm-proxy-probe" {
			t.Errorf("request %s after the trip has User-Agent %q, want the gateway's probe", p.ID, ua)
		}
		if p.Started.Before(tripped.OpenUntil.Add(-clockSlack)) {
			t.Errorf("probe %s started at %s, before the cooldown ended at %s", p.ID,
				p.Started.Format("15:04:05.000"), tripped.OpenUntil.Format("15:04:05.000"))
		}
		if d := p.Ended.Sub(p.Started); d < 450*time.Millisecond || d > 1500*time.Millisecond {
			t.Errorf("probe %s was held %v before the gateway gave up, want about first_byte_timeout (500ms)", p.ID, d)
		}
	}
	if len(probes) == 2 {
		// The first probe's failure re-opened the breaker with the grown
		// cooldown (2s × jitter, capped by max_open 1.5s): the second came
		// no earlier than that.
		if gap := probes[1].Started.Sub(probes[0].Ended); gap < time.Second {
			t.Errorf("the second probe came %v after the first ended, want a re-open cooldown (≥ 1.2s) in between", gap)
		}
	}
	checkAllServed(t, load.snapshot())
}

// TestOpenBreakerKeepsItsDeadlineThroughTenReloads: an open breaker stays
// open with the same open_until through ten config reloads that alternate
// two configs (different consecutive_failures and response header), and
// no request reaches its upstream meanwhile; a stream through another
// upstream, started before the reloads, runs to its end, and its upstream's
// breaker records no failure.
func TestOpenBreakerKeepsItsDeadlineThroughTenReloads(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3, PerReplica: map[int]mockllm.Behavior{
		0: {Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503}},
	}})
	sick := fleet.Replica(0)
	site := func(i int) string {
		return fmt.Sprintf(`	header X-Config %d
	llm_proxy %s {
		lb_policy round_robin
		max_attempts 2
		breaker {
			consecutive_failures %d
			open_for 30s
			min_open 30s
		}
	}`, i, upstreams(fleet), 3+i%2)
	}
	gw := startGateway(t, site(0))
	c := newClient(t)
	ctx := testContext(t, 60*time.Second)
	url := gw.URL + "/v1/chat/completions"

	// Trip the sick upstream: every third request tries it first and
	// fails over.
	for i := 0; gw.breaker(sick.Addr()).State != "open"; i++ {
		if i == 12 {
			t.Fatalf("breaker %+v after 12 requests, want open", gw.breaker(sick.Addr()))
		}
		checkCleanStream(t, streamRequest(ctx, t, c, url, chatBody("Trip it.", true), "X-Mock-Tokens: 2"))
	}
	before := gw.breaker(sick.Addr())
	sickRequests := sick.Stats().Requests

	// A long stream through another upstream, running across the reloads.
	const tokens = 50
	type streamed struct {
		s   *stream
		err error
	}
	done := make(chan streamed, 1)
	resp := post(ctx, t, newClient(t), url, chatBody("Outlive ten configs.", true),
		fmt.Sprintf("X-Mock-Tokens: %d", tokens), "X-Mock-Token-Interval: 100ms", "X-Request-Id: e2e-long")
	if resp.StatusCode != http.StatusOK || resp.Header.Get(mockllm.HeaderReplica) == sick.Addr() {
		t.Fatalf("long stream: status %d from %q", resp.StatusCode, resp.Header.Get(mockllm.HeaderReplica))
	}
	via := resp.Header.Get(mockllm.HeaderReplica)
	go func() {
		defer resp.Body.Close()
		s := &stream{Status: resp.StatusCode, Header: resp.Header}
		s.Events, s.Tail, s.Err = readEvents(resp.Body, nil)
		done <- streamed{s: s}
	}()

	for i := 1; i <= 10; i++ {
		gw.reload(site(i))
		// The old server closed its idle connections; a POST on one of
		// them would fail with EOF (the client does not retry a POST).
		c.CloseIdleConnections()
		v := gw.breaker(sick.Addr())
		if v.State != "open" || !v.OpenUntil.Equal(before.OpenUntil) || !v.Since.Equal(before.Since) {
			t.Errorf("after reload %d: breaker %s, since %s, open until %s; want open since %s until %s", i, v.State,
				v.Since.Format(time.RFC3339Nano), v.OpenUntil.Format(time.RFC3339Nano),
				before.Since.Format(time.RFC3339Nano), before.OpenUntil.Format(time.RFC3339Nano))
		}
		r, err := doPlain(ctx, c, url, chatBody("After a reload.", false), "X-Mock-Tokens: 2")
		if err != nil {
			// A connection that the old server accepted as it shut down
			// is closed unanswered (Caddy, not llm_proxy: the request
			// never reaches a handler). Once more on a new connection.
			t.Logf("request after reload %d: %v; retrying once", i, err)
			c.CloseIdleConnections()
			if r, err = doPlain(ctx, c, url, chatBody("After a reload.", false), "X-Mock-Tokens: 2"); err != nil {
				t.Fatal(err)
			}
		}
		if want := strconv.Itoa(i); r.Status != http.StatusOK || r.Header.Get("X-Config") != want {
			t.Errorf("request after reload %d: status %d, X-Config %q; want 200 from config %s", i, r.Status, r.Header.Get("X-Config"), want)
		}
	}
	if n := sick.Stats().Requests; n != sickRequests {
		t.Errorf("the open upstream got %d requests during the reloads, want none", n-sickRequests)
	}
	select {
	case <-done:
		t.Errorf("the long stream ended before the tenth reload; make it longer")
	default:
	}
	var got streamed
	select {
	case got = <-done:
	case <-ctx.Done():
		t.Fatal("the long stream did not end")
	}
	checkCleanStream(t, got.s)
	if n := len(got.s.Events); n != tokens+2 {
		t.Errorf("the long stream carried %d events, want %d", n, tokens+2)
	}
	if v := gw.breaker(via); v.State != "closed" || v.ConsecutiveFailures != 0 || v.FailuresInWindow != 0 {
		t.Errorf("breaker of %s, which served the stream across the reloads: %+v; want closed without failures", via, v)
	}
	if left := time.Until(before.OpenUntil); left < 20*time.Second {
		t.Errorf("only %v of the cooldown left; the test wants the reloads done well within it", left)
	}
}
