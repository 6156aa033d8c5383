package mockllm

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestParseMetricsMode(t *testing.T) {
	for _, tc := range []struct {
		spec string
		want MetricsMode
		str  string
	}{
		{"", MetricsMode{}, "normal"},
		{"normal", MetricsMode{}, "normal"},
		{"kv=new", MetricsMode{}, "normal"},
		{"frozen", MetricsMode{Fault: MetricsFrozen}, "frozen"},
		{" Frozen , KV=Old ", MetricsMode{Fault: MetricsFrozen, KV: KVOld}, "frozen,kv=old"},
		{"hang", MetricsMode{Fault: MetricsHang}, "hang"},
		{"status=500", MetricsMode{Fault: MetricsStatus, Status: 500}, "status=500"},
		{"kv=both,status=404", MetricsMode{Fault: MetricsStatus, Status: 404, KV: KVBoth}, "status=404,kv=both"},
		{"slow=2s,kv=none", MetricsMode{Fault: MetricsSlow, Delay: 2 * time.Second, KV: KVNone}, "slow=2s,kv=none"},
		{"normal,kv=old", MetricsMode{KV: KVOld}, "kv=old"},
	} {
		got, err := ParseMetricsMode(tc.spec)
		if err != nil || got != tc.want {
			t.Errorf("ParseMetricsMode(%q) = %+v, %v; want %+v", tc.spec, got, err, tc.want)
			continue
		}
		if s := got.String(); s != tc.str {
			t.Errorf("ParseMetricsMode(%q).String() = %q, want %q", tc.spec, s, tc.str)
		}
	}
	for _, spec := range []string{
		"frozen,hang", "status", "status=200", "status=600", "slow", "slow=0", "slow=-1s", "slow=48h",
		"hang=1", "normal=yes", "kv", "kv=new,kv=old", "kv=gpu", "melt", "hang,", ",",
	} {
		if m, err := ParseMetricsMode(spec); err == nil {
			t.Errorf("ParseMetricsMode(%q) = %+v, want an error", spec, m)
		}
	}
	for _, m := range []MetricsMode{
		{Fault: "melt"}, {Fault: MetricsStatus}, {Fault: MetricsSlow}, {Status: 500}, {Delay: time.Second}, {KV: "new"},
	} {
		if m.Validate() == nil {
			t.Errorf("%+v validates", m)
		}
	}
}

// get fetches url with a client-side timeout (0 = none).
func get(t *testing.T, c *http.Client, url string, timeout time.Duration) (*http.Response, []byte, error) {
	t.Helper()
	ctx := context.Background()
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := c.Do(req)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp, body, err
}

func setMetricsMode(t *testing.T, r *Replica, spec string) {
	t.Helper()
	m, err := ParseMetricsMode(spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.SetMetricsMode(m); err != nil {
		t.Fatal(err)
	}
}

func complete(t *testing.T, c *http.Client, r *Replica) {
	t.Helper()
	resp, err := post(t, c, context.Background(), r.URL()+"/v1/chat/completions", chatBody)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp.Body)
	resp.Body.Close()
}

func TestFrozenMetricsServeTheSameBytes(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	r := f.Replica(0)
	c := client(t)
	complete(t, c, r)
	setMetricsMode(t, r, "frozen")
	first := scrape(t, c, r.URL())
	complete(t, c, r) // the live state moves on
	if second := scrape(t, c, r.URL()); second != first {
		t.Errorf("frozen body changed:\n%s\nthen\n%s", first, second)
	}
	if n := histogram(t, first, "vllm:time_to_first_token_seconds").GetSampleCount(); n != 1 {
		t.Errorf("frozen body counts %d first tokens, want the 1 of when it froze", n)
	}
	setMetricsMode(t, r, "normal")
	if n := histogram(t, scrape(t, c, r.URL()), "vllm:time_to_first_token_seconds").GetSampleCount(); n != 2 {
		t.Errorf("thawed body counts %d first tokens, want 2", n)
	}
	// Setting frozen again captures anew, with its own KV name.
	setMetricsMode(t, r, "frozen,kv=old")
	fams := families(t, scrape(t, c, r.URL()))
	if fams["vllm:gpu_cache_usage_perc"] == nil || fams["vllm:kv_cache_usage_perc"] != nil {
		t.Errorf("frozen,kv=old: families %v", names(fams))
	}
	if n := fams["vllm:time_to_first_token_seconds"].GetMetric()[0].GetHistogram().GetSampleCount(); n != 2 {
		t.Errorf("refrozen body counts %d first tokens, want 2", n)
	}
}

