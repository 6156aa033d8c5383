package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
	"github.com/llmproxy/caddy-llm-proxy/internal/redistest"
)

// Fleet state in Redis (issue 10): several real gateways share one real
// redis-server, reached through a TCP fault proxy so that a test can stop,
// blackhole or slow Redis under steady traffic.

// fleetView is GET /llm_proxy/fleet.
type fleetView struct {
	Mode       string `json:"mode"`
	InstanceID string `json:"instance_id"`
	Instances  []struct {
		ID string `json:"instance_id"`
	} `json:"instances"`
}

func (g *gateway) fleet() fleetView {
	g.t.Helper()
	code, body := g.admin(http.MethodGet, "/llm_proxy/fleet")
	if code != http.StatusOK {
		g.t.Fatalf("GET /llm_proxy/fleet: %d %s", code, body)
	}
	var v fleetView
	if err := json.Unmarshal(body, &v); err != nil {
		g.t.Fatalf("GET /llm_proxy/fleet: %v: %s", err, body)
	}
	return v
}

// fleetGlobals is the global option that puts a gateway in a fleet.
func fleetGlobals(redisAddr, id string, extra ...string) string {
	return fmt.Sprintf("llm_proxy {\n\tfleet redis redis://%s {\n\t\trefresh 200ms\n\t\top_timeout 50ms\n\t\tinstance_id %s\n\t}\n%s\n}", redisAddr, id, strings.Join(extra, "\n"))
}

// startFleetGateways starts n gateways in one fleet in front of the mock
// fleet and waits until each sees all n instances.
func startFleetGateways(t *testing.T, n int, redisAddr string, f *mockllm.Fleet, site string, extra ...string) []*gateway {
	t.Helper()
	var gws []*gateway
	for i := range n {
		gws = append(gws, startGatewayWith(t, gatewayOptions{Site: site, Globals: fleetGlobals(redisAddr, fmt.Sprintf("gw-%d", i), extra...)}))
	}
	for i, g := range gws {
		var v fleetView
		if !waitFor(10*time.Second, func() bool { v = g.fleet(); return v.Mode == "fleet" && len(v.Instances) == n }) {
			t.Fatalf("gateway %d: fleet view %+v, want mode fleet with %d instances", i, v, n)
		}
		if v.InstanceID != fmt.Sprintf("gw-%d", i) {
			t.Errorf("gateway %d: instance_id %q", i, v.InstanceID)
		}
	}
	return gws
}

// logCount counts the gateway's log lines that hold every one of parts.
func (g *gateway) logCount(parts ...string) int {
	n := 0
	for _, line := range strings.Split(g.logs.String(), "\n") {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			n++
		}
	}
	return n
}

// degradedGauge reads caddy_llm_proxy_fleet_degraded; found is false when
// the series is missing (which no assertion may read as 0).
func (g *gateway) degradedGauge() (v float64, found bool) {
	return metricValue(g.scrapeMetrics(), "caddy_llm_proxy_fleet_degraded", nil)
}

