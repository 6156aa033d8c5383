package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// at returns a result issued off after start that ended after total.
func at(start time.Time, off, total time.Duration, outcome, upstream string, ttft time.Duration) Result {
	r := Result{Start: start.Add(off), Total: total, Outcome: outcome, Upstream: upstream}
	if ttft > 0 {
		r.TTFT, r.HasTTFT, r.Status = ttft, true, 200
	}
	return r
}

// TestSummarizePhaseMeasuresTheWindowOnly: requests issued during the
// warm-up or after the window are not measured; throughput counts ok
// responses that ended within the window, whenever they were issued;
// censored requests count their elapsed time as TTFT; shares come from
// X-Mock-Replica.
func TestSummarizePhaseMeasuresTheWindowOnly(t *testing.T) {
	t0 := time.Unix(1000, 0)
	s := time.Second
	results := []Result{
		at(t0, 1*s, 5*s, OutcomeOK, "127.0.0.1:9503", msd(4000)),                // warm-up, ends at 6s: throughput only
		at(t0, 1*s, 2*s, OutcomeOK, "127.0.0.1:9501", msd(100)),                 // warm-up, ends at 3s: throughput only
		at(t0, 2*s, 1*s, OutcomeOK, "127.0.0.1:9501", msd(90)),                  // window
		at(t0, 3*s, 1*s, OutcomeOK, "127.0.0.1:9502", msd(110)),                 // window
		at(t0, 4*s, 1*s, OutcomeOK, "127.0.0.1:9502", msd(120)),                 // window
		at(t0, 11*s, 9*s, OutcomeOK, "127.0.0.1:9503", msd(8000)),               // window, ends after it
		at(t0, 11*s+s/2, 9*s, OutcomeCancelled, "", 0),                          // window, censored at 9s
		at(t0, 11*s+s/2, 9*s, OutcomeCancelled, "127.0.0.1:9502", msd(130)),     // window, cut while streaming
		{Start: t0.Add(5 * s), Total: msd(2), Outcome: "http_502", Status: 502}, // window, failed
		at(t0, 12*s, msd(500), OutcomeOK, "127.0.0.1:9501", msd(80)),            // after the window
	}
	p := summarizePhase("least_conn", "u", t0, 2*s, 10*s, results)
	if p.Requests != 7 || p.OK != 4 || p.Censored != 1 || p.Unfinished != 1 || p.failed() != 1 || p.Outcomes[OutcomeOK] != 4 || p.Outcomes["http_502"] != 1 {
		t.Errorf("requests %d ok %d censored %d unfinished %d failed %d outcomes %v; want 7, 4, 1, 1, 1",
			p.Requests, p.OK, p.Censored, p.Unfinished, p.failed(), p.Outcomes)
	}
	// Ok and ended in [2s, 12s): at 6s and 3s (issued in the warm-up), 3s, 4s, 5s.
	if p.Throughput != 0.5 || p.Offered != 0.7 {
		t.Errorf("throughput %v offered %v; want 5 ok in 10s = 0.5, 7 issued in 10s = 0.7", p.Throughput, p.Offered)
	}
	if p.TTFT.Count != 6 || p.TTFT.Max != 9000 || p.TTFT.P50 != 120 {
		t.Errorf("ttft %+v; want 6 samples (the censored one at 9s), median 120ms", p.TTFT)
	}
	if len(p.TTFTs) != 6 || p.TTFTs[0] != msd(90) || p.TTFTs[5] != msd(9000) {
		t.Errorf("TTFTs for the plot %v, want sorted 90ms … 9s", p.TTFTs)
	}
	want := []struct {
		replica string
		n       int64
	}{{noReplica, 2}, {"127.0.0.1:9501", 1}, {"127.0.0.1:9502", 3}, {"127.0.0.1:9503", 1}}
	if len(p.Share) != len(want) {
		t.Fatalf("shares %+v, want %v", p.Share, want)
	}
	for i, w := range want {
		if sh := p.Share[i]; sh.Replica != w.replica || sh.Requests != w.n || sh.Share != float64(w.n)/7 {
			t.Errorf("share %d = %+v, want %s %d/7", i, sh, w.replica, w.n)
		}
	}
	if sh := p.Share[3]; sh.TTFT.Count != 1 || sh.TTFT.P99 != 8000 {
		t.Errorf("straggler's TTFT %+v, want one sample of 8s", sh.TTFT)
	}
	if e := summarizePhase("x", "u", t0, 0, 0, nil); e.Requests != 0 || e.Throughput != 0 || e.TTFT.Count != 0 {
		t.Errorf("empty phase %+v", e)
	}
}

