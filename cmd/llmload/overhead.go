package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Path names in the overhead benchmark.
const (
	PathDirect       = "direct"
	PathLLMProxy     = "llm_proxy"
	PathReverseProxy = "reverse_proxy"
)

// OverheadConfig is the configuration of `llmload overhead`.
type OverheadConfig struct {
	Paths       map[string]string `json:"paths"`
	Streams     []int             `json:"streams"`
	PerLevel    int               `json:"requests_per_level"`
	Batch       int               `json:"batch"`
	Model       string            `json:"model"`
	MaxTokens   int               `json:"max_tokens"`
	PromptBytes int               `json:"prompt_bytes"`
	Timeout     time.Duration     `json:"timeout_ns"`
	Note        string            `json:"note,omitempty"`
}

// PathResult is the measurement of one path at one concurrency level.
type PathResult struct {
	Path     string `json:"path"`
	Requests int64  `json:"requests"`
	Errors   int64  `json:"errors"`
	// Example is one error detail, when there were errors.
	Example string `json:"error_example,omitempty"`
	TTFT    Dist   `json:"ttft"`
	Gap     Dist   `json:"inter_event_gap"`
	// Added* are this path minus direct, in milliseconds.
	AddedTTFTP50 float64 `json:"added_ttft_p50_ms"`
	AddedTTFTP99 float64 `json:"added_ttft_p99_ms"`
	AddedGapP50  float64 `json:"added_gap_p50_ms"`
	AddedGapP99  float64 `json:"added_gap_p99_ms"`
}

// LevelResult is the measurement of every path at one concurrency level.
type LevelResult struct {
	Streams int          `json:"streams"`
	Paths   []PathResult `json:"paths"`
	// RatioP50 and RatioP99 are added TTFT of llm_proxy divided by added
	// TTFT of reverse_proxy; 0 when not meaningful (reverse_proxy added
	// nothing measurable, or a path is missing).
	RatioP50 float64 `json:"ratio_added_ttft_p50"`
	RatioP99 float64 `json:"ratio_added_ttft_p99"`
}

// OverheadReport is what `llmload overhead --json` writes.
type OverheadReport struct {
	Config  OverheadConfig `json:"config"`
	CPUs    int            `json:"cpus"`
	Started time.Time      `json:"started"`
	Levels  []LevelResult  `json:"levels"`
}

