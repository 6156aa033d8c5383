package main

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A real /proc/<pid>/stat line of a process whose name holds a space and a
// ')': fields are counted from the last ')'.
const statSample = "4242 (caddy (x) y) S 4100 4242 4242 0 -1 4194560 1507 0 0 0 1234 567 0 0 20 0 8 0 100 1000 2000 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n"

func TestProcStatSumsUserAndKernelTicks(t *testing.T) {
	st, err := parseProcStat([]byte(statSample))
	if err != nil {
		t.Fatal(err)
	}
	if st.PPID != 4100 || st.CPUTicks != 1234+567 {
		t.Errorf("got ppid %d, ticks %d; want 4100, %d", st.PPID, st.CPUTicks, 1234+567)
	}
}

func TestProcStatRejectsTruncatedLines(t *testing.T) {
	for _, in := range []string{"", "12 (x", "12 (x) S 1 2 3", "12 (x) S one 2 3 4 5 6 7 8 9 10 11 12"} {
		if _, err := parseProcStat([]byte(in)); err == nil {
			t.Errorf("%q: no error", in)
		}
	}
}

func TestProcStatOfThisProcess(t *testing.T) {
	st, err := readProcStat(os.Getpid())
	if err != nil {
		t.Skipf("no /proc here: %v", err)
	}
	if st.PPID != os.Getppid() {
		t.Errorf("ppid %d, want %d", st.PPID, os.Getppid())
	}
	if rss, err := readRSSKB(os.Getpid()); err != nil || rss <= 0 {
		t.Errorf("rss %d kB, %v", rss, err)
	}
	if tree := processTree(os.Getpid()); len(tree) == 0 || tree[0] != os.Getpid() {
		t.Errorf("process tree %v does not start with this process", tree)
	}
}

func TestStatusKBFindsTheKey(t *testing.T) {
	in := "Name:\tcaddy\nVmHWM:\t  90000 kB\nVmRSS:\t   81234 kB\nThreads:\t9\n"
	if n, err := parseStatusKB([]byte(in), "VmRSS"); err != nil || n != 81234 {
		t.Errorf("VmRSS = %d, %v; want 81234", n, err)
	}
	if _, err := parseStatusKB([]byte(in), "MemAvailable"); err == nil {
		t.Error("a missing key gave no error")
	}
}

func TestMaxOpenFilesReadsTheSoftLimit(t *testing.T) {
	in := "Limit                     Soft Limit           Hard Limit           Units     \n" +
		"Max processes             95000                95000                processes \n" +
		"Max open files            1024                 20000                files     \n"
	if n, err := parseMaxOpenFiles([]byte(in)); err != nil || n != 1024 {
		t.Errorf("got %d, %v; want the soft limit 1024", n, err)
	}
	if n, err := parseMaxOpenFiles([]byte("Max open files            unlimited            unlimited            files\n")); err != nil || n != -1 {
		t.Errorf("unlimited: got %d, %v; want -1", n, err)
	}
	if _, err := parseMaxOpenFiles([]byte("Max processes 1 1\n")); err == nil {
		t.Error("no line, no error")
	}
}

func TestSpliceReplacesOnlyTheSuiteSection(t *testing.T) {
	doc := "# Benchmarks\n\nintro\n\n" + suiteBegin + "\nold tables\n" + suiteEnd + "\n\n## Other\n\nkept\n"
	out := string(spliceSuite([]byte(doc), []byte(suiteBegin+"\nnew tables\n"+suiteEnd+"\n")))
	want := "# Benchmarks\n\nintro\n\n" + suiteBegin + "\nnew tables\n" + suiteEnd + "\n\n## Other\n\nkept\n"
	if out != want {
		t.Errorf("got\n%s\nwant\n%s", out, want)
	}
}

