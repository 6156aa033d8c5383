package main

import (
	"math"
	"strings"
	"testing"
)

func hedgedReport() *RunReport {
	return &RunReport{
		Config:  RunConfig{Label: "hedged"},
		Summary: Summary{Requests: 2000, OK: 2000, TTFT: Dist{Count: 2000, P50: 158, P99: 442, P999: 3820}},
		Gateway: &GatewayDelta{Found: true, RequestsTotal: 2000, AttemptsTotal: 2180, HedgeDelayMS: 234,
			Hedges: map[string]float64{HedgeFired: 176, HedgeWon: 95, HedgeLost: 81}},
		Mock: &MockSummary{Requests: 2176, UsefulTokens: 32000, WastedTokens: 50},
	}
}

func TestArmPrefersTheMockCountOfUpstreamRequests(t *testing.T) {
	a := armOf("h", hedgedReport())
	if a.Source != "mock" || a.Upstream != 2176 {
		t.Fatalf("upstream %v from %q, want 2176 from the mock", a.Upstream, a.Source)
	}
	if got := a.ExtraPct(); math.Abs(got-8.8) > 1e-9 {
		t.Errorf("extra = %v%%, want 8.8%%", got)
	}
	if got := a.WastedPct(); math.Abs(got-0.15625) > 1e-9 {
		t.Errorf("wasted = %v%%, want 0.15625%%", got)
	}
	if a.Hedges[HedgeWon] != 95 || a.HedgeDelayMS != 234 {
		t.Errorf("hedges %v delay %v", a.Hedges, a.HedgeDelayMS)
	}
}

func TestArmFallsBackToGatewayAttempts(t *testing.T) {
	rep := hedgedReport()
	rep.Mock = nil
	a := armOf("h", rep)
	if a.Source != "gateway" || math.Abs(a.ExtraPct()-9) > 1e-9 {
		t.Fatalf("extra %v%% from %q, want 9%% from the gateway", a.ExtraPct(), a.Source)
	}
	if !math.IsNaN(a.WastedPct()) {
		t.Errorf("wasted %v without the mock, want NaN", a.WastedPct())
	}
}

func TestArmWithoutCountsHasNoExtra(t *testing.T) {
	a := armOf("x", &RunReport{Summary: Summary{Requests: 10}})
	if !math.IsNaN(a.ExtraPct()) {
		t.Fatalf("extra = %v, want NaN", a.ExtraPct())
	}
}

func TestJudge(t *testing.T) {
	target := Target{Speedup: 5, MaxExtraPct: 10}
	base := armOf("baseline", &RunReport{
		Summary: Summary{Requests: 2000, TTFT: Dist{Count: 2000, P99: 4430}},
		Mock:    &MockSummary{Requests: 2000},
	})
	tests := []struct {
		name     string
		p99      float64
		upstream int64
		met      bool
		why      string
	}{
		{"met", 442, 2176, true, ""},
		{"exactly 5x and 10% is met", 886, 2200, true, ""},
		{"too slow", 1000, 2100, false, "only 4.4× lower"},
		{"too many upstream requests", 442, 2300, false, "15.0% extra upstream requests"},
		{"both", 2000, 2400, false, "only 2.2× lower; 20.0% extra"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := armOf("hedged", &RunReport{
				Summary: Summary{Requests: 2000, TTFT: Dist{Count: 2000, P99: tt.p99}},
				Mock:    &MockSummary{Requests: tt.upstream},
			})
			v := judge(&base, &h, target)
			if v.Met != tt.met {
				t.Fatalf("met = %v (%v), want %v", v.Met, v.Why, tt.met)
			}
			line := v.String(&base, &h, target)
			if tt.why != "" && !strings.Contains(line, tt.why) {
				t.Errorf("verdict %q does not say %q", line, tt.why)
			}
			if tt.met && !strings.HasPrefix(line, "target met") {
				t.Errorf("verdict %q", line)
			}
		})
	}
}

func TestJudgeWithoutMeasurementsIsNotMet(t *testing.T) {
	var base, h Arm
	v := judge(&base, &h, Target{Speedup: 5, MaxExtraPct: 10})
	if v.Met || len(v.Why) != 2 {
		t.Fatalf("%+v", v)
	}
}

func TestPrintComparisonTable(t *testing.T) {
	base := armOf("baseline", &RunReport{
		Summary: Summary{Requests: 2000, OK: 2000, TTFT: Dist{Count: 2000, P50: 155, P99: 4430, P999: 4920}},
		Mock:    &MockSummary{Requests: 2000, UsefulTokens: 32000},
	})
	h := armOf("hedged", hedgedReport())
	var b strings.Builder
	v := printComparison(&b, []Arm{base, h}, Target{Speedup: 5, MaxExtraPct: 10})
	out := b.String()
	for _, want := range []string{
		"| baseline | 2000 (2000) | 155ms | 4.43s | 4.92s | 1.000 (mock) | 0.0% | - | - | 0 of 32000 useful (0.00%) |",
		"| hedged | 2000 (2000) | 158ms | 442ms | 3.82s | 1.088 (mock) | 8.8% | 176 / 95 / 81 / 0 | 234ms | 50 of 32000 useful (0.16%) |",
		"- **hedged** vs baseline: target met: p99 TTFT 4.43s → 442ms (10.0× lower",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if !v.Met {
		t.Errorf("verdict %+v", v)
	}
}
