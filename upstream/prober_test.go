package upstream

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// activeProbing is breaker settings for active probing that trip on one
// failure and cool down at once.
func activeProbing() *breaker.Settings {
	return &breaker.Settings{ConsecutiveFailures: 1, OpenFor: time.Millisecond, MinOpen: -1, MaxOpen: 20 * time.Millisecond, ActiveProbing: true}
}

func testProber(uri string) *Prober {
	return &Prober{Transport: httpTransport{}, URI: uri, Interval: 5 * time.Millisecond, Timeout: 10 * time.Second}
}

// Active probes close a breaker while users are kept away from it; the
// loop stops once every breaker is closed.
func TestActiveProbesCloseBreakerAndStop(t *testing.T) {
	for _, tc := range []struct {
		name   string
		prober *Prober
		check  func(r *http.Request, body string) bool
	}{
		{"GET", testProber("/ready"), func(r *http.Request, _ string) bool {
			return r.Method == http.MethodGet && r.URL.Path == "/ready"
		}},
		{"GET default URI", testProber(""), func(r *http.Request, _ string) bool {
			return r.Method == http.MethodGet && r.URL.Path == DefaultProbeURI
		}},
		{"chat", &Prober{Transport: httpTransport{}, Chat: `{"model":"m","max_tokens":1}`, Interval: 5 * time.Millisecond, Timeout: 10 * time.Second},
			func(r *http.Request, body string) bool {
				return r.Method == http.MethodPost && r.URL.Path == "/v1/chat/completions" &&
					r.Header.Get("Content-Type") == "application/json" && body == `{"model":"m","max_tokens":1}`
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var probes, bad atomic.Int64
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				b, _ := io.ReadAll(r.Body)
				probes.Add(1)
				if !tc.check(r, string(b)) || r.Header.Get("User-Agent") != "caddy-llm-proxy-probe" {
					bad.Add(1)
				}
			}))
			t.Cleanup(srv.Close)
			addr := strings.TrimPrefix(srv.URL, "http://")
			reg := NewRegistry(nil)
			clk := newLoopClock()
			reg.UseClock(clk)
			s := activeProbing()
			s.RecoverySuccesses = 2
			p := startPool(t, reg, Config{Static: targets(addr), Breaker: s, Prober: tc.prober})
			fail(mustPick(t, p, ""))
			var ue *proxy.UnavailableError
			if _, err := pickModel(p, ""); !errors.As(err, &ue) || !ue.CircuitOpen {
				t.Fatalf("a user request was let onto a breaker that probes actively: %v", err)
			}
			// One probe per interval: the first half-opens the breaker,
			// the second closes it, and the loop stops.
			for i := 1; i <= 2; i++ {
				step(t, clk, reg, tc.prober.Interval)
				if n := probes.Load(); n != int64(i) {
					t.Fatalf("%d probes after %d intervals, want %d", n, i, i)
				}
			}
			if st := p.BreakerState(addr, ""); st != "closed" {
				t.Fatalf("two successful probes left the breaker %s, want closed", st)
			}
			clocktest.Settle(t, "the probe loop outlived the open breaker", func() bool { return reg.ProbeLoops() == 0 })
			clk.Advance(time.Minute)
			if n := probes.Load(); n != 2 {
				t.Fatalf("%d probes after the breaker closed, want none", n-2)
			}
			if n := bad.Load(); n > 0 {
				t.Fatalf("%d probes were not the configured request", n)
			}
			finish(mustPick(t, p, ""), proxy.AttemptSuccess)
		})
	}
}

// A reload that turns active probing on while a breaker is open: user
// traffic is now refused (ActiveProbing), so a probe loop must start with
// the new config, not only on the next transition to open.
func TestReloadEnablingProbeRecoversOpenBreaker(t *testing.T) {
	addr, probes := probeServer(t, http.StatusOK)
	reg := NewRegistry(nil)
	clk := newLoopClock()
	reg.UseClock(clk)
	s := breaker.Settings{ConsecutiveFailures: 1, OpenFor: 30 * time.Millisecond, MinOpen: 30 * time.Millisecond}
	old := startPool(t, reg, Config{Static: targets(addr), Breaker: &s})
	fail(mustPick(t, old, "")) // open
	if n := reg.ProbeLoops(); n != 0 {
		t.Fatalf("%d probe loops under passive recovery", n)
	}
	ns := s
	ns.ActiveProbing = true
	next := reload(t, old, Config{Static: targets(addr), Breaker: &ns, Prober: testProber("/")})
	awaitTickers(t, clk, 1) // the new config started a probe loop
	if _, err := pickModel(next, ""); err == nil {
		t.Fatal("a user request was let onto the open breaker")
	}
	// The cooldown (30ms, jittered upward) ends at one of the loop's
	// ticks; the breaker closes after its 2 recovery successes (the
	// default), one probe a tick, and users are refused until then.
	for i := 0; next.BreakerState(addr, "") != "closed"; i++ {
		if i == 40 {
			t.Fatalf("the breaker is %s 200ms after a 30ms cooldown (%d probes)", next.BreakerState(addr, ""), probes())
		}
		if _, err := pickModel(next, ""); err == nil {
			t.Fatalf("a user request was let onto the %s breaker after %d ticks", next.BreakerState(addr, ""), i)
		}
		step(t, clk, reg, 5*time.Millisecond)
	}
	if n := probes(); n != breaker.DefaultRecoverySuccesses {
		t.Fatalf("%d active probes closed the breaker, want %d", n, breaker.DefaultRecoverySuccesses)
	}
	up, err := pickModel(next, "")
	if err != nil {
		t.Fatalf("the healthy upstream is still refused after its probe: %v", err)
	}
	finish(up, proxy.AttemptSuccess)
}

