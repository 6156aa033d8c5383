package upstream

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// The partial-outage simulation (issue 19): a pool at its defaults (no
// breaker block: breaker.Settings{}, Ejection{}, the default retry budget)
// takes an open-loop stream of requests on a fake clock; each attempt
// fails or succeeds at once as the scenario says, and a failed request is
// retried as proxy/attempt.go does (max_attempts 3, the budget asked only
// when an upstream is picked). It reports goodput (requests served) and
// amplification (attempts per request).
//
//	go test -run TestPartialOutageSimulation -v ./upstream/

var simT0 = time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)

const (
	simRate        = 30 // requests per second, open loop
	simDuration    = 120 * time.Second
	simMaxAttempts = 3
	simSettle      = 10 * time.Second // "after discovery": from here on
)

// simOutcome decides an attempt on upstream i at time t.
type simOutcome func(rng *rand.Rand, i int, t time.Duration) proxy.AttemptOutcome

type simResult struct {
	requests, served, attempts int
	// late* count from simSettle on.
	lateRequests, lateServed, lateAttempts int
	// perUpstream counts the attempts on each upstream from simSettle on.
	perUpstream []int
	// ok says, per request in arrival order (one every 1/simRate), whether
	// it was served.
	ok []bool
}

// servedBetween is the share of the requests that arrived in [from, to)
// that were served.
func (r simResult) servedBetween(from, to time.Duration) float64 {
	i, j := int(from*simRate/time.Second), min(int(to*simRate/time.Second), len(r.ok))
	n := 0
	for _, ok := range r.ok[i:j] {
		if ok {
			n++
		}
	}
	return float64(n) / float64(j-i)
}

func (r simResult) goodput() float64 { return float64(r.served) / float64(r.requests) }
func (r simResult) amplification() float64 {
	return float64(r.attempts) / float64(r.requests)
}

func runOutageSim(t *testing.T, n int, seed uint64, outcome simOutcome) simResult {
	t.Helper()
	clk := clocktest.New(simT0)
	reg := NewRegistry(nil)
	reg.UseClock(clk)
	reg.breakerOpts = append(reg.breakerOpts, breaker.WithRand(rand.New(rand.NewPCG(seed, 7)).Float64))
	addrs := make([]string, n)
	index := map[string]int{}
	for i := range addrs {
		addrs[i] = fmt.Sprintf("10.19.%d.%d:8000", seed%200, i+1)
		index[addrs[i]] = i
	}
	p := startPool(t, reg, Config{Key: fmt.Sprintf("sim-%d-%d", n, seed), Static: targets(addrs...), Breaker: &breaker.Settings{}})
	rng := rand.New(rand.NewPCG(seed, uint64(n)))
	res := simResult{perUpstream: make([]int, n)}
	retries := p.Retries()
	peek := retries.(proxy.RetryPeeker)
	step := time.Second / simRate
	for clk.Elapsed() < simDuration {
		late := clk.Elapsed() >= simSettle
		res.requests++
		if late {
			res.lateRequests++
		}
		retries.Request()
		var tried []string
		served := false
		up, err := pickModel(p, "", tried...)
		for attempt := 1; err == nil; attempt++ {
			i := index[up.Addr]
			res.attempts++
			if late {
				res.lateAttempts++
				res.perUpstream[i]++
			}
			tried = append(tried, up.Addr)
			o := outcome(rng, i, clk.Elapsed())
			rep := &proxy.AttemptReport{Upstream: up.Addr, Outcome: o}
			if o == proxy.AttemptSuccess {
				rep.TTFT = 100 * time.Millisecond
				up.Committed(rep.TTFT)
			} else if o == proxy.AttemptHTTP5xx {
				rep.Status = 503
			}
			up.Done(rep)
			if o == proxy.AttemptSuccess {
				served = true
				break
			}
			if attempt >= simMaxAttempts || !peek.RetryAvailable() {
				break
			}
			if up, err = pickModel(p, "", tried...); err != nil {
				break
			}
			if !retries.TryRetry() {
				up.Done(nil)
				break
			}
		}
		res.ok = append(res.ok, served)
		if served {
			res.served++
			if late {
				res.lateServed++
			}
		}
		clk.Advance(step)
	}
	return res
}

// uniform fails every attempt with probability p (a 503).
func uniform(p float64) simOutcome {
	return func(rng *rand.Rand, _ int, _ time.Duration) proxy.AttemptOutcome {
		if rng.Float64() < p {
			return proxy.AttemptHTTP5xx
		}
		return proxy.AttemptSuccess
	}
}

// budgetBound is what the default retry budget lets through over the run:
// 0.1 × requests + 3 + 3 per second.
func budgetBound(requests int) float64 {
	return 0.1*float64(requests) + 3 + 3*simDuration.Seconds()
}

