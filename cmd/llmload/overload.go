package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
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

// The policies of the overload scenario (issue 9's benchmark), by the names
// the verdict looks for.
const (
	PolicyRoundRobin = "round_robin"
	PolicyLeastConn  = "least_conn"
	PolicyLeastQueue = "least_queue"
)

// OverloadTarget is one gateway of the overload scenario: a name (its
// selection policy) and the URL it listens on.
type OverloadTarget struct {
	Name string `json:"name"`
	URL  string `json:"url"`
}

// OverloadConfig is the configuration of `llmload overload`.
type OverloadConfig struct {
	// Targets run one after another, in this order, against the same
	// fleet.
	Targets []OverloadTarget `json:"targets"`
	// Mocks are the base URLs of one replica of each mockllm process: the
	// fleet is drained and its statistics reset before each phase.
	Mocks []string `json:"mocks,omitempty"`
	// Straggler is the address (host:port) of the slow replica, marked in
	// the report.
	Straggler string `json:"straggler,omitempty"`

	// Rate is the arrival rate, the same for every phase: Poisson
	// arrivals from Seed, so each phase sees the same arrival times.
	Rate     float64       `json:"rate"`
	Warmup   time.Duration `json:"warmup_ns"`
	Duration time.Duration `json:"duration_ns"`
	// Grace is how long a phase waits for requests in flight after its
	// last arrival before it cancels them (they count as censored).
	Grace        time.Duration `json:"grace_ns"`
	Timeout      time.Duration `json:"timeout_ns"`
	DrainTimeout time.Duration `json:"drain_timeout_ns"`
	MaxInflight  int           `json:"max_inflight"`
	PromptBytes  int           `json:"prompt_bytes"`
	MaxTokens    int           `json:"max_tokens"`
	Seed         uint64        `json:"seed"`

	Goal OverloadGoal `json:"goal"`
}

// OverloadReport is what `llmload overload --json` writes.
type OverloadReport struct {
	Config  OverloadConfig  `json:"config"`
	Machine Machine         `json:"machine"`
	Started time.Time       `json:"started"`
	Phases  []PhaseResult   `json:"phases"`
	Verdict OverloadVerdict `json:"verdict"`
}

// Machine is where the run happened: load generator, gateway and fleet
// share it.
type Machine struct {
	CPUs       int    `json:"cpus"`
	GOOS       string `json:"goos"`
	GOARCH     string `json:"goarch"`
	LoadBefore string `json:"load_average_before,omitempty"`
	LoadAfter  string `json:"load_average_after,omitempty"`
}

