package upstream

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// Two handlers of one config in front of one failing upstream: site A
// (consecutive_failures 2) stops reaching it after two failures, while site
// B, declared after A, keeps reaching it — with breakers off, or with
// settings of its own that two failures do not trip. Before per-handler
// policy the newest claim's settings applied to both (B off switched A's
// breaker off; B's 5 kept A's breaker closed).
func TestHandlersObeyTheirOwnBreakerPolicy(t *testing.T) {
	for _, tc := range []struct {
		name string
		b    *breaker.Settings
	}{
		{"off", nil},
		{"consecutive_failures 5", &breaker.Settings{ConsecutiveFailures: 5, OpenFor: time.Minute, MinOpen: time.Minute}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := NewRegistry(nil)
			gen := reg.NextGeneration()
			const addr = "10.7.1.1:8000"
			a := startPool(t, reg, Config{Generation: gen, Key: "a", Static: targets(addr),
				Breaker: &breaker.Settings{ConsecutiveFailures: 2, OpenFor: time.Minute, MinOpen: time.Minute}})
			b := startPool(t, reg, Config{Generation: gen, Key: "b", Static: targets(addr), Breaker: tc.b})
			fail(mustPick(t, a, ""))
			fail(mustPick(t, a, ""))
			var ue *proxy.UnavailableError
			if _, err := pickModel(a, ""); !errors.As(err, &ue) || !ue.CircuitOpen {
				t.Fatalf("site A after 2 failures: pick error %v, want circuit open", err)
			}
			// Site B judges the upstream's evidence, A's two failures
			// included, by its own rule: with 5, its fifth failure in a
			// row opens it, not A's second.
			for i := range 2 {
				up, err := pickModel(b, "")
				if err != nil {
					t.Fatalf("site B's request %d refused by site A's breaker: %v", i+1, err)
				}
				fail(up)
			}
			if _, err := pickModel(a, ""); err == nil {
				t.Fatal("site B's traffic closed site A's breaker")
			}
			want := ""
			if tc.b != nil {
				want = "closed"
			}
			if got := b.BreakerState(addr, ""); got != want {
				t.Fatalf("site B's breaker after 4 failures on the upstream %q, want %q", got, want)
			}
			if got := a.BreakerState(addr, ""); got != "open" {
				t.Fatalf("site A's breaker %q, want open", got)
			}
			// The admin view lists each breaker with the pools it serves.
			views := reg.Breakers()
			if want := 1 + len(b.Breakers(b.static[0].e)); len(views) != want {
				t.Fatalf("%d breakers listed, want %d: %+v", len(views), want, views)
			}
			for _, v := range views {
				own := v.State == breaker.Open
				if wantPools := map[bool]string{true: "a", false: "b"}[own]; !slices.Equal(v.Pools, []string{wantPools}) {
					t.Fatalf("breaker %s (%v) serves %v, want [%s]", v.Key, v.State, v.Pools, wantPools)
				}
			}
		})
	}
}

// Same settings in front of one upstream: each handler has its own
// breaker, and both judge every attempt on the upstream, so one failure
// through each site opens both, under one fleet key.
func TestHandlersWithEqualSettingsReachEqualVerdicts(t *testing.T) {
	reg := NewRegistry(nil)
	gen := reg.NextGeneration()
	const addr = "10.7.1.2:8000"
	s := breaker.Settings{ConsecutiveFailures: 2, OpenFor: time.Minute, MinOpen: time.Minute}
	a := startPool(t, reg, Config{Generation: gen, Key: "a", Static: targets(addr), Breaker: &s})
	s2 := s
	b := startPool(t, reg, Config{Generation: gen, Key: "b", Static: targets(addr), Breaker: &s2})
	fail(mustPick(t, a, ""))
	fail(mustPick(t, b, ""))
	for name, p := range map[string]*Pool{"a": a, "b": b} {
		if _, err := pickModel(p, ""); err == nil {
			t.Fatalf("site %s: one failure from each site did not open its breaker", name)
		}
	}
	views := reg.Breakers()
	if len(views) != 2 || views[0].Key != addr || views[1].Key != addr || views[0].State != breaker.Open || views[1].State != breaker.Open ||
		views[0].Handler != "a" || views[1].Handler != "b" || views[0].FleetKey != views[1].FleetKey || views[0].FleetKey != addr+"~"+a.Policy() {
		t.Fatalf("breakers %+v, want two %q, open, of handlers a and b, with fleet key %s~%s", views, addr, addr, a.Policy())
	}
}