// Regression: a breaker that opened after its entry was destroyed (an
// attempt of the released config failing afterwards) started a probe loop
// nobody could stop: it probed the removed upstream forever.
func TestNoProbeLoopAfterEntryDestroyed(t *testing.T) {
	addr, probes := probeServer(t, http.StatusServiceUnavailable)
	reg := NewRegistry(nil)
	p := startPool(t, reg, Config{Static: targets(addr), Breaker: activeProbing(), Prober: testProber("/health")})
	up := mustPick(t, p, "")
	p.Deactivate()
	p.Release() // a reload removed this upstream: entry destroyed
	if _, ok := reg.Entry(addr); ok {
		t.Fatal("entry should be gone")
	}
	fail(up) // the old config's in-flight attempt fails afterwards
	// The open transition would start a loop synchronously.
	if n, loops := probes(), reg.ProbeLoops(); n > 0 || loops > 0 {
		t.Fatalf("destroyed entry probed %d times, %d loops running", n, loops)
	}
}

// Regression: an active probe in flight when its entry was released ran
// to its own timeout (first_byte_timeout, up to minutes) against an
// upstream no config uses any more.
func TestActiveProbeInFlightIsCancelledWhenEntryReleased(t *testing.T) {
	var hanging, cancelled atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hanging.Add(1)
		<-r.Context().Done()
		cancelled.Add(1)
	}))
	t.Cleanup(srv.Close)
	addr := strings.TrimPrefix(srv.URL, "http://")
	reg := NewRegistry(nil)
	clk := newLoopClock()
	reg.UseClock(clk)
	pr := testProber("/health")
	pr.Timeout = time.Hour // on the fake clock, which does not move: only the release can end the probe
	p := startPool(t, reg, Config{Static: targets(addr), Breaker: activeProbing(), Prober: pr})
	fail(mustPick(t, p, ""))
	awaitTickers(t, clk, 1)
	clk.Advance(pr.Interval) // the probe is sent, and hangs
	clocktest.Settle(t, "no active probe was sent", func() bool { return hanging.Load() == 1 })
	if n := cancelled.Load(); n != 0 {
		t.Fatalf("%d probes cancelled before the release", n)
	}
	p.Deactivate()
	p.Release()
	clocktest.Settle(t, "the probe in flight was not cancelled by its entry's release", func() bool { return cancelled.Load() == 1 })
	clocktest.Settle(t, "the probe loop outlived its entry", func() bool { return reg.ProbeLoops() == 0 })
}

// One probe loop runs per upstream however many pools hold it, and a
// reload hands it over to the new config (its Prober is used) without
// stopping it in between.
func TestOneProbeLoopPerUpstreamHandedOverAcrossReload(t *testing.T) {
	var mu sync.Mutex
	paths := map[string]int{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		paths[r.URL.Path]++
		mu.Unlock()
		w.WriteHeader(http.StatusServiceUnavailable) // the breaker stays open
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
	// tick advances the clock until probesTo(path) reaches n, failing
	// after 20 intervals (the cooldown backs off to max_open, 20ms).
	tick := func(path string, n int) {
		t.Helper()
		for i := 0; probesTo(path) < n; i++ {
			if i == 20 {
				t.Fatalf("%d probes to %s after 20 intervals, want %d", probesTo(path), path, n)
			}
			step(t, clk, reg, 5*time.Millisecond)
		}
	}
	oldCfg := Config{Static: targets(addr), Breaker: activeProbing(), Prober: testProber("/old")}
	a := startPool(t, reg, oldCfg)
	b := startPool(t, reg, oldCfg)
	fail(mustPick(t, a, "")) // the breaker is the entry's: open for both pools
	if _, err := pickModel(b, ""); err == nil {
		t.Fatal("the other pool picked the open upstream")
	}
	tick("/old", 2)

	// Sample the loop count through the reload.
	var lo, hi atomic.Int64
	lo.Store(1 << 30)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			n := int64(reg.ProbeLoops())
			if n < lo.Load() {
				lo.Store(n)
			}
			if n > hi.Load() {
				hi.Store(n)
			}
			select {
			case <-stop:
				return
			default:
				runtime.Gosched()
			}
		}
	})
	next := startPool(t, reg, Config{Static: targets(addr), Breaker: activeProbing(), Prober: testProber("/new")})
	for _, old := range []*Pool{a, b} {
		old.Deactivate()
		old.Release()
	}
	tick("/new", 3)
	close(stop)
	wg.Wait()
	if lo.Load() != 1 || hi.Load() != 1 {
		t.Fatalf("probe loops ranged over [%d, %d] through the reload, want exactly 1", lo.Load(), hi.Load())
	}
	if n := reg.ProbeLoops(); n != 1 {
		t.Fatalf("%d probe loops after the reload", n)
	}
	old, nw := probesTo("/old"), probesTo("/new")
	tick("/new", nw+3)
	if probesTo("/old") != old {
		t.Fatalf("the released config's prober was used %d times among 3 probes", probesTo("/old")-old)
	}
	next.Deactivate()
	next.Release()
	clocktest.Settle(t, "the probe loop outlived its entry", func() bool { return reg.ProbeLoops() == 0 })
}

