package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// VictimResult is what the victims (B, C, D together) measured in one arm.
type VictimResult struct {
	Requests int64            `json:"requests"`
	OK       int64            `json:"ok"`
	Outcomes map[string]int64 `json:"outcomes"`
	// Refused counts the victims' 429s (admission must not refuse them).
	Refused int64 `json:"refused"`
	// Censored counts requests that had no first token when the arm ended
	// (cancelled or timed out): their elapsed time is counted as their
	// TTFT, a lower bound, so that a collapsing arm does not look better
	// for the requests it never answered.
	Censored int64 `json:"censored"`
	TTFT     Dist  `json:"ttft"`
}

// NoisyResult is what the noisy tenant measured in one arm.
type NoisyResult struct {
	Requests int64 `json:"requests"`
	Admitted int64 `json:"admitted"`
	// Refused counts 429s, by error code in Refusals.
	Refused  int64            `json:"refused"`
	Refusals map[string]int64 `json:"refusals,omitempty"`
	Outcomes map[string]int64 `json:"outcomes"`
	// RefusalLatency is the client-side time of its 429s (send to end of
	// body, over loopback).
	RefusalLatency Dist `json:"refusal_latency"`
	// GatewayDecision is the gateway-side duration of its 429s, from the
	// access log (arrival to handler return), when one was given.
	GatewayDecision *Dist `json:"gateway_decision,omitempty"`
	TTFT            Dist  `json:"ttft"`
}

// ArmResult is one arm of the isolation scenario.
type ArmResult struct {
	Name    string       `json:"name"`
	URL     string       `json:"url"`
	Elapsed float64      `json:"elapsed_seconds"`
	Dropped int64        `json:"dropped"`
	Victims VictimResult `json:"victims"`
	Noisy   *NoisyResult `json:"noisy,omitempty"`
	// TTFTs are the victims' TTFTs (censored included), sorted, for the
	// plot.
	TTFTs []time.Duration `json:"-"`
}

// summarizeArm aggregates one arm's results.
func summarizeArm(name, url string, victims, noisy []Result, withNoisy bool) ArmResult {
	a := ArmResult{Name: name, URL: url}
	v := &a.Victims
	v.Outcomes = map[string]int64{}
	var ttft Samples
	for i := range victims {
		r := &victims[i]
		v.Requests++
		v.Outcomes[r.Outcome]++
		switch {
		case r.OK():
			v.OK++
		case r.Status == http.StatusTooManyRequests:
			v.Refused++
		}
		switch {
		case r.HasTTFT:
			ttft.Add(r.TTFT)
			a.TTFTs = append(a.TTFTs, r.TTFT)
		case r.Status == 0 && (r.Outcome == OutcomeCancelled || r.Outcome == OutcomeTimeout):
			v.Censored++
			ttft.Add(r.Total)
			a.TTFTs = append(a.TTFTs, r.Total)
		}
	}
	v.TTFT = ttft.Dist()
	slices.Sort(a.TTFTs)
	if !withNoisy {
		return a
	}
	n := &NoisyResult{Outcomes: map[string]int64{}, Refusals: map[string]int64{}}
	var refusal, nttft Samples
	for i := range noisy {
		r := &noisy[i]
		n.Requests++
		n.Outcomes[r.Outcome]++
		if r.Status == http.StatusTooManyRequests {
			n.Refused++
			n.Refusals[cmpOr(r.Code, "(no code)")]++
			refusal.Add(r.Total)
			continue
		}
		if r.Status == http.StatusOK {
			n.Admitted++
		}
		if r.HasTTFT {
			nttft.Add(r.TTFT)
		}
	}
	n.RefusalLatency, n.TTFT = refusal.Dist(), nttft.Dist()
	a.Noisy = n
	return a
}

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// durDist summarizes durations.
func durDist(ds []time.Duration) Dist {
	var s Samples
	for _, d := range ds {
		s.Add(d)
	}
	return s.Dist()
}

// readAccessLog429 reads a Caddy JSON access log from offset and returns
// the duration of every 429 it holds (of tenant, when not "", by the
// access log's llm_tenant field, from log_append llm_tenant
// {http.llm_proxy.tenant}). Lines that are not access log entries are
// skipped.
func readAccessLog429(path string, offset int64, tenant string) ([]time.Duration, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return nil, err
	}
	return parseAccessLog429(f, tenant)
}

