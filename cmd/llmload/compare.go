package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
)

// Outcomes of caddy_llm_proxy_hedges_total.
const (
	HedgeFired      = "fired"
	HedgeWon        = "won"
	HedgeLost       = "lost"
	HedgeSuppressed = "suppressed"
)

// Target is what a hedged run must achieve against its baseline: the
// hedging experiment of The Tail at Scale, on time to first token.
type Target struct {
	// Speedup is the least factor by which p99 TTFT must drop.
	Speedup float64
	// MaxExtraPct is the most extra upstream requests, in percent of the
	// client's requests.
	MaxExtraPct float64
}

// Arm is one run's figures for the comparison.
type Arm struct {
	Label    string
	Requests int64
	OK       int64
	TTFT     Dist
	// Upstream counts upstream requests: the mock's count when the run
	// had --mock, else the gateway's attempts; Source says which ("" when
	// neither was measured).
	Upstream float64
	Source   string
	// Hedges by outcome and the final hedge delay, from the gateway.
	Hedges       map[string]float64
	HedgeDelayMS float64
	// Retries from the gateway (failovers; not hedges).
	Retries float64
	// Tokens, from the mock (Wasted: sent on attempts that did not
	// complete); HasTokens is false without --mock.
	UsefulTokens, WastedTokens int64
	HasTokens                  bool
}

// armOf extracts an Arm from a run report.
func armOf(label string, rep *RunReport) Arm {
	a := Arm{Label: label, Requests: rep.Summary.Requests, OK: rep.Summary.OK, TTFT: rep.Summary.TTFT}
	if g := rep.Gateway; g != nil && g.Found {
		a.Upstream, a.Source = g.AttemptsTotal, "gateway"
		a.Hedges, a.HedgeDelayMS, a.Retries = g.Hedges, g.HedgeDelayMS, g.Retries
	}
	if m := rep.Mock; m != nil {
		a.Upstream, a.Source = float64(m.Requests), "mock"
		a.UsefulTokens, a.WastedTokens, a.HasTokens = m.UsefulTokens, m.WastedTokens, true
	}
	return a
}

// UpstreamPerRequest is upstream requests per client request (NaN when
// unknown).
func (a *Arm) UpstreamPerRequest() float64 {
	if a.Source == "" || a.Requests == 0 {
		return math.NaN()
	}
	return a.Upstream / float64(a.Requests)
}

// ExtraPct is the extra upstream requests in percent of the client's
// requests: 100 × (upstream − requests) / requests.
func (a *Arm) ExtraPct() float64 {
	if math.IsNaN(a.UpstreamPerRequest()) {
		return math.NaN()
	}
	return 100 * (a.Upstream - float64(a.Requests)) / float64(a.Requests)
}

// WastedPct is the wasted tokens in percent of the useful ones (NaN
// without token counts).
func (a *Arm) WastedPct() float64 {
	if !a.HasTokens || a.UsefulTokens == 0 {
		return math.NaN()
	}
	return 100 * float64(a.WastedTokens) / float64(a.UsefulTokens)
}

// Verdict is the hedged arm judged against the baseline.
type Verdict struct {
	Met bool
	// Speedup is the baseline's p99 TTFT over the hedged arm's.
	Speedup float64
	// ExtraPct is the hedged arm's extra upstream requests.
	ExtraPct float64
	// Why lists what missed the target (empty when met).
	Why []string
}

// judge compares a hedged arm with its baseline.
func judge(base, hedged *Arm, t Target) Verdict {
	v := Verdict{Speedup: math.NaN(), ExtraPct: hedged.ExtraPct()}
	if hedged.TTFT.Count > 0 && base.TTFT.Count > 0 && hedged.TTFT.P99 > 0 {
		v.Speedup = base.TTFT.P99 / hedged.TTFT.P99
	}
	switch {
	case math.IsNaN(v.Speedup):
		v.Why = append(v.Why, "no TTFT measured")
	case v.Speedup < t.Speedup:
		v.Why = append(v.Why, fmt.Sprintf("p99 TTFT only %.1f× lower", v.Speedup))
	}
	switch {
	case math.IsNaN(v.ExtraPct):
		v.Why = append(v.Why, "upstream requests not measured (give llmload run --mock or --metrics-url)")
	case v.ExtraPct > t.MaxExtraPct:
		v.Why = append(v.Why, fmt.Sprintf("%.1f%% extra upstream requests", v.ExtraPct))
	}
	v.Met = len(v.Why) == 0
	return v
}

