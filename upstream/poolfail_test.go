package upstream

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// poolRun is one request of runPoolSim.
type poolRun struct {
	at       time.Duration
	served   bool
	attempts int
	// shed: the first pick answered 503 with X-Circuit-Breaker: open and a
	// Retry-After, without an attempt.
	shed       bool
	retryAfter time.Duration
}

// poolSim is a run of runPoolSim: the requests in arrival order and each
// upstream's attempt times.
type poolSim struct {
	p    *Pool
	reqs []poolRun
	// tries[i] are the times of the attempts on upstream i.
	tries [][]time.Duration
	// failedAt are the times the pool was seen failed as a whole.
	failedAt []time.Duration
}

// runPoolSim runs rate requests per second for dur through a pool of n
// upstreams at the defaults (as runOutageSim, with max_attempts 3 and the
// default retry budget) on a fake clock, each attempt decided by outcome.
func runPoolSim(t *testing.T, n, rate int, dur time.Duration, cfg Config, outcome func(i int, at time.Duration) proxy.AttemptOutcome) *poolSim {
	t.Helper()
	clk := clocktest.New(simT0)
	reg := NewRegistry(nil)
	reg.UseClock(clk)
	reg.breakerOpts = append(reg.breakerOpts, breaker.WithRand(rand.New(rand.NewPCG(uint64(n), 3)).Float64))
	addrs := make([]string, n)
	index := map[string]int{}
	for i := range addrs {
		addrs[i] = fmt.Sprintf("10.29.%d.%d:8000", rate, i+1)
		index[addrs[i]] = i
	}
	cfg.Key, cfg.Static = fmt.Sprintf("poolsim-%d", n), targets(addrs...)
	if cfg.Breaker == nil {
		cfg.Breaker = &breaker.Settings{}
	}
	s := &poolSim{p: startPool(t, reg, cfg), tries: make([][]time.Duration, n)}
	retries := s.p.Retries()
	peek := retries.(proxy.RetryPeeker)
	for clk.Elapsed() < dur {
		now := clk.Elapsed()
		if s.p.fail.failed.Load() {
			s.failedAt = append(s.failedAt, now)
		}
		retries.Request()
		r := poolRun{at: now}
		var tried []string
		up, err := pickModel(s.p, "", tried...)
		var ue *proxy.UnavailableError
		if errors.As(err, &ue) && ue.CircuitOpen {
			r.shed, r.retryAfter = true, ue.RetryAfter
		}
		for attempt := 1; err == nil; attempt++ {
			i := index[up.Addr]
			r.attempts++
			s.tries[i] = append(s.tries[i], now)
			tried = append(tried, up.Addr)
			o := outcome(i, now)
			rep := &proxy.AttemptReport{Upstream: up.Addr, Outcome: o}
			if o == proxy.AttemptSuccess {
				rep.TTFT = 100 * time.Millisecond
				up.Committed(rep.TTFT)
			} else if o == proxy.AttemptHTTP5xx {
				rep.Status = 503
			}
			up.Done(rep)
			if o == proxy.AttemptSuccess {
				r.served = true
				break
			}
			if attempt >= simMaxAttempts || !peek.RetryAvailable() {
				break
			}
			if up, err = pickModel(s.p, "", tried...); err != nil {
				break
			}
			if !retries.TryRetry() {
				up.Done(nil)
				break
			}
		}
		s.reqs = append(s.reqs, r)
		clk.Advance(time.Second / time.Duration(rate))
	}
	return s
}

// between returns the requests that arrived in [from, to).
func (s *poolSim) between(from, to time.Duration) []poolRun {
	var out []poolRun
	for _, r := range s.reqs {
		if r.at >= from && r.at < to {
			out = append(out, r)
		}
	}
	return out
}

func servedShare(rs []poolRun) float64 {
	n := 0
	for _, r := range rs {
		if r.served {
			n++
		}
	}
	return float64(n) / float64(len(rs))
}

// From a healthy start, three replicas at 20 requests/s all start
// answering 503: within 2 s (later than 20 requests: 1 s) the gateway answers
// 503 at once with Retry-After; after that each replica receives at most
// one probe per probe interval; 4 s after the replicas recover at least
// 98% is served.
func TestPoolThatFailsAsAWholeFailsFast(t *testing.T) {
	const (
		rate    = 20
		down    = 10 * time.Second
		up      = 30 * time.Second
		end     = 45 * time.Second
		fastBy  = 2 * time.Second // 20 requests take 1 s: the later is 2 s
		probeIv = DefaultPoolProbeInterval
	)
	s := runPoolSim(t, 3, rate, end, Config{}, func(_ int, at time.Duration) proxy.AttemptOutcome {
		if at >= down && at < up {
			return proxy.AttemptHTTP5xx
		}
		return proxy.AttemptSuccess
	})
	if g := servedShare(s.between(0, down)); g < 1 {
		t.Fatalf("served %.1f%% before the failure, want 100%%", 100*g)
	}
	firstShed := time.Duration(-1)
	for _, r := range s.between(down, up) {
		if r.shed {
			firstShed = r.at
			break
		}
	}
	t.Logf("replicas fail at %v; the first 503 at once at %v; failed as a whole %d of %d requests until recovery at %v",
		down, firstShed, len(s.between(down, up))-countAttempted(s.between(down, up)), len(s.between(down, up)), up)
	if firstShed < 0 || firstShed > down+fastBy {
		t.Fatalf("first 503 at once at %v, want by %v", firstShed, down+fastBy)
	}
	for _, r := range s.between(down+fastBy, up) {
		if r.attempts == 0 && (!r.shed || r.retryAfter <= 0) {
			t.Fatalf("request at %v: no attempt, yet no 503 with X-Circuit-Breaker: open and Retry-After (shed %v, retry after %v)", r.at, r.shed, r.retryAfter)
		}
	}
	for i, ts := range s.tries {
		var last time.Duration = -1
		n := 0
		for _, at := range ts {
			if at < down+fastBy || at >= up {
				continue
			}
			n++
			if last >= 0 && at-last < probeIv {
				t.Errorf("replica %d: attempts at %v and %v, less than one probe interval (%v) apart", i, last, at, probeIv)
			}
			last = at
		}
		t.Logf("replica %d: %d attempts in [%v, %v)", i, n, down+fastBy, up)
	}
	after := servedShare(s.between(up+4*time.Second, end))
	t.Logf("served %.1f%% from %v (4 s after recovery)", 100*after, up+4*time.Second)
	if after < 0.98 {
		t.Errorf("served %.1f%% from 4 s after recovery, want ≥ 98%%", 100*after)
	}
}

