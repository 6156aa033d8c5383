package main

import (
	"maps"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"sync"
	"time"
)

// DefaultSampleCap bounds the samples one Samples keeps.
const DefaultSampleCap = 1 << 20

// Samples collects durations for exact percentiles. Up to its cap it keeps
// every sample; beyond, it keeps a uniform random subset of cap samples
// (reservoir sampling), so memory stays bounded and percentiles stay
// unbiased. The zero value keeps DefaultSampleCap samples. Not safe for
// concurrent use.
type Samples struct {
	// Cap is the most samples kept; 0 means DefaultSampleCap.
	Cap    int
	vals   []time.Duration
	n      int64 // samples offered
	max    time.Duration
	sum    time.Duration
	sorted bool
	rng    *rand.Rand
}

// Add records one sample.
func (s *Samples) Add(d time.Duration) {
	s.n++
	s.sum += d
	if d > s.max || s.n == 1 {
		s.max = d
	}
	limit := s.Cap
	if limit <= 0 {
		limit = DefaultSampleCap
	}
	if len(s.vals) < limit {
		s.vals = append(s.vals, d)
		s.sorted = false
		return
	}
	if s.rng == nil {
		s.rng = rand.New(rand.NewPCG(1, 2))
	}
	if j := s.rng.Int64N(s.n); j < int64(limit) {
		s.vals[j] = d
		s.sorted = false
	}
}

// Count returns the number of samples offered, kept or not.
func (s *Samples) Count() int64 { return s.n }

// Max returns the largest sample offered.
func (s *Samples) Max() time.Duration { return s.max }

// Mean returns the mean of all samples offered.
func (s *Samples) Mean() time.Duration {
	if s.n == 0 {
		return 0
	}
	return s.sum / time.Duration(s.n)
}

// Percentile returns the p-th percentile (0 < p <= 100) of the kept
// samples by the nearest-rank method: the smallest sample such that at
// least p% of the samples are less than or equal to it. It returns 0 when
// there are no samples.
func (s *Samples) Percentile(p float64) time.Duration {
	if len(s.vals) == 0 {
		return 0
	}
	if !s.sorted {
		slices.Sort(s.vals)
		s.sorted = true
	}
	return nearestRank(s.vals, p)
}

// nearestRank returns the p-th percentile of sorted values.
func nearestRank(sorted []time.Duration, p float64) time.Duration {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	rank := int(math.Ceil(p / 100 * float64(n)))
	rank = min(max(rank, 1), n)
	return sorted[rank-1]
}

// Dist is a summary of a distribution, in JSON as milliseconds.
type Dist struct {
	Count int64   `json:"count"`
	Mean  float64 `json:"mean_ms"`
	P50   float64 `json:"p50_ms"`
	P90   float64 `json:"p90_ms"`
	P99   float64 `json:"p99_ms"`
	P999  float64 `json:"p99_9_ms"`
	Max   float64 `json:"max_ms"`
}

