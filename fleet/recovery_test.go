package fleet

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/redistest"
)

// recoveryFleet is leaseFleet with settings s: three gateways, up1 opened
// fleet-wide on gw0's three failures; it returns the fleet's end of the
// open time.
func recoveryFleet(t *testing.T, s breaker.Settings) (*redistest.Server, []*gateway, *leaseCounts, time.Time) {
	t.Helper()
	return recoveryFleetLease(t, s, testLease)
}

// recoveryFleetLease is recoveryFleet with a probe lease time of lease.
func recoveryFleetLease(t *testing.T, s breaker.Settings, lease time.Duration) (*redistest.Server, []*gateway, *leaseCounts, time.Time) {
	t.Helper()
	srv := redistest.Start(t, redistest.Options{})
	lc := &leaseCounts{n: make(map[string]int)}
	var gws []*gateway
	for i := range 3 {
		id := fmt.Sprintf("gw%d", i)
		g := startGateway(t, srv.URL(), id, 1, BreakersOptions{LeaseTTL: lease, OnLease: lc.hook(id)})
		g.s = s
		g.b("up1")
		gws = append(gws, g)
	}
	gws[0].fail("up1", 3)
	waitState(t, "every gateway's up1", breaker.Open, breakersOf(gws)...)
	var until time.Time
	waitFor(t, "the fleet's open record everywhere", 2*time.Second, func() bool {
		for _, g := range gws {
			st, ok := g.bs.Opened("up1")
			if !ok {
				return false
			}
			until = st.Until
		}
		return true
	})
	return srv, gws, lc, until
}

// TestBreakersRecoverySuccessesCountedFleetWide: recovery_successes 3, and
// the probe lease goes to a different gateway each time (each winner keeps
// a second probe out, so it only looks at the next rounds): one success on
// each of three gateways closes up1 on all three, the first winner's
// breaker (still half-open on its own single success) included. The count
// lives in Redis with the breaker's hash tag and goes with the close.
func TestBreakersRecoverySuccessesCountedFleetWide(t *testing.T) {
	s := leaseSettings
	s.RecoverySuccesses = 3
	srv, gws, lc, until := recoveryFleet(t, s)
	t.Cleanup(func() {
		if t.Failed() {
			lc.mu.Lock()
			t.Logf("lease outcomes: %v", lc.n)
			lc.mu.Unlock()
		}
	})

	var probed []*gateway
	notBefore, wait := until.Add(-20*time.Millisecond), time.Until(until)+time.Second
	for i := range 3 {
		w, p := probeOnce(t, others(gws, probed...), notBefore, wait, 0)
		won := time.Now()
		p.Done(breaker.Success, 0, "")
		probed = append(probed, w)
		if i == 2 {
			break
		}
		waitFor(t, fmt.Sprintf("%d probe successes in Redis", i+1), time.Second, func() bool {
			v, _ := srv.Do("GET", redisKey("up1", "recovered"))
			return v == fmt.Sprint(i+1)
		})
		if st := w.b("up1").State(); st != breaker.HalfOpen {
			t.Fatalf("success %d: %s is %s, want half-open on its own count (1 of 3)", i+1, w.id, st)
		}
		// A half-open winner takes part in the next round and, its ticker
		// being next in phase, often wins it again (seen under load: gw0
		// and gw1 took turns for 4.5 s). A probe of its own still out
		// makes it only look, so the next lease goes to another gateway.
		hold, ok := w.b("up1").Allow()
		if !ok || !hold.Probe() {
			t.Fatalf("success %d: %s gave no second probe within its lease: %+v", i+1, w.id, w.b("up1").Snapshot())
		}
		t.Cleanup(func() { hold.Done(breaker.Neutral, 0, "") })
		// The next winner comes after this lease runs out (its success
		// extended it by a lease time).
		notBefore, wait = won.Add(testLease-50*time.Millisecond), testLease+4*time.Second
	}
	waitState(t, "every gateway's up1", breaker.Closed, breakersOf(gws)...)
	last := probed[2]
	for _, g := range probed[:2] {
		ts := g.transitions("up1")
		if r := ts[len(ts)-1].Reason; r != "closed in fleet by "+last.id+": 3 probe successes" {
			t.Fatalf("%s closed with %q, want the fleet's third success", g.id, r)
		}
	}
	if rec, _ := srv.Do("GET", redisKey("up1", "open")); !strings.Contains(rec, `"s":"closed"`) {
		t.Fatalf("open record %s, want a tombstone", rec)
	}
	if v, _ := srv.Do("EXISTS", redisKey("up1", "recovered")); v != "0" {
		t.Fatalf("recovered counter still there after the close (EXISTS %s)", v)
	}
}