// The same failure with one replica still healthy: it serves, and the pool
// never counts as failed.
func TestPoolWithOneHealthyReplicaIsNotFailed(t *testing.T) {
	const down, end = 10 * time.Second, 40 * time.Second
	s := runPoolSim(t, 3, 20, end, Config{}, func(i int, at time.Duration) proxy.AttemptOutcome {
		if at >= down && i != 2 {
			return proxy.AttemptHTTP5xx
		}
		return proxy.AttemptSuccess
	})
	if len(s.failedAt) > 0 {
		t.Errorf("the pool counted as failed as a whole at %v, with a healthy replica", s.failedAt[0])
	}
	for _, r := range s.between(down, end) {
		if r.shed {
			t.Fatalf("request at %v answered 503 at once", r.at)
		}
	}
	// Discovery (the outliers' windows filling, within the retry
	// budget) takes a few seconds; after it the healthy one serves.
	const discovered = down + 5*time.Second
	during, after := servedShare(s.between(down, discovered)), servedShare(s.between(discovered, end))
	t.Logf("served %.1f%% in the %v of discovery, %.1f%% after, with one healthy replica of three", 100*during, discovered-down, 100*after)
	if after < 0.95 {
		t.Errorf("served %.1f%% after discovery with one healthy replica, want ≥ 95%%", 100*after)
	}
}

func countAttempted(rs []poolRun) int {
	n := 0
	for _, r := range rs {
		if r.attempts > 0 {
			n++
		}
	}
	return n
}

// poolFailEvents records PoolFailed calls.
type poolFailEvents struct {
	NopObserver
	mu     sync.Mutex
	events []string
}

func (o *poolFailEvents) PoolFailed(pool string, on bool, reason string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.events = append(o.events, fmt.Sprintf("%s %v %s", pool, on, reason))
}

// The pool-wide rule's two changes are reported once each, shown in the
// pool's status, and only a probe sent after the failure re-admits: an
// older attempt that ends well does not.
func TestPoolFailureReportedAndReadmittedByAProbeOnly(t *testing.T) {
	obs := &poolFailEvents{}
	clk := clocktest.New(simT0)
	reg := NewRegistry(obs)
	reg.UseClock(clk)
	addrs := []string{"10.29.8.1:8000", "10.29.8.2:8000"}
	p := startPool(t, reg, Config{Key: "failing", Static: targets(addrs...), Breaker: &breaker.Settings{}})
	// Both served: their failures are no dead server's.
	finish(mustPick(t, p, "", addrs[1]), proxy.AttemptSuccess)
	finish(mustPick(t, p, "", addrs[0]), proxy.AttemptSuccess)
	old := mustPick(t, p, "") // a stream from before the failure
	for i := range PoolFailWindow {
		clk.Advance(10 * time.Millisecond)
		up := mustPick(t, p, "", addrs[i%2])
		fail(up)
	}
	st := p.Status()
	if !st.Failed || st.Failures != 1 || len(obs.events) != 1 || !strings.HasPrefix(obs.events[0], "failing true 40 of its last 40 attempts, across 2 upstreams, failed") {
		t.Fatalf("after %d failures: status %+v, events %q", PoolFailWindow, st, obs.events)
	}
	var ue *proxy.UnavailableError
	if _, err := pickModel(p, ""); !errors.As(err, &ue) || !ue.CircuitOpen || ue.RetryAfter != DefaultPoolProbeInterval {
		t.Fatalf("pick in a failed pool: %v, want 503 circuit open, Retry-After %v", err, DefaultPoolProbeInterval)
	}
	finish(old, proxy.AttemptSuccess)
	if !p.Status().Failed {
		t.Fatal("an attempt sent before the failure re-admitted the pool")
	}
	clk.Advance(DefaultPoolProbeInterval)
	probe := mustPick(t, p, "")
	other := mustPick(t, p, "", probe.Addr) // one probe per upstream
	if other.Addr == probe.Addr {
		t.Fatalf("two probes of %s in one interval", probe.Addr)
	}
	if _, err := pickModel(p, "", addrs...); !errors.As(err, &ue) || !ue.CircuitOpen {
		t.Fatalf("a third attempt in one probe interval: %v", err)
	}
	fail(other)
	finish(probe, proxy.AttemptSuccess)
	if st := p.Status(); st.Failed || len(obs.events) != 2 || obs.events[1] != "failing false " {
		t.Fatalf("after a probe's success: status %+v, events %q", st, obs.events)
	}
	mustPick(t, p, "").Done(nil)
}