func overheadCmd(args []string) error {
	fs := newFlagSet("overhead", "Measure what a gateway adds to TTFT and inter-event gaps: the same streaming\n"+
		"requests go to the mock directly, through llm_proxy and through reverse_proxy,\n"+
		"interleaved in round-robin batches so that all paths see the same conditions.")
	var (
		direct, llm, rp string
		streams         string
		cfg             OverheadConfig
		headers         headerFlag
		jsonOut         string
		allowRemote     bool
		maxDuration     time.Duration
	)
	fs.StringVar(&direct, "direct", "", "base `url` of the mock, the baseline (required)")
	fs.StringVar(&llm, "llm-proxy", "", "base `url` of a Caddy site with llm_proxy in front of the same mock")
	fs.StringVar(&rp, "reverse-proxy", "", "base `url` of a Caddy site with reverse_proxy in front of the same mock")
	fs.StringVar(&streams, "streams", "1,100", "comma-separated concurrency `levels`")
	fs.IntVar(&cfg.PerLevel, "requests-per-level", 0, "measured requests per path and level (0: max(200, 10×streams))")
	fs.IntVar(&cfg.Batch, "batch", 0, "requests per path before switching to the next path (0: max(10, 2×streams))")
	fs.StringVar(&cfg.Model, "model", "mock-llama", "model name in the request body")
	fs.IntVar(&cfg.MaxTokens, "max-tokens", 0, "max_tokens in the request body (0: omitted)")
	fs.IntVar(&cfg.PromptBytes, "prompt-bytes", 0, "pad the prompt to this many bytes")
	fs.DurationVar(&cfg.Timeout, "timeout", 30*time.Second, "bound on one request")
	fs.DurationVar(&maxDuration, "max-duration", 15*time.Minute, "stop (and report what was measured) after this long")
	fs.Var(&headers, "header", "request header 'Key: Value' (repeatable)")
	fs.StringVar(&jsonOut, "json", "", "also write the results as JSON to this `file`")
	fs.StringVar(&cfg.Note, "note", "", "a line about the setup (e.g. the mock's parameters) for the report")
	fs.BoolVar(&allowRemote, "allow-remote", false, "allow targets that are not loopback addresses")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if direct == "" {
		return usageErrorf("--direct is required: it is the baseline")
	}
	if llm == "" && rp == "" {
		return usageErrorf("give --llm-proxy and/or --reverse-proxy")
	}
	levels, err := parseLevels(streams)
	if err != nil {
		return usageErrorf("--streams: %v", err)
	}
	cfg.Streams = levels
	if cfg.PerLevel < 0 || cfg.Batch < 0 {
		return usageErrorf("--requests-per-level and --batch must not be negative")
	}
	cfg.Paths = map[string]string{}
	var order []string
	for _, p := range []struct{ name, raw string }{{PathDirect, direct}, {PathLLMProxy, llm}, {PathReverseProxy, rp}} {
		if p.raw == "" {
			continue
		}
		u, err := checkTarget(p.raw, allowRemote)
		if err != nil {
			return err
		}
		if u.Path == "" || u.Path == "/" {
			u.Path = "/v1/chat/completions"
		}
		cfg.Paths[p.name] = u.String()
		order = append(order, p.name)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, maxDuration)
	defer cancel()

	body := chatBody(cfg.Model, true, cfg.MaxTokens, cfg.PromptBytes)
	maxLevel := 0
	for _, l := range levels {
		maxLevel = max(maxLevel, l)
	}
	reqs := map[string]*Requester{}
	for _, name := range order {
		// One client per path: separate connection pools, the same limits.
		reqs[name] = &Requester{
			Client:  newHTTPClient(maxLevel),
			URL:     cfg.Paths[name],
			Body:    body,
			Header:  headers.h,
			Timeout: cfg.Timeout,
		}
	}

	rep := OverheadReport{Config: cfg, CPUs: runtime.NumCPU(), Started: time.Now()}
	for _, level := range levels {
		if ctx.Err() != nil {
			break
		}
		perLevel := cfg.PerLevel
		if perLevel == 0 {
			perLevel = max(200, 10*level)
		}
		batch := cfg.Batch
		if batch == 0 {
			batch = max(10, 2*level)
		}
		// Fewer requests than streams would never reach the level.
		if perLevel < level || batch < level {
			perLevel, batch = max(perLevel, level), max(batch, level)
			fmt.Fprintf(os.Stderr, "llmload overhead: raised requests per level and batch to at least %d streams\n", level)
		}
		fmt.Fprintf(os.Stderr, "llmload overhead: %d streams, %d requests per path in batches of %d\n", level, perLevel, batch)
		rep.Levels = append(rep.Levels, measureLevel(ctx, reqs, order, level, perLevel, batch))
	}
	printOverhead(os.Stdout, &rep)
	if jsonOut != "" {
		if err := writeJSON(jsonOut, &rep); err != nil {
			return err
		}
	}
	if ctx.Err() != nil {
		return fmt.Errorf("stopped early: %w", context.Cause(ctx))
	}
	return nil
}

// parseLevels parses "1,100" into concurrency levels.
func parseLevels(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("%q is not a positive integer", f)
		}
		out = append(out, n)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no levels in %q", s)
	}
	return out, nil
}

