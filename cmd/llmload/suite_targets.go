package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"

	"github.com/dustin/go-humanize"
)

// suiteGoal is one target of issue 12 item 3, as measured in one run.
type suiteGoal struct {
	What     string // what is compared
	Measured string // the figures and their ratio
	Goal     string
	// Met is whether the run met the goal; Known false when the run could
	// not tell (a scenario or target missing).
	Met, Known bool
}

func (g suiteGoal) verdict() string {
	switch {
	case !g.Known:
		return "not measured"
	case g.Met:
		return "met"
	}
	return "**not met**"
}

// suiteTargets computes the ratios of issue 12 item 3 from a run.
func suiteTargets(run *suiteRun) []suiteGoal {
	var gs []suiteGoal
	ratioGoal := func(what string, a, b float64, unit string, max float64, ok bool) suiteGoal {
		g := suiteGoal{What: what, Goal: fmt.Sprintf("≤ %.2f×", max)}
		if !ok || b <= 0 {
			g.Measured = "—"
			return g
		}
		r := a / b
		g.Measured = fmt.Sprintf("%.1f / %.1f %s = **%.2f×**", a, b, unit, r)
		g.Known, g.Met = true, r <= max
		return g
	}
	// CPU per event (S4 at each level, S4b) against reverse_proxy and nginx.
	for _, sc := range []struct {
		name string
		r    *StreamsReport
	}{{"S4", run.S4}, {"S4b", run.S4b}} {
		if sc.r == nil {
			gs = append(gs, suiteGoal{What: "CPU per event, " + sc.name, Goal: "≤ 0.75× reverse_proxy, ≤ 1.5× nginx", Measured: "—"})
			continue
		}
		for _, level := range sc.r.Levels {
			_, l := sc.r.cell(TargetLLMProxy, level)
			_, c := sc.r.cell(TargetReverseProxy, level)
			_, n := sc.r.cell(TargetNginx, level)
			okL := l != nil && l.Skipped == "" && l.Events > 0
			what := fmt.Sprintf("CPU per event, %s %s streams", sc.name, humanize.Comma(int64(level)))
			gs = append(gs,
				ratioGoal(what+", llm_proxy ÷ reverse_proxy", val(l, okL), cpuOf(c), "µs", 0.75, okL && cpuOf(c) > 0),
				ratioGoal(what+", llm_proxy ÷ nginx", val(l, okL), cpuOf(n), "µs", 1.5, okL && cpuOf(n) > 0))
		}
	}
	// RSS per stream against reverse_proxy.
	if run.S4 != nil {
		for _, level := range run.S4.Levels {
			_, l := run.S4.cell(TargetLLMProxy, level)
			_, c := run.S4.cell(TargetReverseProxy, level)
			ok := l != nil && c != nil && l.Skipped == "" && c.Skipped == ""
			a, b := 0.0, 0.0
			if ok {
				a, b = l.RSSPerStreamKB, c.RSSPerStreamKB
			}
			gs = append(gs, ratioGoal(fmt.Sprintf("RSS per stream, %s streams, llm_proxy ÷ reverse_proxy", humanize.Comma(int64(level))),
				a, b, "KB", 0.5, ok))
		}
	} else {
		gs = append(gs, suiteGoal{What: "RSS per stream, llm_proxy ÷ reverse_proxy", Goal: "≤ 0.50×", Measured: "—"})
	}
	// Added TTFT against reverse_proxy.
	addedGoal := func(what string, lr *LatencyReport, streams int, p99 bool) suiteGoal {
		g := suiteGoal{What: what, Goal: "≤ 1.00× (added TTFT no more than reverse_proxy's)", Measured: "—"}
		lvl := lr.level(streams)
		if lvl == nil {
			return g
		}
		l, c := lvl.target(TargetLLMProxy), lvl.target(TargetReverseProxy)
		if l == nil || c == nil {
			return g
		}
		a, b := l.AddedTTFTP50, c.AddedTTFTP50
		if p99 {
			a, b = l.AddedTTFTP99, c.AddedTTFTP99
		}
		g.Known, g.Met = true, a <= b
		g.Measured = fmt.Sprintf("%s / %s", fmtAdded(a), fmtAdded(b))
		if b > 0.01 {
			g.Measured += fmt.Sprintf(" = **%.2f×**", a/b)
		}
		return g
	}
	gs = append(gs,
		medianAddedGoal("added TTFT p50, S3 100 streams, llm_proxy ÷ reverse_proxy", run.S3, TargetLLMProxy, false, 1),
		medianAddedGoal("added TTFT p99, S3 100 streams, llm_proxy ÷ reverse_proxy", run.S3, TargetLLMProxy, true, 1),
		medianAddedGoal("added TTFT p50, S3 100 streams, llm_proxy with tenants and saturation ÷ reverse_proxy", run.S3, TargetLLMProxyTenants, false, 1.15),
		medianAddedGoal("added TTFT p99, S3 100 streams, llm_proxy with tenants and saturation ÷ reverse_proxy", run.S3, TargetLLMProxyTenants, true, 1.15),
		addedGoal("added TTFT p50, S3 1 stream, llm_proxy ÷ reverse_proxy", run.S3, 1, false),
		addedGoal("added TTFT p50, S1 1 stream (zero-delay mock), llm_proxy ÷ reverse_proxy", run.S1, 1, false))
	// 5,000 streams with no event later than 50 ms.
	g := suiteGoal{What: "streams held by llm_proxy with no event later than 50 ms", Goal: "5,000 streams, 0 late", Measured: "—"}
	if run.S4 != nil && len(run.S4.Levels) > 0 {
		top := run.S4.Levels[len(run.S4.Levels)-1]
		_, l := run.S4.cell(TargetLLMProxy, top)
		switch {
		case l == nil:
		case l.Skipped != "":
			g.Known, g.Measured = true, fmt.Sprintf("%s not held: %s", humanize.Comma(int64(top)), l.Skipped)
		default:
			g.Known = true
			g.Met = l.Late == 0 && l.Failed == 0 && top >= 5000
			g.Measured = fmt.Sprintf("%s streams: %s of %s events late, %d failed", humanize.Comma(int64(top)),
				humanize.Comma(l.Late), humanize.Comma(l.Events), l.Failed)
		}
	}
	gs = append(gs, g)
	// S6 (issue 19): served and attempts at every uniform error rate.
	gs = append(gs, stormSuiteGoals(run.S6)...)
	return gs
}

