package upstream

import (
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

func TestPickSkipsTriedUntilAllTried(t *testing.T) {
	reg := NewRegistry(nil)
	p := startPool(t, reg, Config{Static: targets("10.0.0.1:8000", "10.0.0.2:8000"), Selector: firstSelector{}})
	for _, tc := range []struct {
		tried []string
		want  string
	}{
		{nil, "10.0.0.1:8000"},
		{[]string{"10.0.0.1:8000"}, "10.0.0.2:8000"},
		// With all tried, the policy chooses among all again.
		{[]string{"10.0.0.1:8000", "10.0.0.2:8000"}, "10.0.0.1:8000"},
	} {
		up := mustPick(t, p, "", tc.tried...)
		if up.Addr != tc.want {
			t.Errorf("tried %v: picked %s, want %s", tc.tried, up.Addr, tc.want)
		}
		up.Done(nil)
	}
}

// A backup attempt never goes to an upstream the request tried, nor to one
// whose breaker is not closed.
func TestHedgePicksOnlyUntriedClosedUpstreams(t *testing.T) {
	reg := NewRegistry(nil)
	clk := newLoopClock()
	reg.UseClock(clk)
	p := startPool(t, reg, Config{Static: targets("10.0.1.1:8000", "10.0.1.2:8000"), Selector: firstSelector{},
		Breaker: &breaker.Settings{ConsecutiveFailures: 1, OpenFor: 10 * time.Millisecond, MinOpen: -1}})
	pickHedge := func(tried ...string) (proxy.Upstream, error) {
		return p.Pick(nil, &http.Request{}, proxy.PickRequest{Tried: tried, Hedge: true})
	}
	if _, err := pickHedge("10.0.1.1:8000", "10.0.1.2:8000"); err == nil {
		t.Fatal("a hedge went to an upstream already tried")
	}
	fail(mustPick(t, p, "", "10.0.1.1:8000")) // the second opens
	if breakerOf(t, reg, "10.0.1.2:8000", "").RetryAt().IsZero() {
		t.Fatal("the second breaker did not open")
	}
	clk.Advance(100 * time.Millisecond) // past the 10ms cooldown, however jittered
	if at := breakerOf(t, reg, "10.0.1.2:8000", "").RetryAt(); !at.IsZero() {
		t.Fatalf("the second breaker still refuses until %v after its cooldown", at)
	}
	if up, err := pickHedge("10.0.1.1:8000"); err == nil {
		t.Fatalf("a hedge went to the recovering %s", up.Addr)
	}
}

func TestLeastConnCountsGatewayAttemptsInFlight(t *testing.T) {
	reg := NewRegistry(nil)
	addrs := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
	p := startPool(t, reg, Config{Static: targets(addrs...), Selector: LeastConn{}})
	// Three picks without release land on three different upstreams.
	seen := map[string]bool{}
	var ups []proxy.Upstream
	for range 3 {
		up := mustPick(t, p, "")
		seen[up.Addr] = true
		ups = append(ups, up)
	}
	if len(seen) != 3 {
		t.Fatalf("least_conn spread 3 in-flight attempts over %d upstreams", len(seen))
	}
	// Release one: the next pick goes to it.
	ups[1].Done(nil)
	if got := mustPick(t, p, "").Addr; got != ups[1].Addr {
		t.Fatalf("picked %s, want the idle %s", got, ups[1].Addr)
	}
	for _, a := range addrs {
		e, _ := reg.Entry(a)
		if n := e.Inflight(); n != 1 {
			t.Fatalf("%s has %d in flight, want 1", a, n)
		}
	}
}

// In-flight counts are the entry's: two pools over one upstream see each
// other's attempts.
func TestInflightIsSharedBetweenPools(t *testing.T) {
	reg := NewRegistry(nil)
	a := startPool(t, reg, Config{Static: targets("10.0.2.1:8000", "10.0.2.2:8000")})
	b := startPool(t, reg, Config{Static: targets("10.0.2.1:8000", "10.0.2.2:8000")})
	first := mustPick(t, a, "")
	if second := mustPick(t, b, ""); second.Addr == first.Addr {
		t.Fatalf("the second pool's least_conn ignored the first pool's attempt on %s", first.Addr)
	}
}

func TestRandomChooseAvoidsTheBusierOfTwo(t *testing.T) {
	reg := NewRegistry(nil)
	p := startPool(t, reg, Config{Static: targets("10.0.0.1:8000", "10.0.0.2:8000"), Selector: RandomChoose{Choose: 2}})
	e, _ := reg.Entry("10.0.0.1:8000")
	e.inflight.Store(5)
	for range 50 {
		up := mustPick(t, p, "")
		if up.Addr != "10.0.0.2:8000" {
			t.Fatalf("random_choose 2 over both upstreams picked the busier one")
		}
		up.Done(nil)
	}
}

func TestDynamicSourceTargetsAreReused(t *testing.T) {
	reg := NewRegistry(nil)
	src := func(*http.Request) ([]Target, error) { return targets("10.0.0.7:8000", "10.0.0.8:8000"), nil }
	p := startPool(t, reg, Config{Key: "dynamic:reuse", Source: src})
	a := mustPick(t, p, "")
	c := mustPick(t, p, "", a.Addr)
	if a.Addr == c.Addr {
		t.Fatalf("the second pick should avoid the tried %s", a.Addr)
	}
	ea, _ := reg.Entry(a.Addr)
	if n := ea.Inflight(); n != 1 {
		t.Fatalf("in flight for dynamic %s = %d, want 1", a.Addr, n)
	}
	a.Done(nil)
	c.Done(nil)
	for _, addr := range []string{a.Addr, c.Addr} {
		e, _ := reg.Entry(addr)
		if n := e.Inflight(); n != 0 {
			t.Fatalf("in flight for %s after release = %d", addr, n)
		}
		if n := reg.EntryRefs(addr); n != 1 {
			t.Fatalf("%s referenced %d times, want once however often picked", addr, n)
		}
	}
}

// Regression: Pick said circuit_open (X-Circuit-Breaker: open) whenever no
// upstream qualified with breakers on, also when the fleet was only full.
func TestPickAnswersCircuitOpenOnlyWhenOpenBreakersAreTheCause(t *testing.T) {
	full := []Target{{Addr: "10.0.3.1:8000", MaxRequests: 1}, {Addr: "10.0.3.2:8000", MaxRequests: 1}}
	for _, tc := range []struct {
		name       string
		cfg        Config
		prepare    func(t *testing.T, p *Pool)
		pick       proxy.PickRequest
		circuit    bool
		busy       bool
		retryAfter time.Duration
	}{
		{
			name: "all at max_requests, breakers on",
			cfg:  Config{Static: full, Breaker: &breaker.Settings{}},
			prepare: func(t *testing.T, p *Pool) {
				mustPick(t, p, "")
				mustPick(t, p, "")
			},
			busy: true,
		},
		{
			name: "all at max_requests, breakers off",
			cfg:  Config{Static: full},
			prepare: func(t *testing.T, p *Pool) {
				mustPick(t, p, "")
				mustPick(t, p, "")
			},
			busy: true,
		},
		{
			name: "all open",
			cfg:  Config{Static: targets("10.0.3.3:8000"), Breaker: &breaker.Settings{ConsecutiveFailures: 1, OpenFor: time.Minute, MinOpen: time.Minute}},
			prepare: func(t *testing.T, p *Pool) {
				fail(mustPick(t, p, ""))
			},
			circuit: true,
		},
		{
			name: "breakers off, every upstream tried by a hedge",
			cfg:  Config{Static: targets("10.0.3.4:8000")},
			pick: proxy.PickRequest{Tried: []string{"10.0.3.4:8000"}, Hedge: true},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startPool(t, NewRegistry(nil), tc.cfg)
			if tc.prepare != nil {
				tc.prepare(t, p)
			}
			_, err := p.Pick(nil, &http.Request{}, tc.pick)
			var ue *proxy.UnavailableError
			if !errors.As(err, &ue) || !errors.Is(err, proxy.ErrNoUpstream) {
				t.Fatalf("err %v, want an *UnavailableError", err)
			}
			if ue.CircuitOpen != tc.circuit || ue.Busy != tc.busy {
				t.Fatalf("CircuitOpen %t Busy %t, want %t %t (%s)", ue.CircuitOpen, ue.Busy, tc.circuit, tc.busy, ue.Reason)
			}
			if tc.busy && ue.RetryAfter != 0 {
				// A slot frees as soon as an attempt ends: a retry must
				// not sleep on a full pool.
				t.Fatalf("busy pool: RetryAfter %v, want 0", ue.RetryAfter)
			}
			if tc.retryAfter > 0 && ue.RetryAfter != tc.retryAfter {
				t.Fatalf("RetryAfter %v, want %v", ue.RetryAfter, tc.retryAfter)
			}
		})
	}
}