// measureLevel warms every path up, then sends perLevel requests to each
// path in batches, rotating which path goes first in each round so that
// drift in machine load spreads evenly over the paths.
func measureLevel(ctx context.Context, reqs map[string]*Requester, order []string, level, perLevel, batch int) LevelResult {
	accs := interleaved(ctx, reqs, order, level, perLevel, batch, nil)

	lr := LevelResult{Streams: level}
	for _, name := range order {
		a := accs[name]
		lr.Paths = append(lr.Paths, PathResult{
			Path: name, Requests: a.n, Errors: a.errs, Example: a.example,
			TTFT: a.ttft.Dist(), Gap: a.gaps.Dist(),
		})
	}
	var base *PathResult
	byName := map[string]*PathResult{}
	for i := range lr.Paths {
		p := &lr.Paths[i]
		byName[p.Path] = p
		if p.Path == PathDirect {
			base = p
		}
	}
	for i := range lr.Paths {
		p := &lr.Paths[i]
		p.AddedTTFTP50 = p.TTFT.P50 - base.TTFT.P50
		p.AddedTTFTP99 = p.TTFT.P99 - base.TTFT.P99
		p.AddedGapP50 = p.Gap.P50 - base.Gap.P50
		p.AddedGapP99 = p.Gap.P99 - base.Gap.P99
	}
	if l, r := byName[PathLLMProxy], byName[PathReverseProxy]; l != nil && r != nil {
		lr.RatioP50 = ratio(l.AddedTTFTP50, r.AddedTTFTP50)
		lr.RatioP99 = ratio(l.AddedTTFTP99, r.AddedTTFTP99)
	}
	return lr
}

// ratio returns a/b, or 0 when b is too small for the ratio to mean
// anything (under 1 µs, which includes "reverse_proxy added nothing").
func ratio(a, b float64) float64 {
	if b < 0.001 {
		return 0
	}
	return a / b
}

