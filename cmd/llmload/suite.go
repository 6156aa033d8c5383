package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Target names of the benchmark suite (`llmload suite`, scripts/bench.sh),
// in the order of its table columns. Direct is the baseline every "added"
// figure is measured against.
const (
	TargetDirect   = "direct"
	TargetLLMProxy = "llm_proxy"
	// TargetLLMProxyTenants is llm_proxy with tenants (one key, a tier
	// with limits) and saturation configured (S3 only).
	TargetLLMProxyTenants = "llm_proxy_tenants"
	TargetReverseProxy    = "reverse_proxy"
	TargetNginx           = "nginx"
)

// Suite scenarios (issue 12).
const (
	ScenarioS1  = "S1"  // latency floor: zero-delay mock, c=1
	ScenarioS3  = "S3"  // stream fidelity: c=1 and c=100
	ScenarioS4  = "S4"  // stream capacity: 1,000 / 4,000 / 5,000 streams at 1 event/s
	ScenarioS4b = "S4b" // event rate: 200 streams at 50 events/s
	ScenarioS6  = "S6"  // retry storm: 3 replicas, error rate swept 0 → 100%
)

// suiteScenarios are the scenarios `llmload suite run` drives, in the order
// of a full run; S7 (hedging) and the body burst are scripts of their own.
var suiteScenarios = []string{ScenarioS1, ScenarioS3, ScenarioS4, ScenarioS4b, ScenarioS6}

const suiteUsage = `Usage:
  llmload suite run --scenario S1|S3|S4|S4b|S6 --out DIR --target NAME=URL... [flags]
      drive one scenario against every target in turn (or interleaved), write DIR/<scenario>.json
  llmload suite report --dir DIR --md FILE [--docs docs/benchmarks.md] [--img DIR] [flags]
      the markdown tables, the target ratios (met or not) and the PNG plots of a run
  llmload suite ports N
      print N free loopback TCP ports, one a line (for scripts/bench.sh)

scripts/bench.sh (make bench) starts the mock, the gateways and nginx and runs
all of it; run 'llmload suite run -h' for the scenario flags.
`

// suiteCmd dispatches `llmload suite <run|report|ports>`.
func suiteCmd(args []string) error {
	if len(args) == 0 {
		fmt.Fprint(os.Stderr, suiteUsage)
		return usageErrorf("suite: give run, report or ports")
	}
	switch args[0] {
	case "run":
		return suiteRunCmd(args[1:])
	case "report":
		return suiteReportCmd(args[1:])
	case "ports":
		return suitePortsCmd(args[1:])
	case "-h", "--help", "help":
		fmt.Print(suiteUsage)
		return nil
	}
	return usageErrorf("suite: unknown subcommand %q", args[0])
}

// suitePortsCmd prints N loopback ports that were free a moment ago. All N
// listeners are open at once, so the ports differ.
func suitePortsCmd(args []string) error {
	if len(args) != 1 {
		return usageErrorf("suite ports: want one count")
	}
	n, err := strconv.Atoi(args[0])
	if err != nil || n < 1 || n > 100 {
		return usageErrorf("suite ports: %q: want 1 to 100", args[0])
	}
	var lns []net.Listener
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return fmt.Errorf("suite ports: %w", err)
		}
		lns = append(lns, ln)
		fmt.Println(ln.Addr().(*net.TCPAddr).Port)
	}
	return nil
}

// SuiteTarget is one side of the comparison: a base URL for the
// single-upstream scenarios, one in front of three replicas for S6, and the
// process whose CPU and memory S4/S4b read (0 for direct: there is no
// proxy process).
type SuiteTarget struct {
	Name     string `json:"name"`
	URL      string `json:"url"`
	StormURL string `json:"storm_url,omitempty"`
	PID      int    `json:"pid,omitempty"`
	// MetricsURL is the process's Prometheus endpoint (Caddy's admin
	// /metrics), for its allocations (go_memstats_mallocs_total) in S3;
	// "" when it has none.
	MetricsURL string `json:"metrics_url,omitempty"`
}

