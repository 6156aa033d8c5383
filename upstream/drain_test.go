package upstream

import (
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// A timed drain of an upstream (Entry.Drain for 10 minutes) holds the
// breakers created while it lasts open for what is left of it: a scope
// model pool's breaker of a model first requested 4 minutes in is open
// until the drain's end, not for 10 minutes of its own; after the end a
// new model's breaker starts closed. Undrain closes every breaker, and a
// breaker created after it starts closed.
func TestDrainHoldsNewBreakersOpenForWhatIsLeft(t *testing.T) {
	const addr = "10.7.9.3:8000"
	reg := NewRegistry(nil)
	clk := newLoopClock()
	reg.UseClock(clk)
	p := startPool(t, reg, Config{Key: "m", Static: targets(addr), ScopeModel: true,
		Breaker: &breaker.Settings{ConsecutiveFailures: 3}})
	mustPick(t, p, "a").Done(&proxy.AttemptReport{Upstream: addr, Outcome: proxy.AttemptSuccess})
	e, _ := reg.Entry(addr)
	start := clk.Now()
	opened, ok := e.Drain(10*time.Minute, "maintenance")
	if !ok || len(opened) != 1 || opened[0].Key() != addr+"|a" || opened[0].State() != breaker.Open {
		t.Fatalf("Drain: %v, %d breakers; want model a's breaker open", ok, len(opened))
	}
	clk.Advance(4 * time.Minute)
	var ue *proxy.UnavailableError
	if _, err := pickModel(p, "b"); !errors.As(err, &ue) || !ue.CircuitOpen {
		t.Fatalf("model b first requested during the drain: pick error %v, want circuit open", err)
	}
	b := p.Breakers(e)["b"]
	if b == nil {
		t.Fatal("no breaker of model b")
	}
	if s := b.Snapshot(); !s.Forced || !s.OpenUntil.Equal(start.Add(10*time.Minute)) {
		t.Errorf("model b's breaker: forced %v, open until %v; want forced until the drain's end, %v", s.Forced, s.OpenUntil, start.Add(10*time.Minute))
	}
	clk.Advance(7 * time.Minute)
	if _, err := pickModel(p, "c"); err != nil {
		t.Errorf("model c first requested after the drain ended: %v, want its request through", err)
	}

	if _, ok := e.Drain(0, "until closed"); !ok {
		t.Fatal("second drain refused")
	}
	changed, ok := e.Undrain(false, "back")
	if !ok || len(changed) != 3 {
		t.Fatalf("Undrain: %v, %d breakers; want the three model breakers", ok, len(changed))
	}
	for _, b := range changed {
		if b.State() != breaker.Closed {
			t.Errorf("breaker %s after Undrain: %v, want closed", b.Key(), b.State())
		}
	}
	if _, err := pickModel(p, "d"); err != nil {
		t.Errorf("model d after Undrain: %v, want its request through", err)
	}
}

// An upstream whose pools all have breakers off cannot be drained: Drain
// reports it and changes nothing.
func TestDrainWithBreakersOffIsRefused(t *testing.T) {
	const addr = "10.7.9.4:8000"
	reg := NewRegistry(nil)
	startPool(t, reg, Config{Key: "off", Static: targets(addr)})
	e, _ := reg.Entry(addr)
	if bs, ok := e.Drain(time.Minute, "x"); ok || len(bs) != 0 {
		t.Fatalf("Drain with breakers off: %v, %d breakers; want refused", ok, len(bs))
	}
}

// Pool.Holds names the pool's upstreams: its static ones, and the dynamic
// ones its source returned, until it forgets them.
func TestPoolHoldsItsUpstreams(t *testing.T) {
	reg := NewRegistry(nil)
	static := startPool(t, reg, Config{Key: "s", Static: targets("10.7.9.5:8000", "10.7.9.6:8000")})
	if !static.Holds("10.7.9.6:8000") || static.Holds("10.7.9.7:8000") {
		t.Errorf("static pool: Holds(6) %v, Holds(7) %v; want true, false", static.Holds("10.7.9.6:8000"), static.Holds("10.7.9.7:8000"))
	}
	dyn := startPool(t, reg, Config{Key: "d", Source: func(*http.Request) ([]Target, error) { return targets("10.7.9.7:8000"), nil }})
	if dyn.Holds("10.7.9.7:8000") {
		t.Error("dynamic pool holds an upstream its source has not returned yet")
	}
	mustPick(t, dyn, "")
	if !dyn.Holds("10.7.9.7:8000") || dyn.Holds("10.7.9.5:8000") {
		t.Errorf("dynamic pool after a pick: Holds(7) %v, Holds(5) %v; want true, false", dyn.Holds("10.7.9.7:8000"), dyn.Holds("10.7.9.5:8000"))
	}
	dyn.ForgetUnseen(reg.now().Add(time.Second))
	if dyn.Holds("10.7.9.7:8000") {
		t.Error("dynamic pool still holds an upstream it forgot")
	}
}
