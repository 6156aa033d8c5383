package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/dustin/go-humanize"
)

// RunConfig is the configuration of `llmload run`.
type RunConfig struct {
	URL         string        `json:"url"`
	API         string        `json:"api,omitempty"`
	Concurrency int           `json:"concurrency"`
	Duration    time.Duration `json:"duration_ns"`
	Requests    int64         `json:"requests_limit"`
	Rate        float64       `json:"rate"`
	Model       string        `json:"model"`
	Stream      bool          `json:"stream"`
	MaxTokens   int           `json:"max_tokens"`
	PromptBytes int           `json:"prompt_bytes"`
	Timeout     time.Duration `json:"timeout_ns"`
	Grace       time.Duration `json:"grace_ns"`
	MetricsURL  string        `json:"metrics_url,omitempty"`
	MockURL     string        `json:"mock_url,omitempty"`
	Warmup      time.Duration `json:"warmup_ns,omitempty"`
	Label       string        `json:"label,omitempty"`
}

// RunReport is what `llmload run --json` writes.
type RunReport struct {
	Config  RunConfig     `json:"config"`
	Elapsed float64       `json:"elapsed_seconds"`
	Summary Summary       `json:"summary"`
	Gateway *GatewayDelta `json:"gateway,omitempty"`
	Mock    *MockSummary  `json:"mock,omitempty"`
}