func TestSpliceInsertsBeforeTheFirstSection(t *testing.T) {
	doc := "# Benchmarks\n\nintro\n\n## Saturation\n\nkept\n"
	out := string(spliceSuite([]byte(doc), []byte(suiteBegin+"\nnew\n"+suiteEnd+"\n")))
	want := "# Benchmarks\n\nintro\n\n" + suiteBegin + "\nnew\n" + suiteEnd + "\n\n## Saturation\n\nkept\n"
	if out != want {
		t.Errorf("got\n%s\nwant\n%s", out, want)
	}
	// A second run replaces what the first inserted.
	again := string(spliceSuite([]byte(out), []byte(suiteBegin+"\nnewer\n"+suiteEnd)))
	if strings.Count(again, suiteBegin) != 1 || !strings.Contains(again, "newer") || strings.Contains(again, "\nnew\n") {
		t.Errorf("second splice:\n%s", again)
	}
}

func TestStormFaultHeader(t *testing.T) {
	for rate, want := range map[float64]string{0: "none", 0.25: "status=503,fraction=0.25", 1: "status=503"} {
		if got := stormFault(rate); got != want {
			t.Errorf("rate %g: %q, want %q", rate, got, want)
		}
	}
}

// The report's tables name every target in a column, and the goals read
// the figures of the right target.
func TestSuiteReportTablesAndGoals(t *testing.T) {
	lvl := func(name string, cpu, rss float64, pids bool) StreamsTarget {
		st := StreamsTarget{Name: name, BaselineRSSKB: 1000,
			Levels: []StreamsLevel{{Streams: 1000, Open: 1000, Events: 12000, EventsPerSec: 1000, CPUPerEventUS: cpu, RSSPerStreamKB: rss, RSSKB: 1000 + int64(rss*1000)}}}
		if pids {
			st.PIDs = []int{1}
		}
		return st
	}
	run := &suiteRun{
		S4: &StreamsReport{Levels: []int{1000}, Window: 12 * time.Second, Targets: []StreamsTarget{
			lvl(TargetDirect, 0, 0, false), lvl(TargetLLMProxy, 15, 30, true), lvl(TargetReverseProxy, 22, 70, true), lvl(TargetNginx, 11, 14, true)}},
		S6: &StormReport{Rates: []float64{0, 1}, Targets: []StormTarget{
			{Name: TargetDirect, Points: []StormPoint{{Rate: 0, Requests: 10, OK: 10, PerRequest: 1}, {Rate: 1, Requests: 10, PerRequest: 1}}},
			{Name: TargetLLMProxy, Points: []StormPoint{{Rate: 0, Requests: 10, OK: 10, PerRequest: 1, Bound: 1.5}, {Rate: 1, Requests: 10, PerRequest: 1.05, Bound: 1.5}}},
			{Name: TargetReverseProxy, Points: []StormPoint{{Rate: 0, Requests: 10, OK: 10, PerRequest: 1}, {Rate: 1, Requests: 10, PerRequest: 4}}}}},
	}
	goals := map[string]suiteGoal{}
	for _, g := range suiteTargets(run) {
		goals[g.What] = g
	}
	check := func(what string, met bool) {
		t.Helper()
		g, ok := goals[what]
		if !ok || !g.Known || g.Met != met {
			t.Errorf("%s: %+v (present %v), want known and met=%v", what, g, ok, met)
		}
	}
	check("CPU per event, S4 1,000 streams, llm_proxy ÷ reverse_proxy", true)       // 15/22 = 0.68
	check("CPU per event, S4 1,000 streams, llm_proxy ÷ nginx", true)               // 15/11 = 1.36
	check("RSS per stream, 1,000 streams, llm_proxy ÷ reverse_proxy", true)         // 30/70 = 0.43
	check("S6 served by llm_proxy at every uniform error rate", true)               // 100 vs 100, 0 vs 0
	check("S6 upstream attempts per request, llm_proxy, at every error rate", true) // 1.05 ≤ 1.5
	check("streams held by llm_proxy with no event later than 50 ms", false)        // 1,000 < 5,000
	if g := goals["added TTFT p50, S3 100 streams, llm_proxy ÷ reverse_proxy"]; g.Known {
		t.Errorf("added TTFT known without S3: %+v", g)
	}

	var b bytes.Buffer
	writeSuiteSection(&b, run, &SuiteMeta{Date: time.Now()}, nil)
	md := b.String()
	if !strings.HasPrefix(md, suiteBegin) || !strings.HasSuffix(strings.TrimSpace(md), suiteEnd) {
		t.Error("section is not between the markers")
	}
	for _, want := range []string{" direct |", " llm_proxy |", " reverse_proxy |", " nginx |", "15.0 µs", "30.0 KB", "4.00 · 0% ok", "met (≤ 1.50)"} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q:\n%s", want, md)
		}
	}
}