func overloadCmd(args []string) error {
	fs := newFlagSet("overload", "The overload scenario: open-loop arrivals at a fixed rate through gateways that\n"+
		"differ only in their selection policy, one after another against the same\n"+
		"capacity-limited mock fleet (drained and reset between phases, each phase warmed\n"+
		"up). Reports TTFT p50/p99, throughput and each replica's share of the requests as\n"+
		"a markdown table, a verdict for --candidate against the others, and plots the\n"+
		"TTFT CDFs.")
	var (
		cfg         OverloadConfig
		targets     targetFlag
		mocks       listFlag
		maxRatio    string
		jsonOut     string
		plotOut     string
		allowRemote bool
	)
	fs.Var(&targets, "target", "`name=url` of a gateway (repeatable; the phases run in this order), e.g. round_robin=http://127.0.0.1:8111")
	fs.Var(&mocks, "mock", "base `url` of a mockllm replica (repeatable: one per mockllm process): drain and reset the fleet before each phase")
	fs.StringVar(&cfg.Straggler, "straggler", "", "`host:port` of the straggler replica, marked in the report")
	fs.Float64Var(&cfg.Rate, "rate", 30, "arrival rate, requests per second (Poisson), the same for every phase")
	fs.DurationVar(&cfg.Warmup, "warmup", 5*time.Second, "arrivals before the measured window of each phase (not measured)")
	fs.DurationVar(&cfg.Duration, "duration", 30*time.Second, "measured window of each phase")
	fs.DurationVar(&cfg.Grace, "grace", 10*time.Second, "after a phase's last arrival, wait this long for requests in flight, then cancel them")
	fs.DurationVar(&cfg.Timeout, "timeout", 30*time.Second, "bound on one request")
	fs.DurationVar(&cfg.DrainTimeout, "drain-timeout", 30*time.Second, "bound on waiting for the fleet to drain before a phase")
	fs.IntVar(&cfg.MaxInflight, "max-inflight", 2000, "bound on requests in flight (arrivals beyond are counted as dropped)")
	fs.IntVar(&cfg.PromptBytes, "prompt-bytes", 200, "prompt size")
	fs.IntVar(&cfg.MaxTokens, "max-tokens", 0, "max_tokens of each request (0: the mock's token count)")
	fs.Uint64Var(&cfg.Seed, "seed", 1, "seed of the arrival times")
	fs.StringVar(&cfg.Goal.Candidate, "candidate", PolicyLeastQueue, "the target `name` the verdict judges")
	fs.StringVar(&maxRatio, "max-ratio", "round_robin=0.5,least_conn=0.8", "the candidate's p99 TTFT at most these fractions of the others' (`name=ratio,...`)")
	fs.Float64Var(&cfg.Goal.ThroughputTolerance, "throughput-tolerance", 0.05, "equal throughput: the candidate's at least (1 - this) × each other's")
	fs.StringVar(&jsonOut, "json", "", "also write the report as JSON to this `file`")
	fs.StringVar(&plotOut, "plot", "", "write the TTFT CDFs of the phases as a PNG to this `file`")
	fs.BoolVar(&allowRemote, "allow-remote", false, "allow targets that are not loopback addresses")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	var err error
	if cfg.Goal.MaxRatio, err = parseRatioGoals(maxRatio); err != nil {
		return usageErrorf("--max-ratio: %v", err)
	}
	switch {
	case len(targets) == 0:
		return usageErrorf("at least one --target name=url is required")
	case cfg.Rate <= 0 || cfg.Rate > 10000:
		return usageErrorf("--rate must be in (0, 10000]")
	case cfg.Duration <= 0 || cfg.Duration > 10*time.Minute || cfg.Warmup < 0 || cfg.Warmup > 10*time.Minute:
		return usageErrorf("--duration must be in (0, 10m] and --warmup in [0, 10m]: every run is bounded")
	case cfg.Grace < 0 || cfg.Grace > 5*time.Minute || cfg.Timeout <= 0 || cfg.DrainTimeout <= 0 || cfg.MaxInflight < 1:
		return usageErrorf("--grace must be in [0, 5m], --timeout, --drain-timeout and --max-inflight positive")
	case cfg.Goal.ThroughputTolerance < 0 || cfg.Goal.ThroughputTolerance >= 1:
		return usageErrorf("--throughput-tolerance must be in [0, 1)")
	}
	for _, t := range targets {
		u, err := checkTarget(t.URL, allowRemote)
		if err != nil {
			return err
		}
		if u.Path == "" || u.Path == "/" {
			u.Path = "/v1/chat/completions"
		}
		t.URL = u.String()
		cfg.Targets = append(cfg.Targets, t)
	}
	for _, m := range mocks {
		b, err := mockBase(m, allowRemote)
		if err != nil {
			return err
		}
		cfg.Mocks = append(cfg.Mocks, b)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rep := OverloadReport{Config: cfg, Started: time.Now(), Machine: Machine{
		CPUs: runtime.NumCPU(), GOOS: runtime.GOOS, GOARCH: runtime.GOARCH, LoadBefore: loadAverage(),
	}}
	client := newHTTPClient(256)
	body := chatBody("mock-llama", true, cfg.MaxTokens, cfg.PromptBytes)
	fmt.Fprintf(os.Stderr, "llmload overload: %.1f req/s (Poisson, seed %d) for %v + %v of warm-up per phase, phases %s\n",
		cfg.Rate, cfg.Seed, cfg.Duration, cfg.Warmup, targetNames(cfg.Targets))
	for _, t := range cfg.Targets {
		if ctx.Err() != nil {
			break
		}
		if len(cfg.Mocks) > 0 {
			if err := waitFleetIdle(ctx, client, cfg.Mocks, cfg.DrainTimeout); err != nil {
				fmt.Fprintf(os.Stderr, "llmload: warning: %v\n", err)
			}
			for _, m := range cfg.Mocks {
				if err := resetMock(ctx, client, m); err != nil {
					fmt.Fprintf(os.Stderr, "llmload: warning: %v\n", err)
				}
			}
		}
		fmt.Fprintf(os.Stderr, "llmload overload: phase %s: %s\n", t.Name, t.URL)
		q := &Requester{Client: client, URL: t.URL, Timeout: cfg.Timeout, Body: body}
		ph := runOverloadPhase(ctx, q, &cfg)
		res := summarizePhase(t.Name, t.URL, ph.start, cfg.Warmup, cfg.Duration, ph.results)
		res.Dropped = ph.dropped
		if len(cfg.Mocks) > 0 {
			res.Mock = fetchPhaseReplicas(ctx, client, cfg.Mocks)
		}
		fmt.Fprintf(os.Stderr, "llmload overload: phase %s: %d requests measured, %d ok, p99 TTFT %s\n",
			t.Name, res.Requests, res.OK, fmtDist(res.TTFT, res.TTFT.P99))
		rep.Phases = append(rep.Phases, res)
	}
	rep.Machine.LoadAfter = loadAverage()
	rep.Verdict = judgeOverload(rep.Phases, cfg.Goal)
	printOverload(os.Stdout, &rep)
	if plotOut != "" {
		if err := plotOverloadCDF(plotOut, rep.Phases, cfg.Rate); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "llmload overload: plot written to %s\n", plotOut)
	}
	if jsonOut != "" {
		if err := writeJSON(jsonOut, &rep); err != nil {
			return err
		}
	}
	return ctx.Err()
}

