package upstream

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// ejectionPool is a pool of n upstreams at the default breaker settings on
// a fake clock.
func ejectionPool(t *testing.T, n int, ej Ejection) (*Registry, *Pool, []string, *clocktest.Fake) {
	t.Helper()
	clk := clocktest.New(simT0)
	reg := NewRegistry(nil)
	reg.UseClock(clk)
	addrs := make([]string, n)
	for i := range addrs {
		addrs[i] = fmt.Sprintf("10.19.9.%d:8000", i+1)
	}
	p := startPool(t, reg, Config{Key: "ejection", Static: targets(addrs...), Breaker: &breaker.Settings{}, Ejection: ej})
	return reg, p, addrs, clk
}

// serveOn sends k attempts to addr (picked with every other upstream
// tried), each failing when fail(i) says so.
func serveOn(t *testing.T, p *Pool, addrs []string, addr string, k int, fail func(i int) bool) {
	t.Helper()
	var others []string
	for _, a := range addrs {
		if a != addr {
			others = append(others, a)
		}
	}
	for i := range k {
		up, err := pickModel(p, "", others...)
		if err != nil || up.Addr != addr {
			return // no longer picked
		}
		if fail(i) {
			up.Done(&proxy.AttemptReport{Upstream: addr, Outcome: proxy.AttemptHTTP5xx, Status: 503})
		} else {
			up.Committed(0)
			up.Done(&proxy.AttemptReport{Upstream: addr, Outcome: proxy.AttemptSuccess})
		}
	}
}

// nextRun moves the clock to the pool detectors' next run.
func nextRun(clk *clocktest.Fake) { clk.Advance(OutlierInterval) }

func every(n int) func(int) bool { return func(i int) bool { return i%n == 0 } }
func never(int) bool             { return false }

// An upstream failing half its requests in a pool that fails none is an
// outlier: ejected, on statistical evidence, at the detector's next run and
// not before (nothing of it runs on the request path). The same rate across
// the whole pool ejects nobody.
func TestOutlierEjectedAtTheNextRunUniformFailureNot(t *testing.T) {
	reg, p, addrs, clk := ejectionPool(t, 3, Ejection{})
	serveOn(t, p, addrs, addrs[1], 40, never)
	serveOn(t, p, addrs, addrs[2], 40, never)
	serveOn(t, p, addrs, addrs[0], 40, every(2))
	b := breakerOf(t, reg, addrs[0], "")
	if b.State() != breaker.Closed {
		t.Fatalf("the outlier before the detector ran: %+v, want closed", b.Snapshot())
	}
	nextRun(clk)
	if b.State() != breaker.Open || b.Evidence() != breaker.Statistical {
		t.Fatalf("the outlier: %+v, want open on statistical evidence", b.Snapshot())
	}

	reg, p, addrs, clk = ejectionPool(t, 3, Ejection{})
	for _, a := range addrs {
		serveOn(t, p, addrs, a, 200, every(2))
	}
	nextRun(clk)
	for _, a := range addrs {
		if b := breakerOf(t, reg, a, ""); b.State() != breaker.Closed {
			t.Fatalf("%s at the pool's own 50%%: %+v, want closed", a, b.Snapshot())
		}
	}
}

// At most max(1, ⌊N × max_ejection⌋) upstreams are held open on
// statistical evidence at once.
func TestEjectionCap(t *testing.T) {
	for _, tc := range []struct {
		ratio         float64
		want, wantMax int
	}{{0, 3, 3}, {0.1, 1, 1}, {0.5, 4, 5}} {
		reg, p, addrs, clk := ejectionPool(t, 10, Ejection{MaxEjection: tc.ratio})
		for _, a := range addrs[4:] {
			serveOn(t, p, addrs, a, 60, never)
		}
		for _, a := range addrs[:4] {
			serveOn(t, p, addrs, a, 60, every(2)) // four outliers
		}
		nextRun(clk)
		n := 0
		for _, a := range addrs {
			if breakerOf(t, reg, a, "").Evidence() == breaker.Statistical {
				n++
			}
		}
		if n != tc.want {
			t.Errorf("max_ejection %v: %d ejected, want %d", tc.ratio, n, tc.want)
		}
		if st := p.Status(); st.Ejected != n || st.MaxEjected != tc.wantMax {
			t.Errorf("max_ejection %v: status %+v", tc.ratio, st)
		}
	}
}

