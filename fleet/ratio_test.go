package fleet

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/redis/go-redis/v9"
)

// ratioSettings: only the failure ratio rule (the consecutive rule off),
// 20 requests at least.
var ratioSettings = breaker.Settings{ConsecutiveFailures: -1, FailureRatio: 0.5, MinRequests: 20,
	RatioWindow: 10 * time.Second, MinOpen: -1, OpenFor: 3 * time.Second}

// TestBreakersFailureRatioOnTheFleetsSums: four gateways see 6 requests
// each, half of them failing: none has min_requests 20 of its own, the
// fleet has 24, and the fleet's ratio opens the key on every gateway.
// Three gateways' 18 requests are not enough.
func TestBreakersFailureRatioOnTheFleetsSums(t *testing.T) {
	s, gws := fleetOf(t, 4, 1)
	for _, g := range gws {
		g.s = ratioSettings
	}
	traffic := func(g *gateway) {
		for range 3 {
			g.call("up1", breaker.Success)
			g.call("up1", breaker.Failure)
		}
	}
	for _, g := range gws[:3] {
		traffic(g)
	}
	waitFor(t, "three gateways' sums in Redis", 2*time.Second, func() bool {
		n, _ := s.Do("HLEN", redisKey("up1", "ratio"))
		return n == "3"
	})
	stays(t, breaker.Closed, gws[0].b("up1"), gws[1].b("up1"), gws[2].b("up1"), gws[3].b("up1"))
	traffic(gws[3])
	waitState(t, "every gateway's up1", breaker.Open, gws[0].b("up1"), gws[1].b("up1"), gws[2].b("up1"), gws[3].b("up1"))
	for _, g := range gws {
		if snap := g.b("up1").Snapshot(); snap.Local {
			t.Fatalf("%s: %+v, want the fleet's verdict", g.id, snap)
		}
	}
	st, _ := gws[0].bs.Opened("up1")
	if !strings.HasPrefix(st.Reason, "fleet: failure ratio 12/24 ≥ 0.5 within 10s from 4 gateways") {
		t.Fatalf("reason %q", st.Reason)
	}
	if n, _ := s.Do("EXISTS", redisKey("up1", "ratio")); n != "0" {
		t.Fatalf("ratio sums still in Redis after the open (EXISTS %s)", n)
	}
}

// TestRatioSumsSentWhileOpenAreNotWritten: a gateway whose sums were
// taken before the fleet opened the key, and reach Redis after the trip
// deleted the hash, must not write them back: they would count again in the
// first window after the key closes (seen as a flaky EXISTS 1 above).
func TestRatioSumsSentWhileOpenAreNotWritten(t *testing.T) {
	s, gws := fleetOf(t, 1, 1)
	bs := gws[0].bs
	// ratio runs the script as sendRatio does, with 6 requests, 3 failing
	// (below min_requests 20: it never opens the key itself).
	ratio := func() string {
		t.Helper()
		keys := bs.breakerKeys("up1")
		res, err := bs.do("breaker_ratio", func(ctx context.Context, c redis.Cmdable) ([]any, error) {
			return runScript(ratioScript, ctx, c, []string{keys[5], keys[3], keys[0], keys[1], keys[2], keys[4]},
				"gw1", 6, 3, 0, int64(30000), 20, "0.5", "0", 1, int64(3000), bs.channel, "up1", int64(1000), "10s")
		})
		if err != nil || len(res) == 0 {
			t.Fatalf("ratio script: %v %v", res, err)
		}
		return res[0].(string)
	}
	if got := ratio(); got != "summed" {
		t.Fatalf("with the key closed the script returned %q, want summed", got)
	}
	if n, _ := s.Do("HLEN", redisKey("up1", "ratio")); n != "1" {
		t.Fatalf("sums sent with the key closed: HLEN %s, want 1", n)
	}
	// Another gateway's trip, as Redis holds it: the hash deleted, the key open.
	if _, err := s.Do("DEL", redisKey("up1", "ratio")); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Do("SET", redisKey("up1", "open"), `{"s":"open","u":0,"a":1,"by":"gw9","r":"test"}`); err != nil {
		t.Fatal(err)
	}
	if got := ratio(); got != "open" {
		t.Fatalf("with the key open the script returned %q, want open", got)
	}
	if n, _ := s.Do("EXISTS", redisKey("up1", "ratio")); n != "0" {
		t.Fatalf("sums sent while the key was open were written (EXISTS %s)", n)
	}
}