// runBatch sends n requests with at most conc in flight and returns their
// results.
func runBatch(ctx context.Context, q *Requester, n, conc int) []Result {
	results := make([]Result, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(conc, n) {
		wg.Go(func() {
			for {
				i := next.Add(1) - 1
				if i >= int64(n) || ctx.Err() != nil {
					return
				}
				results[i] = q.Do(ctx)
			}
		})
	}
	wg.Wait()
	// Requests never sent (stopped early) have no outcome; drop them.
	out := results[:0]
	for _, r := range results {
		if r.Outcome != "" {
			out = append(out, r)
		}
	}
	return out
}

// printOverhead writes the results as markdown tables.
func printOverhead(w io.Writer, rep *OverheadReport) {
	cfg := &rep.Config
	fmt.Fprintf(w, "\n### Gateway overhead: TTFT and inter-event gap\n\n")
	fmt.Fprintf(w, "Same mock upstream on every path; %s; %d CPUs; %s.\n",
		pathList(cfg), rep.CPUs, rep.Started.UTC().Format("2006-01-02 15:04 UTC"))
	if cfg.Note != "" {
		fmt.Fprintf(w, "%s.\n", strings.TrimSuffix(cfg.Note, "."))
	}
	fmt.Fprintf(w, "Paths interleaved in round-robin batches; exact percentiles over successful requests;\n")
	fmt.Fprintf(w, "*added* = path − direct (negative values are noise).\n\n")
	fmt.Fprintln(w, "| streams | path | requests | errors | TTFT p50 | TTFT p99 | added p50 | added p99 | gap p50 | gap p99 | gap added p50 | gap added p99 |")
	fmt.Fprintln(w, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, l := range rep.Levels {
		for _, p := range l.Paths {
			addT50, addT99, addG50, addG99 := "—", "—", "—", "—"
			if p.Path != PathDirect {
				addT50, addT99 = fmtAdded(p.AddedTTFTP50), fmtAdded(p.AddedTTFTP99)
				addG50, addG99 = fmtAdded(p.AddedGapP50), fmtAdded(p.AddedGapP99)
			}
			fmt.Fprintf(w, "| %d | %s | %d | %d | %s | %s | %s | %s | %s | %s | %s | %s |\n",
				l.Streams, p.Path, p.Requests, p.Errors,
				fmtFixed(p.TTFT.P50), fmtFixed(p.TTFT.P99), addT50, addT99,
				fmtFixed(p.Gap.P50), fmtFixed(p.Gap.P99), addG50, addG99)
		}
	}
	if _, ok := cfg.Paths[PathLLMProxy]; ok {
		if _, ok := cfg.Paths[PathReverseProxy]; ok {
			fmt.Fprintf(w, "\n| streams | added TTFT p50, llm_proxy / reverse_proxy | added TTFT p99, llm_proxy / reverse_proxy |\n")
			fmt.Fprintln(w, "|---:|---:|---:|")
			for _, l := range rep.Levels {
				var lp, rp *PathResult
				for i := range l.Paths {
					switch l.Paths[i].Path {
					case PathLLMProxy:
						lp = &l.Paths[i]
					case PathReverseProxy:
						rp = &l.Paths[i]
					}
				}
				fmt.Fprintf(w, "| %d | %s / %s = %s | %s / %s = %s |\n", l.Streams,
					fmtAdded(lp.AddedTTFTP50), fmtAdded(rp.AddedTTFTP50), fmtRatio(l.RatioP50),
					fmtAdded(lp.AddedTTFTP99), fmtAdded(rp.AddedTTFTP99), fmtRatio(l.RatioP99))
			}
		}
	}
	for _, l := range rep.Levels {
		for _, p := range l.Paths {
			if p.Errors > 0 {
				fmt.Fprintf(w, "\n%d streams, %s: %d errors, e.g. %s\n", l.Streams, p.Path, p.Errors, truncate(p.Example, 120))
			}
		}
	}
}

func pathList(cfg *OverheadConfig) string {
	var parts []string
	for _, name := range []string{PathDirect, PathLLMProxy, PathReverseProxy} {
		if u, ok := cfg.Paths[name]; ok {
			parts = append(parts, fmt.Sprintf("%s = %s", name, u))
		}
	}
	return strings.Join(parts, ", ")
}

func fmtFixed(v float64) string { return fmt.Sprintf("%.2f ms", v) }

func fmtAdded(v float64) string { return fmt.Sprintf("%+.2f ms", v) }

func fmtRatio(r float64) string {
	if r == 0 {
		return "n/a"
	}
	return fmt.Sprintf("%.2f×", r)
}

// latencyAcc is what the interleaved batches measured for one target.
type latencyAcc struct {
	ttft, gaps Samples
	n, errs    int64
	example    string
}

// interleaved warms every target up (unmeasured, opening the connections
// this level uses), then sends perTarget requests to each at streams
// concurrency in batches of batch, rotating which target goes first in
// each round so that drift in machine load spreads evenly over them.
// warmed, when not nil, runs between the warm-up and the measured rounds.
func interleaved(ctx context.Context, reqs map[string]*Requester, order []string, streams, perTarget, batch int, warmed func()) map[string]*latencyAcc {
	accs := map[string]*latencyAcc{}
	remaining := map[string]int{}
	for _, name := range order {
		accs[name] = &latencyAcc{}
		remaining[name] = perTarget
		runBatch(ctx, reqs[name], max(streams, 5), streams)
	}
	if warmed != nil {
		warmed()
	}
	for round := 0; ctx.Err() == nil; round++ {
		progressed := false
		for i := range order {
			name := order[(round+i)%len(order)]
			n := min(batch, remaining[name])
			if n == 0 {
				continue
			}
			progressed = true
			remaining[name] -= n
			a := accs[name]
			for _, r := range runBatch(ctx, reqs[name], n, streams) {
				a.n++
				if !r.OK() {
					a.errs++
					if a.example == "" {
						a.example = r.Outcome + ": " + r.Detail
					}
					continue
				}
				a.ttft.Add(r.TTFT)
				for _, g := range r.Gaps {
					a.gaps.Add(g)
				}
			}
		}
		if !progressed {
			break
		}
	}
	return accs
}