// The S6 targets fail where llm_proxy serves less than direct − 5 points
// or sends more attempts than the budget allows.
func TestStormGoalsNotMet(t *testing.T) {
	r := &StormReport{Rates: []float64{0.5, 1}, Targets: []StormTarget{
		{Name: TargetDirect, Points: []StormPoint{{Rate: 0.5, Requests: 100, OK: 50}, {Rate: 1, Requests: 100}}},
		{Name: TargetLLMProxy, Points: []StormPoint{{Rate: 0.5, Requests: 100, OK: 44, PerRequest: 1.1, Bound: 1.2}, {Rate: 1, Requests: 100, PerRequest: 1.3, Bound: 1.2}}}}}
	served, attempts, known := stormGoals(r)
	if !known || served[0] || !served[1] || !attempts[0] || attempts[1] {
		t.Fatalf("served %v, attempts %v, known %v; want [false true], [true false], true", served, attempts, known)
	}
	for _, g := range stormSuiteGoals(r) {
		if !g.Known || g.Met {
			t.Errorf("%+v: want known and not met", g)
		}
	}
}

func TestSuitePlotsWriteFiles(t *testing.T) {
	dir := t.TempDir()
	run := &suiteRun{
		S3: &LatencyReport{Levels: []LatencyLevel{{Streams: 100, Targets: []LatencyTarget{
			{Name: TargetDirect, TTFTSamples: []float64{20, 21, 22}}, {Name: TargetLLMProxy, TTFTSamples: []float64{21, 22, 30}}}}}},
		S4b: &StreamsReport{Levels: []int{200}, Targets: []StreamsTarget{
			{Name: TargetLLMProxy, PIDs: []int{1}, Levels: []StreamsLevel{{Streams: 200, Open: 200, Events: 100, CPUPerEventUS: 20}}}}},
		S6: &StormReport{Rates: []float64{0, 1}, Targets: []StormTarget{{Name: TargetLLMProxy, Points: []StormPoint{{Rate: 0, PerRequest: 1}, {Rate: 1, PerRequest: 1.1}}}}},
	}
	plots, err := plotSuite(dir, run)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"ttft-100", "cpu", "amp"} {
		fi, err := os.Stat(filepath.Join(dir, plots[k]))
		if plots[k] == "" || err != nil || fi.Size() == 0 {
			t.Errorf("plot %s: %q, %v", k, plots[k], err)
		}
	}
	if _, ok := plots["rss"]; ok {
		t.Error("an RSS plot without S4")
	}
}

func FuzzParseProcStat(f *testing.F) {
	f.Add([]byte(statSample))
	f.Add([]byte("1 (a) R 0 1 1 0 -1 0 0 0 0 0 5 6 0 0"))
	f.Add([]byte("1 ()) R"))
	f.Fuzz(func(t *testing.T, b []byte) {
		st, err := parseProcStat(b)
		if err == nil && st.CPUTicks < 0 && !bytes.Contains(b, []byte("-")) {
			t.Errorf("negative ticks %d from %q", st.CPUTicks, b)
		}
	})
}

func FuzzParseProcFiles(f *testing.F) {
	f.Add([]byte("VmRSS:\t  81234 kB\n"))
	f.Add([]byte("Max open files            1024                 20000                files\n"))
	f.Add([]byte("Max open files\nVmRSS:"))
	f.Fuzz(func(t *testing.T, b []byte) {
		parseStatusKB(b, "VmRSS")
		parseMaxOpenFiles(b)
	})
}

