package main

import (
	"context"
	"encoding/json"
	"fmt"
	"image/color"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"
)

// PolicyPrefixCache is lb_policy prefix_cache (issue 21).
const PolicyPrefixCache = "prefix_cache"

// PrefixConfig is the configuration of `llmload prefix` (scenario S8 of
// make bench, issue 21): multi-turn conversations, each with a long system
// prompt of its own, sent through each target in turn to one mock fleet
// whose replicas model vLLM's prefix cache (mockllm --prefix-cache).
type PrefixConfig struct {
	Targets []OverloadTarget `json:"targets"`
	// Mock is a mock replica's base URL (its /mock/stats lists the fleet,
	// whose /metrics give the prefix-cache counters).
	Mock string `json:"mock"`
	// Conversations, Turns and SystemChars shape the load; Concurrency is
	// how many conversations run at once (each its turns in order).
	Conversations int `json:"conversations"`
	Turns         int `json:"turns"`
	SystemChars   int `json:"system_chars"`
	Concurrency   int `json:"concurrency"`
	// Tokens is X-Mock-Tokens, the answer's length in tokens.
	Tokens  int           `json:"tokens"`
	Timeout time.Duration `json:"timeout_ns"`
}

// PrefixRun is what one target did with the conversations.
type PrefixRun struct {
	Name string `json:"name"`
	// HitRatio is the share of the prompts' tokens the fleet's prefix
	// caches found (vllm:prefix_cache_hits_total over queries_total,
	// increase during the run).
	HitRatio  float64        `json:"hit_ratio"`
	Requests  int            `json:"requests"`
	Failed    int            `json:"failed"`
	TTFT      Dist           `json:"ttft_ms"`
	ByReplica map[string]int `json:"by_replica"`
	Seconds   float64        `json:"seconds"`

	ttfts []time.Duration
}

// PrefixReport is the JSON of `llmload prefix`.
type PrefixReport struct {
	Config PrefixConfig `json:"config"`
	Runs   []PrefixRun  `json:"runs"`
}