// TestFleetRedisAwaySlowOrBlackholedFailsOpen: three gateways share one
// Redis in front of two replicas; every request is a tenant's with rpm and
// max_concurrent limits, so admission asks Redis on the request path, and
// the upstreams' breakers report to it. In the middle of steady traffic Redis is
// stopped, then (after it is back) blackholed, then made slow (100ms per
// reply, twice op_timeout). Every request completes, none takes longer
// than normal + op_timeout (plus loopback slack), each gateway reports
// degraded (gauge 1, mode local) and writes exactly one warning per
// outage, and after Redis returns each is back in fleet mode within a few
// refresh intervals, with one info line.
func TestFleetRedisAwaySlowOrBlackholedFailsOpen(t *testing.T) {
	t.Parallel()
	rs := redistest.Start(t, redistest.Options{})
	px := redistest.NewProxy(t, rs.Addr())
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2,
		Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(10 * time.Millisecond), Tokens: 3, TokenInterval: 5 * time.Millisecond}})
	key := newKey("failopen")
	gws := startFleetGateways(t, 3, px.Addr(), fleet, "llm_proxy "+upstreams(fleet),
		fmt.Sprintf("\ttenants {\n\t\tkey %s steady tier busy\n\t}\n\ttier busy {\n\t\trpm 100000\n\t\tmax_concurrent 100\n\t}", key))
	for i, g := range gws {
		if v, found := g.degradedGauge(); !found || v != 0 {
			t.Fatalf("gateway %d: fleet_degraded = %v (found %v), want 0 while Redis is healthy", i, v, found)
		}
	}

	var loads []*loadGen
	for _, g := range gws {
		loads = append(loads, startLoad(t, g.URL+"/v1/chat/completions", 2, bearer(key)))
	}
	time.Sleep(500 * time.Millisecond)
	var normal []time.Duration
	for _, l := range loads {
		for _, r := range l.snapshot() {
			normal = append(normal, r.End.Sub(r.Start))
		}
	}
	if len(normal) < 10 {
		t.Fatalf("only %d requests in the first 500ms", len(normal))
	}
	slices.Sort(normal)
	worstNormal := normal[len(normal)-1]
	for i, g := range gws {
		if n, found := metricValue(g.scrapeMetrics(), "caddy_llm_proxy_fleet_op_seconds_count", map[string]string{"op": "limits_reserve"}); !found || n < 1 {
			t.Fatalf("gateway %d: %v admissions through Redis (found %v), want the tenant's limits decided there", i, n, found)
		}
	}

	outages := []struct {
		name        string
		begin, end  func()
		warnOutage  string
		recoverText string
	}{
		{"stopped", rs.Stop, rs.Restart, "switching to local mode", "back to fleet mode"},
		{"blackholed", px.Blackhole, px.Pass, "switching to local mode", "back to fleet mode"},
		{"slow", func() { px.Latency(100 * time.Millisecond) }, px.Pass, "switching to local mode", "back to fleet mode"},
	}
	for n, o := range outages {
		warnBefore := make([]int, len(gws))
		infoBefore := make([]int, len(gws))
		for i, g := range gws {
			warnBefore[i] = g.logCount(`"level":"warn"`, o.warnOutage)
			infoBefore[i] = g.logCount(`"level":"info"`, o.recoverText)
		}
		o.begin()
		for i, g := range gws {
			var v fleetView
			if !waitFor(10*time.Second, func() bool { v = g.fleet(); return v.Mode == "local" }) {
				t.Fatalf("Redis %s: gateway %d still in mode %q after 10s", o.name, i, v.Mode)
			}
			if d, found := g.degradedGauge(); !found || d != 1 {
				t.Errorf("Redis %s: gateway %d fleet_degraded = %v (found %v), want 1", o.name, i, d, found)
			}
		}
		time.Sleep(600 * time.Millisecond) // steady traffic on local state, three refresh intervals
		o.end()
		for i, g := range gws {
			var v fleetView
			if !waitFor(5*time.Second, func() bool { v = g.fleet(); return v.Mode == "fleet" }) {
				t.Fatalf("Redis back after %s: gateway %d still in mode %q after 5s (25 refresh intervals)", o.name, i, v.Mode)
			}
			if d, found := g.degradedGauge(); !found || d != 0 {
				t.Errorf("Redis back after %s: gateway %d fleet_degraded = %v (found %v), want 0", o.name, i, d, found)
			}
			if w := g.logCount(`"level":"warn"`, o.warnOutage) - warnBefore[i]; w != 1 {
				t.Errorf("Redis %s: gateway %d wrote %d warnings, want exactly one", o.name, i, w)
			}
			if in := g.logCount(`"level":"info"`, o.recoverText) - infoBefore[i]; in != 1 {
				t.Errorf("Redis back after %s: gateway %d wrote %d recovery lines, want exactly one", o.name, i, in)
			}
		}
		if n < len(outages)-1 {
			time.Sleep(300 * time.Millisecond)
		}
	}
	for _, l := range loads {
		l.stop()
	}
	// Every request completed, and none waited on Redis past op_timeout.
	limit := worstNormal + 50*time.Millisecond + 250*time.Millisecond // op_timeout + loopback slack on 2 cores
	total := 0
	for i, l := range loads {
		rs := l.snapshot()
		total += len(rs)
		checkAllServed(t, rs)
		for _, r := range rs {
			if d := r.End.Sub(r.Start); d > limit {
				t.Errorf("gateway %d: a request at %s took %v, over normal (%v) + op_timeout + slack", i, r.Start.Format("15:04:05.000"), d, worstNormal)
			}
		}
	}
	t.Logf("%d requests through three outages; worst before them %v", total, worstNormal)
}