// TestBreakersFailedProbeForgetsTheRecovery: a failed probe re-opens the
// key and starts the fleet's count of successes afresh.
func TestBreakersFailedProbeForgetsTheRecovery(t *testing.T) {
	s := leaseSettings
	s.RecoverySuccesses = 2
	srv, gws, _, until := recoveryFleet(t, s)
	w, p := probeOnce(t, gws, until.Add(-20*time.Millisecond), time.Until(until)+time.Second, 0)
	p.Done(breaker.Success, 0, "")
	waitFor(t, "1 probe success in Redis", time.Second, func() bool {
		v, _ := srv.Do("GET", redisKey("up1", "recovered"))
		return v == "1"
	})
	p2, ok := w.b("up1").Allow()
	if !ok || !p2.Probe() {
		t.Fatalf("the winner's half-open breaker gave no second probe: %+v", w.b("up1").Snapshot())
	}
	p2.Done(breaker.Failure, 0, "http 502")
	waitFor(t, "the re-open in Redis", time.Second, func() bool {
		rec, _ := srv.Do("GET", redisKey("up1", "open"))
		v, _ := srv.Do("EXISTS", redisKey("up1", "recovered"))
		return strings.Contains(rec, `"n":1`) && v == "0"
	})
	waitState(t, "every gateway's up1", breaker.Open, breakersOf(gws)...)
}

// TestBreakersCooldownGrowsWithTheFleetsReopens: the first winner's probe
// fails (one re-open: open_for 1s × 2), then that gateway leaves and the
// next winner, whose own breaker never re-opened, fails too: the fleet's
// open time is 4s (two re-opens), not 2s, and every gateway knows the
// fleet's count.
func TestBreakersCooldownGrowsWithTheFleetsReopens(t *testing.T) {
	s := leaseSettings
	s.MaxOpen = time.Minute
	srv, gws, _, until := recoveryFleet(t, s)

	first, p := probeOnce(t, gws, until.Add(-20*time.Millisecond), time.Until(until)+time.Second, 0)
	p.Done(breaker.Failure, 0, "http 502")
	var next time.Time
	waitFor(t, "every gateway seeing the first re-open", 2*time.Second, func() bool {
		for _, g := range gws {
			st, ok := g.bs.Opened("up1")
			if !ok || st.By != first.id || g.bs.Reopens("up1") != 1 {
				return false
			}
			next = st.Until
		}
		return true
	})
	if left := time.Until(next); left < 1500*time.Millisecond || left > 2100*time.Millisecond {
		t.Fatalf("first re-open: open for %v more, want about 2s (open_for 1s × 2)", left)
	}
	first.b("up1").Close() // out of the next lease
	rest := others(gws, first)

	second, p := probeOnce(t, rest, next.Add(-20*time.Millisecond), time.Until(next)+time.Second, 0)
	if n := second.b("up1").Snapshot().Reopens; n != 0 {
		t.Fatalf("%s's breaker had re-opened %d times itself, want 0 for the test to mean anything", second.id, n)
	}
	p.Done(breaker.Failure, 0, "http 502")
	reopened := time.Now()
	waitFor(t, "every gateway seeing the second re-open", 2*time.Second, func() bool {
		for _, g := range rest {
			st, ok := g.bs.Opened("up1")
			if !ok || st.By != second.id || g.bs.Reopens("up1") != 2 {
				return false
			}
			next = st.Until
		}
		return true
	})
	if left := next.Sub(reopened); left < 3500*time.Millisecond || left > 4100*time.Millisecond {
		t.Fatalf("second re-open by another gateway: open for %v, want about 4s (open_for 1s × 2², the fleet's two re-opens)", left)
	}
	if snap := second.b("up1").Snapshot(); snap.Reopens != 2 {
		t.Fatalf("%s's breaker: %d re-opens, want the fleet's 2", second.id, snap.Reopens)
	}
	if rec, _ := srv.Do("GET", redisKey("up1", "open")); !strings.Contains(rec, `"n":2`) {
		t.Fatalf("open record %s, want the fleet's re-open count 2", rec)
	}
	// An operator's close ends it for good: the count starts again.
	second.b("up1").ForceClose("")
	waitFor(t, "the count back to zero", 2*time.Second, func() bool {
		for _, g := range rest {
			if g.bs.Reopens("up1") != 0 || g.b("up1").State() != breaker.Closed {
				return false
			}
		}
		return true
	})
}

// probeLog records the probes the gateways send to up1, as offsets from
// the fleet's end of the open time.
type probeLog struct {
	mu     sync.Mutex
	end    time.Time
	probes []string // "gw0 +12ms"
}

func (l *probeLog) add(id string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.probes = append(l.probes, fmt.Sprintf("%s +%v", id, time.Since(l.end).Round(time.Millisecond)))
}

func (l *probeLog) list() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.probes...)
}