// parseAccessLog429 is readAccessLog429 on a reader.
func parseAccessLog429(r io.Reader, tenant string) ([]time.Duration, error) {
	var out []time.Duration
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 4<<20)
	for sc.Scan() {
		line := sc.Bytes()
		i := strings.IndexByte(string(line), '{')
		if i < 0 {
			continue
		}
		var e struct {
			Logger   string   `json:"logger"`
			Status   int      `json:"status"`
			Duration *float64 `json:"duration"`
			Tenant   any      `json:"llm_tenant"`
			// Decision is {http.llm_proxy.admission_us}: the gateway's
			// own decision time, without Caddy's request handling.
			Decision any `json:"llm_admission_us"`
		}
		if json.Unmarshal(line[i:], &e) != nil || !strings.HasPrefix(e.Logger, "http.log.access") || e.Duration == nil {
			continue
		}
		if e.Status != http.StatusTooManyRequests {
			continue
		}
		if tenant != "" && fmt.Sprint(e.Tenant) != tenant {
			continue
		}
		if us, err := strconv.ParseFloat(fmt.Sprint(e.Decision), 64); e.Decision != nil && err == nil {
			out = append(out, time.Duration(us*float64(time.Microsecond)))
			continue
		}
		out = append(out, time.Duration(*e.Duration*float64(time.Second)))
	}
	return out, sc.Err()
}

// IsolationTarget is what the scenario must show.
type IsolationTarget struct {
	// MaxRatio bounds the victims' p99 TTFT with admission control ÷ solo.
	MaxRatio float64 `json:"max_ratio"`
	// MinRatioWithout is what the scenario expects without admission
	// control (the noisy tenant hurts): at least this × solo.
	MinRatioWithout float64 `json:"min_ratio_without"`
	// MaxDecision bounds the p99 of the noisy tenant's refusals.
	MaxDecision time.Duration `json:"max_decision_ns"`
}

// IsolationVerdict compares the arms.
type IsolationVerdict struct {
	SoloP99MS    float64 `json:"solo_p99_ms"`
	WithoutP99MS float64 `json:"without_admission_p99_ms"`
	WithP99MS    float64 `json:"with_admission_p99_ms"`
	RatioWithout float64 `json:"ratio_without"`
	RatioWith    float64 `json:"ratio_with"`
	// DecisionP99US is the p99 of the noisy tenant's refusals with
	// admission control, in µs; DecisionSource says how it was measured.
	DecisionP99US  float64 `json:"decision_p99_us"`
	DecisionSource string  `json:"decision_source"`
	// Isolated: with admission, ratio ≤ MaxRatio and no victim refused.
	Isolated bool `json:"isolated"`
	// Hurt: without admission, ratio ≥ MinRatioWithout (the scenario
	// really is a noisy neighbour).
	Hurt bool `json:"hurt"`
	// FastRefusals: DecisionP99US ≤ MaxDecision.
	FastRefusals bool     `json:"fast_refusals"`
	Notes        []string `json:"notes,omitempty"`
}

// OK reports whether every target was met.
func (v IsolationVerdict) OK() bool { return v.Isolated && v.Hurt && v.FastRefusals }

// judgeIsolation compares the arms against the target.
func judgeIsolation(arms []ArmResult, t IsolationTarget) IsolationVerdict {
	var v IsolationVerdict
	byName := map[string]*ArmResult{}
	for i := range arms {
		byName[arms[i].Name] = &arms[i]
	}
	solo, without, with := byName[ArmSolo], byName[ArmNoAdmission], byName[ArmAdmission]
	if solo == nil || solo.Victims.TTFT.Count == 0 {
		v.Notes = append(v.Notes, "no victims' TTFT alone: nothing to compare with")
		return v
	}
	v.SoloP99MS = solo.Victims.TTFT.P99
	ratio := func(a *ArmResult) float64 {
		if a == nil || a.Victims.TTFT.Count == 0 || v.SoloP99MS <= 0 {
			return math.NaN()
		}
		return a.Victims.TTFT.P99 / v.SoloP99MS
	}
	if without != nil {
		v.WithoutP99MS, v.RatioWithout = without.Victims.TTFT.P99, ratio(without)
		v.Hurt = v.RatioWithout >= t.MinRatioWithout
		if without.Victims.Censored > 0 {
			v.Notes = append(v.Notes, fmt.Sprintf("without admission control %d victims' requests had no first token by the end of the arm; their elapsed time counts as TTFT, so that p99 is a lower bound", without.Victims.Censored))
		}
	}
	if with != nil {
		v.WithP99MS, v.RatioWith = with.Victims.TTFT.P99, ratio(with)
		v.Isolated = v.RatioWith <= t.MaxRatio && with.Victims.Refused == 0
		if with.Victims.Refused > 0 {
			v.Notes = append(v.Notes, fmt.Sprintf("admission control refused %d of the victims' requests", with.Victims.Refused))
		}
		if n := with.Noisy; n != nil {
			switch {
			case n.GatewayDecision != nil && n.GatewayDecision.Count > 0:
				v.DecisionP99US, v.DecisionSource = n.GatewayDecision.P99*1000, "gateway-side (the 429s' admission_us in the access log: identify + admit)"
			case n.RefusalLatency.Count > 0:
				v.DecisionP99US, v.DecisionSource = n.RefusalLatency.P99*1000, "client-side latency of the 429s (an upper bound)"
			default:
				v.Notes = append(v.Notes, "the noisy tenant got no 429 with admission control")
			}
			if v.DecisionSource != "" {
				v.FastRefusals = v.DecisionP99US <= float64(t.MaxDecision)/float64(time.Microsecond)
			}
		}
	}
	return v
}