// TestFleetBreakerTripsOnceForTheFleet: three gateways share one Redis in
// front of three replicas under steady traffic; replica 0 starts to accept
// requests and hang. Across the whole fleet, the user requests that reach
// it before it is excluded are at most the trip threshold (3) plus those
// in flight when the fleet's count crossed it (at most one per worker: 6),
// not 3 per gateway plus those; every gateway shows its breaker open with
// scope fleet; no user sees an error (each hung attempt fails over before
// commit). A fourth gateway started while it is open sees it open, with
// its remaining time, before any traffic of its own.
func TestFleetBreakerTripsOnceForTheFleet(t *testing.T) {
	t.Parallel()
	rs := redistest.Start(t, redistest.Options{})
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3,
		Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	sick := fleet.Replica(0)
	site := "llm_proxy " + upstreams(fleet) + " {\n\tfirst_byte_timeout 300ms\n\tmax_attempts 2\n\tbreaker {\n\t\tconsecutive_failures 3\n\t\topen_for 30s\n\t\tmin_open 30s\n\t}\n}"
	gws := startFleetGateways(t, 3, rs.Addr(), fleet, site)
	var loads []*loadGen
	for _, g := range gws {
		loads = append(loads, startLoad(t, g.URL+"/v1/chat/completions", 2))
	}
	time.Sleep(300 * time.Millisecond)
	b := sick.Behavior()
	b.Fault = mockllm.Fault{Kind: mockllm.FaultHang}
	hungAt := time.Now()
	sick.SetBehavior(b)
	for i, g := range gws {
		var v breakerView
		if !waitFor(10*time.Second, func() bool { v = g.breakers()[sick.Addr()]; return v.State == "open" }) {
			t.Fatalf("gateway %d: replica 0's breaker is %q 10s after it began to hang", i, v.State)
		}
		if v.Scope != "fleet" || v.OpenedBy == "" {
			t.Errorf("gateway %d: breaker open with scope %q opened_by %q, want fleet and the opener", i, v.Scope, v.OpenedBy)
		}
	}
	time.Sleep(500 * time.Millisecond)
	for _, l := range loads {
		l.stop()
	}
	reached := 0
	for _, rec := range userRecords(sick, "load-") {
		if rec.Started.After(hungAt) {
			reached++
		}
	}
	if limit := 3 + 6; reached > limit {
		t.Errorf("%d user requests reached the hung replica across three gateways, want at most %d (threshold 3 + 6 in flight)", reached, limit)
	}
	for _, l := range loads {
		checkAllServed(t, l.snapshot())
	}
	t.Logf("%d user requests reached the hung replica before the fleet excluded it", reached)

	rec, err := rs.Do("GET", "llmproxy:{breaker:"+gws[0].breaker(sick.Addr()).FleetKey+"}:open")
	if err != nil {
		t.Fatalf("reading the fleet's open record: %v", err)
	}
	var open struct {
		State string `json:"s"`
		Until int64  `json:"u"`
	}
	if err := json.Unmarshal([]byte(rec), &open); err != nil || open.State != "open" {
		t.Fatalf("the fleet's open record %q (%v), want open", rec, err)
	}
	want := time.UnixMilli(open.Until)
	// Late enough that a fresh cooldown of its own (30s from its start)
	// would end 8s after the fleet's.
	time.Sleep(time.Until(hungAt.Add(8 * time.Second)))
	late := startGatewayWith(t, gatewayOptions{Site: site, Globals: fleetGlobals(rs.Addr(), "gw-late")})
	var v breakerView
	if !waitFor(5*time.Second, func() bool { v = late.breakers()[sick.Addr()]; return v.State == "open" }) {
		t.Fatalf("a gateway started while the fleet has replica 0 open sees %q", v.State)
	}
	// Its remaining time is the fleet's, not a fresh cooldown of its own
	// (30s from now); a gateway may hold it a probe lease longer (≤ 5s).
	if d := v.OpenUntil.Sub(want); d < -time.Second || d > 6*time.Second {
		t.Errorf("the late gateway's breaker is open until %s, the fleet's record until %s", v.OpenUntil.Format(time.RFC3339Nano), want.Format(time.RFC3339Nano))
	}
	if n := len(userRecords(sick, "late-")); n != 0 {
		t.Errorf("the late gateway sent %d requests to the open replica", n)
	}
}

