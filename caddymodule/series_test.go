package caddymodule

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// served counts one finished request on addr through the request
// observer, as the lifecycle does: an attempt with a TTFT, a retry, and
// the request.
func served(addr string) {
	o := requestObserver{models: shared.upstreams.Models}
	o.AttemptDone(&proxy.AttemptReport{Upstream: addr, Outcome: proxy.AttemptSuccess, TTFT: 20 * time.Millisecond})
	o.Retry(addr, proxy.AttemptHTTP5xx)
	o.RequestDone(&proxy.Result{Upstream: addr, Outcome: proxy.OutcomeSuccess, Status: 200, Streamed: true, Duration: time.Second})
}

// perUpstreamFamilies are the families served records a series in.
var perUpstreamFamilies = []string{"caddy_llm_proxy_requests_total", "caddy_llm_proxy_upstream_attempts_total",
	"caddy_llm_proxy_ttft_seconds", "caddy_llm_proxy_stream_duration_seconds", "caddy_llm_proxy_retries_total"}

// seriesOf returns the per-upstream families that have a series for addr.
func seriesOf(t *testing.T, addr string) []string {
	t.Helper()
	var out []string
	for _, f := range perUpstreamFamilies {
		if _, found := gathered(t, f, map[string]string{"upstream": addr}); found {
			out = append(out, f)
		}
	}
	return out
}

// runApp starts an app with pools, as a config's start does.
func runApp(t *testing.T, pools ...*upstream.Pool) *App {
	t.Helper()
	a := &App{ctx: caddy.Context{Context: context.Background()}, logger: zap.NewNop()}
	for _, p := range pools {
		a.adopt(p)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	return a
}

func pickFrom(t *testing.T, p *upstream.Pool, tried ...string) proxy.Upstream {
	t.Helper()
	up, err := p.Pick(httptest.NewRecorder(), httptest.NewRequest("POST", "/v1/chat/completions", nil), proxy.PickRequest{Tried: tried})
	if err != nil {
		t.Fatal(err)
	}
	return up
}

// TestSeriesOfAnUpstreamRemovedByAReloadGo: a reload drops upstream Y from
// the only config that had it; Y's series stay while a request to it is
// still running, and are gone once it ends; X's stay.
func TestSeriesOfAnUpstreamRemovedByAReloadGo(t *testing.T) {
	initMetrics()
	const x, y = "10.20.7.1:8000", "10.20.7.2:8000"
	old, err := shared.upstreams.NewPool(upstream.Config{Key: t.Name() + "-old", Static: []upstream.Target{{Addr: x}, {Addr: y}}})
	if err != nil {
		t.Fatal(err)
	}
	oldApp := runApp(t, old)
	served(x)
	served(y)
	if got := seriesOf(t, y); len(got) != len(perUpstreamFamilies) {
		t.Fatalf("before the reload, %s has series in %v, want every one of %v", y, got, perUpstreamFamilies)
	}
	running := pickFrom(t, old, x) // a stream to y, still running across the reload

	next, err := shared.upstreams.NewPool(upstream.Config{Key: t.Name() + "-new", Static: []upstream.Target{{Addr: x}}})
	if err != nil {
		t.Fatal(err)
	}
	defer next.Release()
	nextApp := runApp(t, next)
	defer nextApp.Stop()
	if err := oldApp.Stop(); err != nil {
		t.Fatal(err)
	}
	old.Release()
	if _, ok := shared.upstreams.Entry(y); ok {
		t.Fatalf("%s is still in the registry after the reload that dropped it", y)
	}
	if got := seriesOf(t, y); len(got) != len(perUpstreamFamilies) {
		t.Fatalf("with a request to %s still running, its series are %v, want every one of %v", y, got, perUpstreamFamilies)
	}
	running.Done(&proxy.AttemptReport{Upstream: y, Outcome: proxy.AttemptSuccess})
	served(y) // the running request's own counts, after its attempt ended
	if got := seriesOf(t, y); len(got) != 0 {
		t.Fatalf("after its last request ended, %s (dropped by the reload) still has series in %v", y, got)
	}
	if got := seriesOf(t, x); len(got) != len(perUpstreamFamilies) {
		t.Fatalf("%s, kept by the reload, lost series: has %v", x, got)
	}
}

// TestSeriesOfAnUpstreamADynamicSourceDroppedGo: a dynamic source stops
// returning an upstream; once the pool forgets it, its series go.
func TestSeriesOfAnUpstreamADynamicSourceDroppedGo(t *testing.T) {
	initMetrics()
	const d1, d2 = "10.20.8.1:8000", "10.20.8.2:8000"
	var current atomic.Value
	current.Store(d1)
	src := func(*http.Request) ([]upstream.Target, error) {
		return []upstream.Target{{Addr: current.Load().(string)}}, nil
	}
	p, err := shared.upstreams.NewPool(upstream.Config{Key: "dynamic:" + t.Name(), Source: src})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Release()
	a := runApp(t, p)
	defer a.Stop()
	pickFrom(t, p).Done(&proxy.AttemptReport{Upstream: d1, Outcome: proxy.AttemptSuccess})
	served(d1)
	if got := seriesOf(t, d1); len(got) != len(perUpstreamFamilies) {
		t.Fatalf("%s has series in %v, want every one of %v", d1, got, perUpstreamFamilies)
	}
	dropped := time.Now()
	current.Store(d2)
	pickFrom(t, p).Done(&proxy.AttemptReport{Upstream: d2, Outcome: proxy.AttemptSuccess})
	served(d2)
	p.ForgetUnseen(dropped) // as the sweep does a minute later
	if _, ok := shared.upstreams.Entry(d1); ok {
		t.Fatalf("%s is still in the registry after the pool forgot it", d1)
	}
	if got := seriesOf(t, d1); len(got) != 0 {
		t.Fatalf("%s, dropped by the source and forgotten, still has series in %v", d1, got)
	}
	if got := seriesOf(t, d2); len(got) != len(perUpstreamFamilies) {
		t.Fatalf("%s, which the source returns, has series in %v, want every one of %v", d2, got, perUpstreamFamilies)
	}
}