func runCmd(args []string) error {
	fs := newFlagSet("run", "Send bounded load to one endpoint and summarize TTFT, event gaps and outcomes.")
	var (
		cfg         RunConfig
		headers     headerFlag
		jsonOut     string
		progress    bool
		allowRemote bool
		sampleCap   int
	)
	fs.StringVar(&cfg.URL, "url", "http://127.0.0.1:8089/v1/chat/completions", "`endpoint` (default: the --api's path on 127.0.0.1:8089)")
	fs.StringVar(&cfg.API, "api", APIChat, "the API to speak: chat, completions, responses (OpenAI Responses) or messages (Anthropic Messages); TTFT is taken at its first generated event")
	fs.IntVar(&cfg.Concurrency, "concurrency", 8, "concurrent requests (closed loop)")
	fs.DurationVar(&cfg.Duration, "duration", 20*time.Second, "stop sending new requests after this long")
	fs.Int64Var(&cfg.Requests, "requests", 0, "stop after this many requests (0: bounded by --duration only)")
	fs.Float64Var(&cfg.Rate, "rate", 0, "at most this many requests per second (0: as fast as --concurrency allows)")
	fs.StringVar(&cfg.Model, "model", "mock-llama", "model name in the request body")
	fs.BoolVar(&cfg.Stream, "stream", true, "request a streaming (SSE) response")
	fs.IntVar(&cfg.MaxTokens, "max-tokens", 0, "max_tokens in the request body (0: omitted)")
	fs.IntVar(&cfg.PromptBytes, "prompt-bytes", 0, "pad the prompt to this many bytes")
	fs.DurationVar(&cfg.Timeout, "timeout", 60*time.Second, "bound on one request")
	fs.DurationVar(&cfg.Grace, "grace", 10*time.Second, "after --duration, wait this long for requests in flight, then cancel them")
	fs.StringVar(&cfg.MetricsURL, "metrics-url", "", "gateway Prometheus `url` to scrape before and after (e.g. http://127.0.0.1:2019/metrics)")
	fs.StringVar(&cfg.MockURL, "mock", "", "a mockllm replica's base `url`: reset the fleet's statistics before the run, read them after (upstream requests, wasted tokens)")
	fs.DurationVar(&cfg.Warmup, "warmup", 0, "send the same load this long first, unmeasured (e.g. to let the gateway learn its hedge delay)")
	fs.StringVar(&cfg.Label, "label", "", "a name for this run in the report (see llmload compare)")
	fs.Var(&headers, "header", "request header 'Key: Value' (repeatable)")
	fs.StringVar(&jsonOut, "json", "", "also write the report as JSON to this `file`")
	fs.BoolVar(&progress, "progress", true, "show a live progress line on stderr")
	fs.BoolVar(&allowRemote, "allow-remote", false, "allow a target that is not a loopback address")
	fs.IntVar(&sampleCap, "max-samples", DefaultSampleCap, "samples kept per distribution (beyond: uniform reservoir)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if !validAPI(cfg.API) {
		return usageErrorf("--api %q: want chat, completions, responses or messages", cfg.API)
	}
	urlSet := false
	fs.Visit(func(f *flag.Flag) { urlSet = urlSet || f.Name == "url" })
	if !urlSet {
		cfg.URL = "http://127.0.0.1:8089" + apiPaths[cfg.API]
	}
	switch {
	case cfg.Concurrency < 1:
		return usageErrorf("--concurrency must be at least 1")
	case cfg.Duration <= 0:
		return usageErrorf("--duration must be positive: every run is bounded")
	case cfg.Requests < 0 || cfg.Rate < 0 || cfg.Timeout < 0 || cfg.Grace < 0 || cfg.Warmup < 0:
		return usageErrorf("--requests, --rate, --timeout, --grace and --warmup must not be negative")
	}
	if _, err := checkTarget(cfg.URL, allowRemote); err != nil {
		return err
	}
	if cfg.MetricsURL != "" {
		if _, err := checkTarget(cfg.MetricsURL, allowRemote); err != nil {
			return err
		}
	}
	if cfg.MockURL != "" {
		var err error
		if cfg.MockURL, err = mockBase(cfg.MockURL, allowRemote); err != nil {
			return err
		}
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	client := newHTTPClient(cfg.Concurrency)
	q := &Requester{
		Client:  client,
		URL:     cfg.URL,
		Body:    apiBody(cfg.API, cfg.Model, cfg.Stream, cfg.MaxTokens, cfg.PromptBytes),
		Header:  headers.h,
		Timeout: cfg.Timeout,
		API:     cfg.API,
	}

	var inflight atomic.Int64
	if cfg.Warmup > 0 {
		fmt.Fprintf(os.Stderr, "llmload: warming up for %v (not measured)\n", cfg.Warmup)
		w := cfg
		w.Duration, w.Requests = cfg.Warmup, 0
		runLoad(ctx, q, w, NewCollector(recentWindow), &inflight)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		// Let the attempts the warm-up abandoned (hedge losers) end
		// before the counters are read.
		time.Sleep(300 * time.Millisecond)
	}
	if cfg.MockURL != "" {
		if err := resetMock(ctx, client, cfg.MockURL); err != nil {
			fmt.Fprintf(os.Stderr, "llmload: warning: %v; the mock's counts are left out\n", err)
			cfg.MockURL = ""
		}
	}

	var before Scrape
	if cfg.MetricsURL != "" {
		var err error
		if before, err = scrapeMetrics(ctx, client, cfg.MetricsURL, metricPrefix); err != nil {
			fmt.Fprintf(os.Stderr, "llmload: warning: %v; the gateway counters are left out\n", err)
			cfg.MetricsURL = ""
		}
	}

	col := NewCollector(sampleCap)
	start := time.Now()
	var stopProgress func()
	if progress {
		stopProgress = startProgress(os.Stderr, start, col, &inflight)
	}
	runLoad(ctx, q, cfg, col, &inflight)
	elapsed := time.Since(start)
	if stopProgress != nil {
		stopProgress()
	}

	rep := RunReport{Config: cfg, Elapsed: elapsed.Seconds(), Summary: col.Summary()}
	if cfg.MetricsURL != "" || cfg.MockURL != "" {
		// The gateway counts a request when its handler returns, and the
		// mock sees a cancelled attempt end, a moment after the client
		// read the last byte.
		time.Sleep(300 * time.Millisecond)
	}
	if cfg.MockURL != "" {
		if fs, err := fetchMock(context.Background(), client, cfg.MockURL); err != nil {
			fmt.Fprintf(os.Stderr, "llmload: warning: %v\n", err)
		} else {
			m := summarizeMock(cfg.MockURL, fs)
			rep.Mock = &m
		}
	}
	if cfg.MetricsURL != "" {
		after, err := scrapeMetrics(context.Background(), client, cfg.MetricsURL, metricPrefix)
		if err != nil {
			fmt.Fprintf(os.Stderr, "llmload: warning: %v\n", err)
		} else {
			g := gatewayDelta(Delta(before, after))
			g.HedgeDelayMS = hedgeDelayMS(after)
			rep.Gateway = &g
		}
	}
	printRunReport(os.Stdout, &rep)
	if jsonOut != "" {
		if err := writeJSON(jsonOut, &rep); err != nil {
			return err
		}
	}
	if rep.Summary.Requests > 0 && rep.Summary.OK == 0 {
		return fmt.Errorf("no request succeeded")
	}
	return nil
}

// runLoad runs cfg.Concurrency workers until the duration, the request
// limit or ctx ends the run. Requests still in flight get cfg.Grace to
// finish, then they are cancelled.
func runLoad(ctx context.Context, q *Requester, cfg RunConfig, col *Collector, inflight *atomic.Int64) {
	issueCtx, cancelIssue := context.WithTimeout(ctx, cfg.Duration)
	defer cancelIssue()
	// Cancel, never a deadline, so that these count as cancelled, not timeouts.
	reqCtx, cancelReqs := context.WithCancel(ctx)
	defer cancelReqs()
	hardStop := time.AfterFunc(cfg.Duration+cfg.Grace, cancelReqs)
	defer hardStop.Stop()

	g := &gate{limit: cfg.Requests}
	if cfg.Rate > 0 {
		g.interval = time.Duration(float64(time.Second) / cfg.Rate)
		g.next = time.Now()
	}
	var wg sync.WaitGroup
	for range cfg.Concurrency {
		wg.Go(func() {
			for g.pass(issueCtx) {
				inflight.Add(1)
				r := q.Do(reqCtx)
				inflight.Add(-1)
				col.Add(&r)
			}
		})
	}
	wg.Wait()
}

// gate decides whether a worker may send another request: the request
// limit, the rate and the issuing deadline.
type gate struct {
	limit  int64 // 0: none
	issued atomic.Int64

	mu       sync.Mutex
	interval time.Duration // 0: no rate limit
	next     time.Time
}

func (g *gate) pass(ctx context.Context) bool {
	if ctx.Err() != nil {
		return false
	}
	if g.limit > 0 && g.issued.Add(1) > g.limit {
		return false
	}
	if g.interval == 0 {
		return true
	}
	g.mu.Lock()
	now := time.Now()
	if g.next.Before(now.Add(-g.interval)) {
		g.next = now // do not burst to catch up after a stall
	}
	at := g.next
	g.next = g.next.Add(g.interval)
	g.mu.Unlock()
	t := time.NewTimer(time.Until(at))
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// startProgress prints a progress line to w about 4 times per second
// (every 5 seconds, one line each, when w is not a terminal). The returned
// function prints the final line and stops.
func startProgress(w *os.File, start time.Time, col *Collector, inflight *atomic.Int64) func() {
	tty := isTerminal(w)
	period := 250 * time.Millisecond
	if !tty {
		period = 5 * time.Second
	}
	line := func() string {
		done, okRatio, p50, p99 := col.Progress()
		el := time.Since(start)
		rps := float64(done) / max(el.Seconds(), 1e-9)
		return fmt.Sprintf("%6.1fs  done %d  in flight %d  ok %.1f%%  ttft p50 %s p99 %s  %.1f req/s",
			el.Seconds(), done, inflight.Load(), okRatio*100, fmtDur(p50), fmtDur(p99), rps)
	}
	show := func() {
		if tty {
			fmt.Fprintf(w, "\r%s\x1b[K", line())
		} else {
			fmt.Fprintln(w, line())
		}
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(period)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				show()
			case <-done:
				return
			}
		}
	})
	return func() {
		close(done)
		wg.Wait()
		show()
		if tty {
			fmt.Fprintln(w)
		}
	}
}

