package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Arm names of the isolation scenario, in the order they run.
const (
	ArmSolo        = "victims-alone"
	ArmNoAdmission = "noisy-no-admission"
	ArmAdmission   = "noisy-with-admission"
)

// IsolationConfig is the configuration of `llmload isolation`. The keys
// are never written to the report.
type IsolationConfig struct {
	SoloURL      string `json:"solo_url"`
	PlainURL     string `json:"plain_url"`
	AdmissionURL string `json:"admission_url"`
	MockURL      string `json:"mock_url,omitempty"`

	NoisyKey   string   `json:"-"`
	VictimKeys []string `json:"-"`

	Duration time.Duration `json:"duration_ns"`
	Grace    time.Duration `json:"grace_ns"`
	Timeout  time.Duration `json:"timeout_ns"`

	// Slots is the fleet's capacity (concurrent generations), for the
	// noisy tenant's fair share.
	Slots int `json:"slots"`
	// VictimRate is each victim's request rate (Poisson arrivals).
	VictimRate        float64 `json:"victim_rate"`
	VictimPromptBytes int     `json:"victim_prompt_bytes"`
	VictimMaxTokens   int     `json:"victim_max_tokens"`
	// NoisyFactor times its fair share: NoisyRate = NoisyFactor × Slots ÷
	// tenants ÷ LongHold, unless NoisyRate is given.
	NoisyFactor     float64       `json:"noisy_factor"`
	NoisyRate       float64       `json:"noisy_rate"`
	LongPromptBytes int           `json:"long_prompt_bytes"`
	LongMaxTokens   int           `json:"long_max_tokens"`
	LongHold        time.Duration `json:"long_hold_ns"`
	MaxInflight     int           `json:"max_inflight"`

	// AccessLog is the admission gateway's JSON access log, read for the
	// gateway-side duration of its 429s.
	AccessLog   string `json:"access_log,omitempty"`
	NoisyTenant string `json:"noisy_tenant,omitempty"`
	Seed        uint64 `json:"seed"`

	Target IsolationTarget `json:"target"`
}

// IsolationReport is what `llmload isolation --json` writes.
type IsolationReport struct {
	Config  IsolationConfig  `json:"config"`
	Started time.Time        `json:"started"`
	Arms    []ArmResult      `json:"arms"`
	Verdict IsolationVerdict `json:"verdict"`
}