// A reload that turns active probing off stops the loop.
func TestReloadDisablingProbeStopsLoop(t *testing.T) {
	addr, probes := probeServer(t, http.StatusServiceUnavailable)
	reg := NewRegistry(nil)
	clk := newLoopClock()
	reg.UseClock(clk)
	old := startPool(t, reg, Config{Static: targets(addr), Breaker: activeProbing(), Prober: testProber("/")})
	fail(mustPick(t, old, ""))
	if n := reg.ProbeLoops(); n != 1 {
		t.Fatalf("%d probe loops for an open breaker, want 1", n)
	}
	step(t, clk, reg, 5*time.Millisecond)
	if n := probes(); n != 1 {
		t.Fatalf("%d probes in the first interval, want 1", n)
	}
	s := activeProbing()
	s.ActiveProbing = false
	reload(t, old, Config{Static: targets(addr), Breaker: s})
	// The loop wakes at the tick it armed before the reload; that tick
	// may still send the probe it was armed for, then the loop stops.
	step(t, clk, reg, time.Second)
	clocktest.Settle(t, "the probe loop outlived active probing", func() bool { return reg.ProbeLoops() == 0 })
	n := probes()
	if n > 2 {
		t.Fatalf("%d probes at the first tick after active probing was turned off, want at most 1", n-1)
	}
	clk.Advance(time.Minute)
	if m := probes(); m != n {
		t.Fatalf("%d probes after the loop stopped", m-n)
	}
}

// Regression: a half-open probe that is a healthy user stream (first token
// at once) lasting longer than the probe timeout (first_byte_timeout)
// re-opened the breaker: the permit was held until the stream ended, and
// the breaker fails probes older than ProbeTimeout. Committed settles it.
func TestLongHealthyProbeStreamClosesBreakerViaCommitted(t *testing.T) {
	const probeTimeout = 20 * time.Millisecond
	reg := NewRegistry(nil)
	clk := newLoopClock()
	reg.UseClock(clk)
	p := startPool(t, reg, Config{Static: targets("10.9.0.1:8000"), Breaker: &breaker.Settings{ConsecutiveFailures: 1,
		OpenFor: 10 * time.Millisecond, MinOpen: -1, MaxOpen: time.Second, RecoverySuccesses: 1, ProbeTimeout: probeTimeout}})
	fail(mustPick(t, p, ""))
	if _, err := pickModel(p, ""); err == nil {
		t.Fatal("picked the upstream whose breaker just opened")
	}
	clk.Advance(time.Second) // max_open: the cooldown is over
	probe, err := pickModel(p, "")
	if err != nil {
		t.Fatalf("no half-open probe after the cooldown: %v", err)
	}
	if st := p.BreakerState("10.9.0.1:8000", ""); st != "half_open" {
		t.Fatalf("the probe was picked with the breaker %s", st)
	}
	// The first token comes after 5ms (the proxy commits it); the stream
	// then runs past the probe timeout.
	probe.Committed(5 * time.Millisecond)
	clk.Advance(2 * probeTimeout)
	if up, err := pickModel(p, ""); err != nil { // any other request meanwhile
		t.Fatalf("refused during the healthy probe stream: %v", err)
	} else {
		finish(up, proxy.AttemptSuccess)
	}
	probe.Done(&proxy.AttemptReport{Upstream: probe.Addr, Outcome: proxy.AttemptSuccess, TTFT: 5 * time.Millisecond, Committed: true})
	snap := breakerOf(t, reg, "10.9.0.1:8000", "").Snapshot()
	if snap.State != breaker.Closed {
		t.Fatalf("healthy probe stream (ttft 5ms) left the breaker %v; last failure %q", snap.State, snap.LastFailure)
	}
}
