package main

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// LatencyReport is S1 or S3: streamed requests to every target, interleaved
// in round-robin batches so that every target sees the same machine.
type LatencyReport struct {
	Config SuiteConfig `json:"config"`
	// Upstream says what the mock did on every request.
	Upstream string         `json:"upstream"`
	Started  time.Time      `json:"started"`
	Levels   []LatencyLevel `json:"levels"`
}

// LatencyLevel is one concurrency level of a latency scenario, one run of
// it: S3 measures its 100-stream level Runs times (run 1, 2, 3), each
// interleaving every target.
type LatencyLevel struct {
	Streams int             `json:"streams"`
	Run     int             `json:"run,omitempty"`
	Targets []LatencyTarget `json:"targets"`
}

// LatencyTarget is one target at one level. Added* are this target minus
// direct at the same percentile, in ms (negative values are noise).
type LatencyTarget struct {
	Name     string `json:"name"`
	Requests int64  `json:"requests"`
	Errors   int64  `json:"errors"`
	Example  string `json:"error_example,omitempty"`
	TTFT     Dist   `json:"ttft"`
	Gap      Dist   `json:"inter_event_gap"`

	AddedTTFTP50 float64 `json:"added_ttft_p50_ms"`
	AddedTTFTP99 float64 `json:"added_ttft_p99_ms"`
	AddedGapP99  float64 `json:"added_gap_p99_ms"`
	// TTFTSamples are the TTFTs in ms, sorted (for the CDF plots).
	TTFTSamples []float64 `json:"ttft_samples_ms,omitempty"`
	// CPUPerRequestUS is the target's process CPU time (user + system,
	// every thread, /proc/<pid>/task/*/schedstat) over the level's
	// measured requests, per request, in µs; AllocsPerRequest its Go heap
	// allocations (go_memstats_mallocs_total) per request. Absent when
	// unknown (direct; nginx has no allocation count). The targets are
	// idle outside their own batches, so the counters hold their own
	// requests (and a background scrape or probe now and then).
	CPUPerRequestUS  *float64 `json:"cpu_per_request_us,omitempty"`
	AllocsPerRequest *float64 `json:"allocs_per_request,omitempty"`
}

// latencyPlan is one level of a latency scenario: how many requests each
// target gets and in batches of how many.
type latencyPlan struct{ streams, requests, batch, run int }

// latencyPlans returns the levels of S1 or S3 (override: "1,100" keeps
// the scenario's request counts per level where it has them).
func latencyPlans(cfg *SuiteConfig) ([]latencyPlan, error) {
	var plans []latencyPlan
	switch {
	case cfg.Scenario == ScenarioS1 && cfg.Smoke:
		plans = []latencyPlan{{1, 40, 10, 0}}
	case cfg.Scenario == ScenarioS1:
		plans = []latencyPlan{{1, 2000, 100, 0}}
	case cfg.Smoke:
		plans = []latencyPlan{{1, 6, 3, 0}, {100, 200, 100, 0}}
	default:
		// c=1: 100 requests of ~0.2 s per target; c=100: 2,000 per target
		// in batches of 200 (~0.5 s): with five targets a target waits
		// ~2 s between its batches, well inside every proxy's keep-alive
		// (llm_proxy drops idle upstream connections after 4 s, uvicorn
		// after 5 s). Batches of 400 left ~4.4 s, so llm_proxy re-dialled
		// every upstream connection at the start of each batch and the
		// others did not: a keep-alive artifact, not a per-request cost.
		plans = []latencyPlan{{1, 100, 20, 0}, {100, 2000, 200, 0}}
	}
	if cfg.Scenario == ScenarioS3 && cfg.Runs > 1 {
		// The 100-stream level Runs times (issue 22: the median of three
		// interleaved runs), each run after the one before.
		var out []latencyPlan
		for _, p := range plans {
			if p.streams != 100 {
				out = append(out, p)
				continue
			}
			for r := 1; r <= cfg.Runs; r++ {
				p.run = r
				out = append(out, p)
			}
		}
		plans = out
	}
	if cfg.Levels == "" {
		return plans, nil
	}
	levels, err := parseLevels(cfg.Levels)
	if err != nil {
		return nil, err
	}
	var out []latencyPlan
	for _, l := range levels {
		p := latencyPlan{l, max(200, 10*l), max(10, 2*l), 0}
		for _, q := range plans {
			if q.streams == l {
				p = q
			}
		}
		out = append(out, p)
	}
	return out, nil
}