// TestFleetOperatorActionsApplyFleetWide: an operator's open on one
// gateway's admin API opens the breaker on the others (through Redis, no
// traffic needed), and a close on another gateway closes it everywhere;
// a reset likewise.
func TestFleetOperatorActionsApplyFleetWide(t *testing.T) {
	t.Parallel()
	rs := redistest.Start(t, redistest.Options{})
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2})
	gws := startFleetGateways(t, 3, rs.Addr(), fleet, "llm_proxy "+upstreams(fleet))
	addr := fleet.Replica(1).Addr()
	everywhere := func(state string) {
		t.Helper()
		for i, g := range gws {
			var v breakerView
			if !waitFor(5*time.Second, func() bool { v = g.breakers()[addr]; return v.State == state }) {
				t.Fatalf("gateway %d: breaker of %s is %q, want %q on every gateway", i, addr, v.State, state)
			}
		}
	}
	if code, _ := gws[0].breakerAction(addr, "open"); code != http.StatusOK {
		t.Fatalf("open on gateway 0: %d", code)
	}
	everywhere("open")
	if v := gws[2].breakers()[addr]; v.Scope != "fleet" || v.OpenedBy != "gw-0" {
		t.Errorf("gateway 2 sees the operator's open with scope %q opened_by %q, want fleet and gw-0", v.Scope, v.OpenedBy)
	}
	if code, _ := gws[1].breakerAction(addr, "close"); code != http.StatusOK {
		t.Fatalf("close on gateway 1: %d", code)
	}
	everywhere("closed")
	if code, _ := gws[2].breakerAction(addr, "open"); code != http.StatusOK {
		t.Fatalf("open on gateway 2: %d", code)
	}
	everywhere("open")
	if code, _ := gws[0].breakerAction(addr, "reset"); code != http.StatusOK {
		t.Fatalf("reset on gateway 0: %d", code)
	}
	everywhere("closed")
}