// Below panic_threshold of available upstreams, the pool routes over every
// upstream not held by hard evidence; with the rule off it does not.
func TestPanicRoutesOverStatisticalNotHard(t *testing.T) {
	for _, thr := range []float64{0, -1} {
		reg, p, addrs, _ := ejectionPool(t, 3, Ejection{PanicThreshold: thr})
		breakerOf(t, reg, addrs[0], "").ForceOpen(0, "hard: maintenance")
		breakerOf(t, reg, addrs[1], "").Eject("outlier", 0.5)
		picked := map[string]int{}
		for range 300 {
			up, err := pickModel(p, "")
			if err != nil {
				t.Fatal(err)
			}
			picked[up.Addr]++
			up.Done(nil)
		}
		st := p.Status()
		if picked[addrs[0]] != 0 {
			t.Fatalf("threshold %v: the hard-held upstream got %d picks", thr, picked[addrs[0]])
		}
		if thr == 0 && (picked[addrs[1]] < 50 || !st.Panic || st.PanicRequests != 300) {
			t.Fatalf("panic: the ejected upstream got %d of 300 picks, status %+v; want about half, panic on", picked[addrs[1]], st)
		}
		if thr < 0 && (picked[addrs[1]] != 0 || st.Panic) {
			t.Fatalf("panic off: the ejected upstream got %d picks, status %+v", picked[addrs[1]], st)
		}
	}
}

// An upstream back from an ejection keeps its place under the cap while on
// probation (breaker.OnProbation): the pool's status shows it, or an
// operator reads "ejected 0 of 1" while no outlier can be ejected.
func TestStatusShowsProbation(t *testing.T) {
	reg, p, addrs, clk := ejectionPool(t, 3, Ejection{})
	b := breakerOf(t, reg, addrs[0], "")
	b.Eject("outlier", 0)
	nextRun(clk)
	if st := p.Status(); st.Ejected != 1 || st.Probation != 0 || !slices.Equal(st.EjectedUpstreams, addrs[:1]) {
		t.Fatalf("ejected: status %+v", st)
	}
	clk.Advance(time.Hour)
	serveOn(t, p, addrs, addrs[0], 5, never) // probes, then a few in its window
	if !b.OnProbation() {
		t.Fatalf("not on probation: %+v", b.Snapshot())
	}
	nextRun(clk)
	if st := p.Status(); st.Ejected != 0 || st.Probation != 1 || st.MaxEjected != 1 {
		t.Fatalf("on probation: status %+v", st)
	}
}

// The breaker settings' ratio rule (failure_ratio) is the pool detector's,
// within the pool's cap, as its own outlier rules are. Every replica of two
// failing half its requests: when each breaker tripped on its own rule,
// both opened and the pool showed "ejected 2 of 1", which fired a
// pool-unavailable alert while the pool served.
func TestBreakerRatioRuleEjectsWithinTheCap(t *testing.T) {
	clk := clocktest.New(simT0)
	reg := NewRegistry(nil)
	reg.UseClock(clk)
	addrs := []string{"10.19.8.1:8000", "10.19.8.2:8000"}
	p := startPool(t, reg, Config{Key: "ratio-cap", Static: targets(addrs...),
		Breaker: &breaker.Settings{ConsecutiveFailures: -1, FailureRatio: 0.5, MinRequests: 10}})
	for i := range 40 {
		for _, a := range addrs {
			serveOn(t, p, addrs, a, 1, func(int) bool { return i%2 == 1 })
		}
	}
	for _, a := range addrs {
		if b := breakerOf(t, reg, a, ""); b.State() != breaker.Closed {
			t.Fatalf("%s before the detector ran: %+v, want closed (the rule is the pool's)", a, b.Snapshot())
		}
	}
	nextRun(clk)
	open := 0
	for _, a := range addrs {
		b := breakerOf(t, reg, a, "")
		if b.State() == breaker.Open {
			open++
			if b.Evidence() != breaker.Statistical {
				t.Fatalf("%s: %+v, want open on statistical evidence", a, b.Snapshot())
			}
		}
	}
	if open != 1 {
		t.Fatalf("%d of 2 breakers open on the failure ratio rule, want 1 (the cap, max(1, ⌊2 × 0.3⌋))", open)
	}
	if st := p.Status(); st.Ejected != 1 || st.MaxEjected != 1 {
		t.Fatalf("status %+v, want ejected 1 of 1", st)
	}
}

