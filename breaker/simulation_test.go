package breaker_test

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/breaker/breakertest"
)

// The outage discovery simulation (issue 10, docs/benchmarks.md): a fleet
// of gateway instances, each with its own breaker for one upstream
// (ConsecutiveFailures 3), takes requests at a steady rate, each arriving
// at an instance drawn at random. The upstream goes down: from then on
// every attempt fails (connection refused: hard evidence, breaker.Down)
// after a fixed latency, so some attempts are in
// flight when a breaker opens. The simulation counts the user requests that
// reach the down upstream before every instance excludes it, with the trip
// counts shared by the fleet (SharedMemory), with only the verdicts shared
// (one MemoryStore: an instance adopts the open state at its next
// failure), and with nothing shared. Everything runs on the fake clock with
// a seeded generator, so the table is the same on every run:
//
//	go test -run TestOutageDiscoverySimulation -v ./breaker/
const (
	simThreshold = 3                     // ConsecutiveFailures
	simInterval  = 2 * time.Millisecond  // fleet-wide arrivals: 500 requests/s
	simLatency   = 20 * time.Millisecond // every attempt ends after this
	simWarmup    = time.Second           // of successes before the outage
	simLimit     = 8 * time.Second       // the outage is discovered well within the 10s cooldown
	simSeeds     = 20
)

type simMode int

const (
	simFleet    simMode = iota // SharedMemory: counts and verdicts shared
	simVerdicts                // one MemoryStore: verdicts shared
	simNone                    // nothing shared
)

var simModeNames = [...]string{"fleet counts (SharedMemory)", "verdicts only (MemoryStore)", "no sharing"}

type simResult struct {
	reached  int           // attempts started on the down upstream until every instance excluded it
	inflight int           // of them, still in flight at that moment
	took     time.Duration // from the outage until every instance excluded it
}

// simAttempt is an attempt in flight.
type simAttempt struct {
	p    breaker.Permit
	ends time.Duration // since the start
	down bool          // started after the outage
}

func simulate(t *testing.T, instances int, mode simMode, seed uint64) simResult {
	t.Helper()
	clk := newClock()
	rng := rand.New(rand.NewPCG(seed, uint64(instances)))
	s := breaker.Settings{ConsecutiveFailures: simThreshold}
	var sm *breakertest.SharedMemory
	var ms *breaker.MemoryStore
	switch mode {
	case simFleet:
		sm = breakertest.NewSharedMemory(clk, 1)
	case simVerdicts:
		ms = breaker.NewMemoryStore()
	}
	bs := make([]*breaker.Breaker, instances)
	for i := range bs {
		opts := []breaker.Option{breaker.WithClock(clk), noJitter}
		switch mode {
		case simFleet:
			opts = append(opts, breaker.WithStore(sm.Instance(fmt.Sprintf("gw%d", i))))
		case simVerdicts:
			opts = append(opts, breaker.WithStore(ms))
		}
		bs[i] = breaker.New("upstream", s, opts...)
	}
	excluded := func() bool {
		for _, b := range bs {
			if b.State() != breaker.Open {
				return false
			}
		}
		return true
	}

	var r simResult
	var queue []simAttempt // in flight, by end time (the latency is fixed)
	next := time.Duration(0)
	for {
		// The next event: an attempt ends (first on a tie), or a request
		// arrives.
		if len(queue) > 0 && queue[0].ends <= next {
			a := queue[0]
			queue = queue[1:]
			clk.Advance(a.ends - clk.Elapsed())
			if a.down {
				a.p.Done(breaker.Down, 0, "connection refused")
			} else {
				a.p.Done(breaker.Success, 300*time.Millisecond, "")
			}
			if excluded() {
				for _, q := range queue {
					if q.down {
						r.inflight++
					}
				}
				r.took = clk.Elapsed() - simWarmup
				return r
			}
			continue
		}
		clk.Advance(next - clk.Elapsed())
		down := next >= simWarmup
		if !down && next+simLatency > simWarmup {
			// The last successes end before the outage, so that none
			// resets a run of failures.
			next = simWarmup
			continue
		}
		if down && next-simWarmup > simLimit {
			t.Fatalf("%d instances, %s, seed %d: not every instance excluded the upstream after %s", instances, simModeNames[mode], seed, simLimit)
		}
		if p, ok := bs[rng.IntN(instances)].Allow(); ok {
			if down {
				r.reached++
			}
			queue = append(queue, simAttempt{p: p, ends: next + simLatency, down: down})
		}
		next += simInterval
	}
}

// simStats summarizes one cell of the table over the seeds.
type simStats struct{ mean, max float64 }

func (s simStats) String() string { return fmt.Sprintf("%.1f (%.0f)", s.mean, s.max) }

func TestOutageDiscoverySimulation(t *testing.T) {
	sizes := []int{1, 10, 100}
	var table strings.Builder
	fmt.Fprintf(&table, "| instances | %s | threshold + in flight at the fleet's open | %s | %s | every instance excludes it after (fleet / none) |\n",
		simModeNames[simFleet], simModeNames[simVerdicts], simModeNames[simNone])
	table.WriteString("|---:|---:|---:|---:|---:|---:|\n")
	for _, n := range sizes {
		var cell [3]simStats
		var bound simStats
		var took [3]time.Duration
		for seed := uint64(1); seed <= simSeeds; seed++ {
			var rs [3]simResult
			for m := range rs {
				rs[m] = simulate(t, n, simMode(m), seed)
				v := float64(rs[m].reached)
				cell[m].mean += v / simSeeds
				cell[m].max = max(cell[m].max, v)
				took[m] += rs[m].took / simSeeds
			}
			f := rs[simFleet]
			b := float64(simThreshold + f.inflight)
			bound.mean += b / simSeeds
			bound.max = max(bound.max, b)
			// Shared: the fleet's threshold plus what was in flight when
			// the fleet opened, at every size.
			if f.reached > simThreshold+f.inflight {
				t.Errorf("%d instances, seed %d: %d requests reached the down upstream with fleet counts, want ≤ %d + %d in flight",
					n, seed, f.reached, simThreshold, f.inflight)
			}
			// Not shared: every instance needs its own threshold.
			if got := rs[simNone].reached; got < simThreshold*n {
				t.Errorf("%d instances, seed %d: %d requests reached it without sharing, want ≥ %d", n, seed, got, simThreshold*n)
			}
			// Verdicts only: every instance needs at least one failure
			// of its own to learn of the verdict.
			if got := rs[simVerdicts].reached; got < n {
				t.Errorf("%d instances, seed %d: %d requests reached it with verdicts shared, want ≥ %d", n, seed, got, n)
			}
		}
		if n >= 10 && cell[simNone].mean < float64(n)*cell[simFleet].mean/10 {
			t.Errorf("%d instances: no sharing %.1f is not growing with the fleet (fleet counts %.1f)", n, cell[simNone].mean, cell[simFleet].mean)
		}
		fmt.Fprintf(&table, "| %d | %s | %s | %s | %s | %s / %s |\n", n, cell[simFleet], bound, cell[simVerdicts], cell[simNone],
			took[simFleet].Round(time.Millisecond), took[simNone].Round(time.Millisecond))
	}
	t.Logf("requests that reach the down upstream before every instance excludes it: mean (max) over %d seeds;\n"+
		"consecutive_failures %d, %s fleet-wide arrivals (%.0f/s) at a random instance, every attempt fails after %s\n\n%s",
		simSeeds, simThreshold, simInterval, float64(time.Second)/float64(simInterval), simLatency, table.String())
}