func isTerminal(f *os.File) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// fmtDur formats a duration for humans with 3 significant digits.
func fmtDur(d time.Duration) string { return fmtMS(ms(d)) }

// fmtMS formats milliseconds for humans with about 3 significant digits.
func fmtMS(v float64) string {
	switch {
	case v != v: // NaN
		return "-"
	case v >= 10000:
		return fmt.Sprintf("%.1fs", v/1000)
	case v >= 1000:
		return fmt.Sprintf("%.2fs", v/1000)
	case v >= 100:
		return fmt.Sprintf("%.0fms", v)
	case v >= 10:
		return fmt.Sprintf("%.1fms", v)
	default:
		return fmt.Sprintf("%.2fms", v)
	}
}

// printRunReport writes the human summary of a run.
func printRunReport(w io.Writer, rep *RunReport) {
	s := &rep.Summary
	cfg := &rep.Config
	api := cfg.API
	if api == "" {
		api = APIChat
	}
	fmt.Fprintf(w, "\nllmload run: %s  api=%s stream=%t concurrency=%d\n", cfg.URL, api, cfg.Stream, cfg.Concurrency)
	fmt.Fprintf(w, "  %s requests in %.1fs (%.1f req/s), %s events, %s received\n\n",
		humanize.Comma(s.Requests), rep.Elapsed, float64(s.Requests)/max(rep.Elapsed, 1e-9),
		humanize.Comma(s.Events), humanize.IBytes(uint64(s.Bytes)))

	t := table{indent: "  ", tail: true}
	t.row("outcome", "count", "share", "")
	for _, k := range sortedOutcomes(s.Outcomes) {
		ex := ""
		if d := s.Examples[k]; d != "" && k != OutcomeOK {
			ex = "e.g. " + truncate(d, 80)
		}
		t.row(k, s.Outcomes[k], fmt.Sprintf("%.1f%%", pct(s.Outcomes[k], s.Requests)), ex)
	}
	t.write(w)
	fmt.Fprintln(w)

	t = table{indent: "  "}
	t.row("latency", "n", "p50", "p90", "p99", "p99.9", "max")
	for _, r := range []struct {
		name string
		d    Dist
	}{{"ttft", s.TTFT}, {"inter-event gap", s.Gap}, {"total (ok requests)", s.Total}} {
		d := r.d
		t.row(r.name, d.Count, fmtDist(d, d.P50), fmtDist(d, d.P90), fmtDist(d, d.P99), fmtDist(d, d.P999), fmtDist(d, d.Max))
	}
	t.write(w)
	fmt.Fprintln(w)

	t = table{indent: "  "}
	t.row("upstream ("+UpstreamHeader+")", "requests", "ok", "ttft p50", "p99", "p99.9")
	for _, u := range s.Upstreams {
		t.row(u.Upstream, u.Requests, fmt.Sprintf("%.1f%%", pct(u.OK, u.Requests)),
			fmtDist(u.TTFT, u.TTFT.P50), fmtDist(u.TTFT, u.TTFT.P99), fmtDist(u.TTFT, u.TTFT.P999))
	}
	t.write(w)

	if m := rep.Mock; m != nil {
		printMock(w, m)
	}
	if g := rep.Gateway; g != nil {
		fmt.Fprintf(w, "\ngateway counters (delta of %s)\n", cfg.MetricsURL)
		if !g.Found {
			fmt.Fprintf(w, "  no %s* series found\n", metricPrefix)
			return
		}
		t = table{indent: "  ", tail: true}
		t.row("requests", fmt.Sprintf("%.0f", g.RequestsTotal), "by outcome: "+fmtCounts(g.Requests))
		t.row("attempts", fmt.Sprintf("%.0f", g.AttemptsTotal), "")
		t.row("failovers", fmt.Sprintf("%.0f", g.Failovers), "(attempts − requests that reached an upstream)")
		if g.TTFTCount > 0 {
			t.row("ttft", fmt.Sprintf("%.0f", g.TTFTCount), fmt.Sprintf("p50 %s, p99 %s (estimated from the %s buckets)",
				fmtMS(g.TTFTP50), fmtMS(g.TTFTP99), metricTTFT))
		}
		if g.Retries > 0 || g.BudgetExhausted > 0 {
			t.row("retries", fmt.Sprintf("%.0f", g.Retries), fmt.Sprintf("%.0f refused by the retry budget", g.BudgetExhausted))
		}
		if len(g.Hedges) > 0 || g.HedgeDelayMS > 0 {
			t.row("hedges", fmt.Sprintf("%.0f", g.Hedges[HedgeFired]), fmt.Sprintf("fired; %s; hedge delay at the end %s",
				fmtCounts(g.Hedges), fmtMS(g.HedgeDelayMS)))
		}
		t.write(w)
		if len(g.Attempts) > 0 {
			fmt.Fprintln(w)
			t = table{indent: "  "}
			t.row("attempts: upstream", "outcome", "count")
			for _, a := range g.Attempts {
				t.row(a.Upstream, a.Outcome, fmt.Sprintf("%.0f", a.Count))
			}
			t.write(w)
		}
	}
}