// Two handlers of one config with breaker settings of their own probe
// their own breakers with their own Prober (one loop per upstream).
func TestEachPolicyIsProbedWithItsHandlersProber(t *testing.T) {
	var mu sync.Mutex
	paths := map[string]int{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		paths[r.URL.Path]++
		mu.Unlock()
		w.WriteHeader(http.StatusServiceUnavailable) // the breakers stay open
	}))
	t.Cleanup(srv.Close)
	probesTo := func(path string) int {
		mu.Lock()
		defer mu.Unlock()
		return paths[path]
	}
	addr := strings.TrimPrefix(srv.URL, "http://")
	reg := NewRegistry(nil)
	clk := newLoopClock()
	reg.UseClock(clk)
	gen := reg.NextGeneration()
	sa, sb := activeProbing(), activeProbing()
	sb.RecoverySuccesses = 3 // another policy
	a := startPool(t, reg, Config{Generation: gen, Key: "a", Static: targets(addr), Breaker: sa, Prober: testProber("/a")})
	b := startPool(t, reg, Config{Generation: gen, Key: "b", Static: targets(addr), Breaker: sb, Prober: testProber("/b")})
	fail(mustPick(t, a, ""))
	if _, err := pickModel(b, ""); err == nil {
		t.Fatal("site b's breaker did not hear site a's failure")
	}
	// The cooldowns back off to max_open (20ms): 40 ticks of 5ms see
	// several probes of each policy.
	for i := 0; probesTo("/a") < 2 || probesTo("/b") < 2; i++ {
		if i == 40 {
			t.Fatalf("probes after 40 intervals: /a %d, /b %d; want 2 each", probesTo("/a"), probesTo("/b"))
		}
		step(t, clk, reg, 5*time.Millisecond)
	}
	if n := reg.ProbeLoops(); n != 1 {
		t.Fatalf("%d probe loops for one upstream, want 1", n)
	}
}

// Two handlers' breakers on one upstream are half-open at once: one
// handler's probe is out, so the other's request goes elsewhere (here:
// nowhere, 503) instead of probing the upstream a second time; once the
// probe is settled, the other handler may probe.
func TestHalfOpenProbesOfOneUpstreamAreBoundedAcrossHandlers(t *testing.T) {
	clk := clocktest.New(simT0)
	reg := NewRegistry(nil)
	reg.UseClock(clk)
	const addr = "10.7.1.9:8000"
	s := func(n int) *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: 1, OpenFor: time.Second, MinOpen: -1, RecoverySuccesses: n}
	}
	gen := reg.NextGeneration()
	a := startPool(t, reg, Config{Generation: gen, Key: "a", Handler: "a", Static: targets(addr), Breaker: s(1)})
	b := startPool(t, reg, Config{Generation: gen, Key: "b", Handler: "b", Static: targets(addr), Breaker: s(2)})
	fail(mustPick(t, a, ""))
	for name, p := range map[string]*Pool{"a": a, "b": b} {
		if _, err := pickModel(p, ""); err == nil {
			t.Fatalf("site %s: the upstream's failure did not open its breaker", name)
		}
	}
	clk.Advance(2 * time.Second)
	probe := mustPick(t, a, "")
	if a.BreakerState(addr, "") != "half_open" {
		t.Fatalf("site a after its cooldown: %s, want half_open", a.BreakerState(addr, ""))
	}
	var ue *proxy.UnavailableError
	if _, err := pickModel(b, ""); !errors.As(err, &ue) {
		t.Fatalf("site b while site a's probe is out: pick error %v, want unavailable (one probe at a time)", err)
	}
	if st := b.BreakerState(addr, ""); st != "half_open" && st != "open" {
		t.Fatalf("site b: %s", st)
	}
	probe.Done(&proxy.AttemptReport{Upstream: addr, Outcome: proxy.AttemptSuccess})
	if a.BreakerState(addr, "") != "closed" {
		t.Fatalf("site a after its probe succeeded: %s, want closed", a.BreakerState(addr, ""))
	}
	up, err := pickModel(b, "")
	if err != nil {
		t.Fatalf("site b once a's probe was settled: %v, want its probe through", err)
	}
	up.Done(&proxy.AttemptReport{Upstream: addr, Outcome: proxy.AttemptSuccess})
}

// Handlers with equal settings in front of one upstream move together, and
// their common transition is reported once, not once per site; handlers
// with other settings report their own.
func TestEqualVerdictsReportOneTransition(t *testing.T) {
	for _, tc := range []struct {
		name   string
		second int // the second site's consecutive_failures
		want   int
	}{{"equal settings", 1, 1}, {"other settings", 2, 2}} {
		t.Run(tc.name, func(t *testing.T) {
			obs := newFakeObserver()
			reg := NewRegistry(obs)
			const addr = "10.7.1.12:8000"
			s := func(n int) *breaker.Settings {
				return &breaker.Settings{ConsecutiveFailures: n, OpenFor: time.Minute, MinOpen: time.Minute}
			}
			gen := reg.NextGeneration()
			a := startPool(t, reg, Config{Generation: gen, Key: "a", Handler: "a", Named: true, Static: targets(addr), Breaker: s(1)})
			b := startPool(t, reg, Config{Generation: gen, Key: "b", Handler: "b", Named: true, Static: targets(addr), Breaker: s(tc.second)})
			finish(mustPick(t, a, ""), proxy.AttemptConnectError)
			if tc.second > 1 {
				finish(mustPick(t, b, ""), proxy.AttemptConnectError)
			}
			for name, p := range map[string]*Pool{"a": a, "b": b} {
				if st := p.BreakerState(addr, ""); st != "open" {
					t.Fatalf("site %s: %q, want open", name, st)
				}
			}
			if n := obs.countPrefix("transition " + gaugeKey(addr, "") + " closed→open"); n != tc.want {
				t.Fatalf("%d closed→open transitions reported, want %d", n, tc.want)
			}
		})
	}
}