func prefixCmd(args []string) error {
	fs := newFlagSet("prefix", "Multi-turn conversations with long system prompts through each target in turn, to one\n"+
		"mock fleet with a prefix cache (mockllm --prefix-cache): the fleet's prefix-cache hit ratio,\n"+
		"TTFT p50/p99 and requests per replica for each target (make bench's S8, issue 21).")
	var (
		cfg         PrefixConfig
		targets     targetFlag
		jsonPath    string
		plotPath    string
		mdPath      string
		allowRemote bool
	)
	fs.Var(&targets, "target", "`name=url` of a site in front of the fleet (repeatable; run in order)")
	fs.StringVar(&cfg.Mock, "mock", "", "base `url` of a mock replica (required)")
	fs.IntVar(&cfg.Conversations, "conversations", 36, "conversations per target")
	fs.IntVar(&cfg.Turns, "turns", 4, "turns per conversation")
	fs.IntVar(&cfg.SystemChars, "system-chars", 6000, "characters of each conversation's system prompt")
	fs.IntVar(&cfg.Concurrency, "concurrency", 9, "conversations at once")
	fs.IntVar(&cfg.Tokens, "tokens", 8, "tokens per answer (X-Mock-Tokens)")
	fs.DurationVar(&cfg.Timeout, "timeout", 30*time.Second, "bound on one request")
	fs.StringVar(&jsonPath, "json", "", "write the report to this `file`")
	fs.StringVar(&plotPath, "plot", "", "write a PNG of the TTFT CDFs to this `file`")
	fs.StringVar(&mdPath, "md", "", "write the markdown table to this `file` (also printed)")
	fs.BoolVar(&allowRemote, "allow-remote", false, "allow targets that are not loopback addresses")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if len(targets) == 0 || cfg.Mock == "" {
		return usageErrorf("give --target name=url (one or more) and --mock")
	}
	if cfg.Conversations < 1 || cfg.Turns < 1 || cfg.Concurrency < 1 || cfg.SystemChars < 1 {
		return usageErrorf("--conversations, --turns, --concurrency and --system-chars must be positive")
	}
	for _, t := range targets {
		u, err := checkTarget(t.URL, allowRemote)
		if err != nil {
			return err
		}
		cfg.Targets = append(cfg.Targets, OverloadTarget{Name: t.Name, URL: strings.TrimSuffix(u.String(), "/")})
	}
	m, err := mockBase(cfg.Mock, allowRemote)
	if err != nil {
		return err
	}
	cfg.Mock = m

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	client := newHTTPClient(cfg.Concurrency * 2)
	rep := PrefixReport{Config: cfg}
	for _, t := range cfg.Targets {
		if err := waitFleetIdle(ctx, client, []string{cfg.Mock}, 30*time.Second); err != nil {
			return err
		}
		run, err := runPrefixTarget(ctx, client, &cfg, t)
		if err != nil {
			return fmt.Errorf("%s: %w", t.Name, err)
		}
		fmt.Fprintf(os.Stderr, "llmload prefix: %s: hit ratio %.2f, TTFT p50 %s p99 %s, %d requests (%d failed) in %.1fs\n",
			t.Name, run.HitRatio, fmtMS(run.TTFT.P50), fmtMS(run.TTFT.P99), run.Requests, run.Failed, run.Seconds)
		rep.Runs = append(rep.Runs, run)
	}
	md := prefixTable(&rep)
	fmt.Print(md)
	if mdPath != "" {
		if err := os.WriteFile(mdPath, []byte(md), 0o644); err != nil {
			return err
		}
	}
	if jsonPath != "" {
		if err := writeJSON(jsonPath, rep); err != nil {
			return err
		}
	}
	if plotPath != "" {
		var lines []cdfLine
		for i, r := range rep.Runs {
			c, ok := policyColors[r.Name]
			if !ok {
				c = fallbackColors[i%len(fallbackColors)]
			}
			lines = append(lines, cdfLine{Name: r.Name, P99: r.TTFT.P99, TTFTs: r.ttfts, Color: c})
		}
		title := fmt.Sprintf("TTFT of %d conversations × %d turns, %d-character system prompts (CDF)", cfg.Conversations, cfg.Turns, cfg.SystemChars)
		if err := plotCDFs(plotPath, title, "target", lines); err != nil {
			return err
		}
	}
	return nil
}

func init() { policyColors[PolicyPrefixCache] = color.RGBA{R: 0x1f, G: 0x78, B: 0xb4, A: 0xff} }

// prefixConversation is one chat of `llmload prefix`.
type prefixConversation struct {
	msgs []map[string]string
}

func newPrefixConversation(target string, id, systemChars int) *prefixConversation {
	head := fmt.Sprintf("[%s: conversation %03d] You are assistant %03d. ", target, id, id)
	rule := fmt.Sprintf("Rule %03d: answer precisely, cite your sources and keep it short. ", id)
	sys := head + strings.Repeat(rule, systemChars/len(rule)+1)
	return &prefixConversation{msgs: []map[string]string{{"role": "system", "content": sys[:systemChars]}}}
}

func (c *prefixConversation) ask(turn, tokens int) []byte {
	c.msgs = append(c.msgs, map[string]string{"role": "user", "content": fmt.Sprintf("Question %d: %s", turn, strings.Repeat("tell me more, ", 15))})
	b, _ := json.Marshal(map[string]any{"model": "mock-llama", "stream": true, "max_tokens": tokens, "messages": c.msgs})
	return b
}

func (c *prefixConversation) answered(turn int) {
	c.msgs = append(c.msgs, map[string]string{"role": "assistant", "content": fmt.Sprintf("Answer %d: %s", turn, strings.Repeat("it depends. ", 25))})
}