// printMock writes what the mock fleet counted.
func printMock(w io.Writer, m *MockSummary) {
	fmt.Fprintf(w, "\nmock fleet (%s%s, reset before the run)\n", m.URL, mockStatsPath)
	t := table{indent: "  ", tail: true}
	t.row("upstream requests", m.Requests, fmt.Sprintf("completed %d, cancelled %d, faults %d", m.Completed, m.Cancelled, m.Faults))
	cover := ""
	if m.Records < m.Requests {
		cover = fmt.Sprintf(" (from the latest %d of %d requests)", m.Records, m.Requests)
	}
	t.row("tokens", m.UsefulTokens+m.WastedTokens, fmt.Sprintf("useful %d, wasted %d (%.2f%% of useful)%s",
		m.UsefulTokens, m.WastedTokens, m.WastedPct(), cover))
	if m.Cancelled > 0 {
		t.row("cancelled held", fmt.Sprintf("%.1fs", m.CancelledSeconds), "upstream time of cancelled requests, arrival to cancellation")
	}
	t.write(w)
}

// sortedOutcomes lists ok first, then the others by count (descending).
func sortedOutcomes(m map[string]int64) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		a, b := keys[i], keys[j]
		if (a == OutcomeOK) != (b == OutcomeOK) {
			return a == OutcomeOK
		}
		if m[a] != m[b] {
			return m[a] > m[b]
		}
		return a < b
	})
	return keys
}

func fmtCounts(m map[string]float64) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		if m[k] != 0 {
			parts = append(parts, fmt.Sprintf("%s %.0f", k, m[k]))
		}
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, ", ")
}

// fmtDist formats one statistic of d, "-" when d has no samples.
func fmtDist(d Dist, v float64) string {
	if d.Count == 0 {
		return "-"
	}
	return fmtMS(v)
}

func pct(n, total int64) float64 {
	if total == 0 {
		return 0
	}
	return 100 * float64(n) / float64(total)
}

func truncate(s string, n int) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