// medianAddedGoal is issue 22's S3 target: name's added TTFT (p50, or p99)
// at 100 streams over reverse_proxy's, in each run of the level, and their
// median at most limit×. A run where reverse_proxy added nothing
// measurable (≤ 0.01 ms) counts as met when name added no more, else as
// over any limit.
func medianAddedGoal(what string, lr *LatencyReport, name string, p99 bool, limit float64) suiteGoal {
	g := suiteGoal{What: what, Goal: fmt.Sprintf("median of the runs ≤ %.2f×", limit), Measured: "—"}
	var ratios []float64
	var cells []string
	for _, lvl := range lr.runs(100) {
		l, c := lvl.target(name), lvl.target(TargetReverseProxy)
		if l == nil || c == nil {
			continue
		}
		a, b := l.AddedTTFTP50, c.AddedTTFTP50
		if p99 {
			a, b = l.AddedTTFTP99, c.AddedTTFTP99
		}
		r := a / b
		switch {
		case b > 0.01:
		case a <= b:
			r = 0
		default:
			r = math.Inf(1)
		}
		ratios = append(ratios, r)
		cells = append(cells, fmt.Sprintf("%s / %s = %.2f×", fmtAdded(a), fmtAdded(b), r))
	}
	if len(ratios) == 0 {
		return g
	}
	m := median(ratios)
	g.Known, g.Met = true, m <= limit
	g.Measured = fmt.Sprintf("%s; median **%.2f×**", strings.Join(cells, "; "), m)
	return g
}

// median is the middle value (the mean of the two middle ones for an even
// count) of vs, which it sorts.
func median(vs []float64) float64 {
	slices.Sort(vs)
	n := len(vs)
	if n%2 == 1 {
		return vs[n/2]
	}
	return (vs[n/2-1] + vs[n/2]) / 2
}

// stormSuiteGoals are S6's two targets over every error rate.
func stormSuiteGoals(r *StormReport) []suiteGoal {
	sg := suiteGoal{What: "S6 served by llm_proxy at every uniform error rate", Goal: fmt.Sprintf("≥ direct − %.0f points", stormServedSlack), Measured: "—"}
	ag := suiteGoal{What: "S6 upstream attempts per request, llm_proxy, at every error rate", Goal: "≤ 1 + ratio + floor (budget bound)", Measured: "—"}
	if r == nil {
		return []suiteGoal{sg, ag}
	}
	served, attempts, known := stormGoals(r)
	if !known {
		return []suiteGoal{sg, ag}
	}
	var llm, direct StormTarget
	for _, t := range r.Targets {
		switch t.Name {
		case TargetLLMProxy:
			llm = t
		case TargetDirect:
			direct = t
		}
	}
	sg.Known, ag.Known, sg.Met, ag.Met = true, true, true, true
	var sm, am []string
	for i, pt := range llm.Points {
		sg.Met = sg.Met && served[i]
		ag.Met = ag.Met && attempts[i]
		sm = append(sm, fmt.Sprintf("%.0f%%: %.0f vs %.0f", 100*pt.Rate, pt.Served(), direct.Points[i].Served()))
		am = append(am, fmt.Sprintf("%.0f%%: %.2f ≤ %.2f", 100*pt.Rate, pt.PerRequest, pt.Bound))
	}
	sg.Measured, ag.Measured = strings.Join(sm, "; "), strings.Join(am, "; ")
	return []suiteGoal{sg, ag}
}

func val(l *StreamsLevel, ok bool) float64 {
	if !ok {
		return 0
	}
	return l.CPUPerEventUS
}

func cpuOf(l *StreamsLevel) float64 {
	if l == nil || l.Skipped != "" || l.Events == 0 {
		return 0
	}
	return l.CPUPerEventUS
}

func writeSuiteTargets(w io.Writer, gs []suiteGoal) {
	fmt.Fprintf(w, "### Targets of issue 12 (item 3) in this run\n\n")
	rows := [][]string{{"target", "measured", "goal", "verdict"}}
	for _, g := range gs {
		rows = append(rows, []string{g.What, g.Measured, g.Goal, g.verdict()})
	}
	writeMarkdown(w, rows, "llll")
	fmt.Fprintln(w)
}

// printSuiteTargets prints the goals for a terminal, one a line.
func printSuiteTargets(w io.Writer, gs []suiteGoal) {
	fmt.Fprintln(w, "Targets of issue 12 (item 3), this run:")
	for _, g := range gs {
		fmt.Fprintf(w, "  %-12s %s: %s (goal %s)\n", g.verdict(), g.What, strings.ReplaceAll(g.Measured, "**", ""), g.Goal)
	}
}