func runLatencyScenario(ctx context.Context, cfg *SuiteConfig) (*LatencyReport, error) {
	plans, err := latencyPlans(cfg)
	if err != nil {
		return nil, err
	}
	// S1: the floor, no delay anywhere in the mock. S3: a stream of 10
	// events 20 ms apart after a 20 ms TTFT (issue 12's setup).
	ttft, tokens, interval := time.Duration(0), 1, time.Duration(0)
	if cfg.Scenario == ScenarioS3 {
		ttft, tokens, interval = 20*time.Millisecond, 10, 20*time.Millisecond
	}
	rep := &LatencyReport{Config: *cfg, Started: time.Now(),
		Upstream: fmt.Sprintf("mock TTFT %s, %d tokens %s apart (chat chunks: role, tokens, [DONE])", ttft, tokens, interval)}
	maxLevel := 0
	for _, p := range plans {
		maxLevel = max(maxLevel, p.streams)
	}
	reqs := map[string]*Requester{}
	var order []string
	for _, t := range cfg.Targets {
		h := mockHeaders(ttft, tokens, interval)
		for k, v := range cfg.Header {
			h[k] = v
		}
		reqs[t.Name] = &Requester{
			Client:  newHTTPClient(maxLevel),
			URL:     t.URL + "/v1/chat/completions",
			Body:    chatBody("mock-llama", true, 0, 0),
			Header:  h,
			Timeout: cfg.Timeout,
		}
		order = append(order, t.Name)
	}
	for _, p := range plans {
		if ctx.Err() != nil {
			break
		}
		run := ""
		if p.run > 0 {
			run = fmt.Sprintf(" (run %d of %d)", p.run, cfg.Runs)
		}
		suiteLog("%s: %d streams%s, %d requests per target in batches of %d", cfg.Scenario, p.streams, run, p.requests, p.batch)
		lvl := measureLatencyLevel(ctx, reqs, order, p, cfg.Scenario == ScenarioS3, cfg.Targets)
		lvl.Run = p.run
		rep.Levels = append(rep.Levels, lvl)
	}
	return rep, nil
}

// costCounters are a target process's cumulative CPU time and heap
// allocations at one moment (ok false: unknown).
type costCounters struct {
	cpuNS, mallocs   float64
	cpuOK, mallocsOK bool
}

// readCosts samples t's counters: CPU from schedstat over its process tree,
// allocations from its metrics endpoint.
func readCosts(ctx context.Context, t SuiteTarget) costCounters {
	var c costCounters
	if t.PID > 0 {
		if ns, err := treeCPUNanos(t.PID); err == nil {
			c.cpuNS, c.cpuOK = float64(ns), true
		}
	}
	if t.MetricsURL != "" {
		sc, err := scrapeMetrics(ctx, http.DefaultClient, t.MetricsURL, "go_memstats_mallocs_total")
		if err == nil {
			for _, s := range sc {
				if s.Name == "go_memstats_mallocs_total" {
					c.mallocs, c.mallocsOK = s.Value, true
				}
			}
		}
	}
	return c
}

// measureLatencyLevel warms every target up, then sends p.requests to each
// in batches, rotating which target goes first in each round so that drift
// in machine load spreads over all of them. With keep, TTFT samples are kept
// for plots.
func measureLatencyLevel(ctx context.Context, reqs map[string]*Requester, order []string, p latencyPlan, keep bool, targets []SuiteTarget) LatencyLevel {
	before := map[string]costCounters{}
	accs := interleaved(ctx, reqs, order, p.streams, p.requests, max(p.batch, p.streams), func() {
		for _, t := range targets {
			before[t.Name] = readCosts(ctx, t)
		}
	})
	after := map[string]costCounters{}
	for _, t := range targets {
		after[t.Name] = readCosts(ctx, t)
	}

	lvl := LatencyLevel{Streams: p.streams}
	for _, name := range order {
		a := accs[name]
		t := LatencyTarget{Name: name, Requests: a.n, Errors: a.errs, Example: a.example,
			TTFT: a.ttft.Dist(), Gap: a.gaps.Dist()}
		if b, e := before[name], after[name]; a.n > 0 {
			if b.cpuOK && e.cpuOK && e.cpuNS >= b.cpuNS {
				v := (e.cpuNS - b.cpuNS) / 1e3 / float64(a.n)
				t.CPUPerRequestUS = &v
			}
			if b.mallocsOK && e.mallocsOK && e.mallocs >= b.mallocs {
				v := (e.mallocs - b.mallocs) / float64(a.n)
				t.AllocsPerRequest = &v
			}
		}
		if keep {
			for _, v := range a.ttft.vals {
				t.TTFTSamples = append(t.TTFTSamples, ms(v))
			}
			slices.Sort(t.TTFTSamples)
		}
		lvl.Targets = append(lvl.Targets, t)
	}
	base := lvl.Targets[0] // direct
	for i := range lvl.Targets {
		t := &lvl.Targets[i]
		t.AddedTTFTP50 = t.TTFT.P50 - base.TTFT.P50
		t.AddedTTFTP99 = t.TTFT.P99 - base.TTFT.P99
		t.AddedGapP99 = t.Gap.P99 - base.Gap.P99
	}
	return lvl
}

// target returns the named target's result, nil when absent.
func (l *LatencyLevel) target(name string) *LatencyTarget {
	for i := range l.Targets {
		if l.Targets[i].Name == name {
			return &l.Targets[i]
		}
	}
	return nil
}

// runs returns every run of the level with that many streams, in order.
func (r *LatencyReport) runs(streams int) []*LatencyLevel {
	if r == nil {
		return nil
	}
	var out []*LatencyLevel
	for i := range r.Levels {
		if r.Levels[i].Streams == streams {
			out = append(out, &r.Levels[i])
		}
	}
	return out
}

// level returns the (first run of the) level with that many streams, nil
// when absent.
func (r *LatencyReport) level(streams int) *LatencyLevel {
	if r == nil {
		return nil
	}
	for i := range r.Levels {
		if r.Levels[i].Streams == streams {
			return &r.Levels[i]
		}
	}
	return nil
}

// fmtLevels is "1 and 100".
func fmtLevels(ls []int) string {
	s := make([]string, len(ls))
	for i, l := range ls {
		s[i] = strconv.Itoa(l)
	}
	return strings.Join(s, ", ")
}
