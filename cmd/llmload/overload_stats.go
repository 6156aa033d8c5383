package main

import (
	"cmp"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"time"
)

// PhaseResult is one policy's phase of the overload scenario: what the
// requests issued in the measured window saw.
type PhaseResult struct {
	Name string `json:"name"`
	URL  string `json:"url"`
	// Requests were issued in the measured window; OK of them finished.
	Requests int64            `json:"requests"`
	OK       int64            `json:"ok"`
	Outcomes map[string]int64 `json:"outcomes"`
	// Censored had no first token when they ended (cancelled at the end
	// of the phase, or timed out): their elapsed time counts as their
	// TTFT, a lower bound, so that a policy does not look better for the
	// requests it never answered.
	Censored int64 `json:"censored"`
	// Unfinished had their first token but were still streaming when
	// they were cancelled at the end of the phase (or timed out).
	Unfinished int64 `json:"unfinished"`
	// Dropped arrivals found --max-inflight requests in flight (whole
	// phase).
	Dropped int64 `json:"dropped"`
	// Offered is Requests per second of the window; Throughput the ok
	// responses that ended within the window (whenever they were issued)
	// per second of it.
	Offered    float64 `json:"offered_per_second"`
	Throughput float64 `json:"throughput_per_second"`
	TTFT       Dist    `json:"ttft"`
	// Share is each replica's part of the measured requests, by the
	// X-Mock-Replica response header; sorted by address.
	Share []ReplicaShare `json:"share"`
	// Mock is what each replica counted over the whole phase (warm-up and
	// grace included), from /mock/stats.
	Mock []PhaseReplica `json:"mock,omitempty"`
	// TTFTs are the measured TTFTs (censored included), sorted, for the
	// plot.
	TTFTs []time.Duration `json:"-"`
}

// ReplicaShare is one replica's part of a phase's measured requests.
type ReplicaShare struct {
	Replica  string  `json:"replica"`
	Requests int64   `json:"requests"`
	Share    float64 `json:"share"`
	TTFT     Dist    `json:"ttft"`
}

// PhaseReplica is what one mock replica counted during a phase.
type PhaseReplica struct {
	Addr      string `json:"addr"`
	Requests  int64  `json:"requests"`
	Completed int64  `json:"completed"`
	Cancelled int64  `json:"cancelled"`
	// MaxInFlight is the most requests it held at once (running and
	// waiting): above its capacity, the queue.
	MaxInFlight int `json:"max_in_flight"`
}

// noReplica names the requests without an X-Mock-Replica header (no
// upstream answered them).
const noReplica = "(no answer)"

// summarizePhase aggregates the results of a phase that started at start:
// requests issued in [start+warmup, start+warmup+window) are measured;
// throughput counts ok responses that ended in that window.
func summarizePhase(name, url string, start time.Time, warmup, window time.Duration, results []Result) PhaseResult {
	p := PhaseResult{Name: name, URL: url, Outcomes: map[string]int64{}}
	from, to := start.Add(warmup), start.Add(warmup+window)
	in := func(t time.Time) bool { return !t.Before(from) && t.Before(to) }
	var ttft Samples
	byReplica := map[string]*Samples{}
	counts := map[string]int64{}
	var completedInWindow int64
	for i := range results {
		r := &results[i]
		if r.OK() && in(r.Start.Add(r.Total)) {
			completedInWindow++
		}
		if !in(r.Start) {
			continue
		}
		p.Requests++
		p.Outcomes[r.Outcome]++
		if r.OK() {
			p.OK++
		}
		up := cmp.Or(r.Upstream, noReplica)
		counts[up]++
		cut := r.Outcome == OutcomeCancelled || r.Outcome == OutcomeTimeout
		var d time.Duration
		switch {
		case r.HasTTFT:
			d = r.TTFT
			if cut {
				p.Unfinished++
			}
		case cut:
			p.Censored++
			d = r.Total
		default:
			continue // an error answer: no TTFT to speak of
		}
		ttft.Add(d)
		p.TTFTs = append(p.TTFTs, d)
		s := byReplica[up]
		if s == nil {
			s = &Samples{}
			byReplica[up] = s
		}
		s.Add(d)
	}
	p.TTFT = ttft.Dist()
	slices.Sort(p.TTFTs)
	if secs := window.Seconds(); secs > 0 {
		p.Offered = float64(p.Requests) / secs
		p.Throughput = float64(completedInWindow) / secs
	}
	for up, n := range counts {
		rs := ReplicaShare{Replica: up, Requests: n, Share: float64(n) / float64(p.Requests)}
		if s := byReplica[up]; s != nil {
			rs.TTFT = s.Dist()
		}
		p.Share = append(p.Share, rs)
	}
	slices.SortFunc(p.Share, func(a, b ReplicaShare) int { return strings.Compare(a.Replica, b.Replica) })
	return p
}