func phase(name string, p99, throughput, offered float64) PhaseResult {
	return PhaseResult{Name: name, Requests: 100, OK: 100, Offered: offered, Throughput: throughput,
		TTFT: Dist{Count: 100, P50: p99 / 4, P99: p99}}
}

var issueGoal = OverloadGoal{Candidate: PolicyLeastQueue, ThroughputTolerance: 0.05,
	MaxRatio: []RatioGoal{{PolicyRoundRobin, 0.5}, {PolicyLeastConn, 0.8}}}

func TestJudgeOverload(t *testing.T) {
	for _, tc := range []struct {
		name          string
		phases        []PhaseResult
		met, equal    bool
		ratios        []float64
		noteSubstring string
	}{{
		name: "met, round robin did not keep up",
		phases: []PhaseResult{phase(PolicyLeastQueue, 400, 32, 32), phase(PolicyLeastConn, 1000, 32, 32),
			phase(PolicyRoundRobin, 8000, 29, 32)},
		met: true, equal: true, ratios: []float64{0.05, 0.4}, noteSubstring: "round_robin completed 29.0 req/s of the 32.0 offered",
	}, {
		name:   "least_conn ratio missed",
		phases: []PhaseResult{phase(PolicyLeastQueue, 900, 32, 32), phase(PolicyLeastConn, 1000, 32, 32), phase(PolicyRoundRobin, 8000, 32, 32)},
		met:    false, equal: true, ratios: []float64{0.1125, 0.9},
	}, {
		name: "lower tail bought with lower throughput",
		phases: []PhaseResult{phase(PolicyLeastQueue, 200, 25, 32), phase(PolicyLeastConn, 1000, 32, 32),
			phase(PolicyRoundRobin, 8000, 32, 32)},
		met: false, equal: false, ratios: []float64{0.025, 0.2}, noteSubstring: "least_queue completed 25.0",
	}, {
		name:   "a baseline is missing",
		phases: []PhaseResult{phase(PolicyLeastQueue, 200, 32, 32), phase(PolicyLeastConn, 1000, 32, 32)},
		met:    false, equal: true, ratios: []float64{0, 0.2}, noteSubstring: "no TTFT measured for round_robin",
	}, {
		name:   "the candidate is missing",
		phases: []PhaseResult{phase(PolicyLeastConn, 1000, 32, 32)},
		met:    false, noteSubstring: "no TTFT measured for the candidate least_queue",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			v := judgeOverload(tc.phases, issueGoal)
			if v.Met != tc.met || v.EqualThroughput != tc.equal {
				t.Errorf("met %v equal throughput %v, want %v %v (%+v)", v.Met, v.EqualThroughput, tc.met, tc.equal, v)
			}
			if tc.ratios != nil {
				if len(v.Comparisons) != len(tc.ratios) {
					t.Fatalf("comparisons %+v, want %d", v.Comparisons, len(tc.ratios))
				}
				for i, r := range tc.ratios {
					if got := v.Comparisons[i].Ratio; got < r-1e-9 || got > r+1e-9 {
						t.Errorf("ratio against %s = %v, want %v", v.Comparisons[i].Baseline, got, r)
					}
				}
			}
			if tc.noteSubstring != "" && !strings.Contains(strings.Join(v.Notes, "\n"), tc.noteSubstring) {
				t.Errorf("notes %q, want one containing %q", v.Notes, tc.noteSubstring)
			}
		})
	}
}

func TestJudgeOverloadNotesCensoredFailedAndDropped(t *testing.T) {
	lq := phase(PolicyLeastQueue, 200, 32, 32)
	rr := phase(PolicyRoundRobin, 9000, 32, 32)
	rr.OK, rr.Censored, rr.Unfinished, rr.Dropped = 88, 7, 2, 4
	rr.Outcomes = map[string]int64{OutcomeOK: 88, OutcomeCancelled: 9, "http_502": 3}
	v := judgeOverload([]PhaseResult{lq, rr}, OverloadGoal{Candidate: PolicyLeastQueue, MaxRatio: []RatioGoal{{PolicyRoundRobin, 0.5}}})
	notes := strings.Join(v.Notes, "\n")
	for _, want := range []string{"round_robin: 7 requests had no first token", "round_robin: 2 requests were still streaming", "round_robin: 3 requests failed (outcomes other than ok: cancelled 9, http_502 3)", "round_robin: 4 arrivals dropped"} {
		if !strings.Contains(notes, want) {
			t.Errorf("notes %q, want %q", notes, want)
		}
	}
}

