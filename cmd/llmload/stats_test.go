package main

import (
	"testing"
	"time"
)

func TestPercentileNearestRank(t *testing.T) {
	ms := time.Millisecond
	hundred := make([]time.Duration, 100)
	for i := range hundred {
		hundred[i] = time.Duration(100-i) * ms // 100ms .. 1ms, unsorted
	}
	tests := []struct {
		name string
		vals []time.Duration
		p    float64
		want time.Duration
	}{
		{"empty is zero", nil, 50, 0},
		{"single sample is every percentile", []time.Duration{7 * ms}, 99.9, 7 * ms},
		{"p50 of 1..100", hundred, 50, 50 * ms},
		{"p99 of 1..100", hundred, 99, 99 * ms},
		{"p99.9 of 1..100 is the max", hundred, 99.9, 100 * ms},
		{"p100 is the max", hundred, 100, 100 * ms},
		{"tiny p is the min", hundred, 0.001, 1 * ms},
		{"p50 of two is the lower", []time.Duration{2 * ms, 1 * ms}, 50, 1 * ms},
		{"p51 of two is the upper", []time.Duration{2 * ms, 1 * ms}, 51, 2 * ms},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var s Samples
			for _, v := range tt.vals {
				s.Add(v)
			}
			if got := s.Percentile(tt.p); got != tt.want {
				t.Errorf("Percentile(%v) = %v, want %v", tt.p, got, tt.want)
			}
		})
	}
}

func TestSamplesAddAfterPercentileResorts(t *testing.T) {
	var s Samples
	s.Add(3)
	s.Add(1)
	if got := s.Percentile(100); got != 3 {
		t.Fatalf("max = %v, want 3", got)
	}
	s.Add(9)
	if got := s.Percentile(100); got != 9 {
		t.Fatalf("max after Add = %v, want 9", got)
	}
}

func TestSamplesCapKeepsMemoryBoundedAndStatsExact(t *testing.T) {
	s := Samples{Cap: 1000}
	for i := 1; i <= 100_000; i++ {
		s.Add(time.Duration(i))
	}
	if len(s.vals) != 1000 {
		t.Fatalf("kept %d samples, want 1000", len(s.vals))
	}
	if s.Count() != 100_000 || s.Max() != 100_000 || s.Mean() != 50_000 {
		t.Fatalf("count/max/mean = %d/%v/%v, want exact 100000/100000/50000", s.Count(), s.Max(), s.Mean())
	}
	// A uniform reservoir: the median lands near the true one.
	if p50 := s.Percentile(50); p50 < 45_000 || p50 > 55_000 {
		t.Fatalf("reservoir p50 = %v, want about 50000", p50)
	}
}

func TestCollectorSummarizesOutcomesAndUpstreams(t *testing.T) {
	c := NewCollector(0)
	add := func(up, outcome string, ttft time.Duration, gaps ...time.Duration) {
		r := Result{Upstream: up, Outcome: outcome, TTFT: ttft, HasTTFT: ttft > 0, Gaps: gaps, Events: 1 + len(gaps), Bytes: 10}
		c.Add(&r)
	}
	add("a", OutcomeOK, 10*time.Millisecond, time.Millisecond, 2*time.Millisecond)
	add("a", OutcomeOK, 30*time.Millisecond)
	add("b", "http_503", 0)
	add("", OutcomeTruncated, 20*time.Millisecond, 3*time.Millisecond)

	s := c.Summary()
	if s.Requests != 4 || s.OK != 2 {
		t.Fatalf("requests/ok = %d/%d, want 4/2", s.Requests, s.OK)
	}
	if s.Outcomes[OutcomeOK] != 2 || s.Outcomes["http_503"] != 1 || s.Outcomes[OutcomeTruncated] != 1 {
		t.Fatalf("outcomes = %v", s.Outcomes)
	}
	if s.TTFT.Count != 3 || s.TTFT.P50 != 20 || s.TTFT.Max != 30 {
		t.Fatalf("ttft = %+v, want 3 samples, p50 20ms, max 30ms", s.TTFT)
	}
	if s.Gap.Count != 3 || s.Gap.P99 != 3 {
		t.Fatalf("gap = %+v, want 3 samples, p99 3ms", s.Gap)
	}
	if s.Events != 7 || s.Bytes != 40 {
		t.Fatalf("events/bytes = %d/%d, want 7/40", s.Events, s.Bytes)
	}
	want := []UpstreamSummary{
		{Upstream: "(none)", Requests: 1},
		{Upstream: "a", Requests: 2, OK: 2},
		{Upstream: "b", Requests: 1},
	}
	if len(s.Upstreams) != len(want) {
		t.Fatalf("upstreams = %+v", s.Upstreams)
	}
	for i, w := range want {
		g := s.Upstreams[i]
		if g.Upstream != w.Upstream || g.Requests != w.Requests || g.OK != w.OK {
			t.Errorf("upstream %d = %+v, want %+v", i, g, w)
		}
	}
	if s.Upstreams[1].TTFT.P50 != 10 {
		t.Errorf("upstream a ttft p50 = %v, want 10", s.Upstreams[1].TTFT.P50)
	}
	done, okRatio, p50, p99 := c.Progress()
	if done != 4 || okRatio != 0.5 || p50 != 20*time.Millisecond || p99 != 30*time.Millisecond {
		t.Errorf("progress = %d %v %v %v", done, okRatio, p50, p99)
	}
}