// RatioGoal bounds the candidate's p99 TTFT by a fraction of a baseline's.
type RatioGoal struct {
	Baseline string  `json:"baseline"`
	Max      float64 `json:"max"`
}

// OverloadGoal is what the overload scenario must show (issue 9:
// least_queue's p99 TTFT ≤ 0.5× round_robin's and ≤ 0.8× least_conn's at
// equal throughput).
type OverloadGoal struct {
	Candidate string      `json:"candidate"`
	MaxRatio  []RatioGoal `json:"max_ratio"`
	// ThroughputTolerance: "equal throughput" means the candidate's is at
	// least (1 − this) × each baseline's.
	ThroughputTolerance float64 `json:"throughput_tolerance"`
}

// OverloadComparison is the candidate against one baseline.
type OverloadComparison struct {
	Baseline      string  `json:"baseline"`
	BaselineP99MS float64 `json:"baseline_p99_ms"`
	// Ratio is the candidate's p99 TTFT ÷ the baseline's (0 when either
	// is missing).
	Ratio    float64 `json:"ratio"`
	MaxRatio float64 `json:"max_ratio"`
	Met      bool    `json:"met"`
	// ThroughputRatio is the candidate's throughput ÷ the baseline's.
	ThroughputRatio float64 `json:"throughput_ratio"`
}

// OverloadVerdict compares the candidate with the baselines.
type OverloadVerdict struct {
	Candidate      string               `json:"candidate"`
	CandidateP99MS float64              `json:"candidate_p99_ms"`
	Comparisons    []OverloadComparison `json:"comparisons"`
	// EqualThroughput: the candidate's throughput is within the tolerance
	// of every baseline's, or above.
	EqualThroughput bool     `json:"equal_throughput"`
	Met             bool     `json:"met"`
	Notes           []string `json:"notes,omitempty"`
}

// judgeOverload compares the candidate phase with each baseline of g.
func judgeOverload(phases []PhaseResult, g OverloadGoal) OverloadVerdict {
	v := OverloadVerdict{Candidate: g.Candidate}
	byName := map[string]*PhaseResult{}
	for i := range phases {
		byName[phases[i].Name] = &phases[i]
	}
	c := byName[g.Candidate]
	if c == nil || c.TTFT.Count == 0 {
		v.Notes = append(v.Notes, fmt.Sprintf("no TTFT measured for the candidate %s", g.Candidate))
		return v
	}
	v.CandidateP99MS = c.TTFT.P99
	v.Met, v.EqualThroughput = true, true
	for _, rg := range g.MaxRatio {
		cmpn := OverloadComparison{Baseline: rg.Baseline, MaxRatio: rg.Max}
		b := byName[rg.Baseline]
		if b == nil || b.TTFT.Count == 0 || b.TTFT.P99 <= 0 {
			v.Met = false
			v.Notes = append(v.Notes, fmt.Sprintf("no TTFT measured for %s: nothing to compare with", rg.Baseline))
			v.Comparisons = append(v.Comparisons, cmpn)
			continue
		}
		cmpn.BaselineP99MS = b.TTFT.P99
		cmpn.Ratio = c.TTFT.P99 / b.TTFT.P99
		cmpn.Met = cmpn.Ratio <= rg.Max
		if b.Throughput > 0 {
			cmpn.ThroughputRatio = c.Throughput / b.Throughput
		}
		if c.Throughput < (1-g.ThroughputTolerance)*b.Throughput {
			v.EqualThroughput = false
		}
		v.Met = v.Met && cmpn.Met
		v.Comparisons = append(v.Comparisons, cmpn)
	}
	v.Met = v.Met && v.EqualThroughput
	for i := range phases {
		p := &phases[i]
		if p.Offered > 0 && p.Throughput < (1-g.ThroughputTolerance)*p.Offered {
			v.Notes = append(v.Notes, fmt.Sprintf("%s completed %.1f req/s of the %.1f offered: it did not keep up (its backlog grew through the window)",
				p.Name, p.Throughput, p.Offered))
		}
		if p.Censored > 0 {
			v.Notes = append(v.Notes, fmt.Sprintf("%s: %d requests had no first token by the end of the phase; their elapsed time counts as TTFT, so its p99 is a lower bound",
				p.Name, p.Censored))
		}
		if p.Unfinished > 0 {
			v.Notes = append(v.Notes, fmt.Sprintf("%s: %d requests were still streaming when the phase ended (cancelled after their first token)", p.Name, p.Unfinished))
		}
		if bad := p.failed(); bad > 0 {
			v.Notes = append(v.Notes, fmt.Sprintf("%s: %d requests failed (outcomes other than ok: %s)", p.Name, bad, fmtIntCounts(withoutOK(p.Outcomes))))
		}
		if p.Dropped > 0 {
			v.Notes = append(v.Notes, fmt.Sprintf("%s: %d arrivals dropped at the in-flight bound", p.Name, p.Dropped))
		}
	}
	return v
}

