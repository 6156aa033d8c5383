package main

import (
	"bytes"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func msd(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }

func TestFairRate(t *testing.T) {
	// 16 slots shared by 4 tenants, requests holding a slot 2s: 4 slots
	// each, 2 requests per second.
	if got := fairRate(16, 4, 2*time.Second); got != 2 {
		t.Errorf("fairRate(16, 4, 2s) = %v, want 2", got)
	}
}

// TestSummarizeArmCountsCensoredAndRefusals: victims' TTFTs include the
// elapsed time of requests that never got a first token (a lower bound);
// 429s of the victims are counted as refused; the noisy tenant's 429s are
// counted by code with their client-side latency, and its TTFT is of the
// admitted ones.
func TestSummarizeArmCountsCensoredAndRefusals(t *testing.T) {
	victims := []Result{
		{Status: 200, Outcome: OutcomeOK, HasTTFT: true, TTFT: msd(50)},
		{Status: 200, Outcome: OutcomeOK, HasTTFT: true, TTFT: msd(70)},
		{Status: 0, Outcome: OutcomeCancelled, Total: msd(9000)},
		{Status: 429, Outcome: "http_429", Code: "tenant_rpm", Total: msd(1)},
	}
	noisy := []Result{
		{Status: 200, Outcome: OutcomeOK, HasTTFT: true, TTFT: msd(80)},
		{Status: 429, Outcome: "http_429", Code: "tenant_concurrency", Total: msd(0.2)},
		{Status: 429, Outcome: "http_429", Code: "tenant_concurrency", Total: msd(0.4)},
		{Status: 429, Outcome: "http_429", Total: msd(0.3)},
	}
	a := summarizeArm(ArmAdmission, "u", victims, noisy, true)
	v := a.Victims
	if v.Requests != 4 || v.OK != 2 || v.Refused != 1 || v.Censored != 1 || v.TTFT.Count != 3 || v.TTFT.Max != 9000 {
		t.Errorf("victims %+v", v)
	}
	if len(a.TTFTs) != 3 || a.TTFTs[0] != msd(50) || a.TTFTs[2] != msd(9000) {
		t.Errorf("TTFTs for the plot %v, want sorted 50ms, 70ms, 9s", a.TTFTs)
	}
	n := a.Noisy
	if n == nil || n.Requests != 4 || n.Admitted != 1 || n.Refused != 3 || n.Refusals["tenant_concurrency"] != 2 || n.Refusals["(no code)"] != 1 {
		t.Fatalf("noisy %+v", n)
	}
	if n.RefusalLatency.Count != 3 || n.RefusalLatency.P50 != 0.3 || n.TTFT.Count != 1 || n.TTFT.P50 != 80 {
		t.Errorf("noisy latencies: refusals %+v ttft %+v", n.RefusalLatency, n.TTFT)
	}
	if s := summarizeArm(ArmSolo, "u", victims, nil, false); s.Noisy != nil {
		t.Errorf("a solo arm has a noisy result")
	}
}

func armWithP99(name string, p99 float64) ArmResult {
	return ArmResult{Name: name, Victims: VictimResult{TTFT: Dist{Count: 100, P99: p99}}}
}

func TestJudgeIsolation(t *testing.T) {
	target := IsolationTarget{MaxRatio: 1.2, MinRatioWithout: 10, MaxDecision: 100 * time.Microsecond}
	with := armWithP99(ArmAdmission, 110)
	with.Noisy = &NoisyResult{RefusalLatency: Dist{Count: 10, P99: 0.3}, GatewayDecision: &Dist{Count: 10, P99: 0.05}}
	arms := []ArmResult{armWithP99(ArmSolo, 100), armWithP99(ArmNoAdmission, 2500), with}
	v := judgeIsolation(arms, target)
	if !v.OK() || v.RatioWith != 1.1 || v.RatioWithout != 25 || math.Abs(v.DecisionP99US-50) > 1e-9 || !strings.HasPrefix(v.DecisionSource, "gateway-side") {
		t.Errorf("verdict %+v, want every target met, ratios 1.1 and 25, decision 50µs gateway-side", v)
	}

	// No access log: the client-side latency is used, and it is too slow.
	arms[2].Noisy.GatewayDecision = nil
	v = judgeIsolation(arms, target)
	if v.FastRefusals || math.Abs(v.DecisionP99US-300) > 1e-9 || !strings.HasPrefix(v.DecisionSource, "client-side") {
		t.Errorf("verdict %+v, want the client-side 300µs, over the target", v)
	}

	// Too slow with admission; a refused victim fails isolation too.
	arms[2].Victims.TTFT.P99 = 130
	if v = judgeIsolation(arms, target); v.Isolated {
		t.Errorf("1.3× solo judged isolated: %+v", v)
	}
	arms[2].Victims.TTFT.P99 = 100
	arms[2].Victims.Refused = 1
	if v = judgeIsolation(arms, target); v.Isolated || len(v.Notes) == 0 {
		t.Errorf("a refused victim judged isolated: %+v", v)
	}
	// A scenario that does not hurt without admission is not a noisy neighbour.
	arms[1].Victims.TTFT.P99 = 500
	if v = judgeIsolation(arms, target); v.Hurt {
		t.Errorf("5× solo without admission judged hurt (want ≥ 10×): %+v", v)
	}
	if v = judgeIsolation(nil, target); v.OK() || len(v.Notes) == 0 {
		t.Errorf("no arms: %+v", v)
	}
}

func TestParseAccessLog429(t *testing.T) {
	log := strings.Join([]string{
		`{"level":"info","logger":"http.log.access.log0","msg":"handled request","status":429,"duration":0.000042,"llm_tenant":"a"}`,
		`{"level":"info","logger":"http.log.access.log0","msg":"handled request","status":200,"duration":0.5,"llm_tenant":"b"}`,
		`{"level":"info","logger":"http.log.access.log0","msg":"handled request","status":429,"duration":0.000080,"llm_tenant":"b"}`,
		`{"level":"warn","logger":"http.handlers.llm_proxy","msg":"something","status":429,"duration":1}`,
		`not json`,
		`2026/12/01 11:00:00.000 INFO http.log.access {"logger":"http.log.access","status":429,"duration":0.00006}`,
		`{"logger":"http.log.access","status":429,"duration":0.0009,"llm_admission_us":7}`,
		`{"logger":"http.log.access","status":429,"duration":0.0009,"llm_admission_us":"11"}`,
	}, "\n")
	all, err := parseAccessLog429(strings.NewReader(log), "")
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 5 || all[0] != 42*time.Microsecond || all[2] != 60*time.Microsecond || all[3] != 7*time.Microsecond || all[4] != 11*time.Microsecond {
		t.Errorf("every 429: %v, want 42µs, 80µs, 60µs, then the decision times 7µs and 11µs", all)
	}
	a, _ := parseAccessLog429(strings.NewReader(log), "a")
	if len(a) != 1 || a[0] != 42*time.Microsecond {
		t.Errorf("tenant a's 429s: %v, want [42µs]", a)
	}
	dir := t.TempDir()
	f := filepath.Join(dir, "access.log")
	if err := os.WriteFile(f, []byte(log), 0o644); err != nil {
		t.Fatal(err)
	}
	from, err := readAccessLog429(f, int64(strings.Index(log, "\n")+1), "")
	if err != nil || len(from) != 4 {
		t.Errorf("from the second line: %v, %v; want the 4 later 429s", from, err)
	}
}

func TestCDFPoints(t *testing.T) {
	s := []time.Duration{0, msd(10), msd(10), msd(20), msd(40)}
	pts := cdfPoints(s, 0, 0.01)
	want := [][2]float64{{0.01, 0.2}, {10, 0.6}, {20, 0.8}, {40, 1}}
	if len(pts) != len(want) {
		t.Fatalf("points %v, want %v", pts, want)
	}
	for i, w := range want {
		if pts[i].X != w[0] || math.Abs(pts[i].Y-w[1]) > 1e-12 {
			t.Errorf("point %d = %v, want %v", i, pts[i], w)
		}
	}
	many := make([]time.Duration, 10000)
	for i := range many {
		many[i] = time.Duration(i+1) * time.Microsecond
	}
	pts = cdfPoints(many, 100, 0.01)
	if len(pts) > 101 || pts[len(pts)-1].Y != 1 || pts[len(pts)-1].X != ms(many[len(many)-1]) {
		t.Errorf("%d points, last %v; want at most 101 ending at (10ms, 1)", len(pts), pts[len(pts)-1])
	}
	for i := 1; i < len(pts); i++ {
		if pts[i].X <= pts[i-1].X || pts[i].Y <= pts[i-1].Y {
			t.Fatalf("points not increasing at %d: %v then %v", i, pts[i-1], pts[i])
		}
	}
	if cdfPoints(nil, 10, 0.01) != nil {
		t.Error("points of no samples")
	}
}

func TestPlotTTFTCDFWritesPNG(t *testing.T) {
	mk := func(name string, base float64) ArmResult {
		a := ArmResult{Name: name}
		for i := range 200 {
			a.TTFTs = append(a.TTFTs, msd(base*(1+float64(i)/100)))
		}
		a.Victims.TTFT = durDist(a.TTFTs)
		return a
	}
	path := filepath.Join(t.TempDir(), "cdf.png")
	if err := plotTTFTCDF(path, []ArmResult{mk(ArmSolo, 50), mk(ArmNoAdmission, 2000), mk(ArmAdmission, 52)}); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(b, []byte("\x89PNG\r\n\x1a\n")) || len(b) < 1000 {
		t.Errorf("%s is not a PNG image (%d bytes)", path, len(b))
	}
	if err := plotTTFTCDF(filepath.Join(t.TempDir(), "none.png"), []ArmResult{{Name: ArmSolo}}); err == nil {
		t.Error("a plot of no samples succeeded")
	}
}

func TestErrorCodeOf(t *testing.T) {
	for body, want := range map[string]string{
		`{"error":{"message":"m","type":"rate_limit_error","code":"tenant_tpm"}}`: "tenant_tpm",
		`{"object":"error","message":"m","code":400}`:                             "",
		`{"error":{"message":"m","code":429}}`:                                    "429",
		`not json`:                                                                "",
	} {
		if got := errorCodeOf([]byte(body)); got != want {
			t.Errorf("errorCodeOf(%s) = %q, want %q", body, got, want)
		}
	}
}