func TestHangingMetricsReturnWhenTheClientGivesUp(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast, Metrics: MetricsMode{Fault: MetricsHang}})
	r := f.Replica(0)
	c := client(t)
	if _, _, err := get(t, c, r.URL()+"/metrics", 50*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("hanging scrape: err %v, want the client's deadline", err)
	}
	waitFor(t, time.Second, "the hanging handler to return", func() bool { return r.Stats().ScrapesInFlight == 0 })

	// Stopping the replica ends a hanging scrape too.
	errc := make(chan error, 1)
	go func() { _, _, err := get(t, c, r.URL()+"/metrics", 0); errc <- err }()
	waitFor(t, time.Second, "the scrape to hang", func() bool { return r.Stats().ScrapesInFlight == 1 })
	if err := r.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err == nil {
		t.Error("hanging scrape succeeded")
	}
	waitFor(t, time.Second, "the hanging handler to return", func() bool { return r.Stats().ScrapesInFlight == 0 })
}

func TestMetricsStatusFault(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast, Replicas: 2, PerReplicaMetrics: map[int]MetricsMode{1: {Fault: MetricsStatus, Status: 500}}})
	c := client(t)
	resp, body, err := get(t, c, f.Replica(1).URL()+"/metrics", 0)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 500 || strings.Contains(string(body), "vllm:") || len(body) > 100 {
		t.Errorf("status=500: %d %q", resp.StatusCode, body)
	}
	scrape(t, c, f.Replica(0).URL()) // the other replica answers
}

func TestSlowMetricsAnswerLateOrNotAtAll(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	r := f.Replica(0)
	c := client(t)
	setMetricsMode(t, r, "slow=100ms")
	start := time.Now()
	body := scrape(t, c, r.URL())
	if d := time.Since(start); d < 100*time.Millisecond {
		t.Errorf("slow=100ms answered after %s", d)
	}
	if gauge(t, body, "vllm:num_requests_running") != 0 {
		t.Errorf("slow body:\n%s", body)
	}
	setMetricsMode(t, r, "slow=1h")
	if _, _, err := get(t, c, r.URL()+"/metrics", 50*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("slow=1h: err %v, want the client's deadline", err)
	}
	waitFor(t, time.Second, "the slow handler to give up", func() bool { return r.Stats().ScrapesInFlight == 0 })
}

func names[V any](m map[string]V) []string {
	var s []string
	for k := range m {
		s = append(s, k)
	}
	return s
}

func TestKVMetricNames(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	r := f.Replica(0)
	c := client(t)
	for _, tc := range []struct {
		spec     string
		new, old bool
	}{
		{"normal", true, false},
		{"kv=new", true, false},
		{"kv=old", false, true},
		{"kv=both", true, true},
		{"kv=none", false, false},
		{"slow=1ms,kv=both", true, true},
		{"frozen,kv=none", false, false},
	} {
		setMetricsMode(t, r, tc.spec)
		fams := families(t, scrape(t, c, r.URL()))
		if got := fams["vllm:kv_cache_usage_perc"] != nil; got != tc.new {
			t.Errorf("%s: vllm:kv_cache_usage_perc present %v, want %v", tc.spec, got, tc.new)
		}
		if got := fams["vllm:gpu_cache_usage_perc"] != nil; got != tc.old {
			t.Errorf("%s: vllm:gpu_cache_usage_perc present %v, want %v", tc.spec, got, tc.old)
		}
		if fams["vllm:num_requests_waiting"] == nil || fams["vllm:request_queue_time_seconds"] == nil {
			t.Errorf("%s: families %v", tc.spec, names(fams))
		}
	}
}