func FuzzSpliceSuite(f *testing.F) {
	f.Add([]byte("# B\n\n## A\n"), []byte(suiteBegin+"\nx\n"+suiteEnd))
	f.Add([]byte(suiteEnd+suiteBegin), []byte("y"))
	f.Fuzz(func(t *testing.T, doc, section []byte) {
		out := spliceSuite(doc, section)
		if !bytes.Contains(out, bytes.TrimRight(section, "\n")) {
			t.Errorf("the section is not in the result")
		}
	})
}

// A stream whose last token comes 400 ms after its schedule has exactly
// that event counted late (bound 150 ms); the role chunk and the first
// token, sent together, are on time.
func TestStreamSetCountsLateEvents(t *testing.T) {
	const interval = 50 * time.Millisecond
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fl := w.(http.Flusher)
		send := func(s string) { fmt.Fprintf(w, "data: %s\n\n", s); fl.Flush() }
		first := time.Now()
		send(`{"role"}`)
		send(`{"token":0}`)
		for i := 1; i <= 3; i++ {
			due := first.Add(time.Duration(i) * interval)
			if i == 3 {
				due = due.Add(400 * time.Millisecond)
			}
			time.Sleep(time.Until(due))
			send(fmt.Sprintf(`{"token":%d}`, i))
		}
		<-r.Context().Done()
	}))
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	s := &streamSet{ctx: ctx, client: srv.Client(), url: srv.URL, body: []byte("{}"), header: http.Header{},
		interval: interval, late: 150 * time.Millisecond}
	s.measuring.Store(true)
	s.open(1, 1000)
	if !s.waitStarted(5 * time.Second) {
		t.Fatal("no first event")
	}
	deadline := time.Now().Add(5 * time.Second)
	for s.events.Load() < 5 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	s.wg.Wait()
	if n := s.events.Load(); n != 5 {
		t.Errorf("%d events, want 5", n)
	}
	if n := s.lateN.Load(); n != 1 {
		t.Errorf("%d late events, want 1 (the delayed token)", n)
	}
	if f := s.failed.Load(); f != 0 {
		t.Errorf("%d failed streams after a cancel, want 0: %s", f, s.failExample)
	}
	if m := s.lateness.Max(); m < 350*time.Millisecond {
		t.Errorf("largest lateness %s, want about 400ms", m)
	}
}

// S3's goals of issue 22 take the median of the runs' ratios, each run's
// llm_proxy (or llm_proxy_tenants) added TTFT over reverse_proxy's.
func TestMedianAddedGoalTakesTheMiddleRun(t *testing.T) {
	run := func(n int, llm, ten, rp float64) LatencyLevel {
		return LatencyLevel{Streams: 100, Run: n, Targets: []LatencyTarget{
			{Name: TargetDirect},
			{Name: TargetLLMProxy, AddedTTFTP50: llm, AddedTTFTP99: 2 * llm},
			{Name: TargetLLMProxyTenants, AddedTTFTP50: ten, AddedTTFTP99: 2 * ten},
			{Name: TargetReverseProxy, AddedTTFTP50: rp, AddedTTFTP99: 2 * rp},
		}}
	}
	r := &LatencyReport{Levels: []LatencyLevel{
		{Streams: 1, Targets: []LatencyTarget{{Name: TargetDirect}, {Name: TargetLLMProxy, AddedTTFTP50: 9}, {Name: TargetReverseProxy, AddedTTFTP50: 1}}},
		run(1, 9, 11, 10), run(2, 12, 13, 10), run(3, 11, 50, 10),
	}}
	g := medianAddedGoal("p50", r, TargetLLMProxy, false, 1)
	if !g.Known || g.Met || !strings.Contains(g.Measured, "median **1.10×**") {
		t.Errorf("llm_proxy p50 runs 0.9×, 1.2×, 1.1× (the 1-stream level's 9× ignored): %+v, want median 1.10× not met", g)
	}
	g = medianAddedGoal("p99", r, TargetLLMProxyTenants, true, 1.15)
	if !g.Known || g.Met || !strings.Contains(g.Measured, "median **1.30×**") {
		t.Errorf("tenants p99 runs 1.1×, 1.3×, 5×: %+v, want median 1.30× not met", g)
	}
	r.Levels[3] = run(2, 12, 11.4, 10)
	if g = medianAddedGoal("p50", r, TargetLLMProxyTenants, false, 1.15); !g.Met {
		t.Errorf("tenants p50 runs 1.1×, 1.14×, 5×: %+v, want met at 1.15×", g)
	}
	// reverse_proxy adding nothing measurable: met only by adding no more.
	z := &LatencyReport{Levels: []LatencyLevel{run(1, 0.5, 0, 0), run(2, 0.5, 0, 0), run(3, 0, 0, 0)}}
	if g = medianAddedGoal("p50", z, TargetLLMProxy, false, 1); g.Met {
		t.Errorf("llm_proxy +0.5 ms in two runs where reverse_proxy added 0: %+v, want not met", g)
	}
	if g = medianAddedGoal("p50", z, TargetLLMProxyTenants, false, 1.15); !g.Met {
		t.Errorf("tenants +0 ms where reverse_proxy added 0: %+v, want met", g)
	}
	if g = medianAddedGoal("p50", &LatencyReport{}, TargetLLMProxy, false, 1); g.Known {
		t.Errorf("no S3: %+v, want not measured", g)
	}
}