// Dist summarizes the samples.
func (s *Samples) Dist() Dist {
	return Dist{
		Count: s.n,
		Mean:  ms(s.Mean()),
		P50:   ms(s.Percentile(50)),
		P90:   ms(s.Percentile(90)),
		P99:   ms(s.Percentile(99)),
		P999:  ms(s.Percentile(99.9)),
		Max:   ms(s.max),
	}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// recentWindow is how many of the latest TTFTs the progress line uses.
const recentWindow = 1024

// Collector aggregates Results; safe for concurrent use.
type Collector struct {
	mu         sync.Mutex
	outcomes   map[string]int64
	details    map[string]string // outcome -> one example detail
	ttft       Samples
	gaps       Samples
	total      Samples
	byUpstream map[string]*upstreamStats
	events     int64
	bytes      int64
	recent     []time.Duration // ring of the latest TTFTs
	recentNext int
	done       int64
	ok         int64
}

type upstreamStats struct {
	requests int64
	ok       int64
	ttft     Samples
}

// NewCollector returns an empty Collector whose sample sets keep at most
// sampleCap samples each (0: DefaultSampleCap).
func NewCollector(sampleCap int) *Collector {
	c := &Collector{
		outcomes:   map[string]int64{},
		details:    map[string]string{},
		byUpstream: map[string]*upstreamStats{},
	}
	c.ttft.Cap, c.gaps.Cap, c.total.Cap = sampleCap, sampleCap, sampleCap
	return c
}

// Add records one result.
func (c *Collector) Add(r *Result) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.done++
	c.outcomes[r.Outcome]++
	if r.Detail != "" && c.details[r.Outcome] == "" {
		c.details[r.Outcome] = r.Detail
	}
	if r.OK() {
		c.ok++
	}
	c.events += int64(r.Events)
	c.bytes += r.Bytes
	if r.OK() {
		c.total.Add(r.Total)
	}
	for _, g := range r.Gaps {
		c.gaps.Add(g)
	}
	up := r.Upstream
	if up == "" {
		up = "(none)"
	}
	u := c.byUpstream[up]
	if u == nil {
		u = &upstreamStats{}
		u.ttft.Cap = c.ttft.Cap
		c.byUpstream[up] = u
	}
	u.requests++
	if r.OK() {
		u.ok++
	}
	if r.HasTTFT {
		c.ttft.Add(r.TTFT)
		u.ttft.Add(r.TTFT)
		if len(c.recent) < recentWindow {
			c.recent = append(c.recent, r.TTFT)
		} else {
			c.recent[c.recentNext] = r.TTFT
			c.recentNext = (c.recentNext + 1) % recentWindow
		}
	}
}

// Progress returns the requests done, the share that were ok, and the p50
// and p99 TTFT of the latest results.
func (c *Collector) Progress() (done int64, okRatio float64, p50, p99 time.Duration) {
	c.mu.Lock()
	done, ok := c.done, c.ok
	recent := slices.Clone(c.recent)
	c.mu.Unlock()
	if done > 0 {
		okRatio = float64(ok) / float64(done)
	}
	slices.Sort(recent)
	return done, okRatio, nearestRank(recent, 50), nearestRank(recent, 99)
}

// UpstreamSummary is the per-upstream part of a Summary.
type UpstreamSummary struct {
	Upstream string `json:"upstream"`
	Requests int64  `json:"requests"`
	OK       int64  `json:"ok"`
	TTFT     Dist   `json:"ttft"`
}

// Summary is the aggregate of a run.
type Summary struct {
	Requests int64             `json:"requests"`
	OK       int64             `json:"ok"`
	Outcomes map[string]int64  `json:"outcomes"`
	Examples map[string]string `json:"outcome_examples,omitempty"`
	TTFT     Dist              `json:"ttft"`
	Gap      Dist              `json:"inter_event_gap"`
	Total    Dist              `json:"total_duration_ok"` // of ok requests
	Events   int64             `json:"events"`
	Bytes    int64             `json:"bytes"`
	// Upstreams is sorted by upstream name.
	Upstreams []UpstreamSummary `json:"upstreams"`
}

// Summary returns the aggregate so far.
func (c *Collector) Summary() Summary {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := Summary{
		Requests: c.done,
		OK:       c.ok,
		Outcomes: maps.Clone(c.outcomes),
		Examples: maps.Clone(c.details),
		TTFT:     c.ttft.Dist(),
		Gap:      c.gaps.Dist(),
		Total:    c.total.Dist(),
		Events:   c.events,
		Bytes:    c.bytes,
	}
	for name, u := range c.byUpstream {
		s.Upstreams = append(s.Upstreams, UpstreamSummary{
			Upstream: name, Requests: u.requests, OK: u.ok, TTFT: u.ttft.Dist(),
		})
	}
	sort.Slice(s.Upstreams, func(i, j int) bool { return s.Upstreams[i].Upstream < s.Upstreams[j].Upstream })
	return s
}