// At every uniform failure rate the pool serves at least what one upstream
// serves alone (1 − p), less 5 points, and never amplifies past the retry
// budget.
func TestPartialOutageSimulation(t *testing.T) {
	var table strings.Builder
	table.WriteString("| p | N | served | attempts/request | bound |\n|---:|---:|---:|---:|---:|\n")
	for _, prob := range []float64{0.1, 0.25, 0.5, 0.75, 0.9, 1.0} {
		for _, n := range []int{1, 3, 10} {
			r := runOutageSim(t, n, uint64(1000*prob)+uint64(n), uniform(prob))
			bound := float64(r.requests) + budgetBound(r.requests)
			fmt.Fprintf(&table, "| %.2f | %d | %.1f%% | %.2f | %.2f |\n", prob, n, 100*r.goodput(), r.amplification(), bound/float64(r.requests))
			if g := r.goodput(); g < 1-prob-0.05 {
				t.Errorf("p=%.2f N=%d: served %.1f%%, want ≥ %.1f%%", prob, n, 100*g, 100*(1-prob-0.05))
			}
			if float64(r.attempts) > bound {
				t.Errorf("p=%.2f N=%d: %d attempts for %d requests, over the budget's bound %.0f", prob, n, r.attempts, r.requests, bound)
			}
		}
	}
	t.Logf("uniform failure, %d requests/s for %s, defaults:\n%s", simRate, simDuration, table.String())
}

// One upstream of N refuses connections: after discovery it receives only
// probes, and users see at least 99% served.
func TestSimulationOneDeadUpstream(t *testing.T) {
	for _, n := range []int{3, 10} {
		r := runOutageSim(t, n, uint64(n), func(_ *rand.Rand, i int, _ time.Duration) proxy.AttemptOutcome {
			if i == 0 {
				return proxy.AttemptConnectError
			}
			return proxy.AttemptSuccess
		})
		t.Logf("N=%d: served %.2f%%, %.3f attempts/request, %d attempts on the dead one after %s",
			n, 100*r.goodput(), r.amplification(), r.perUpstream[0], simSettle)
		if g := r.goodput(); g < 0.99 {
			t.Errorf("N=%d: served %.2f%%, want ≥ 99%%", n, 100*g)
		}
		// Probes only: one per half-open, the cooldown doubling from 10s
		// (10, 20, 40, 80s): a handful over the run.
		if r.perUpstream[0] > 6 {
			t.Errorf("N=%d: the dead upstream got %d attempts after discovery, want only probes (≤ 6)", n, r.perUpstream[0])
		}
	}
}

// Every upstream refuses connections, or holds every request until the
// first-byte timeout: the pool fails fast after discovery, at most 0.2
// attempts per request.
func TestSimulationEveryUpstreamDeadOrHanging(t *testing.T) {
	for _, o := range []proxy.AttemptOutcome{proxy.AttemptConnectError, proxy.AttemptFirstByteTimeout} {
		for _, n := range []int{1, 3, 10} {
			r := runOutageSim(t, n, uint64(n)+7, func(*rand.Rand, int, time.Duration) proxy.AttemptOutcome { return o })
			per := float64(r.lateAttempts) / float64(r.lateRequests)
			t.Logf("%s, N=%d: %.3f attempts/request after %s (%d attempts in all)", o, n, per, simSettle, r.attempts)
			if per > 0.2 {
				t.Errorf("%s, N=%d: %.3f attempts per request after discovery, want ≤ 0.2", o, n, per)
			}
		}
	}
}

// A pool at 50% uniform failure that recovers: nearly everything is served
// again within 4 seconds.
func TestSimulationRecoversWithinSeconds(t *testing.T) {
	const recovered = 60 * time.Second
	for _, n := range []int{1, 3} {
		r := runOutageSim(t, n, uint64(n)+11, func(rng *rand.Rand, _ int, at time.Duration) proxy.AttemptOutcome {
			if at < recovered && rng.Float64() < 0.5 {
				return proxy.AttemptHTTP5xx
			}
			return proxy.AttemptSuccess
		})
		during := r.servedBetween(simSettle, recovered)
		after := r.servedBetween(recovered+4*time.Second, simDuration)
		t.Logf("N=%d: %.1f%% served at 50%% failure, %.1f%% from 4s after recovery", n, 100*during, 100*after)
		if during < 0.45 || after < 0.98 {
			t.Errorf("N=%d: served %.1f%% during (want ≥ 45%%), %.1f%% from 4s after (want ≥ 98%%)", n, 100*during, 100*after)
		}
	}
}