// phaseRun is what one phase collected.
type phaseRun struct {
	start   time.Time
	results []Result
	dropped int64
}

// runOverloadPhase sends Poisson arrivals at cfg.Rate through q for
// cfg.Warmup + cfg.Duration, waits up to cfg.Grace for the requests in
// flight, then cancels the rest. The arrival times come from cfg.Seed
// alone, so every phase sees the same ones.
func runOverloadPhase(ctx context.Context, q *Requester, cfg *OverloadConfig) phaseRun {
	start := time.Now()
	end := start.Add(cfg.Warmup + cfg.Duration)
	reqCtx, cancelReqs := context.WithCancel(ctx)
	defer cancelReqs()
	hardStop := time.AfterFunc(cfg.Warmup+cfg.Duration+cfg.Grace, cancelReqs)
	defer hardStop.Stop()

	var (
		mu       sync.Mutex
		results  []Result
		dropped  int64
		issued   atomic.Int64
		inflight atomic.Int64
		wg       sync.WaitGroup
	)
	sem := make(chan struct{}, cfg.MaxInflight)
	stopProgress := phaseProgress(start, &issued, &inflight)
	defer stopProgress()
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x6f76))
	next := start
arrivals:
	for {
		next = next.Add(time.Duration(rng.ExpFloat64() / cfg.Rate * float64(time.Second)))
		if !next.Before(end) {
			break
		}
		t := time.NewTimer(time.Until(next))
		select {
		case <-ctx.Done():
			t.Stop()
			break arrivals
		case <-t.C:
		}
		select {
		case sem <- struct{}{}:
		default:
			dropped++
			continue
		}
		issued.Add(1)
		inflight.Add(1)
		wg.Go(func() {
			defer func() { <-sem; inflight.Add(-1) }()
			r := q.Do(reqCtx)
			r.Gaps, r.Detail = nil, truncate(r.Detail, 200) // keeps memory flat
			mu.Lock()
			results = append(results, r)
			mu.Unlock()
		})
	}
	wg.Wait()
	return phaseRun{start: start, results: results, dropped: dropped}
}

// phaseProgress prints a line every 5 s on stderr while a phase runs.
func phaseProgress(start time.Time, issued, inflight *atomic.Int64) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(5 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				fmt.Fprintf(os.Stderr, "  %5.0fs  issued %d, in flight %d\n", time.Since(start).Seconds(), issued.Load(), inflight.Load())
			}
		}
	})
	return func() { close(done); wg.Wait() }
}

