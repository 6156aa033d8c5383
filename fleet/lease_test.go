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

// The probe lease tests: three gateways, one breaker each for one key,
// opened fleet-wide for a short open_for; a lease of 500ms (under 0.8 ×
// open_for 1s, over 2 × the tests' refresh).
const testLease = 500 * time.Millisecond

var leaseSettings = breaker.Settings{ConsecutiveFailures: 3, MinOpen: -1, OpenFor: time.Second, RecoverySuccesses: 1}

// leaseCounts records the OnLease outcomes per gateway.
type leaseCounts struct {
	mu sync.Mutex
	n  map[string]int // "gw0 won"
}

func (lc *leaseCounts) hook(id string) func(string) {
	return func(result string) {
		lc.mu.Lock()
		defer lc.mu.Unlock()
		lc.n[id+" "+result]++
	}
}

// total is the number of result outcomes over every gateway.
func (lc *leaseCounts) total(result string) int {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	n := 0
	for k, v := range lc.n {
		if strings.HasSuffix(k, " "+result) {
			n += v
		}
	}
	return n
}

func (lc *leaseCounts) of(id, result string) int {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	return lc.n[id+" "+result]
}

// leaseFleet starts three gateways with the lease settings and opens up1
// fleet-wide on gw0's failures; it returns the fleet's end of the open time.
func leaseFleet(t *testing.T) (*redistest.Server, []*gateway, *leaseCounts, time.Time) {
	t.Helper()
	s := redistest.Start(t, redistest.Options{})
	lc := &leaseCounts{n: make(map[string]int)}
	var gws []*gateway
	for i := range 3 {
		id := fmt.Sprintf("gw%d", i)
		g := startGateway(t, s.URL(), id, 1, BreakersOptions{LeaseTTL: testLease, OnLease: lc.hook(id)})
		g.s = leaseSettings
		g.b("up1")
		gws = append(gws, g)
	}
	gws[0].fail("up1", 3)
	waitState(t, "every gateway's up1", breaker.Open, gws[0].b("up1"), gws[1].b("up1"), gws[2].b("up1"))
	var until time.Time
	waitFor(t, "the fleet's open record everywhere", 2*time.Second, func() bool {
		for _, g := range gws {
			st, ok := g.bs.Opened("up1")
			if !ok || st.By != "gw0" {
				return false
			}
			until = st.Until
		}
		return true
	})
	for _, g := range gws {
		if got := g.b("up1").Snapshot().OpenUntil; got.Sub(until.Add(testLease)).Abs() > 100*time.Millisecond {
			t.Fatalf("%s: breaker open until %v, want the fleet's end %v plus the lease time", g.id, got, until)
		}
	}
	return s, gws, lc, until
}