// TestBreakersSlowRatioOnTheFleetsSums: the slow call ratio too, and a
// gateway's sums that stop coming (it left) are not counted for long.
func TestBreakersSlowRatioOnTheFleetsSums(t *testing.T) {
	s, gws := fleetOf(t, 3, 1)
	for _, g := range gws {
		g.s = breaker.Settings{ConsecutiveFailures: -1, SlowTTFT: time.Second, SlowRatio: 0.5, MinRequests: 20,
			RatioWindow: 10 * time.Second, MinOpen: -1, OpenFor: 3 * time.Second}
	}
	calls := func(g *gateway, n int) {
		for range n {
			for _, ttft := range []time.Duration{100 * time.Millisecond, 2 * time.Second} {
				p, ok := g.b("up1").Allow()
				if !ok {
					t.Fatalf("%s refused a call", g.id)
				}
				p.Done(breaker.Success, ttft, "")
			}
		}
	}
	calls(gws[0], 5) // 10 requests, 5 slow
	waitFor(t, "gw0's sums in Redis", 2*time.Second, func() bool {
		n, _ := s.Do("HLEN", redisKey("up1", "ratio"))
		return n == "1"
	})
	// gw0 leaves: its sums are dropped once they are older than 3 ×
	// refresh, so gw1's 10 requests alone do not reach 20.
	gws[0].b("up1").Close()
	time.Sleep(4 * testRefresh)
	calls(gws[1], 5)
	stays(t, breaker.Closed, gws[1].b("up1"), gws[2].b("up1"))
	calls(gws[2], 5)
	waitState(t, "gw1 and gw2", breaker.Open, gws[1].b("up1"), gws[2].b("up1"))
	st, _ := gws[2].bs.Opened("up1")
	if !strings.HasPrefix(st.Reason, "fleet: slow call ratio 10/20 ≥ 0.5 within 10s from 2 gateways") {
		t.Fatalf("reason %q", st.Reason)
	}
}

// TestBreakersLocalRatioTripStillReportsItsWindow: one gateway sees 20
// requests, half failing, and trips on its own ratio rule (it has
// min_requests by itself) before its worker reads its window: the window
// of a breaker open by its own rules is still the fleet's evidence, so
// with min_reporters 1 the fleet opens the key on the other gateways too.
func TestBreakersLocalRatioTripStillReportsItsWindow(t *testing.T) {
	_, gws := fleetOf(t, 3, 1)
	for _, g := range gws {
		g.s = ratioSettings
		g.b("up1")
	}
	for range 10 {
		gws[0].call("up1", breaker.Success)
		gws[0].call("up1", breaker.Failure)
	}
	if st := gws[0].b("up1").State(); st != breaker.Open {
		t.Fatalf("gw0 is %s after 10 of 20 failures, want open by its own ratio rule", st)
	}
	waitState(t, "the other gateways' up1", breaker.Open, gws[1].b("up1"), gws[2].b("up1"))
	st, _ := gws[1].bs.Opened("up1")
	if !strings.HasPrefix(st.Reason, "fleet: failure ratio 10/20 ≥ 0.5 within 10s from 1 gateway") || st.By != "gw0" {
		t.Fatalf("fleet entry %+v", st)
	}
	waitFor(t, "gw0 adopting the fleet's verdict", time.Second, func() bool { return !gws[0].b("up1").Snapshot().Local })
}