// mockLoad is the part of GET /mock/stats that the overload scenario reads:
// each replica's scheduler gauges and its counts since the last reset.
type mockLoad struct {
	Replicas []struct {
		Addr        string `json:"addr"`
		Requests    int64  `json:"requests"`
		Completed   int64  `json:"completed"`
		Cancelled   int64  `json:"cancelled"`
		InFlight    int    `json:"in_flight"`
		MaxInFlight int    `json:"max_in_flight"`
		Running     int    `json:"running"`
		Waiting     int    `json:"waiting"`
	} `json:"replicas"`
}

func fetchMockLoad(ctx context.Context, client *http.Client, base string) (*mockLoad, error) {
	b, err := mockCall(ctx, client, http.MethodGet, base+mockStatsPath)
	if err != nil {
		return nil, err
	}
	var m mockLoad
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("mock stats %s: %w", base+mockStatsPath, err)
	}
	return &m, nil
}

// waitFleetIdle waits until every replica of every mock reports nothing
// running, nothing waiting and nothing in flight.
func waitFleetIdle(ctx context.Context, client *http.Client, mocks []string, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		busy := []string{}
		for _, base := range mocks {
			m, err := fetchMockLoad(ctx, client, base)
			if err != nil {
				return err
			}
			for _, r := range m.Replicas {
				if r.Running != 0 || r.Waiting != 0 || r.InFlight != 0 {
					busy = append(busy, fmt.Sprintf("%s (%d running, %d waiting)", r.Addr, r.Running, r.Waiting))
				}
			}
		}
		if len(busy) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("mock fleet not drained after %v: %s", d, strings.Join(busy, ", "))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// fetchPhaseReplicas reads what each replica counted during the phase
// (since the reset before it); nil when a mock does not answer.
func fetchPhaseReplicas(ctx context.Context, client *http.Client, mocks []string) []PhaseReplica {
	var out []PhaseReplica
	for _, base := range mocks {
		m, err := fetchMockLoad(ctx, client, base)
		if err != nil {
			fmt.Fprintf(os.Stderr, "llmload: warning: %v\n", err)
			return nil
		}
		for _, r := range m.Replicas {
			out = append(out, PhaseReplica{Addr: r.Addr, Requests: r.Requests, Completed: r.Completed,
				Cancelled: r.Cancelled, MaxInFlight: r.MaxInFlight})
		}
	}
	return out
}

// targetFlag collects repeated --target name=url flags.
type targetFlag []OverloadTarget

func (f *targetFlag) String() string {
	if f == nil {
		return ""
	}
	parts := make([]string, len(*f))
	for i, t := range *f {
		parts[i] = t.Name + "=" + t.URL
	}
	return strings.Join(parts, ",")
}

func (f *targetFlag) Set(s string) error {
	name, u, ok := strings.Cut(s, "=")
	name, u = strings.TrimSpace(name), strings.TrimSpace(u)
	if !ok || name == "" || u == "" {
		return fmt.Errorf("target %q: want name=url", s)
	}
	for _, t := range *f {
		if t.Name == name {
			return fmt.Errorf("target %q: name %s given twice", s, name)
		}
	}
	*f = append(*f, OverloadTarget{Name: name, URL: u})
	return nil
}

// listFlag collects a repeated string flag.
type listFlag []string

func (f *listFlag) String() string { return strings.Join(*f, ",") }

func (f *listFlag) Set(s string) error {
	if s = strings.TrimSpace(s); s == "" {
		return fmt.Errorf("empty value")
	}
	*f = append(*f, s)
	return nil
}

// parseRatioGoals parses "name=ratio,name=ratio" in order.
func parseRatioGoals(s string) ([]RatioGoal, error) {
	var out []RatioGoal
	for _, part := range strings.Split(s, ",") {
		if part = strings.TrimSpace(part); part == "" {
			continue
		}
		name, v, ok := strings.Cut(part, "=")
		r, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if !ok || strings.TrimSpace(name) == "" || err != nil || !(r > 0) {
			return nil, fmt.Errorf("%q: want name=ratio with a positive ratio", part)
		}
		out = append(out, RatioGoal{Baseline: strings.TrimSpace(name), Max: r})
	}
	return out, nil
}

func targetNames(ts []OverloadTarget) string {
	names := make([]string, len(ts))
	for i, t := range ts {
		names[i] = t.Name
	}
	return strings.Join(names, ", ")
}

// loadAverage is the 1, 5 and 15 minute load averages, "" where unknown.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}