// runPrefixTarget runs the conversations through one target.
func runPrefixTarget(ctx context.Context, client *http.Client, cfg *PrefixConfig, t OverloadTarget) (PrefixRun, error) {
	replicas, err := fetchMockLoad(ctx, client, cfg.Mock)
	if err != nil {
		return PrefixRun{}, err
	}
	var addrs []string
	for _, r := range replicas.Replicas {
		addrs = append(addrs, r.Addr)
	}
	q0, h0, err := prefixCounters(ctx, client, addrs)
	if err != nil {
		return PrefixRun{}, err
	}
	run := PrefixRun{Name: t.Name, ByReplica: map[string]int{}}
	var mu sync.Mutex
	var samples Samples
	next := make(chan int)
	var wg sync.WaitGroup
	start := time.Now()
	header := mockHeaders(0, cfg.Tokens, time.Millisecond)
	header.Del("X-Mock-Ttft") // the fleet's own TTFT and prefill model
	for range cfg.Concurrency {
		wg.Go(func() {
			for id := range next {
				cv := newPrefixConversation(t.Name, id, cfg.SystemChars)
				for turn := range cfg.Turns {
					q := Requester{Client: client, URL: t.URL + "/v1/chat/completions", Body: cv.ask(turn, cfg.Tokens), Header: header, Timeout: cfg.Timeout}
					res := q.Do(ctx)
					cv.answered(turn)
					mu.Lock()
					run.Requests++
					if res.OK() && res.HasTTFT {
						samples.Add(res.TTFT)
						run.ttfts = append(run.ttfts, res.TTFT)
						run.ByReplica[res.Upstream]++
					} else {
						run.Failed++
					}
					mu.Unlock()
				}
			}
		})
	}
	for id := range cfg.Conversations {
		select {
		case next <- id:
		case <-ctx.Done():
		}
	}
	close(next)
	wg.Wait()
	run.Seconds = time.Since(start).Seconds()
	q1, h1, err := prefixCounters(ctx, client, addrs)
	if err != nil {
		return run, err
	}
	if dq := q1 - q0; dq > 0 {
		run.HitRatio = (h1 - h0) / dq
	}
	run.TTFT = samples.Dist()
	sort.Slice(run.ttfts, func(i, j int) bool { return run.ttfts[i] < run.ttfts[j] })
	return run, ctx.Err()
}

// prefixCounters sums vllm:prefix_cache_queries_total and hits_total over
// the replicas' /metrics.
func prefixCounters(ctx context.Context, client *http.Client, addrs []string) (queries, hits float64, err error) {
	for _, a := range addrs {
		s, err := scrapeMetrics(ctx, client, "http://"+a+"/metrics", "vllm:prefix_cache_")
		if err != nil {
			return 0, 0, err
		}
		for _, series := range s {
			switch series.Name {
			case "vllm:prefix_cache_queries_total":
				queries += series.Value
			case "vllm:prefix_cache_hits_total":
				hits += series.Value
			}
		}
	}
	return queries, hits, nil
}

// prefixTable is the markdown table of a report: one row per target.
func prefixTable(rep *PrefixReport) string {
	var b strings.Builder
	c := rep.Config
	fmt.Fprintf(&b, "%d conversations × %d turns, %d-character system prompts, %d at a time, %d tokens per answer, through each target in turn to one mock fleet with a prefix cache.\n\n",
		c.Conversations, c.Turns, c.SystemChars, c.Concurrency, c.Tokens)
	var addrs []string
	for _, r := range rep.Runs {
		for a := range r.ByReplica {
			if !slices.Contains(addrs, a) {
				addrs = append(addrs, a)
			}
		}
	}
	sort.Strings(addrs)
	b.WriteString("| policy | prefix hit ratio | TTFT p50 | TTFT p99 | TTFT mean | requests per replica | failed |\n|---|---|---|---|---|---|---|\n")
	for _, r := range rep.Runs {
		var shares []string
		for _, a := range addrs {
			shares = append(shares, fmt.Sprintf("%d (%.0f%%)", r.ByReplica[a], 100*float64(r.ByReplica[a])/float64(max(r.Requests-r.Failed, 1))))
		}
		fmt.Fprintf(&b, "| %s | %.2f | %s | %s | %s | %s | %d |\n", r.Name, r.HitRatio, fmtMS(r.TTFT.P50), fmtMS(r.TTFT.P99), fmtMS(r.TTFT.Mean),
			strings.Join(shares, " / "), r.Failed)
	}
	b.WriteString("\nReplicas in the order " + strings.Join(addrs, ", ") + ".\n")
	return b.String()
}
