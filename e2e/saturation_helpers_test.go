package e2e

// Helpers of the saturation tests (saturation_test.go): the admin API's
// saturation snapshots (GET /llm_proxy/saturation), the saturation
// metrics, load sent straight to a replica behind the gateway's back (as
// other clients of a shared inference server would), and streams through
// the gateway with the replica that served them and their TTFT.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// satSignalView is one signal of an upstream's snapshot.
type satSignalView struct {
	Signal string   `json:"signal"`
	Value  *float64 `json:"value"`
	State  string   `json:"state"`
}

// satView is one upstream's saturation snapshot as the admin API shows it.
type satView struct {
	Upstream    string          `json:"upstream"`
	ScrapedAt   *time.Time      `json:"scraped_at"`
	AgeSeconds  float64         `json:"age_seconds"`
	LastError   string          `json:"last_error"`
	Score       float64         `json:"score"`
	ScoreKnown  bool            `json:"score_known"`
	Inflight    int64           `json:"inflight"`
	SinceScrape int64           `json:"since_scrape"`
	Signals     []satSignalView `json:"signals"`
}

// signal returns the snapshot's signal named name (zero when absent).
func (v satView) signal(name string) satSignalView {
	for _, s := range v.Signals {
		if s.Signal == name {
			return s
		}
	}
	return satSignalView{}
}

// value is the signal's last known value, and whether there is one.
func (s satSignalView) value() (float64, bool) {
	if s.Value == nil {
		return 0, false
	}
	return *s.Value, true
}

// saturation lists the upstreams' snapshots (GET /llm_proxy/saturation)
// by dial address; an upstream listed twice fails the test (one snapshot
// per upstream, whatever the reloads).
func (g *gateway) saturation() map[string]satView {
	g.t.Helper()
	status, body := g.admin(http.MethodGet, "/llm_proxy/saturation")
	if status != http.StatusOK {
		g.t.Fatalf("GET /llm_proxy/saturation: status %d: %s", status, body)
	}
	var views []satView
	if err := json.Unmarshal(body, &views); err != nil {
		g.t.Fatalf("GET /llm_proxy/saturation: not a JSON array of snapshots: %v: %s", err, body)
	}
	out := make(map[string]satView, len(views))
	for _, v := range views {
		if _, dup := out[v.Upstream]; dup {
			g.t.Errorf("GET /llm_proxy/saturation lists upstream %s twice: %s", v.Upstream, body)
		}
		out[v.Upstream] = v
	}
	return out
}

// waitSaturation polls the admin API until the snapshot of addr satisfies
// cond or d passes; it returns the last snapshot (zero when none was
// listed) and whether cond held.
func (g *gateway) waitSaturation(addr string, d time.Duration, cond func(satView) bool) (satView, bool) {
	g.t.Helper()
	var v satView
	ok := waitFor(d, func() bool {
		var listed bool
		v, listed = g.saturation()[addr]
		return listed && cond(v)
	})
	return v, ok
}

// waitScraped waits until every replica of f has a snapshot from a
// successful scrape.
func (g *gateway) waitScraped(f *mockllm.Fleet, d time.Duration) {
	g.t.Helper()
	var views map[string]satView
	if !waitFor(d, func() bool {
		views = g.saturation()
		for _, a := range f.Addrs() {
			if v, ok := views[a]; !ok || v.ScrapedAt == nil {
				return false
			}
		}
		return true
	}) {
		g.t.Fatalf("after %v not every replica of %v has a scraped snapshot: %+v", d, f.Addrs(), views)
	}
}

// satBreaker is a breaker as the admin API lists it, with the mark of a
// trip by observation (the saturation breaker).
type satBreaker struct {
	breakerView
	Observed bool `json:"observed"`
}

// satBreaker returns the breaker of key with its observed mark.
func (g *gateway) satBreaker(key string) satBreaker {
	g.t.Helper()
	status, body := g.admin(http.MethodGet, "/llm_proxy/breakers")
	if status != http.StatusOK {
		g.t.Fatalf("GET /llm_proxy/breakers: status %d: %s", status, body)
	}
	var views []satBreaker
	if err := json.Unmarshal(body, &views); err != nil {
		g.t.Fatalf("GET /llm_proxy/breakers: %v: %s", err, body)
	}
	for _, v := range views {
		if v.Key == key {
			return v
		}
	}
	g.t.Fatalf("the admin API lists no breaker %q: %s", key, body)
	return satBreaker{}
}

// Saturation metric names.
const (
	satValueMetric  = "caddy_llm_proxy_upstream_saturation"
	satStateMetric  = "caddy_llm_proxy_saturation_signal_state"
	scrapeErrMetric = "caddy_llm_proxy_scrape_errors_total"
	scrapeDurMetric = "caddy_llm_proxy_scrape_duration_seconds"
)

// Values of caddy_llm_proxy_saturation_signal_state.
const (
	stateFresh   = 0
	stateStale   = 1
	stateMissing = 2
)

// satMetric reads the series of name for one upstream and signal; found is
// false when the gateway exposes no such series.
func satMetric(samples []metricSample, name, addr, signal string) (v float64, found bool) {
	return metricValue(samples, name, map[string]string{"upstream": addr, "signal": signal})
}

// waitSatMetric polls the gateway's metrics until the series of name for
// addr and signal exists and cond holds for its value, or d passes; it
// returns the last value and whether the series was exposed.
func (g *gateway) waitSatMetric(name, addr, signal string, d time.Duration, cond func(float64) bool) (v float64, found, ok bool) {
	g.t.Helper()
	ok = waitFor(d, func() bool {
		v, found = satMetric(g.scrapeMetrics(), name, addr, signal)
		return found && cond(v)
	})
	return v, found, ok
}