// Regression: max_requests was checked, then incremented, so concurrent
// picks overshot it. The entry's in-flight count must never exceed it.
func TestMaxRequestsHoldsExactlyUnderConcurrency(t *testing.T) {
	for _, limit := range []int{1, 3} {
		t.Run("", func(t *testing.T) {
			reg := NewRegistry(nil)
			p := startPool(t, reg, Config{Static: []Target{{Addr: "10.0.4.1:8000", MaxRequests: limit}}, Breaker: &breaker.Settings{}})
			e, _ := reg.Entry("10.0.4.1:8000")
			var peak, granted atomic.Int64
			var wg sync.WaitGroup
			start := make(chan struct{})
			for range 64 {
				wg.Go(func() {
					<-start
					for range 200 {
						up, err := pickModel(p, "")
						if err != nil {
							var ue *proxy.UnavailableError
							if !errors.As(err, &ue) || !ue.Busy {
								t.Errorf("refused with %v, want busy", err)
								return
							}
							continue
						}
						granted.Add(1)
						n := e.Inflight()
						for {
							m := peak.Load()
							if n <= m || peak.CompareAndSwap(m, n) {
								break
							}
						}
						finish(up, proxy.AttemptSuccess)
					}
				})
			}
			close(start)
			wg.Wait()
			if m := peak.Load(); m > int64(limit) {
				t.Fatalf("max_requests %d: %d attempts in flight observed", limit, m)
			}
			if granted.Load() == 0 {
				t.Fatal("no pick was granted")
			}
			if n := e.Inflight(); n != 0 {
				t.Fatalf("%d in flight after every attempt ended", n)
			}
		})
	}
}