// failed counts the measured requests that got an error (not ok, and not
// cut by the end of the phase).
func (p *PhaseResult) failed() int64 { return p.Requests - p.OK - p.Censored - p.Unfinished }

func withoutOK(m map[string]int64) map[string]int64 {
	out := map[string]int64{}
	for k, n := range m {
		if k != OutcomeOK {
			out[k] = n
		}
	}
	return out
}

// printOverload writes the human report: a markdown table of the phases, a
// second one of the tails and the replicas' queues, then the verdict.
func printOverload(w io.Writer, rep *OverloadReport) {
	cfg := &rep.Config
	fmt.Fprintf(w, "\nllmload overload: Poisson arrivals at %.1f req/s (seed %d) through each policy, %v measured after %v of warm-up; %d CPUs, load average %s before, %s after\n\n",
		cfg.Rate, cfg.Seed, cfg.Duration, cfg.Warmup, rep.Machine.CPUs, cmp.Or(rep.Machine.LoadBefore, "?"), cmp.Or(rep.Machine.LoadAfter, "?"))
	rows := [][]string{{"policy", "requests", "ok", "throughput (req/s)", "TTFT p50", "TTFT p99", "requests per replica"}}
	for i := range rep.Phases {
		p := &rep.Phases[i]
		rows = append(rows, []string{p.Name, fmt.Sprint(p.Requests), fmt.Sprint(p.OK), fmt.Sprintf("%.1f", p.Throughput),
			fmtDist(p.TTFT, p.TTFT.P50), fmtDist(p.TTFT, p.TTFT.P99), fmtShares(p.Share, cfg.Straggler)})
	}
	writeMarkdown(w, rows, "lrrrrrl")
	if cfg.Straggler != "" {
		fmt.Fprintf(w, "\n\\* %s is the straggler.\n", shortAddr(cfg.Straggler))
	}
	fmt.Fprintln(w)
	rows = [][]string{{"policy", "TTFT p90", "p99.9", "max", "censored", "failed", "p99 by replica", "peak in flight by replica (mock)"}}
	for i := range rep.Phases {
		p := &rep.Phases[i]
		rows = append(rows, []string{p.Name, fmtDist(p.TTFT, p.TTFT.P90), fmtDist(p.TTFT, p.TTFT.P999), fmtDist(p.TTFT, p.TTFT.Max),
			fmt.Sprint(p.Censored), fmt.Sprint(p.failed()), fmtReplicaP99(p.Share, cfg.Straggler), fmtPeaks(p.Mock, cfg.Straggler)})
	}
	writeMarkdown(w, rows, "lrrrrrll")
	fmt.Fprintln(w)
	v := rep.Verdict
	mark := func(ok bool) string {
		if ok {
			return "PASS"
		}
		return "FAIL"
	}
	byName := map[string]*PhaseResult{}
	for i := range rep.Phases {
		byName[rep.Phases[i].Name] = &rep.Phases[i]
	}
	for _, c := range v.Comparisons {
		if c.BaselineP99MS == 0 {
			fmt.Fprintf(w, "  FAIL  %s against %s: not measured\n", v.Candidate, c.Baseline)
			continue
		}
		fmt.Fprintf(w, "  %s  %s p99 TTFT %s is %.2f× %s's (%s; target ≤ %g×)\n",
			mark(c.Met), v.Candidate, fmtMS(v.CandidateP99MS), c.Ratio, c.Baseline, fmtMS(c.BaselineP99MS), c.MaxRatio)
	}
	if c := byName[v.Candidate]; c != nil && len(v.Comparisons) > 0 {
		var others []string
		for _, cm := range v.Comparisons {
			if b := byName[cm.Baseline]; b != nil {
				others = append(others, fmt.Sprintf("%s %.1f", b.Name, b.Throughput))
			}
		}
		fmt.Fprintf(w, "  %s  at equal throughput: %s %.1f req/s against %s (offered %.1f; tolerance %.0f%%)\n",
			mark(v.EqualThroughput), c.Name, c.Throughput, strings.Join(others, ", "), c.Offered, 100*cfg.Goal.ThroughputTolerance)
	}
	if v.Met {
		fmt.Fprintln(w, "  target met")
	} else {
		fmt.Fprintln(w, "  target NOT met")
	}
	for _, n := range v.Notes {
		fmt.Fprintf(w, "  note: %s\n", n)
	}
}

