package fleet

import (
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/redistest"
)

// TestBreakersAgreeOnOpenUntil: three gateways against one real Redis; the
// first sees every failure, so its own rules trip its breaker (with the
// most jitter: 1.2 × open_for) as its failures open the key fleet-wide
// (open_for, plus the probe lease time). Every gateway's breaker then ends
// its cooldown at the same time, the fleet's record's end plus the lease
// time: the opener does not refuse longer than the rest.
func TestBreakersAgreeOnOpenUntil(t *testing.T) {
	s := redistest.Start(t, redistest.Options{})
	var gws []*gateway
	for _, id := range []string{"gw0", "gw1", "gw2"} {
		g := startGateway(t, s.URL(), id, 1, BreakersOptions{})
		g.s = breaker.Settings{MinOpen: -1, OpenFor: time.Minute}
		gws = append(gws, g)
	}
	// The opener's breaker draws the longest cooldown jitter.
	opener := gws[0]
	opener.bk["up1"] = breaker.New("up1", opener.s, breaker.WithStore(opener.bs), breaker.WithRand(func() float64 { return 0.999 }))
	for _, g := range gws[1:] {
		g.b("up1") // joined before the key opens
	}
	opener.fail("up1", 3)
	waitState(t, "every gateway's up1", breaker.Open, opener.b("up1"), gws[1].b("up1"), gws[2].b("up1"))
	var rec OpenState
	waitFor(t, "the fleet's open record on every gateway", 2*time.Second, func() bool {
		for _, g := range gws {
			st, ok := g.bs.Opened("up1")
			if !ok {
				return false
			}
			rec = st
		}
		return true
	})
	// The lease time is DefaultProbeLeaseTTL (4s < 0.8 × open_for).
	want := rec.Until.Add(DefaultProbeLeaseTTL)
	waitFor(t, "every gateway's breaker open until the fleet's end", 2*time.Second, func() bool {
		for _, g := range gws {
			if d := g.b("up1").Snapshot().OpenUntil.Sub(want); d.Abs() > 100*time.Millisecond {
				return false
			}
		}
		return true
	})
	for _, g := range gws {
		snap := g.b("up1").Snapshot()
		st, _ := g.bs.Opened("up1")
		t.Logf("%s: breaker open for %v more, the fleet's record %v more (by %s)", g.id,
			time.Until(snap.OpenUntil).Round(100*time.Millisecond), time.Until(st.Until).Round(100*time.Millisecond), st.By)
		if snap.Local {
			t.Errorf("%s: the breaker is still a local trip after the fleet opened the key: %+v", g.id, snap)
		}
		if d := st.Until.Sub(rec.Until); d.Abs() > 100*time.Millisecond {
			t.Errorf("%s: the fleet's record ends %v off the others'", g.id, d)
		}
	}
	if left := time.Until(rec.Until); left < 55*time.Second || left > time.Minute {
		t.Fatalf("the fleet's record is open for %v more, want about open_for 1m", left)
	}
}