// SuiteConfig is what `llmload suite run` was asked to do.
type SuiteConfig struct {
	Scenario string        `json:"scenario"`
	Targets  []SuiteTarget `json:"targets"`
	// Mock is the base URL of a mock replica (for /mock/stats and
	// /mock/reset, which answer for the whole fleet).
	Mock  string `json:"mock"`
	Smoke bool   `json:"smoke"`
	// LateAfter is how late an event may arrive before it counts as late
	// (S4, S4b): 50 ms, issue 12's bound.
	LateAfter time.Duration `json:"late_after_ns"`
	Timeout   time.Duration `json:"timeout_ns"`
	// Levels overrides the scenario's concurrency levels ("" keeps them).
	Levels string `json:"levels,omitempty"`
	// Window overrides the measured window of S4/S4b (0 keeps it).
	Window time.Duration `json:"window_ns,omitempty"`
	// Header is sent with every request of S1 and S3 (e.g. the API key
	// of the llm_proxy_tenants target; the others pass it on).
	Header http.Header `json:"header,omitempty"`
	// Runs is how many times S3's 100-stream level is measured (each run
	// interleaves every target); its goals take the median (default 3).
	Runs int `json:"runs,omitempty"`
}

func suiteRunCmd(args []string) error {
	fs := newFlagSet("suite run", "Drive one scenario of the benchmark suite (issue 12) against every target\n"+
		"and write DIR/<scenario>.json. Targets are named direct, llm_proxy, reverse_proxy, nginx;\n"+
		"direct is the baseline and must come first.")
	var (
		cfg         SuiteConfig
		targets     targetFlag
		storms      targetFlag
		pids        listFlag
		metrics     targetFlag
		headers     listFlag
		out         string
		allowRemote bool
		maxDuration time.Duration
	)
	fs.StringVar(&cfg.Scenario, "scenario", "", "one of "+strings.Join(suiteScenarios, ", ")+" (required)")
	fs.Var(&targets, "target", "`name=url` of a target's single-upstream site (repeatable; direct first)")
	fs.Var(&storms, "storm", "`name=url` of a target's three-replica site for S6 (repeatable)")
	fs.Var(&pids, "pid", "`name=pid` of a target's process for CPU and RSS (repeatable; its descendants count too)")
	fs.Var(&metrics, "metrics", "`name=url` of a target process's Prometheus endpoint, for its allocations per request in S3 (repeatable)")
	fs.Var(&headers, "header", "request `header` 'Key: Value' sent with every request of S1 and S3 (repeatable)")
	fs.IntVar(&cfg.Runs, "runs", 3, "measure S3's 100-stream level this many times (its goals take the median)")
	fs.StringVar(&cfg.Mock, "mock", "", "base `url` of a mock replica (required for S6)")
	fs.StringVar(&out, "out", "", "`directory` for <scenario>.json (required)")
	fs.BoolVar(&cfg.Smoke, "smoke", false, "tiny sizes: a few seconds per scenario (CI)")
	fs.DurationVar(&cfg.LateAfter, "late-after", 50*time.Millisecond, "an event later than this behind its schedule is late (S4, S4b)")
	fs.DurationVar(&cfg.Timeout, "timeout", 30*time.Second, "bound on one request (S1, S3, S6)")
	fs.StringVar(&cfg.Levels, "levels", "", "override the scenario's `levels` (streams), e.g. 1000,4000")
	fs.DurationVar(&cfg.Window, "window", 0, "override the measured window of S4/S4b")
	fs.DurationVar(&maxDuration, "max-duration", 10*time.Minute, "stop (and write what was measured) after this long")
	fs.BoolVar(&allowRemote, "allow-remote", false, "allow targets that are not loopback addresses")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if !slices.Contains(suiteScenarios, cfg.Scenario) {
		return usageErrorf("--scenario %q: want one of %s", cfg.Scenario, strings.Join(suiteScenarios, ", "))
	}
	if out == "" {
		return usageErrorf("--out is required")
	}
	if len(targets) == 0 || targets[0].Name != TargetDirect {
		return usageErrorf("give --target direct=URL first, then the proxies")
	}
	byName := map[string]*SuiteTarget{}
	for _, t := range targets {
		u, err := checkTarget(t.URL, allowRemote)
		if err != nil {
			return err
		}
		cfg.Targets = append(cfg.Targets, SuiteTarget{Name: t.Name, URL: strings.TrimSuffix(u.String(), "/")})
	}
	for i := range cfg.Targets {
		byName[cfg.Targets[i].Name] = &cfg.Targets[i]
	}
	for _, s := range storms {
		t := byName[s.Name]
		if t == nil {
			return usageErrorf("--storm %s: no --target of that name", s.Name)
		}
		u, err := checkTarget(s.URL, allowRemote)
		if err != nil {
			return err
		}
		t.StormURL = strings.TrimSuffix(u.String(), "/")
	}
	for _, p := range pids {
		name, v, ok := strings.Cut(p, "=")
		pid, err := strconv.Atoi(v)
		if !ok || err != nil || pid < 1 {
			return usageErrorf("--pid %q: want name=pid", p)
		}
		t := byName[name]
		if t == nil {
			return usageErrorf("--pid %s: no --target of that name", name)
		}
		t.PID = pid
	}
	for _, m := range metrics {
		t := byName[m.Name]
		if t == nil {
			return usageErrorf("--metrics %s: no --target of that name", m.Name)
		}
		u, err := checkTarget(m.URL, allowRemote)
		if err != nil {
			return err
		}
		t.MetricsURL = u.String()
	}
	for _, h := range headers {
		k, v, ok := strings.Cut(h, ":")
		if !ok || strings.TrimSpace(k) == "" {
			return usageErrorf("--header %q: want 'Key: Value'", h)
		}
		if cfg.Header == nil {
			cfg.Header = http.Header{}
		}
		cfg.Header.Add(strings.TrimSpace(k), strings.TrimSpace(v))
	}
	if cfg.Runs < 1 {
		return usageErrorf("--runs %d: want at least 1", cfg.Runs)
	}
	if cfg.Scenario == ScenarioS6 && cfg.Mock == "" {
		return usageErrorf("S6 needs --mock")
	}
	if cfg.Mock != "" {
		m, err := mockBase(cfg.Mock, allowRemote)
		if err != nil {
			return err
		}
		cfg.Mock = m
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, maxDuration)
	defer cancel()

	started := time.Now()
	var rep any
	var err error
	switch cfg.Scenario {
	case ScenarioS1, ScenarioS3:
		rep, err = runLatencyScenario(ctx, &cfg)
	case ScenarioS4, ScenarioS4b:
		rep, err = runStreamsScenario(ctx, &cfg)
	case ScenarioS6:
		rep, err = runStormScenario(ctx, &cfg)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", cfg.Scenario, err)
	}
	path := filepath.Join(out, cfg.Scenario+".json")
	if err := writeJSON(path, rep); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "llmload suite: %s done in %s, %s\n", cfg.Scenario, time.Since(started).Round(100*time.Millisecond), path)
	if ctx.Err() != nil {
		return fmt.Errorf("%s stopped early: %w", cfg.Scenario, context.Cause(ctx))
	}
	return nil
}

// suiteLog prints a progress line on stderr.
func suiteLog(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "llmload suite: "+format+"\n", args...)
}

// mockHeaders returns the X-Mock-* request headers that ask every mock
// replica for a TTFT, a number of tokens and their interval (the mock reads
// them per request, so one mock fleet serves every scenario; the proxies
// pass them through).
func mockHeaders(ttft time.Duration, tokens int, interval time.Duration) http.Header {
	return http.Header{
		"X-Mock-Ttft":           {ttft.String()},
		"X-Mock-Tokens":         {strconv.Itoa(tokens)},
		"X-Mock-Token-Interval": {interval.String()},
	}
}