// TestFleetProbesOncePerIntervalAndSurvivesAKilledProber: three gateways
// in front of three replicas, with active probing every 2s (open_for 2s,
// so the fleet's probe lease is 1.6s); replica 0 becomes degraded: it
// accepts completions and hangs, and its /health says 503. Once the fleet
// has it open, the test counts the probes at the mock over 30s: at most
// one per probe interval (30s / 2s, +1 at the edges), never two closer
// than the lease time (three gateways probing on their own cooldowns
// would send about three times as many, some a moment apart), and no user
// request. Then one gateway is killed (-9) and the replica recovers: the
// two left close its breaker within a few seconds, whoever held the
// lease — it is never wedged.
func TestFleetProbesOncePerIntervalAndSurvivesAKilledProber(t *testing.T) {
	t.Parallel()
	const (
		interval = 2 * time.Second
		window   = 30 * time.Second
		lease    = interval * 8 / 10 // 0.8 × open_for (= interval), under the default 4s
	)
	rs := redistest.Start(t, redistest.Options{})
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 3,
		Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	sick := fleet.Replica(0)
	site := "llm_proxy " + upstreams(fleet) + " {\n\tfirst_byte_timeout 300ms\n\tmax_attempts 2\n\tbreaker {\n\t\tconsecutive_failures 3\n\t\topen_for 2s\n\t\tmin_open 2s\n\t\tmax_open 4s\n\t\trecovery_successes 1\n\t\tprobe {\n\t\t\turi /health\n\t\t\tinterval 2s\n\t\t}\n\t}\n}"
	gws := startFleetGateways(t, 3, rs.Addr(), fleet, site)
	var loads []*loadGen
	for _, g := range gws {
		loads = append(loads, startLoad(t, g.URL+"/v1/chat/completions", 1))
	}
	time.Sleep(300 * time.Millisecond)
	b := sick.Behavior()
	b.Fault = mockllm.Fault{Kind: mockllm.FaultHang}
	b.HealthStatus = 503
	sick.SetBehavior(b)
	for i, g := range gws {
		if _, ok := g.waitBreaker(sick.Addr(), 10*time.Second, func(v breakerView) bool { return v.State == "open" }); !ok {
			t.Fatalf("gateway %d: replica 0's breaker never opened", i)
		}
	}
	// The probes' arrival times, from the mock's health check counter
	// sampled every 10ms.
	from := time.Now()
	last := sick.Stats().HealthChecks
	var at []time.Time
	for time.Since(from) < window {
		time.Sleep(10 * time.Millisecond)
		if n := sick.Stats().HealthChecks; n != last {
			for range n - last {
				at = append(at, time.Now())
			}
			last = n
		}
	}
	probes := len(at)
	if limit := int(window/interval) + 1; probes < 1 || probes > limit {
		t.Errorf("the fleet sent %d probes to the degraded replica in %s at a %s interval, want between 1 and one per interval (≤ %d), not one per gateway",
			probes, window, interval, limit)
	}
	var gaps []time.Duration
	for i := 1; i < len(at); i++ {
		gaps = append(gaps, at[i].Sub(at[i-1]).Round(10*time.Millisecond))
	}
	// Lease time less slack for the sampling and the probers' 250ms look.
	if minGap := lease - 400*time.Millisecond; len(gaps) > 0 && slices.Min(gaps) < minGap {
		t.Errorf("two probes %s apart (gaps %v), want every two at least the lease time %s apart (less %s slack): one prober at a time for the fleet",
			slices.Min(gaps), gaps, lease, lease-minGap)
	}
	if n := len(recordsBetween(userRecords(sick, "load-"), from, time.Time{})); n != 0 {
		t.Errorf("%d user requests reached the open replica while the fleet probed it", n)
	}
	won := 0.0
	for _, g := range gws {
		won += metricValueOrZero(t, g.scrapeMetrics(), "caddy_llm_proxy_probe_leases_total", map[string]string{"result": "won"})
	}
	if won < float64(probes) {
		t.Errorf("caddy_llm_proxy_probe_leases_total{result=won} summed over the fleet = %v, want at least one lease per probe (%d)", won, probes)
	}
	t.Logf("%d probes in %s across three gateways, gaps %v; %v leases won", probes, window, gaps, won)

	loads[0].stop()
	_ = gws[0].cmd.Process.Kill() // kill -9, lease or not
	<-gws[0].exited
	b.Fault, b.HealthStatus = mockllm.Fault{}, 0
	sick.SetBehavior(b)
	for i, g := range gws[1:] {
		if v, ok := g.waitBreaker(sick.Addr(), 15*time.Second, func(v breakerView) bool { return v.State == "closed" }); !ok {
			t.Fatalf("gateway %d: replica 0's breaker is %q 15s after it recovered with a gateway killed: wedged", i+1, v.State)
		}
	}
	for _, l := range loads[1:] {
		l.stop()
		checkAllServed(t, l.snapshot())
	}
}