// Each handler judges the upstream's shared evidence within its own pool's
// cap: X failing half of handler b's requests, in b's pool of ten, is
// ejected from b's pool, but not from handler a's pool of two, whose only
// place (a's cap is one) Y holds. a's pool never shows "ejected 2 of 1".
func TestEachPoolEjectsOnTheSharedEvidenceWithinItsOwnCap(t *testing.T) {
	clk := clocktest.New(simT0)
	reg := NewRegistry(nil)
	reg.UseClock(clk)
	s := breaker.Settings{ConsecutiveFailures: -1, FailureRatio: 0.5, MinRequests: 10}
	x, y := "10.19.10.1:8000", "10.19.10.2:8000"
	small := []string{x, y}
	big := []string{x, y}
	for i := range 8 {
		big = append(big, fmt.Sprintf("10.19.10.%d:8000", 10+i))
	}
	a := startPool(t, reg, Config{Key: "a", Handler: "a", Static: targets(small...), Breaker: &s})
	b := startPool(t, reg, Config{Key: "b", Handler: "b", Static: targets(big...), Breaker: &s})
	half := func(i int) bool { return i%2 == 1 }
	serveOn(t, a, small, y, 20, half)
	nextRun(clk)
	if st := a.Status(); st.Ejected != 1 {
		t.Fatalf("a: %+v, want y ejected", st)
	}
	serveOn(t, b, big, x, 20, half)
	nextRun(clk)
	nextRun(clk)
	ex, _ := reg.Entry(x)
	if st := a.Breakers(ex)[""].State(); st != breaker.Closed {
		t.Fatalf("x in pool a is %s, want closed: pool a's only place is y's", st)
	}
	if st := a.Status(); st.Ejected != 1 || st.MaxEjected != 1 {
		t.Fatalf("a: %+v, want ejected 1 of 1", st)
	}
	if st := b.Breakers(ex)[""].State(); st != breaker.Open {
		t.Fatalf("x in pool b is %s, want open: half its requests failed, within b's cap of 3", st)
	}
}

// fails says whether attempt i fails: i%n is one of idx.
func fails(n int, idx ...int) func(int) bool {
	return func(i int) bool {
		for _, k := range idx {
			if i%n == k {
				return true
			}
		}
		return false
	}
}

// The rest of the pool's ratio counts each peer once, however busy: a
// replica failing 30% between a busy one failing none and a quiet one
// failing 60% is no outlier (pooling the requests judged it against the
// busy one alone: 12 failures in 220 requests). A fourth upstream holds
// the cap's one place, so the 60% one stays a peer (over the cap).
func TestPeersCountOnceHoweverBusy(t *testing.T) {
	reg, p, addrs, clk := ejectionPool(t, 4, Ejection{})
	breakerOf(t, reg, addrs[3], "").Eject("holds the place", 0) // held ratio 1: never displaced
	serveOn(t, p, addrs, addrs[0], 200, never)
	serveOn(t, p, addrs, addrs[2], 20, fails(5, 1, 2, 3)) // 12 of 20, the last a success
	serveOn(t, p, addrs, addrs[1], 40, fails(10, 1, 4, 7))
	nextRun(clk)
	if rc := breakerOf(t, reg, addrs[2], "").RatioCounts(); rc.Requests != 20 || rc.Failures != 12 {
		t.Fatalf("the 60%% replica's window: %+v, want 12 failures in 20", rc)
	}
	if e, _ := reg.Entry(addrs[2]); !p.overCap(e, clk.Now()) {
		t.Fatalf("the 60%% replica is no outlier over the cap (status %+v)", p.Status())
	}
	b := breakerOf(t, reg, addrs[1], "")
	if e, _ := reg.Entry(addrs[1]); b.State() != breaker.Closed || p.overCap(e, clk.Now()) {
		t.Fatalf("the 30%% replica between peers at 0%% and 60%%: %+v, over the cap %v; want closed, no outlier", b.Snapshot(), p.overCap(e, clk.Now()))
	}
	if r := b.PeerRatio(); r < 0.29 || r > 0.31 {
		t.Errorf("the 30%% replica's peer ratio %.3f, want the peers' mean 0.30", r)
	}
}