func isolationCmd(args []string) error {
	fs := newFlagSet("isolation", "The noisy-neighbour scenario: victims B, C, D send a normal load while the noisy\n"+
		"tenant A sends ten times its fair share of long requests, in three arms in one run:\n"+
		"victims alone, with A through a gateway without admission control, and with A\n"+
		"through a gateway with admission control. Reports the victims' TTFT (p99 against\n"+
		"solo) and how fast A's refusals are decided; plots the victims' TTFT CDFs.")
	var (
		cfg         IsolationConfig
		victimKeys  string
		jsonOut     string
		plotOut     string
		allowRemote bool
	)
	fs.StringVar(&cfg.PlainURL, "plain", "", "base `url` of a gateway WITHOUT admission control (required)")
	fs.StringVar(&cfg.AdmissionURL, "admission", "", "base `url` of a gateway WITH admission control (required)")
	fs.StringVar(&cfg.SoloURL, "solo", "", "base `url` for the victims-alone arm (default: --plain)")
	fs.StringVar(&cfg.MockURL, "mock", "", "a mockllm replica's base `url`: wait for the fleet to drain before each arm")
	fs.StringVar(&cfg.NoisyKey, "noisy-key", "", "the noisy tenant's API `key` (sent as Authorization: Bearer)")
	fs.StringVar(&victimKeys, "victim-keys", "", "comma-separated API `keys` of the victims (B, C, D)")
	fs.DurationVar(&cfg.Duration, "duration", 15*time.Second, "length of each arm")
	fs.DurationVar(&cfg.Grace, "grace", 3*time.Second, "after an arm, wait this long for requests in flight, then cancel them")
	fs.DurationVar(&cfg.Timeout, "timeout", 30*time.Second, "bound on one request")
	fs.IntVar(&cfg.Slots, "slots", 16, "the fleet's concurrent generations (replicas × capacity), for A's fair share")
	fs.Float64Var(&cfg.VictimRate, "victim-rate", 8, "requests per second of each victim")
	fs.IntVar(&cfg.VictimPromptBytes, "victim-prompt-bytes", 200, "prompt size of the victims' requests")
	fs.IntVar(&cfg.VictimMaxTokens, "victim-max-tokens", 20, "max_tokens of the victims' requests")
	fs.Float64Var(&cfg.NoisyFactor, "noisy-factor", 10, "A's load in multiples of its fair share")
	fs.Float64Var(&cfg.NoisyRate, "noisy-rate", 0, "A's request rate (0: --noisy-factor × slots ÷ tenants ÷ --long-hold)")
	fs.IntVar(&cfg.LongPromptBytes, "long-prompt-bytes", 8000, "prompt size of A's long requests")
	fs.IntVar(&cfg.LongMaxTokens, "long-max-tokens", 200, "max_tokens of A's long requests")
	fs.DurationVar(&cfg.LongHold, "long-hold", 2050*time.Millisecond, "how long one of A's requests holds a slot (TTFT + tokens × interval)")
	fs.IntVar(&cfg.MaxInflight, "max-inflight", 4000, "bound on requests in flight (arrivals beyond are counted as dropped)")
	fs.StringVar(&cfg.AccessLog, "access-log", "", "the admission gateway's JSON access log `file`: gateway-side duration of A's 429s")
	fs.StringVar(&cfg.NoisyTenant, "noisy-tenant", "", "A's tenant id in the access log's llm_tenant field (default: every 429)")
	fs.Uint64Var(&cfg.Seed, "seed", 1, "seed of the arrival times")
	fs.Float64Var(&cfg.Target.MaxRatio, "target-max-ratio", 1.2, "with admission, the victims' p99 TTFT at most this × solo")
	fs.Float64Var(&cfg.Target.MinRatioWithout, "target-min-ratio-without", 10, "without admission, expected at least this × solo")
	fs.DurationVar(&cfg.Target.MaxDecision, "target-max-decision", 100*time.Microsecond, "A's refusals decided within this at p99")
	fs.StringVar(&jsonOut, "json", "", "also write the report as JSON to this `file`")
	fs.StringVar(&plotOut, "plot", "", "write the victims' TTFT CDFs as a PNG to this `file`")
	fs.BoolVar(&allowRemote, "allow-remote", false, "allow targets that are not loopback addresses")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if cfg.PlainURL == "" || cfg.AdmissionURL == "" {
		return usageErrorf("--plain and --admission are required")
	}
	if cfg.SoloURL == "" {
		cfg.SoloURL = cfg.PlainURL
	}
	for _, k := range strings.Split(victimKeys, ",") {
		if k = strings.TrimSpace(k); k != "" {
			cfg.VictimKeys = append(cfg.VictimKeys, k)
		}
	}
	switch {
	case cfg.NoisyKey == "" || len(cfg.VictimKeys) == 0:
		return usageErrorf("--noisy-key and --victim-keys are required")
	case cfg.Duration <= 0 || cfg.Duration > 10*time.Minute:
		return usageErrorf("--duration must be in (0, 10m]: every run is bounded")
	case cfg.Slots < 1 || cfg.VictimRate <= 0 || cfg.NoisyFactor < 0 || cfg.NoisyRate < 0 || cfg.LongHold <= 0 || cfg.MaxInflight < 1:
		return usageErrorf("--slots, --victim-rate, --long-hold and --max-inflight must be positive, --noisy-factor and --noisy-rate not negative")
	}
	for _, p := range []*string{&cfg.SoloURL, &cfg.PlainURL, &cfg.AdmissionURL} {
		u, err := checkTarget(*p, allowRemote)
		if err != nil {
			return err
		}
		if u.Path == "" || u.Path == "/" {
			u.Path = "/v1/chat/completions"
		}
		*p = u.String()
	}
	if cfg.MockURL != "" {
		var err error
		if cfg.MockURL, err = mockBase(cfg.MockURL, allowRemote); err != nil {
			return err
		}
	}
	if cfg.NoisyRate == 0 {
		cfg.NoisyRate = fairRate(cfg.Slots, 1+len(cfg.VictimKeys), cfg.LongHold) * cfg.NoisyFactor
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rep := IsolationReport{Config: cfg, Started: time.Now()}
	client := newHTTPClient(256)
	fmt.Fprintf(os.Stderr, "llmload isolation: victims %d × %.1f req/s; noisy A %.1f req/s (%.0f× its fair share of %d slots), %d-byte prompts, max_tokens %d; %v per arm\n",
		len(cfg.VictimKeys), cfg.VictimRate, cfg.NoisyRate, cfg.NoisyRate/fairRate(cfg.Slots, 1+len(cfg.VictimKeys), cfg.LongHold),
		cfg.Slots, cfg.LongPromptBytes, cfg.LongMaxTokens, cfg.Duration)
	for _, arm := range []struct {
		name, url string
		noisy     bool
	}{{ArmSolo, cfg.SoloURL, false}, {ArmNoAdmission, cfg.PlainURL, true}, {ArmAdmission, cfg.AdmissionURL, true}} {
		if ctx.Err() != nil {
			break
		}
		if cfg.MockURL != "" {
			if err := waitDrained(ctx, client, cfg.MockURL, 15*time.Second); err != nil {
				fmt.Fprintf(os.Stderr, "llmload: warning: %v\n", err)
			}
		}
		var logOffset int64 = -1
		if arm.name == ArmAdmission && cfg.AccessLog != "" {
			if fi, err := os.Stat(cfg.AccessLog); err == nil {
				logOffset = fi.Size()
			} else {
				fmt.Fprintf(os.Stderr, "llmload: warning: access log: %v\n", err)
			}
		}
		fmt.Fprintf(os.Stderr, "llmload isolation: arm %s: %s\n", arm.name, arm.url)
		res := runIsolationArm(ctx, client, &cfg, arm.name, arm.url, arm.noisy)
		if logOffset >= 0 && res.Noisy != nil {
			time.Sleep(200 * time.Millisecond) // the access log is written as each handler returns
			if ds, err := readAccessLog429(cfg.AccessLog, logOffset, cfg.NoisyTenant); err != nil {
				fmt.Fprintf(os.Stderr, "llmload: warning: access log: %v\n", err)
			} else {
				d := durDist(ds)
				res.Noisy.GatewayDecision = &d
			}
		}
		rep.Arms = append(rep.Arms, res)
	}
	rep.Verdict = judgeIsolation(rep.Arms, cfg.Target)
	printIsolation(os.Stdout, &rep)
	if plotOut != "" {
		if err := plotTTFTCDF(plotOut, rep.Arms); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "llmload isolation: plot written to %s\n", plotOut)
	}
	if jsonOut != "" {
		if err := writeJSON(jsonOut, &rep); err != nil {
			return err
		}
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return nil
}

// fairRate is the request rate at which one of tenants tenants uses its
// fair share of slots with requests that hold a slot for hold.
func fairRate(slots, tenants int, hold time.Duration) float64 {
	return float64(slots) / float64(tenants) / hold.Seconds()
}

// waitDrained waits until the mock fleet holds no request.
func waitDrained(ctx context.Context, client *http.Client, mock string, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		fs, err := fetchMock(ctx, client, mock)
		if err != nil {
			return err
		}
		n := 0
		for _, r := range fs.Replicas {
			n += r.InFlight
		}
		if n == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the mock fleet still holds %d requests after %v", n, d)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// armCollector gathers one arm's results by tenant class.
type armCollector struct {
	mu      sync.Mutex
	victims []Result
	noisy   []Result
	dropped atomic.Int64
}

// runIsolationArm runs one arm: Poisson arrivals of every victim (and of
// the noisy tenant when noisy) for cfg.Duration, then cfg.Grace for the
// requests in flight, then cancels the rest.
func runIsolationArm(ctx context.Context, client *http.Client, cfg *IsolationConfig, name, url string, noisy bool) ArmResult {
	issueCtx, cancelIssue := context.WithTimeout(ctx, cfg.Duration)
	defer cancelIssue()
	reqCtx, cancelReqs := context.WithCancel(ctx)
	defer cancelReqs()
	hardStop := time.AfterFunc(cfg.Duration+cfg.Grace, cancelReqs)
	defer hardStop.Stop()

	col := &armCollector{}
	sem := make(chan struct{}, cfg.MaxInflight)
	var wg sync.WaitGroup
	start := time.Now()
	source := func(seed uint64, rate float64, q *Requester, into *[]Result) {
		rng := rand.New(rand.NewPCG(cfg.Seed, seed))
		next := time.Now()
		for {
			next = next.Add(time.Duration(rng.ExpFloat64() / rate * float64(time.Second)))
			t := time.NewTimer(time.Until(next))
			select {
			case <-issueCtx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			select {
			case sem <- struct{}{}:
			default:
				col.dropped.Add(1)
				continue
			}
			wg.Go(func() {
				defer func() { <-sem }()
				r := q.Do(reqCtx)
				r.Gaps = nil // not needed; keeps memory flat
				col.mu.Lock()
				*into = append(*into, r)
				col.mu.Unlock()
			})
		}
	}
	var sources sync.WaitGroup
	for i, k := range cfg.VictimKeys {
		q := &Requester{Client: client, URL: url, Timeout: cfg.Timeout,
			Body:   chatBody("mock-llama", true, cfg.VictimMaxTokens, cfg.VictimPromptBytes),
			Header: http.Header{"Authorization": {"Bearer " + k}}}
		sources.Go(func() { source(uint64(100+i), cfg.VictimRate, q, &col.victims) })
	}
	if noisy && cfg.NoisyRate > 0 {
		q := &Requester{Client: client, URL: url, Timeout: cfg.Timeout,
			Body:   chatBody("mock-llama", true, cfg.LongMaxTokens, cfg.LongPromptBytes),
			Header: http.Header{"Authorization": {"Bearer " + cfg.NoisyKey}}}
		sources.Go(func() { source(1, cfg.NoisyRate, q, &col.noisy) })
	}
	sources.Wait()
	wg.Wait()
	res := summarizeArm(name, url, col.victims, col.noisy, noisy)
	res.Dropped = col.dropped.Load()
	res.Elapsed = time.Since(start).Seconds()
	return res
}