// String is the one-line verdict.
func (v Verdict) String(base, hedged *Arm, t Target) string {
	head := "target met"
	if !v.Met {
		head = "target NOT met (" + strings.Join(v.Why, "; ") + ")"
	}
	return fmt.Sprintf("%s: p99 TTFT %s → %s (%s lower; target ≥ %g×) for %s extra upstream requests (target ≤ %g%%).",
		head, fmtDist(base.TTFT, base.TTFT.P99), fmtDist(hedged.TTFT, hedged.TTFT.P99),
		fmtFactor(v.Speedup), t.Speedup, fmtPct(v.ExtraPct), t.MaxExtraPct)
}

func fmtFactor(f float64) string {
	if math.IsNaN(f) {
		return "-"
	}
	return fmt.Sprintf("%.1f×", f)
}

func fmtPct(p float64) string {
	if math.IsNaN(p) {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", p)
}

// printComparison writes the arms as a markdown table, then a verdict line
// for every arm after the first, judged against the first; it returns the
// last arm's verdict.
func printComparison(w io.Writer, arms []Arm, t Target) Verdict {
	fmt.Fprintln(w, "| arm | requests (ok) | TTFT p50 | TTFT p99 | TTFT p99.9 | upstream req / request | extra upstream req | hedges fired / won / lost / suppressed | hedge delay (end) | wasted tokens |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|")
	for i := range arms {
		a := &arms[i]
		hedges, delay := "-", "-"
		if a.Hedges != nil || a.HedgeDelayMS > 0 {
			h := a.Hedges
			hedges = fmt.Sprintf("%.0f / %.0f / %.0f / %.0f", h[HedgeFired], h[HedgeWon], h[HedgeLost], h[HedgeSuppressed])
		}
		if a.HedgeDelayMS > 0 {
			delay = fmtMS(a.HedgeDelayMS)
		}
		per := "-"
		if r := a.UpstreamPerRequest(); !math.IsNaN(r) {
			per = fmt.Sprintf("%.3f (%s)", r, a.Source)
		}
		wasted := "-"
		if a.HasTokens {
			wasted = fmt.Sprintf("%d of %d useful (%s)", a.WastedTokens, a.UsefulTokens, fmtPctFine(a.WastedPct()))
		}
		fmt.Fprintf(w, "| %s | %d (%d) | %s | %s | %s | %s | %s | %s | %s | %s |\n",
			a.Label, a.Requests, a.OK, fmtDist(a.TTFT, a.TTFT.P50), fmtDist(a.TTFT, a.TTFT.P99), fmtDist(a.TTFT, a.TTFT.P999),
			per, fmtPct(a.ExtraPct()), hedges, delay, wasted)
	}
	var v Verdict
	if len(arms) > 1 {
		fmt.Fprintln(w)
	}
	for i := 1; i < len(arms); i++ {
		base, other := &arms[0], &arms[i]
		v = judge(base, other, t)
		fmt.Fprintf(w, "- **%s** vs %s: %s\n", other.Label, base.Label, v.String(base, other, t))
	}
	return v
}

// fmtPctFine formats a small percentage with two decimals.
func fmtPctFine(p float64) string {
	if math.IsNaN(p) {
		return "-"
	}
	return fmt.Sprintf("%.2f%%", p)
}

func compareCmd(args []string) error {
	fs := newFlagSet("compare", "Compare llmload run --json reports, the first being the baseline: a markdown table, then\n"+
		"a one-line verdict for each other report against the baseline.\n"+
		"Usage: llmload compare [flags] base.json hedged.json [more.json...]")
	var (
		t      Target
		strict bool
	)
	fs.Float64Var(&t.Speedup, "target-speedup", 5, "p99 TTFT must be at least this many times lower")
	fs.Float64Var(&t.MaxExtraPct, "target-max-extra", 10, "at most this many extra upstream requests, in percent of requests")
	fs.BoolVar(&strict, "strict", false, "exit with status 1 when the last report misses the target")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", errFlags, err)
	}
	if fs.NArg() < 2 {
		fs.Usage()
		return usageErrorf("want at least two reports, the baseline first")
	}
	arms := make([]Arm, 0, fs.NArg())
	for _, path := range fs.Args() {
		rep, err := readReport(path)
		if err != nil {
			return err
		}
		label := rep.Config.Label
		if label == "" {
			label = strings.TrimSuffix(filepath.Base(path), filepath.Ext(path))
		}
		arms = append(arms, armOf(label, rep))
	}
	v := printComparison(os.Stdout, arms, t)
	if strict && !v.Met {
		return fmt.Errorf("target not met")
	}
	return nil
}

func readReport(path string) (*RunReport, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var rep RunReport
	if err := json.Unmarshal(b, &rep); err != nil {
		return nil, fmt.Errorf("report %s: %w", path, err)
	}
	return &rep, nil
}