// driveProbes runs one loop per gateway until the test ends, each looking
// at its breaker of up1 every poll; probe says whether the loop sends a
// probe now, given its breaker and when it last sent one, and take asks
// for the permit. Every probe and every user call succeeds: the upstream
// is healthy again.
func driveProbes(t *testing.T, gws []*gateway, log *probeLog, poll time.Duration,
	probe func(b *breaker.Breaker, last time.Time) bool, take func(b *breaker.Breaker) (breaker.Permit, bool)) {
	t.Helper()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, g := range gws {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var last time.Time
			tick := time.NewTicker(poll)
			defer tick.Stop()
			for {
				select {
				case <-stop:
					return
				case <-tick.C:
				}
				b := g.b("up1")
				if !probe(b, last) {
					continue
				}
				if p, ok := take(b); ok {
					if p.Probe() {
						last = time.Now()
						log.add(g.id)
					}
					p.Done(breaker.Success, 0, "")
				}
			}
		}()
	}
	t.Cleanup(func() {
		close(stop)
		wg.Wait()
	})
}

// TestRecoverySuccesses2AcrossThreeGatewaysClosesWithinTwoProbeIntervals:
// recovery_successes 2, three gateways, up1 open fleet-wide, the upstream
// healthy again. From the end of the fleet's open time, every gateway's
// breaker is closed within two probe intervals, after exactly two probes
// in all, every one under a live probe lease (none dropped as expired:
// at most one gateway probes the key at a time, and no probe is wasted).
//
// The probe interval is the active prober's (`probe { interval }`,
// upstream.Prober.Interval, default 5s): upstream.Entry's probe loop
// probes an open breaker as soon as it is due (its cooldown over, or its
// gateway won the fleet's probe lease: ProbeNow) and a half-open one an
// interval after its last probe; activeProber does the same. The fleet's
// lease time (BreakersOptions.LeaseTTL, at most 0.8 × open_for) is below
// or at that interval: DefaultProbeLeaseTTL is 0.8 × DefaultProbeInterval,
// and a `probe { interval 4s }` meets the default lease of 4s. Without a
// prober, user requests are the probes and the lease time is the fleet's
// only probe interval.
//
// The lease holder sends both probes: its first success extends its lease
// by a lease time, over its next probe an interval later. Before, a lease
// equal to the interval ran out just before the holder's second probe
// (5 runs in 6): that success was dropped as expired, the holder's breaker
// closed on its own count while the fleet's stayed open, and another
// gateway probed again within ~80ms (three probes for two successes).
func TestRecoverySuccesses2AcrossThreeGatewaysClosesWithinTwoProbeIntervals(t *testing.T) {
	const interval = 500 * time.Millisecond // the tests' refresh is 100ms: 1s : 5s as by default
	activeProber := func(b *breaker.Breaker, last time.Time) bool {
		return b.ProbeDue() && (b.State() == breaker.Open || time.Since(last) >= interval)
	}
	userCalls := func(*breaker.Breaker, time.Time) bool { return true }
	for _, tc := range []struct {
		name   string
		lease  time.Duration
		active bool
		within time.Duration
	}{
		{"active prober, lease 0.8 × interval", interval * 8 / 10, true, 2 * interval},
		{"active prober, lease = interval", interval, true, 2 * interval},
		{"user requests are the probes", testLease, false, 2 * testLease},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := leaseSettings // open_for 1s: the lease is at most 800ms
			s.RecoverySuccesses = 2
			s.ActiveProbing = tc.active
			_, gws, lc, end := recoveryFleetLease(t, s, tc.lease)
			log := &probeLog{end: end}
			if tc.active {
				driveProbes(t, gws, log, interval/20, activeProber, (*breaker.Breaker).AllowProbe)
			} else {
				driveProbes(t, gws, log, 5*time.Millisecond, userCalls, (*breaker.Breaker).Allow)
			}
			waitFor(t, "every gateway's up1 closed", 5*time.Second, func() bool {
				for _, b := range breakersOf(gws) {
					if b.State() != breaker.Closed {
						return false
					}
				}
				return true
			})
			took := time.Since(end)
			probes := log.list()
			lc.mu.Lock()
			leases := fmt.Sprint(lc.n)
			lc.mu.Unlock()
			t.Logf("closed on every gateway %v after the fleet's open time ended; probes %v; leases %s",
				took.Round(time.Millisecond), probes, leases)
			if took > tc.within {
				t.Errorf("closed %v after the end, want within %v", took.Round(time.Millisecond), tc.within)
			}
			if len(probes) != 2 {
				t.Errorf("%d probes %v, want 2 (recovery_successes 2 over the fleet, none wasted)", len(probes), probes)
			}
			if t.Failed() {
				for _, g := range gws {
					for _, tr := range g.transitions("up1") {
						t.Logf("%s: %s → %s at +%v: %s", g.id, tr.From, tr.To, tr.At.Sub(end).Round(time.Millisecond), tr.Reason)
					}
				}
			}
			if n := lc.total(LeaseExpired); n != 0 {
				t.Errorf("%d probe results dropped as expired, want every probe under a live lease", n)
			}
		})
	}
}
