package breaker_test

import (
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// A reload's new breaker for a handler takes the old one's verdict as it
// was: open since the same time until the same end, on the same evidence,
// with no transition heard (the handler's state did not change); a forced
// open stays forced; a closed old breaker hands nothing over.
func TestCarryOverKeepsTheVerdictWithoutATransition(t *testing.T) {
	clk := newClock()
	s := breaker.Settings{ConsecutiveFailures: 2, OpenFor: time.Minute, MinOpen: -1}
	old := breaker.New("up", s, breaker.WithClock(clk), noJitter)
	for range 2 {
		p, _ := old.Allow()
		p.Done(breaker.Down, 0, "connect_error")
	}
	before := old.Snapshot()
	if before.State != breaker.Open || before.Evidence != breaker.Hard {
		t.Fatalf("old breaker %+v, want open on hard evidence", before)
	}
	clk.Advance(10 * time.Second)
	var heard recorder
	nb := breaker.New("up", s, breaker.WithClock(clk), noJitter, breaker.WithListener(heard.listen))
	nb.CarryOver(old, "reload")
	after := nb.Snapshot()
	if after.State != breaker.Open || !after.Since.Equal(before.Since) || !after.OpenUntil.Equal(before.OpenUntil) || after.Evidence != breaker.Hard {
		t.Fatalf("carried %+v, want open since %v until %v on hard evidence", after, before.Since, before.OpenUntil)
	}
	if ts := heard.all(); len(ts) != 0 {
		t.Fatalf("carry-over delivered transitions %+v, want none", ts)
	}
	if _, ok := nb.Allow(); ok {
		t.Fatal("the carried breaker let a call through before the cooldown's end")
	}
	clk.Advance(51 * time.Second)
	if p, ok := nb.Allow(); !ok || !p.Probe() {
		t.Fatalf("after the old cooldown's end: %v, probe %v; want a probe", ok, p.Probe())
	}

	forced := breaker.New("up", s, breaker.WithClock(clk))
	forced.ForceOpen(time.Hour, "maintenance")
	nf := breaker.New("up", s, breaker.WithClock(clk))
	clk.Advance(time.Minute)
	nf.CarryOver(forced, "reload")
	if got := nf.Snapshot(); !got.Forced || got.State != breaker.Open || !got.OpenUntil.Equal(forced.Snapshot().OpenUntil) {
		t.Fatalf("carried forced open %+v, want forced until %v", got, forced.Snapshot().OpenUntil)
	}

	closed := breaker.New("up", s, breaker.WithClock(clk))
	nc := breaker.New("up", s, breaker.WithClock(clk))
	nc.CarryOver(closed, "reload")
	if nc.State() != breaker.Closed {
		t.Fatalf("carried a closed breaker: %v, want closed", nc.State())
	}
}