// probeOnce polls the gateways' breakers (user calls) until one lets a
// probe in, within wait; then it keeps polling for hold and fails if any
// other lets one in. It returns the winner and its probe permit; the
// probe is left out (the winner's breaker refuses meanwhile).
func probeOnce(t *testing.T, gws []*gateway, notBefore time.Time, wait, hold time.Duration) (*gateway, breaker.Permit) {
	t.Helper()
	var (
		winner *gateway
		permit breaker.Permit
	)
	deadline := time.Now().Add(wait)
	for winner == nil {
		if time.Now().After(deadline) {
			t.Fatalf("no gateway let a probe in within %v", wait)
		}
		for _, g := range gws {
			if p, ok := g.b("up1").Allow(); ok {
				if at := time.Now(); at.Before(notBefore) {
					t.Fatalf("%s let a probe in at %v, before %v", g.id, at.Format("15:04:05.000"), notBefore.Format("15:04:05.000"))
				}
				winner, permit = g, p
				break
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	for end := time.Now().Add(hold); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		for _, g := range gws {
			if p, ok := g.b("up1").Allow(); ok {
				p.Done(breaker.Neutral, 0, "")
				t.Fatalf("%s let a second probe in (the lease is %s's): %+v", g.id, winner.id, g.b("up1").Snapshot())
			}
		}
	}
	if st := winner.b("up1").State(); st != breaker.HalfOpen {
		t.Fatalf("the winner %s is %s, want half-open", winner.id, st)
	}
	return winner, permit
}

func others(gws []*gateway, not ...*gateway) []*gateway {
	var out []*gateway
next:
	for _, g := range gws {
		for _, n := range not {
			if g == n {
				continue next
			}
		}
		out = append(out, g)
	}
	return out
}

func breakersOf(gws []*gateway) []*breaker.Breaker {
	var bs []*breaker.Breaker
	for _, g := range gws {
		bs = append(bs, g.b("up1"))
	}
	return bs
}

// TestProbeLeaseOneGatewayProbes: after the fleet's open time, exactly one
// of the three breakers half-opens within the lease time, the other two
// refuse; the winner's success closes all three.
func TestProbeLeaseOneGatewayProbes(t *testing.T) {
	_, gws, lc, until := leaseFleet(t)
	winner, p := probeOnce(t, gws, until.Add(-20*time.Millisecond), until.Sub(time.Now())+time.Second, testLease*8/10)
	if lc.total(LeaseWon) != 1 || lc.of(winner.id, LeaseWon) != 1 {
		t.Fatalf("lease outcomes %v, want one won, by %s", lc.n, winner.id)
	}
	waitFor(t, "the two others lost", time.Second, func() bool { return lc.total(LeaseLost) == 2 })
	for _, g := range others(gws, winner) {
		if ts := g.transitions("up1"); len(ts) != 1 || ts[0].To != breaker.Open {
			t.Fatalf("%s: transitions %+v, want only the open", g.id, ts)
		}
	}
	p.Done(breaker.Success, 0, "")
	waitState(t, "every gateway's up1", breaker.Closed, breakersOf(gws)...)
	if ts := others(gws, winner)[0].transitions("up1"); !strings.HasPrefix(ts[len(ts)-1].Reason, "closed in fleet by "+winner.id) {
		t.Fatalf("transitions %+v", ts)
	}
	if n := lc.total(LeaseExpired); n != 0 {
		t.Fatalf("%d results dropped as expired", n)
	}
}

// TestProbeLeaseFailedProbeReopensAll: the winner's failed probe re-opens
// the key fleet-wide, and the next round has one prober again.
func TestProbeLeaseFailedProbeReopensAll(t *testing.T) {
	_, gws, lc, until := leaseFleet(t)
	winner, p := probeOnce(t, gws, until.Add(-20*time.Millisecond), until.Sub(time.Now())+time.Second, 100*time.Millisecond)
	p.Done(breaker.Failure, 0, "http 502")
	waitState(t, "the winner", breaker.Open, winner.b("up1"))
	var next time.Time
	waitFor(t, "every gateway seeing the re-open", 2*time.Second, func() bool {
		for _, g := range gws {
			st, ok := g.bs.Opened("up1")
			if !ok || st.By != winner.id || !strings.HasPrefix(st.Reason, "probe failed: http 502") {
				return false
			}
			next = st.Until
		}
		return true
	})
	for _, g := range gws {
		if got := g.b("up1").Snapshot().OpenUntil; got.Before(next) {
			t.Fatalf("%s: open until %v, before the fleet's new end %v", g.id, got, next)
		}
	}
	winner2, p2 := probeOnce(t, gws, next.Add(-20*time.Millisecond), next.Sub(time.Now())+time.Second, testLease*8/10)
	p2.Done(breaker.Success, 0, "")
	waitState(t, "every gateway's up1", breaker.Closed, breakersOf(gws)...)
	if lc.total(LeaseWon) != 2 {
		t.Fatalf("lease outcomes %v (winners %s, %s), want two won", lc.n, winner.id, winner2.id)
	}
}

// TestProbeLeaseHolderDiesAnotherProbes: a winner that never reports (its
// store closed, its probe never done) holds the key only for the lease
// time: then another gateway probes, and its success closes the rest.
func TestProbeLeaseHolderDiesAnotherProbes(t *testing.T) {
	_, gws, _, until := leaseFleet(t)
	dead, _ := probeOnce(t, gws, until.Add(-20*time.Millisecond), until.Sub(time.Now())+time.Second, 0)
	won := time.Now()
	dead.bs.Close()
	rest := others(gws, dead)
	next, p := probeOnce(t, rest, won.Add(testLease-50*time.Millisecond), testLease+time.Second, 100*time.Millisecond)
	if took := time.Since(won); took > testLease+3*testRefresh {
		t.Fatalf("%s probed %v after the dead winner's lease, want within the lease time and a refresh", next.id, took)
	}
	p.Done(breaker.Success, 0, "")
	waitState(t, "the live gateways' up1", breaker.Closed, breakersOf(rest)...)
}

// TestProbeLeaseLateResultDropped: a winner whose probe is still out when
// its lease runs out (another gateway took it) goes back to open, waiting
// for the new holder like the others, and its late result is dropped and
// counted "expired" once; the fleet's record and the other breakers keep
// the key open until the new winner reports, whose success closes every
// gateway's breaker, the late one's included.
func TestProbeLeaseLateResultDropped(t *testing.T) {
	s, gws, lc, until := leaseFleet(t)
	late, lateProbe := probeOnce(t, gws, until.Add(-20*time.Millisecond), until.Sub(time.Now())+time.Second, 0)
	won := time.Now()
	rest := others(gws, late)
	next, p := probeOnce(t, rest, won.Add(testLease-50*time.Millisecond), testLease+time.Second, 0)
	waitState(t, "the late winner back to open", breaker.Open, late.b("up1"))
	waitFor(t, "the late lease counted expired", time.Second, func() bool { return lc.of(late.id, LeaseExpired) == 1 })
	lateProbe.Done(breaker.Success, 0, "")
	if st := late.b("up1").State(); st != breaker.Open {
		t.Fatalf("the late winner is %s after its late success, want still open (the result is dropped)", st)
	}
	if rec, _ := s.Do("GET", redisKey("up1", "open")); !strings.Contains(rec, `"s":"open"`) {
		t.Fatalf("open record %s, want it still open", rec)
	}
	third := others(rest, next)[0]
	stays(t, breaker.Open, third.b("up1"), late.b("up1"))
	if st := next.b("up1").State(); st != breaker.HalfOpen {
		t.Fatalf("the new winner is %s, want still half-open", st)
	}
	p.Done(breaker.Success, 0, "")
	waitState(t, "every gateway's up1", breaker.Closed, breakersOf(gws)...)
	if n := lc.total(LeaseExpired); n != 1 {
		t.Fatalf("%d results expired, want the late one only", n)
	}
}

// TestProbeLeaseHalfOpenWinnerRejoinsTheRound: recovery_successes 2; the
// winner's first probe succeeds and its breaker stays half-open, but it
// probes no more within its lease (which that success extended by a lease
// time). When the lease runs out the half-open breaker takes part in the
// next round with the open ones: afterwards exactly one gateway lets a
// probe in (the new holder, maybe the same); a first winner that lost is
// back to open, its lease not counted expired (no probe of it was out);
// the second success, whoever's, closes all three.
func TestProbeLeaseHalfOpenWinnerRejoinsTheRound(t *testing.T) {
	s := leaseSettings
	s.RecoverySuccesses = 2
	_, gws, lc, until := recoveryFleet(t, s)
	first, p := probeOnce(t, gws, until.Add(-20*time.Millisecond), time.Until(until)+time.Second, 0)
	won := time.Now()
	p.Done(breaker.Success, 0, "")
	if st := first.b("up1").State(); st != breaker.HalfOpen {
		t.Fatalf("the first winner is %s after one of two successes, want half-open", st)
	}
	time.Sleep(time.Until(won.Add(testLease + 3*testRefresh)))
	if n := lc.total(LeaseWon); n != 1 {
		t.Fatalf("%d leases won a lease time after the first, want 1: its success extended it", n)
	}
	time.Sleep(time.Until(won.Add(2*testLease + 3*testRefresh)))
	if n := lc.total(LeaseWon); n != 2 {
		t.Fatalf("%d leases won after the first ran out, want 2", n)
	}
	second, p2 := probeOnce(t, gws, time.Time{}, time.Second, 100*time.Millisecond)
	if second != first {
		if st := first.b("up1").State(); st != breaker.Open {
			t.Fatalf("%s holds the lease now, and the first winner %s is %s, want back to open", second.id, first.id, st)
		}
		if n := lc.of(first.id, LeaseExpired); n != 0 {
			t.Fatalf("%s's lease counted expired %d times, want 0: no probe of it was out", first.id, n)
		}
	}
	p2.Done(breaker.Success, 0, "")
	waitState(t, "every gateway's up1", breaker.Closed, breakersOf(gws)...)
	t.Logf("first %s, second %s", first.id, second.id)
}

// TestProbeLeaseOwnLeaseOnItsWayOutIsNotAnotherGatewaysHold: the winner's
// breaker recovers on its own count and writes the close, which carries its
// lease and ends it; a lease round of the same instance already in flight
// (its script ran before the write) then finds the key "held" by that lease
// while the instance has let go of it. That is its own lease on its way
// out, not another gateway's hold: its breaker, closed, stays closed (it
// is not pushed open until "the holder's" lease ends), and no lease is
// counted lost. The round is replayed here by hand: the lease and an open
// record past its end are put back in Redis after the close.
func TestProbeLeaseOwnLeaseOnItsWayOutIsNotAnotherGatewaysHold(t *testing.T) {
	s := leaseSettings
	s.RecoverySuccesses = 1
	srv, gws, lc, until := recoveryFleet(t, s)
	w, p := probeOnce(t, gws, until.Add(-20*time.Millisecond), time.Until(until)+time.Second, 0)
	w.bs.mu.Lock()
	lease := w.bs.keys["up1"].lease
	w.bs.mu.Unlock()
	if !strings.HasPrefix(lease, w.id+":") {
		t.Fatalf("the winner's lease is %q", lease)
	}
	p.Done(breaker.Success, 0, "")
	waitState(t, "every gateway's up1", breaker.Closed, breakersOf(gws)...)
	waitFor(t, "the close in Redis", time.Second, func() bool {
		rec, _ := srv.Do("GET", redisKey("up1", "open"))
		return strings.Contains(rec, `"s":"closed"`)
	})
	lost := lc.total(LeaseLost)

	// The round's view: the lease still there, the record open and over.
	past := time.Now().Add(-time.Second).UnixMilli()
	if _, err := srv.Do("SET", redisKey("up1", "open"), fmt.Sprintf(`{"s":"open","u":%d,"a":%d,"by":"gw0","r":"x"}`, past, past-1000), "PX", "60000"); err != nil {
		t.Fatal(err)
	}
	if _, err := srv.Do("SET", redisKey("up1", "probe"), lease, "PX", "60000"); err != nil {
		t.Fatal(err)
	}
	b := w.b("up1")
	w.bs.tryLease("up1", []*breaker.Breaker{b}, testLease, false)
	w.bs.flush()
	if st := b.State(); st != breaker.Closed {
		t.Fatalf("%s's breaker is %s after its own lease was found held, want closed: %+v", w.id, st, b.Snapshot())
	}
	if n := lc.total(LeaseLost); n != lost {
		t.Fatalf("%d leases counted lost, want %d: the lease is the instance's own", n, lost)
	}
}