// writeMarkdown writes rows (the first is the header) as a markdown table
// with padded columns; align has one 'l' or 'r' per column.
func writeMarkdown(w io.Writer, rows [][]string, align string) {
	if len(rows) == 0 {
		return
	}
	widths := make([]int, len(rows[0]))
	for _, r := range rows {
		for i, c := range r {
			if i < len(widths) {
				widths[i] = max(widths[i], len([]rune(c)), 3)
			}
		}
	}
	line := func(cells []string) {
		var b strings.Builder
		b.WriteString("|")
		for i := range widths {
			c := ""
			if i < len(cells) {
				c = cells[i]
			}
			pad := strings.Repeat(" ", widths[i]-len([]rune(c)))
			if i < len(align) && align[i] == 'r' {
				b.WriteString(" " + pad + c + " |")
			} else {
				b.WriteString(" " + c + pad + " |")
			}
		}
		fmt.Fprintln(w, b.String())
	}
	line(rows[0])
	sep := make([]string, len(widths))
	for i, n := range widths {
		if i < len(align) && align[i] == 'r' {
			sep[i] = strings.Repeat("-", n-1) + ":"
		} else {
			sep[i] = strings.Repeat("-", n)
		}
	}
	fmt.Fprintln(w, "|"+strings.Join(wrap(sep, " ", " "), "|")+"|")
	for _, r := range rows[1:] {
		line(r)
	}
}

func wrap(ss []string, before, after string) []string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = before + s + after
	}
	return out
}

// shortAddr is ":port" for a host:port, the input otherwise.
func shortAddr(addr string) string {
	if _, port, err := net.SplitHostPort(addr); err == nil {
		return ":" + port
	}
	return addr
}

// replicaLabel is a replica's short address, starred when it is the
// straggler.
func replicaLabel(addr, straggler string) string {
	l := shortAddr(addr)
	if straggler != "" && addr == straggler {
		l += "\\*"
	}
	return l
}

// fmtShares is "[:9501 38% · :9502 37% · :9503\* 25%]".
func fmtShares(ss []ReplicaShare, straggler string) string {
	if len(ss) == 0 {
		return "-"
	}
	parts := make([]string, len(ss))
	for i, s := range ss {
		parts[i] = fmt.Sprintf("%s %.0f%%", replicaLabel(s.Replica, straggler), 100*s.Share)
	}
	return strings.Join(parts, " · ")
}

func fmtReplicaP99(ss []ReplicaShare, straggler string) string {
	var parts []string
	for _, s := range ss {
		if s.TTFT.Count > 0 {
			parts = append(parts, fmt.Sprintf("%s %s", replicaLabel(s.Replica, straggler), fmtMS(s.TTFT.P99)))
		}
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, " · ")
}

func fmtPeaks(rs []PhaseReplica, straggler string) string {
	if len(rs) == 0 {
		return "-"
	}
	rs = slices.Clone(rs)
	slices.SortFunc(rs, func(a, b PhaseReplica) int { return strings.Compare(a.Addr, b.Addr) })
	parts := make([]string, len(rs))
	for i, r := range rs {
		parts[i] = fmt.Sprintf("%s %d", replicaLabel(r.Addr, straggler), r.MaxInFlight)
	}
	return strings.Join(parts, " · ")
}