// printIsolation writes the human report.
func printIsolation(w io.Writer, rep *IsolationReport) {
	cfg := &rep.Config
	fmt.Fprintf(w, "\nllmload isolation: %d victims × %.1f req/s (%d-byte prompts, max_tokens %d); noisy A %.1f req/s (%d-byte prompts, max_tokens %d); %v per arm\n\n",
		len(cfg.VictimKeys), cfg.VictimRate, cfg.VictimPromptBytes, cfg.VictimMaxTokens,
		cfg.NoisyRate, cfg.LongPromptBytes, cfg.LongMaxTokens, cfg.Duration)
	t := table{indent: "  "}
	t.row("arm", "victims", "ok", "refused", "censored", "ttft p50", "p90", "p99", "p99.9", "p99 ÷ solo")
	v := rep.Verdict
	for _, a := range rep.Arms {
		d := a.Victims.TTFT
		r := "1.00×"
		if a.Name != ArmSolo {
			r = fmtFactor(d.P99 / v.SoloP99MS)
		}
		t.row(a.Name, a.Victims.Requests, a.Victims.OK, a.Victims.Refused, a.Victims.Censored,
			fmtDist(d, d.P50), fmtDist(d, d.P90), fmtDist(d, d.P99), fmtDist(d, d.P999), r)
	}
	t.write(w)
	fmt.Fprintln(w)
	t = table{indent: "  ", tail: true}
	t.row("arm", "noisy A", "admitted", "429", "429 client p50", "p99", "gateway-side p99", "by code")
	for _, a := range rep.Arms {
		n := a.Noisy
		if n == nil {
			continue
		}
		gw := "-"
		if n.GatewayDecision != nil && n.GatewayDecision.Count > 0 {
			gw = fmtUS(n.GatewayDecision.P99)
		}
		rl := n.RefusalLatency
		p50, p99 := "-", "-"
		if rl.Count > 0 {
			p50, p99 = fmtUS(rl.P50), fmtUS(rl.P99)
		}
		t.row(a.Name, n.Requests, n.Admitted, n.Refused, p50, p99, gw, fmtIntCounts(n.Refusals))
	}
	t.write(w)
	fmt.Fprintln(w)
	mark := func(ok bool) string {
		if ok {
			return "PASS"
		}
		return "FAIL"
	}
	tg := cfg.Target
	fmt.Fprintf(w, "  %s  with admission control the victims' p99 TTFT is %s solo (%s vs %s; target ≤ %.1f×)\n",
		mark(v.Isolated), fmtFactor(v.RatioWith), fmtMS(v.WithP99MS), fmtMS(v.SoloP99MS), tg.MaxRatio)
	fmt.Fprintf(w, "  %s  without admission control it is %s solo (%s; expected ≥ %.0f×)\n",
		mark(v.Hurt), fmtFactor(v.RatioWithout), fmtMS(v.WithoutP99MS), tg.MinRatioWithout)
	if v.DecisionSource != "" {
		fmt.Fprintf(w, "  %s  A's refusals decided in %s at p99, %s (target < %v)\n",
			mark(v.FastRefusals), fmtUS(v.DecisionP99US/1000), v.DecisionSource, tg.MaxDecision)
	} else {
		fmt.Fprintf(w, "  FAIL  A's refusal latency: not measured\n")
	}
	for _, n := range v.Notes {
		fmt.Fprintf(w, "  note: %s\n", n)
	}
}

// fmtUS formats milliseconds as microseconds.
func fmtUS(msv float64) string {
	us := msv * 1000
	switch {
	case us != us:
		return "-"
	case us >= 10000:
		return fmtMS(msv)
	case us >= 100:
		return fmt.Sprintf("%.0fµs", us)
	default:
		return fmt.Sprintf("%.1fµs", us)
	}
}

func fmtIntCounts(m map[string]int64) string {
	f := make(map[string]float64, len(m))
	for _, k := range slices.Sorted(maps.Keys(m)) {
		f[k] = float64(m[k])
	}
	return fmtCounts(f)
}