func TestS3MeasuresTheHundredStreamLevelInRuns(t *testing.T) {
	plans, err := latencyPlans(&SuiteConfig{Scenario: ScenarioS3, Runs: 3})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, p := range plans {
		got = append(got, fmt.Sprintf("%d/%d", p.streams, p.run))
	}
	if strings.Join(got, " ") != "1/0 100/1 100/2 100/3" {
		t.Errorf("S3 plans %v, want 1/0 100/1 100/2 100/3", got)
	}
	plans, _ = latencyPlans(&SuiteConfig{Scenario: ScenarioS1, Runs: 3})
	if len(plans) != 1 || plans[0].run != 0 {
		t.Errorf("S1 plans %+v, want one level, no runs", plans)
	}
}

func TestLatencyTablesShowTheTenantsTargetAndCosts(t *testing.T) {
	cpu, allocs := 712.4, 245.0
	r := &LatencyReport{Levels: []LatencyLevel{{Streams: 100, Run: 2, Targets: []LatencyTarget{
		{Name: TargetDirect}, {Name: TargetLLMProxy, CPUPerRequestUS: &cpu, AllocsPerRequest: &allocs},
		{Name: TargetLLMProxyTenants}, {Name: TargetReverseProxy}}}}}
	var b strings.Builder
	writeLatencyTables(&b, r, true)
	out := b.String()
	for _, want := range []string{"| llm_proxy_tenants |", "100 (run 2)", "CPU per request, µs", " 712 |", " 245 |"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	if strings.Index(out, "llm_proxy_tenants") > strings.Index(out, "reverse_proxy") {
		t.Errorf("llm_proxy_tenants should stand beside llm_proxy, before reverse_proxy:\n%s", out)
	}
}

func FuzzParseSchedstat(f *testing.F) {
	f.Add([]byte("945490 164103 2\n"))
	f.Add([]byte(""))
	f.Add([]byte("x 1 2"))
	f.Fuzz(func(t *testing.T, b []byte) {
		ns, err := parseSchedstat(b)
		if err == nil && ns < 0 && !bytes.Contains(b, []byte("-")) {
			t.Errorf("negative time %d from %q", ns, b)
		}
	})
}

func TestTreeCPUNanosOfThisProcess(t *testing.T) {
	a, err := treeCPUNanos(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	x := 0
	for i := range 20_000_000 {
		x ^= i
	}
	b, _ := treeCPUNanos(os.Getpid())
	if a <= 0 || b <= a {
		t.Errorf("CPU time %d then %d ns after a busy loop (%d), want positive and growing", a, b, x)
	}
}