// satSite is a site block body: llm_proxy in front of every replica of f,
// with a saturation block of the given lines and other handler lines.
func satSite(f *mockllm.Fleet, sat string, lines ...string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "\tllm_proxy %s {\n", upstreams(f))
	for _, l := range lines {
		for line := range strings.SplitSeq(strings.TrimSpace(l), "\n") {
			fmt.Fprintf(&b, "\t\t%s\n", strings.TrimSpace(line))
		}
	}
	b.WriteString("\t\tsaturation {\n")
	for line := range strings.SplitSeq(strings.TrimSpace(sat), "\n") {
		fmt.Fprintf(&b, "\t\t\t%s\n", strings.TrimSpace(line))
	}
	b.WriteString("\t\t}\n\t}")
	return b.String()
}

// directLoad is traffic sent straight to one replica, not through the
// gateway: the gateway learns of it only from the replica's /metrics.
type directLoad struct {
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	draining atomic.Bool
}

// startDirectLoad runs workers that each send a plain chat request (body,
// "" for a short one) to r with headers; with repeat, each sends again as
// soon as its request ends, until stop. Requests are named
// direct-<worker>-<n> (X-Request-Id).
func startDirectLoad(t *testing.T, r *mockllm.Replica, workers int, repeat bool, body string, headers ...string) *directLoad {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	l := &directLoad{cancel: cancel}
	tr := &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: workers}
	c := &http.Client{Transport: tr}
	url := r.URL() + "/v1/chat/completions"
	if body == "" {
		body = chatBody("Load from another client.", false)
	}
	for w := range workers {
		l.wg.Go(func() {
			for n := 0; ctx.Err() == nil && !l.draining.Load(); n++ {
				hs := append([]string{fmt.Sprintf("X-Request-Id: direct-%d-%d", w, n)}, headers...)
				_ = send(ctx, c, url, body, hs...)
				if !repeat {
					return
				}
			}
		})
	}
	t.Cleanup(func() { l.stop(); tr.CloseIdleConnections() })
	return l
}

// stop cancels the load's requests and waits for its workers: the
// client goes away, and its queued requests with it.
func (l *directLoad) stop() {
	l.cancel()
	l.wg.Wait()
}

// drain sends no more requests and waits for those in flight to be
// served: the replica's queue drains.
func (l *directLoad) drain() {
	l.draining.Store(true)
	l.wg.Wait()
}

// userResult is one streamed request through the gateway as its client
// saw it.
type userResult struct {
	ID   string
	Sent time.Time
	// Replica is the upstream that served it (X-Mock-Replica).
	Replica string
	// TTFT is from sending the request to its first data event.
	TTFT time.Duration
	// Problem is empty for a complete, clean 200 stream.
	Problem string
}

// userStream sends one streamed chat request named id through the gateway.
func userStream(ctx context.Context, c *http.Client, url, id string, headers ...string) userResult {
	r := userResult{ID: id, Sent: time.Now()}
	s, err := doStream(ctx, c, url, chatBody("A user's question.", true), append([]string{"X-Request-Id: " + id}, headers...)...)
	if err != nil {
		r.Problem = err.Error()
		return r
	}
	r.Sent, r.Replica, r.Problem = s.Sent, s.Header.Get(mockllm.HeaderReplica), streamProblem(s)
	if ev := s.dataEvents(); len(ev) > 0 {
		r.TTFT = ev[0].At.Sub(s.Sent)
	}
	return r
}

// userBurst sends n streamed requests through the gateway, each in its own
// goroutine, spaced by gap (0: all at once, released together), and
// returns their results in the order they were started.
func userBurst(ctx context.Context, c *http.Client, url, prefix string, n int, gap time.Duration, headers ...string) []userResult {
	out := make([]userResult, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			if gap > 0 {
				time.Sleep(time.Duration(i) * gap)
			}
			out[i] = userStream(ctx, c, url, fmt.Sprintf("%s-%d", prefix, i), headers...)
		})
	}
	close(start)
	wg.Wait()
	return out
}

// checkUsersServed fails the test for every result that is not a clean
// 200 stream.
func checkUsersServed(t *testing.T, what string, rs []userResult) {
	t.Helper()
	bad := 0
	for _, r := range rs {
		if r.Problem != "" {
			if bad++; bad <= 5 {
				t.Errorf("%s: request %s sent at %s: %s", what, r.ID, r.Sent.Format("15:04:05.000"), r.Problem)
			}
		}
	}
	if bad > 0 {
		t.Errorf("%s: %d of %d requests failed, want every one served", what, bad, len(rs))
	}
}

// countByReplica counts the results by the replica that served them.
func countByReplica(rs []userResult) map[string]int {
	out := map[string]int{}
	for _, r := range rs {
		out[r.Replica]++
	}
	return out
}

// ttfts returns the TTFTs of the results served by one of addrs, sorted.
func ttfts(rs []userResult, addrs ...string) []time.Duration {
	var out []time.Duration
	for _, r := range rs {
		if r.Problem == "" && slices.Contains(addrs, r.Replica) {
			out = append(out, r.TTFT)
		}
	}
	slices.Sort(out)
	return out
}

// median of sorted durations (0 for none).
func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	return ds[len(ds)/2]
}

// userRecords returns the replica's records of requests sent through the
// gateway by the test (X-Request-Id with prefix).
func userRecords(r *mockllm.Replica, prefix string) []mockllm.RequestRecord {
	var out []mockllm.RequestRecord
	for _, rec := range r.Stats().Recent {
		if strings.HasPrefix(rec.ID, "chatcmpl-"+prefix) {
			out = append(out, rec)
		}
	}
	return out
}