func TestParseRatioGoals(t *testing.T) {
	g, err := parseRatioGoals(" round_robin=0.5, least_conn=0.8 ,")
	if err != nil || len(g) != 2 || g[0] != (RatioGoal{"round_robin", 0.5}) || g[1] != (RatioGoal{"least_conn", 0.8}) {
		t.Errorf("parseRatioGoals = %v, %v", g, err)
	}
	for _, bad := range []string{"round_robin", "=0.5", "x=0", "x=-1", "x=abc", "x=NaN"} {
		if _, err := parseRatioGoals(bad); err == nil {
			t.Errorf("parseRatioGoals(%q) succeeded", bad)
		}
	}
}

func TestTargetFlagKeepsOrderAndRefusesDuplicates(t *testing.T) {
	var f targetFlag
	for _, s := range []string{"least_queue=http://127.0.0.1:8113", "round_robin = http://127.0.0.1:8111"} {
		if err := f.Set(s); err != nil {
			t.Fatal(err)
		}
	}
	if len(f) != 2 || f[0].Name != "least_queue" || f[1] != (OverloadTarget{"round_robin", "http://127.0.0.1:8111"}) {
		t.Errorf("targets %+v", f)
	}
	for _, bad := range []string{"least_queue=http://x", "nourl", "=http://x", "name="} {
		if err := f.Set(bad); err == nil {
			t.Errorf("Set(%q) succeeded", bad)
		}
	}
}

func TestPrintOverloadTable(t *testing.T) {
	lq := phase(PolicyLeastQueue, 420, 33.1, 33.6)
	lq.Share = []ReplicaShare{{Replica: "127.0.0.1:9501", Requests: 38, Share: 0.38}, {Replica: "127.0.0.1:9502", Requests: 37, Share: 0.37},
		{Replica: "127.0.0.1:9503", Requests: 25, Share: 0.25, TTFT: Dist{Count: 25, P99: 524}}}
	lq.Mock = []PhaseReplica{{Addr: "127.0.0.1:9503", MaxInFlight: 12}, {Addr: "127.0.0.1:9501", MaxInFlight: 18}}
	rr := phase(PolicyRoundRobin, 7370, 30.6, 33.6)
	rep := OverloadReport{Config: OverloadConfig{Rate: 32, Seed: 1, Duration: 30 * time.Second, Warmup: 5 * time.Second,
		Straggler: "127.0.0.1:9503", Goal: OverloadGoal{Candidate: PolicyLeastQueue, ThroughputTolerance: 0.05,
			MaxRatio: []RatioGoal{{PolicyRoundRobin, 0.5}}}}, Machine: Machine{CPUs: 2}, Phases: []PhaseResult{lq, rr}}
	rep.Verdict = judgeOverload(rep.Phases, rep.Config.Goal)
	var b bytes.Buffer
	printOverload(&b, &rep)
	out := b.String()
	for _, want := range []string{
		"| policy      | requests |  ok | throughput (req/s) | TTFT p50 | TTFT p99 | requests per replica                |",
		"| ----------- | -------: | --: | -----------------: | -------: | -------: | ----------------------------------- |",
		"| least_queue |      100 | 100 |               33.1 |    105ms |    420ms | :9501 38% · :9502 37% · :9503\\* 25% |",
		"| round_robin |      100 | 100 |               30.6 |    1.84s |    7.37s | -                                   |",
		"\\* :9503 is the straggler.",
		":9501 18 · :9503\\* 12",
		"PASS  least_queue p99 TTFT 420ms is 0.06× round_robin's (7.37s; target ≤ 0.5×)",
		"PASS  at equal throughput: least_queue 33.1 req/s against round_robin 30.6 (offered 33.6; tolerance 5%)",
		"  target met\n",
		"note: round_robin completed 30.6 req/s of the 33.6 offered",
		"2 CPUs",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
}

func TestPlotOverloadCDFWritesPNG(t *testing.T) {
	mk := func(name string, base float64) PhaseResult {
		p := PhaseResult{Name: name}
		for i := range 200 {
			p.TTFTs = append(p.TTFTs, msd(base*(1+float64(i)/100)))
		}
		p.TTFT = durDist(p.TTFTs)
		return p
	}
	path := filepath.Join(t.TempDir(), "cdf.png")
	if err := plotOverloadCDF(path, []PhaseResult{mk(PolicyLeastQueue, 100), mk(PolicyLeastConn, 300), mk(PolicyRoundRobin, 2000), mk("other", 50)}, 32); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(b, []byte("\x89PNG\r\n\x1a\n")) || len(b) < 1000 {
		t.Errorf("%s is not a PNG image (%d bytes)", path, len(b))
	}
	if err := plotOverloadCDF(filepath.Join(t.TempDir(), "none.png"), []PhaseResult{{Name: PolicyLeastQueue}}, 32); err == nil {
		t.Error("a plot of no samples succeeded")
	}
}