// TestFleetRecoverySuccessesCountFleetWide: three gateways probe a failing
// replica actively (a lease each time, 1.6s); recovery_successes 3. Once
// the replica recovers, the fleet closes its breaker on every gateway
// after about 3 successful probes in all, whichever gateways held the
// leases (each counted success extends its holder's lease over its next
// probe, so usually one gateway sends all three) — not 3 per gateway
// (each gateway's own 3 would take 5 to 9).
func TestFleetRecoverySuccessesCountFleetWide(t *testing.T) {
	t.Parallel()
	rs := redistest.Start(t, redistest.Options{})
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2,
		Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	sick := fleet.Replica(0)
	site := "llm_proxy " + upstreams(fleet) + " {\n\tmax_attempts 2\n\tbreaker {\n\t\tconsecutive_failures 3\n\t\topen_for 2s\n\t\tmin_open 2s\n\t\tmax_open 4s\n\t\trecovery_successes 3\n\t\tprobe {\n\t\t\turi /health\n\t\t\tinterval 2s\n\t\t}\n\t}\n}"
	gws := startFleetGateways(t, 3, rs.Addr(), fleet, site)
	b := sick.Behavior()
	b.Fault = mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503}
	b.HealthStatus = 503
	sick.SetBehavior(b)
	var loads []*loadGen
	for _, g := range gws {
		loads = append(loads, startLoad(t, g.URL+"/v1/chat/completions", 1))
	}
	for i, g := range gws {
		if _, ok := g.waitBreaker(sick.Addr(), 10*time.Second, func(v breakerView) bool { return v.State == "open" }); !ok {
			t.Fatalf("gateway %d: replica 0's breaker never opened", i)
		}
	}
	time.Sleep(3 * time.Second) // a failed probe or two: the fleet re-opens
	b.Fault, b.HealthStatus = mockllm.Fault{}, 0
	sick.SetBehavior(b)
	recovered := time.Now()
	before := sick.Stats().HealthChecks
	closed := func() bool {
		for _, g := range gws {
			if g.breakers()[sick.Addr()].State != "closed" {
				return false
			}
		}
		return true
	}
	if !waitFor(20*time.Second, closed) {
		t.Fatalf("replica 0's breaker not closed on every gateway 20s after it recovered")
	}
	probes := sick.Stats().HealthChecks - before
	// +1: a probe that was on its way when the replica recovered.
	if probes < 3 || probes > 4 {
		t.Errorf("%d successful probes closed the breaker of three gateways, want recovery_successes 3 over the fleet (+1 at the edge), not 3 per gateway", probes)
	}
	for _, l := range loads {
		l.stop()
		checkAllServed(t, l.snapshot())
	}
	t.Logf("%d probes closed the fleet's breaker %v after the replica recovered", probes, time.Since(recovered).Round(10*time.Millisecond))
}

// TestFleetFailureRatioTripsOnTheFleetsSums: replica 0 fails every second
// request (503); the breakers' rule is failure_ratio 0.4 over at least 24
// requests (the consecutive rule out of reach). One gateway's share of the
// traffic (fewer than 24 attempts at replica 0) opens nothing; once three
// gateways' windows add up, the fleet's ratio opens replica 0 on all three
// (scope fleet), the idle first gateway included, with the ratio as the
// fleet's reason. No user sees an error (the failures fail over).
func TestFleetFailureRatioTripsOnTheFleetsSums(t *testing.T) {
	t.Parallel()
	rs := redistest.Start(t, redistest.Options{})
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2,
		Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(2 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	sick := fleet.Replica(0)
	b := sick.Behavior()
	b.Fault = mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503, Every: 2}
	sick.SetBehavior(b)
	site := "llm_proxy " + upstreams(fleet) + " {\n\tlb_policy round_robin\n\tmax_attempts 2\n\tbreaker {\n\t\tconsecutive_failures 1000\n\t\tfailure_ratio 0.4 min_requests 24 window 30s\n\t\topen_for 30s\n\t}\n}"
	gws := startFleetGateways(t, 3, rs.Addr(), fleet, site)
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	traffic := func(g *gateway) {
		t.Helper()
		for range 20 {
			if r := send(ctx, c, g.URL+"/v1/chat/completions", chatBody("half of them fail at replica 0", false)); r.Err != nil || r.Status != http.StatusOK {
				t.Fatalf("%d %v %s, want every request served", r.Status, r.Err, r.Body)
			}
		}
	}
	traffic(gws[0])
	time.Sleep(time.Second) // five refresh intervals: the first gateway's sums are in Redis
	for i, g := range gws {
		if v := g.breakers()[sick.Addr()]; v.State != "closed" {
			t.Fatalf("gateway %d: replica 0's breaker %q after one gateway's share (%d attempts at it), want closed", i, v.State, len(userRecords(sick, "")))
		}
	}
	traffic(gws[1])
	traffic(gws[2])
	for i, g := range gws {
		v, ok := g.waitBreaker(sick.Addr(), 5*time.Second, func(v breakerView) bool { return v.State == "open" })
		if !ok || v.Scope != "fleet" {
			t.Fatalf("gateway %d: replica 0's breaker %q scope %q, want open by the fleet", i, v.State, v.Scope)
		}
	}
	rec, err := rs.Do("GET", "llmproxy:{breaker:"+gws[0].breaker(sick.Addr()).FleetKey+"}:open")
	if err != nil || !strings.Contains(rec, "fleet: failure ratio") {
		t.Fatalf("the fleet's open record %q (%v), want opened by the fleet's failure ratio", rec, err)
	}
	t.Logf("%d attempts at replica 0 in all; %s", len(userRecords(sick, "")), rec)
}

