package caddymodule

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/saturation"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// loggedApp starts an app whose logger records, so the observer's log
// lines (written through the newest running app) can be read.
func loggedApp(t *testing.T) *observer.ObservedLogs {
	t.Helper()
	core, logs := observer.New(zapcore.DebugLevel)
	a := &App{ctx: caddy.Context{Context: context.Background()}, logger: zap.New(core)}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Stop() })
	return logs
}

// TestSignalStateChangeIsLoggedOnce: a signal that goes stale is logged
// once (warn) however many scrapes keep it stale, and once (info) when it
// is fresh again; its gauges follow every scrape.
func TestSignalStateChangeIsLoggedOnce(t *testing.T) {
	initMetrics()
	logs := loggedApp(t)
	const addr = "10.1.9.1:8000"
	o := upstreamObserver{}
	t.Cleanup(func() { o.ScraperGone(addr) })
	fresh, stale := saturation.SignalFresh, saturation.SignalStale

	o.SignalUpdated(addr, saturation.SignalQueueDepth, saturation.Known(3), fresh, fresh)
	o.SignalUpdated(addr, saturation.SignalQueueDepth, saturation.Known(3), stale, fresh)
	o.SignalUpdated(addr, saturation.SignalQueueDepth, saturation.Known(3), stale, stale)
	o.SignalUpdated(addr, saturation.SignalQueueDepth, saturation.Known(3), stale, stale)
	if v := testutil.ToFloat64(metrics.signalState.WithLabelValues(addr, "queue_depth")); v != 1 {
		t.Fatalf("signal_state = %v, want 1 (stale)", v)
	}
	o.SignalUpdated(addr, saturation.SignalQueueDepth, saturation.Known(7), fresh, stale)
	if v := testutil.ToFloat64(metrics.saturation.WithLabelValues(addr, "queue_depth")); v != 7 {
		t.Fatalf("upstream_saturation = %v, want 7", v)
	}
	got := logs.FilterFieldKey("signal").AllUntimed()
	if len(got) != 2 {
		t.Fatalf("%d log lines, want 2: %v", len(got), got)
	}
	if got[0].Message != "saturation signal stale" || got[0].Level != zapcore.WarnLevel ||
		got[0].ContextMap()["upstream"] != addr || got[0].ContextMap()["signal"] != "queue_depth" {
		t.Errorf("first line %v %q %v", got[0].Level, got[0].Message, got[0].ContextMap())
	}
	if got[1].Message != "saturation signal fresh" || got[1].Level != zapcore.InfoLevel {
		t.Errorf("second line %v %q", got[1].Level, got[1].Message)
	}
}

// TestUnknownSignalHasNoValueSeries: a signal never known has a state
// series (missing) but no value series, rather than a 0 that reads as idle.
func TestUnknownSignalHasNoValueSeries(t *testing.T) {
	initMetrics()
	loggedApp(t)
	const addr = "10.1.9.2:8000"
	o := upstreamObserver{}
	t.Cleanup(func() { o.ScraperGone(addr) })
	o.SignalUpdated(addr, saturation.SignalKVUsage, saturation.Value{}, saturation.SignalMissing, saturation.SignalFresh)
	if v := testutil.ToFloat64(metrics.signalState.WithLabelValues(addr, "kv_usage")); v != 2 {
		t.Fatalf("signal_state = %v, want 2 (missing)", v)
	}
	if hasSeries(t, metrics.saturation.DeletePartialMatch, addr) {
		t.Fatal("a value series exists for a signal never known")
	}
}

// hasSeries reports whether vec has a series for upstream addr, by
// deleting it (the tests own their addresses).
func hasSeries(t *testing.T, deletePartial func(prometheus.Labels) int, addr string) bool {
	t.Helper()
	return deletePartial(prometheus.Labels{"upstream": addr}) > 0
}

// TestScrapeErrorsStartAtZeroAndGoWithTheScraper: the error counter exists
// from the first scrape, successful or not, counts failures, and every
// series of the upstream is deleted when its scraper goes.
func TestScrapeErrorsStartAtZeroAndGoWithTheScraper(t *testing.T) {
	initMetrics()
	const addr = "10.1.9.3:8000"
	o := upstreamObserver{}
	o.Scraped(addr, 3*time.Millisecond, nil)
	if n := testutil.CollectAndCount(metrics.scrapeErrors); n == 0 {
		t.Fatal("no scrape_errors_total series after a successful scrape")
	}
	if v := testutil.ToFloat64(metrics.scrapeErrors.WithLabelValues(addr)); v != 0 {
		t.Fatalf("scrape_errors_total = %v, want 0", v)
	}
	o.Scraped(addr, 500*time.Millisecond, errors.New("GET /metrics: status 500"))
	if v := testutil.ToFloat64(metrics.scrapeErrors.WithLabelValues(addr)); v != 1 {
		t.Fatalf("scrape_errors_total = %v, want 1", v)
	}
	o.SignalUpdated(addr, saturation.SignalRunning, saturation.Known(2), saturation.SignalFresh, saturation.SignalFresh)
	o.ScraperGone(addr)
	for name, del := range map[string]func(prometheus.Labels) int{
		"upstream_saturation":     metrics.saturation.DeletePartialMatch,
		"saturation_signal_state": metrics.signalState.DeletePartialMatch,
		"scrape_duration_seconds": metrics.scrapeDuration.DeletePartialMatch,
		"scrape_errors_total":     metrics.scrapeErrors.DeletePartialMatch,
	} {
		if hasSeries(t, del, addr) {
			t.Errorf("%s still has a series for %s after ScraperGone", name, addr)
		}
	}
}

// TestRequestsAndTokensCarryTheAPI: caddy_llm_proxy_requests_total and
// caddy_llm_proxy_tokens_total are labelled by the request's API.
func TestRequestsAndTokensCarryTheAPI(t *testing.T) {
	initMetrics()
	o := requestObserver{models: upstream.NewModelNames(8, 8)}
	series := metrics.requests.WithLabelValues("10.0.0.1:8000", o.models.Label(""), "messages", "success")
	before := testutil.ToFloat64(series)
	o.RequestDone(&proxy.Result{Upstream: "10.0.0.1:8000", API: "messages", Outcome: proxy.OutcomeSuccess})
	if got := testutil.ToFloat64(series); got != before+1 {
		t.Fatalf("requests_total{api=messages} = %v, want %v", got, before+1)
	}
	tokens := metrics.tokens.WithLabelValues("gold", "responses", "completion", "usage", "")
	before = testutil.ToFloat64(tokens)
	admissionObserver{}.Tokens("a", "gold", "responses", "completion", "usage", 11)
	if got := testutil.ToFloat64(tokens); got != before+11 {
		t.Fatalf("tokens_total{api=responses} = %v, want %v", got, before+11)
	}
}
