package main

import (
	"math"
	"strings"
	"testing"
)

const scrapeBefore = `# HELP caddy_llm_proxy_requests_total Requests by outcome.
# TYPE caddy_llm_proxy_requests_total counter
caddy_llm_proxy_requests_total{model="mock",outcome="success",upstream="127.0.0.1:9101"} 10
caddy_llm_proxy_upstream_attempts_total{outcome="success",upstream="127.0.0.1:9101"} 10
caddy_http_requests_total{server="srv0"} 99
`

const scrapeAfter = `caddy_llm_proxy_requests_total{model="mock",outcome="success",upstream="127.0.0.1:9101"} 60
caddy_llm_proxy_requests_total{model="mock",outcome="success",upstream="127.0.0.1:9103"} 45
caddy_llm_proxy_requests_total{model="mock",outcome="upstream_error",upstream="127.0.0.1:9102"} 5
caddy_llm_proxy_upstream_attempts_total{outcome="success",upstream="127.0.0.1:9101"} 60
caddy_llm_proxy_upstream_attempts_total{outcome="success",upstream="127.0.0.1:9103"} 45
caddy_llm_proxy_upstream_attempts_total{outcome="status_5xx",upstream="127.0.0.1:9102"} 25
caddy_llm_proxy_ttft_seconds_bucket{upstream="a",le="0.1"} 0
caddy_llm_proxy_ttft_seconds_bucket{upstream="a",le="0.2"} 50
caddy_llm_proxy_ttft_seconds_bucket{upstream="a",le="0.4"} 100
caddy_llm_proxy_ttft_seconds_bucket{upstream="a",le="+Inf"} 100
caddy_llm_proxy_ttft_seconds_count{upstream="a"} 100
caddy_llm_proxy_weird{x="a \"quoted\", comma}",y="back\\slash"} 1.5e+00 1712345678
`

func TestGatewayDeltaCountsFailovers(t *testing.T) {
	before, err := parseExposition(strings.NewReader(scrapeBefore), metricPrefix)
	if err != nil {
		t.Fatal(err)
	}
	after, err := parseExposition(strings.NewReader(scrapeAfter), metricPrefix)
	if err != nil {
		t.Fatal(err)
	}
	if len(before) != 2 {
		t.Fatalf("kept %d series before, want 2 (prefix filter)", len(before))
	}
	g := gatewayDelta(Delta(before, after))
	if !g.Found || g.RequestsTotal != 100 || g.AttemptsTotal != 120 || g.Failovers != 20 {
		t.Fatalf("requests %v attempts %v failovers %v; want 100, 120, 20", g.RequestsTotal, g.AttemptsTotal, g.Failovers)
	}
	if g.Requests["success"] != 95 || g.Requests["upstream_error"] != 5 {
		t.Errorf("requests by outcome %v", g.Requests)
	}
	want := []AttemptCount{
		{"127.0.0.1:9101", "success", 50},
		{"127.0.0.1:9102", "status_5xx", 25},
		{"127.0.0.1:9103", "success", 45},
	}
	if len(g.Attempts) != len(want) {
		t.Fatalf("attempts %+v", g.Attempts)
	}
	for i := range want {
		if g.Attempts[i] != want[i] {
			t.Errorf("attempts[%d] = %+v, want %+v", i, g.Attempts[i], want[i])
		}
	}
	// 50 of 100 observations are at or below 0.2 s: the median is 200 ms.
	if g.TTFTCount != 100 || g.TTFTP50 != 200 || g.TTFTP99 < 390 || g.TTFTP99 > 400 {
		t.Errorf("ttft count %v p50 %v p99 %v", g.TTFTCount, g.TTFTP50, g.TTFTP99)
	}
}

func TestParseSeriesUnescapesLabels(t *testing.T) {
	s, err := parseSeries(`caddy_llm_proxy_weird{x="a \"quoted\", comma}",y="back\\slash",z="nl\n"} 1.5e+00 1712345678`)
	if err != nil {
		t.Fatal(err)
	}
	if s.Name != "caddy_llm_proxy_weird" || s.Value != 1.5 {
		t.Fatalf("name %q value %v", s.Name, s.Value)
	}
	if s.Labels["x"] != `a "quoted", comma}` || s.Labels["y"] != `back\slash` || s.Labels["z"] != "nl\n" {
		t.Fatalf("labels %q", s.Labels)
	}
	for _, bad := range []string{`m{x="unterminated} 1`, `m{x=1} 1`, `m 1x`, `m`} {
		if _, err := parseSeries(bad); err == nil {
			t.Errorf("parseSeries(%s) accepted a malformed line", bad)
		}
	}
}

func TestGatewayDeltaWithoutSeries(t *testing.T) {
	if g := gatewayDelta(Delta(Scrape{}, Scrape{})); g.Found || g.TTFTP50 != 0 {
		t.Fatalf("%+v", g)
	}
}

func TestGatewayDeltaCountsHedgesAndReadsTheDelayGauge(t *testing.T) {
	before, _ := parseExposition(strings.NewReader(`caddy_llm_proxy_hedges_total{outcome="fired"} 10
caddy_llm_proxy_hedge_delay_seconds{model="m"} 1
`), metricPrefix)
	after, err := parseExposition(strings.NewReader(`caddy_llm_proxy_hedges_total{outcome="fired"} 30
caddy_llm_proxy_hedges_total{outcome="won"} 12
caddy_llm_proxy_hedges_total{outcome="suppressed"} 3
caddy_llm_proxy_retries_total{upstream="a",reason="http_5xx"} 4
caddy_llm_proxy_retries_total{upstream="b",reason="connect_error"} 1
caddy_llm_proxy_retry_budget_exhausted_total 2
caddy_llm_proxy_hedge_delay_seconds{model="m"} 0.234
caddy_llm_proxy_hedge_delay_seconds{model="other"} 0.1
`), metricPrefix)
	if err != nil {
		t.Fatal(err)
	}
	g := gatewayDelta(Delta(before, after))
	if g.Hedges[HedgeFired] != 20 || g.Hedges[HedgeWon] != 12 || g.Hedges[HedgeSuppressed] != 3 {
		t.Errorf("hedges %v", g.Hedges)
	}
	if g.Retries != 5 || g.BudgetExhausted != 2 {
		t.Errorf("retries %v exhausted %v", g.Retries, g.BudgetExhausted)
	}
	// The gauge is read from the last scrape, not differenced.
	if got := hedgeDelayMS(after); math.Abs(got-234) > 1e-9 {
		t.Errorf("hedge delay %v ms, want 234", got)
	}
}