func TestMockMetricsEndpoint(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast, Replicas: 2, Metrics: MetricsMode{KV: KVBoth}})
	r1 := f.Replica(1)
	c := client(t)
	do := func(method, body string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(method, r1.URL()+"/mock/metrics", strings.NewReader(body))
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		return resp.StatusCode, string(readAll(t, resp.Body))
	}
	if code, body := do(http.MethodGet, ""); code != 200 || body != "kv=both\n" {
		t.Errorf("GET /mock/metrics: %d %q", code, body)
	}
	if code, body := do(http.MethodPut, "Frozen, kv=old"); code != 200 || body != "frozen,kv=old\n" {
		t.Errorf("PUT /mock/metrics: %d %q", code, body)
	}
	if code, body := do(http.MethodPut, "status=200"); code != 400 || !strings.Contains(body, "status") {
		t.Errorf("bad PUT /mock/metrics: %d %q", code, body)
	}
	if got := r1.MetricsMode(); got != (MetricsMode{Fault: MetricsFrozen, KV: KVOld}) {
		t.Errorf("MetricsMode() = %+v", got)
	}
	if code, body := do(http.MethodGet, ""); code != 200 || body != "frozen,kv=old\n" {
		t.Errorf("GET /mock/metrics: %d %q", code, body)
	}
	if s := f.Stats(); s.Replicas[0].Metrics != "kv=both" || s.Replicas[1].Metrics != "frozen,kv=old" {
		t.Errorf("stats metrics modes %q, %q", s.Replicas[0].Metrics, s.Replicas[1].Metrics)
	}
	if err := r1.SetMetricsMode(MetricsMode{Fault: MetricsSlow}); err == nil || r1.MetricsMode().Fault != MetricsFrozen {
		t.Errorf("SetMetricsMode(slow without delay): %v, mode now %v", err, r1.MetricsMode())
	}
}

func TestScrapeCounts(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	r := f.Replica(0)
	c := client(t)
	scrape(t, c, r.URL())
	scrape(t, c, r.URL())
	if s := r.Stats(); s.Scrapes != 2 || s.MaxConcurrentScrapes != 1 || s.ScrapesInFlight != 0 {
		t.Errorf("after 2 scrapes: scrapes %d, max concurrent %d, in flight %d", s.Scrapes, s.MaxConcurrentScrapes, s.ScrapesInFlight)
	}

	setMetricsMode(t, r, "hang")
	var wg sync.WaitGroup
	cancels := make([]context.CancelFunc, 3)
	for i := range cancels {
		ctx, cancel := context.WithCancel(context.Background())
		cancels[i] = cancel
		defer cancel()
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, r.URL()+"/metrics", nil)
			if resp, err := c.Do(req); err == nil {
				resp.Body.Close()
			}
		}()
	}
	waitFor(t, time.Second, "3 hanging scrapes", func() bool { return r.Stats().ScrapesInFlight == 3 })
	cancels[0]()
	cancels[1]()
	waitFor(t, time.Second, "2 scrapes to end", func() bool { return r.Stats().ScrapesInFlight == 1 })

	var stats FleetStats
	resp, body, err := get(t, c, r.URL()+"/mock/stats", 0)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET /mock/stats: %v", err)
	}
	if err := json.Unmarshal(body, &stats); err != nil {
		t.Fatal(err)
	}
	if s := stats.Replicas[0]; s.Scrapes != 5 || s.MaxConcurrentScrapes != 3 || s.ScrapesInFlight != 1 {
		t.Errorf("/mock/stats: scrapes %d, max concurrent %d, in flight %d; want 5, 3, 1", s.Scrapes, s.MaxConcurrentScrapes, s.ScrapesInFlight)
	}
	for _, field := range []string{`"scrapes":5`, `"max_concurrent_scrapes":3`, `"scrapes_in_flight":1`, `"kv_blocks":2048`, `"kv_blocks_used":0`, `"metrics":"hang"`} {
		if !strings.Contains(string(body), field) {
			t.Errorf("/mock/stats lacks %s", field)
		}
	}

	req, _ := http.NewRequest(http.MethodPost, r.URL()+"/mock/reset", nil)
	if resp, err := c.Do(req); err != nil || resp.StatusCode != http.StatusNoContent {
		t.Fatalf("POST /mock/reset: %v", err)
	} else {
		resp.Body.Close()
	}
	if s := r.Stats(); s.Scrapes != 0 || s.MaxConcurrentScrapes != 1 || s.ScrapesInFlight != 1 {
		t.Errorf("after reset: scrapes %d, max concurrent %d, in flight %d; want 0, 1, 1", s.Scrapes, s.MaxConcurrentScrapes, s.ScrapesInFlight)
	}
	cancels[2]()
	wg.Wait()
	waitFor(t, time.Second, "the last scrape to end", func() bool { return r.Stats().ScrapesInFlight == 0 })
	if r.ResetStats(); r.Stats().MaxConcurrentScrapes != 0 {
		t.Errorf("after ResetStats: max concurrent %d, want 0", r.Stats().MaxConcurrentScrapes)
	}
}