// Under a full ejection cap a worse outlier takes the place of a milder
// one, which serves again; one only a little worse does not.
func TestWorseOutlierTakesTheCapsPlace(t *testing.T) {
	for _, tc := range []struct {
		name     string
		fail     func(int) bool
		displace bool
	}{
		{"80% against a held 40%", fails(5, 1, 2, 3, 4), true},
		{"50% against a held 40%", fails(2, 1), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg, p, addrs, clk := ejectionPool(t, 3, Ejection{})
			serveOn(t, p, addrs, addrs[0], 100, never)
			serveOn(t, p, addrs, addrs[1], 40, fails(5, 1, 3))
			nextRun(clk)
			mild, worse := breakerOf(t, reg, addrs[1], ""), breakerOf(t, reg, addrs[2], "")
			if mild.Evidence() != breaker.Statistical {
				t.Fatalf("the 40%% replica: %+v, want ejected", mild.Snapshot())
			}
			if r := mild.HeldRatio(); r < 0.39 || r > 0.41 {
				t.Errorf("held ratio %.3f, want 0.40", r)
			}
			serveOn(t, p, addrs, addrs[2], 40, tc.fail)
			nextRun(clk)
			if got := worse.Evidence() == breaker.Statistical; got != tc.displace {
				t.Fatalf("the worse replica ejected %v, want %v: %+v", got, tc.displace, worse.Snapshot())
			}
			// Out for want of a place under the cap, the pardoned one
			// (or the worse one refused) serves with its recent
			// failures counted against it in selection.
			out, _ := reg.Entry(addrs[2])
			if tc.displace {
				if s := mild.Snapshot(); s.State != breaker.Closed || s.Evidence != breaker.EvidenceNone || mild.OnProbation() {
					t.Errorf("the pardoned replica: %+v, want closed, off probation", s)
				}
				out, _ = reg.Entry(addrs[1])
			} else if mild.Evidence() != breaker.Statistical {
				t.Errorf("the held replica: %+v, want still ejected", mild.Snapshot())
			}
			if !p.overCap(out, clk.Now()) {
				t.Errorf("%s: its recent failures do not count against it", out.addr)
			}
			if st := p.Status(); st.Ejected != 1 {
				t.Errorf("status %+v, want 1 ejected", st)
			}
		})
	}
}

// A half-open upstream held on hard evidence that answers a probe and then
// fails more than its pool explains re-opens as an outlier, on statistical
// evidence, at once (the breaker asks no cap); the pool's detector trims
// the holds over its cap at its next run, keeping the worse: the pool shows
// one ejected of one again.
func TestProbeOutlierOverTheCapTrimmedAtTheNextRun(t *testing.T) {
	reg, p, addrs, clk := ejectionPool(t, 3, Ejection{})
	serveOn(t, p, addrs, addrs[0], 100, never)
	serveOn(t, p, addrs, addrs[1], 40, fails(5, 1, 3))
	serveOn(t, p, addrs, addrs[2], 3, func(int) bool { return true })
	nextRun(clk)
	held, down := breakerOf(t, reg, addrs[1], ""), breakerOf(t, reg, addrs[2], "")
	if held.Evidence() != breaker.Statistical || down.Evidence() != breaker.Hard {
		t.Fatalf("before: %+v / %+v, want one ejected, one down", held.Snapshot(), down.Snapshot())
	}
	clk.Advance(down.Snapshot().OpenUntil.Sub(clk.Now()))
	serveOn(t, p, addrs, addrs[2], 2, func(i int) bool { return i == 1 }) // a probe answered, then one failed
	if s := down.Snapshot(); s.State != breaker.Open || s.Evidence != breaker.Statistical || s.Reopens != 1 {
		t.Fatalf("after its probes: %+v, want open again as an outlier", s)
	}
	nextRun(clk)
	if st := p.Status(); st.Ejected != 1 || st.MaxEjected != 1 || !slices.Equal(st.EjectedUpstreams, addrs[2:]) {
		t.Errorf("status %+v, want 1 of 1 ejected: %s (failing 1 of 2 probes), not the milder %s", st, addrs[2], addrs[1])
	}
	if s := held.Snapshot(); s.State != breaker.Closed || s.Evidence != breaker.EvidenceNone {
		t.Errorf("the milder hold: %+v, want pardoned", s)
	}
}

// A reload that lowers max_ejection leaves more upstreams held than the
// new cap allows; the new pool's detector pardons the mildest at its first
// run, keeping the worst.
func TestLoweredCapTrimmedWorstKept(t *testing.T) {
	reg, p, addrs, clk := ejectionPool(t, 10, Ejection{MaxEjection: 0.5})
	for _, a := range addrs[3:] {
		serveOn(t, p, addrs, a, 60, never)
	}
	// Each starts with a success: no run of failures in a silent window.
	serveOn(t, p, addrs, addrs[0], 60, fails(10, 1, 3, 5, 7))          // 40%
	serveOn(t, p, addrs, addrs[1], 60, fails(10, 1, 2, 3, 5, 6, 7, 8)) // 70%
	serveOn(t, p, addrs, addrs[2], 60, fails(2, 1))                    // 50%
	nextRun(clk)
	if st := p.Status(); st.Ejected != 3 {
		t.Fatalf("before the reload: %+v, want 3 ejected", st)
	}
	next := reload(t, p, Config{Key: "ejection", Static: targets(addrs...), Breaker: &breaker.Settings{}, Ejection: Ejection{MaxEjection: 0.1}})
	if st := next.Status(); st.Ejected != 1 || st.MaxEjected != 1 || !slices.Equal(st.EjectedUpstreams, addrs[1:2]) {
		t.Fatalf("after the reload: %+v, want only the 70%% one (%s) held", st, addrs[1])
	}
	for _, a := range []string{addrs[0], addrs[2]} {
		if b := breakerOf(t, reg, a, ""); b.State() != breaker.Closed {
			t.Errorf("%s: %+v, want pardoned", a, b.Snapshot())
		}
	}
}