// TestFleetMinReportersKeepsOneGatewaysBrokenPathLocal: with min_reporters
// 2, a gateway whose every request fails (its own broken path: here it
// asks the replicas for 503s) opens its breakers by its own rules only;
// the two other gateways keep them closed and serve through them, since
// one reporter is not enough to open an upstream for the fleet.
func TestFleetMinReportersKeepsOneGatewaysBrokenPathLocal(t *testing.T) {
	t.Parallel()
	rs := redistest.Start(t, redistest.Options{})
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2,
		Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	globals := func(id string) string {
		return strings.Replace(fleetGlobals(rs.Addr(), id), "refresh 200ms", "refresh 200ms\n\t\tmin_reporters 2", 1)
	}
	site := "llm_proxy " + upstreams(fleet) + " {\n\tbreaker {\n\t\tconsecutive_failures 3\n\t\topen_for 30s\n\t}\n}"
	broken := startGatewayWith(t, gatewayOptions{Globals: globals("gw-broken"), Site: "request_header X-Mock-Fault status=503\n" + site})
	healthy := []*gateway{
		startGatewayWith(t, gatewayOptions{Globals: globals("gw-a"), Site: site}),
		startGatewayWith(t, gatewayOptions{Globals: globals("gw-b"), Site: site}),
	}
	for _, g := range append([]*gateway{broken}, healthy...) {
		if !waitFor(10*time.Second, func() bool { v := g.fleet(); return v.Mode == "fleet" && len(v.Instances) == 3 }) {
			t.Fatalf("%s never saw the fleet of three", g.fleet().InstanceID)
		}
	}
	c := newClient(t)
	ctx := testContext(t, 20*time.Second)
	for range 8 {
		r := send(ctx, c, broken.URL+"/v1/chat/completions", chatBody("through a broken path", false))
		if r.Err != nil {
			t.Fatal(r.Err)
		}
	}
	for _, r := range fleet.Replicas() {
		if v, ok := broken.waitBreaker(r.Addr(), 5*time.Second, func(v breakerView) bool { return v.State == "open" }); !ok || v.Scope != "local" {
			t.Fatalf("the broken gateway's breaker of %s is %q scope %q, want open by its own rules (local)", r.Addr(), v.State, v.Scope)
		}
	}
	time.Sleep(1 * time.Second) // five refresh intervals for a fleet verdict to show, if there were one
	for i, g := range healthy {
		for _, r := range fleet.Replicas() {
			if v := g.breakers()[r.Addr()]; v.State != "closed" {
				t.Errorf("healthy gateway %d: breaker of %s is %q (opened by %q) after one gateway's failures with min_reporters 2, want closed", i, r.Addr(), v.State, v.OpenedBy)
			}
		}
		if r := send(ctx, c, g.URL+"/v1/chat/completions", chatBody("through a good path", false)); r.Err != nil || r.Status != 200 {
			t.Errorf("healthy gateway %d: %d %v, want 200", i, r.Status, r.Err)
		}
	}
}