// An outcome of an attempt the pool routed over a held breaker (panic: no
// permit) still reaches the detector: its next run sees it in the
// upstream's counts. Lost, an upstream routed over in panic looked to its
// pool as it did when it was ejected, however it failed since.
func TestOutcomeInPanicReachesTheDetector(t *testing.T) {
	reg, p, addrs, clk := ejectionPool(t, 3, Ejection{})
	breakerOf(t, reg, addrs[0], "").ForceOpen(0, "hard: maintenance")
	ejected := breakerOf(t, reg, addrs[1], "")
	ejected.Eject("outlier", 0)
	nextRun(clk)
	before := p.outliers().seen[outlierKey{addrs[1], ""}]
	for range 10 {
		up := mustPick(t, p, "", addrs[2])
		if up.Addr != addrs[1] {
			t.Fatalf("picked %s, want the ejected %s routed over in panic", up.Addr, addrs[1])
		}
		finish(up, proxy.AttemptHTTP5xx)
	}
	if st := p.Status(); !st.Panic {
		t.Fatalf("status %+v, want panic", st)
	}
	nextRun(clk)
	after := p.outliers().seen[outlierKey{addrs[1], ""}]
	if after.Requests-before.Requests != 10 || after.Failures-before.Failures != 10 {
		t.Fatalf("the detector saw %+v, then %+v: want the 10 failures made in panic", before.RatioCounts, after.RatioCounts)
	}
	if s := ejected.Snapshot(); s.State != breaker.Open || s.Evidence != breaker.Statistical {
		t.Fatalf("the routed-over breaker: %+v, want still held (no verdict without a permit)", s)
	}
}

// The detector runs every OutlierInterval while its pool is active, and
// never after the pool is released (nor while it is deactivated).
func TestDetectorStopsWithItsPool(t *testing.T) {
	_, p, _, clk := ejectionPool(t, 3, Ejection{})
	runs := p.det.runs.Load()
	clk.Advance(3 * OutlierInterval)
	if n := p.det.runs.Load() - runs; n != 3 {
		t.Fatalf("%d runs in 3 intervals, want 3", n)
	}
	p.Deactivate()
	runs = p.det.runs.Load()
	clk.Advance(3 * OutlierInterval)
	if n := p.det.runs.Load() - runs; n != 0 {
		t.Fatalf("%d runs while deactivated, want 0", n)
	}
	p.Activate()
	clk.Advance(OutlierInterval)
	p.Release()
	runs = p.det.runs.Load()
	clk.Advance(10 * OutlierInterval)
	if n := p.det.runs.Load() - runs; n != 0 {
		t.Fatalf("%d runs after Release, want 0", n)
	}
	if _, funcs := clk.Armed(); funcs != 0 {
		t.Fatalf("%d timers still armed after Release", funcs)
	}
}

// A scope model pool's status counts an upstream held on statistical
// evidence for a model as ejected, as a per-upstream pool's does.
func TestScopeModelPoolStatusCountsItsEjectedUpstreams(t *testing.T) {
	clk := clocktest.New(simT0)
	reg := NewRegistry(nil)
	reg.UseClock(clk)
	addrs := []string{"10.19.11.1:8000", "10.19.11.2:8000", "10.19.11.3:8000"}
	p := startPool(t, reg, Config{Key: "scoped", Static: targets(addrs...), ScopeModel: true, Breaker: &breaker.Settings{}})
	serveOn(t, p, addrs, addrs[1], 40, never)
	serveOn(t, p, addrs, addrs[2], 40, never)
	serveOn(t, p, addrs, addrs[0], 40, every(2))
	nextRun(clk)
	e, _ := reg.Entry(addrs[0])
	if b := p.Breakers(e)[p.breakerKey("")]; b == nil || b.Evidence() != breaker.Statistical {
		t.Fatalf("the outlier's model breaker: %v, want held on statistical evidence", b)
	}
	if st := p.Status(); st.Ejected != 1 || !slices.Equal(st.EjectedUpstreams, addrs[:1]) {
		t.Fatalf("status %+v, want %s ejected", st, addrs[0])
	}
}
