package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// TestMetricsCountRequestsAndSurviveReload: the caddy_llm_proxy_*
// collectors count requests, attempts, TTFT observations and relayed
// events exactly, and keep their values across a reload that changes the
// config (and keep counting after it).
func TestMetricsCountRequestsAndSurviveReload(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, PerReplica: map[int]mockllm.Behavior{
		0: {Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503}},
	}})
	bad, good := fleet.Replica(0).Addr(), fleet.Replica(1).Addr()
	site := func(extra string) string {
		// breaker off: every request fails on the first upstream first, so
		// that each one counts the same attempts; min_per_sec 50: every
		// one is retried, over the default floor (3 at once, 3 a second).
		return fmt.Sprintf("%s\tllm_proxy %s %s {\n\t\tlb_policy first\n\t\tmax_attempts 2\n\t\tbreaker off\n\t\tretries {\n\t\t\tmin_per_sec 50\n\t\t}\n\t}", extra, bad, good)
	}
	gw := startGateway(t, site(""))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	const model = "mock-llama"
	// Each stream: role chunk, 4 token chunks, [DONE].
	const eventsPerStream = 6
	send := func() {
		t.Helper()
		s := streamRequest(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("Count me.", true),
			"X-Mock-Tokens: 4", "X-Mock-Token-Interval: 0")
		checkCleanStream(t, s)
		if len(s.Events) != eventsPerStream {
			t.Fatalf("got %d events, want %d", len(s.Events), eventsPerStream)
		}
	}
	for range 3 {
		send()
	}
	invalid, err := doPlain(ctx, c, gw.URL+"/v1/chat/completions", `{"model":`)
	if err != nil || invalid.Status != http.StatusBadRequest {
		t.Fatalf("invalid JSON: %v, status %v", err, invalid)
	}

	type want struct {
		name   string
		labels map[string]string
		value  float64
	}
	expect := func(streams int) []want {
		n := float64(streams)
		return []want{
			{"caddy_llm_proxy_requests_total", map[string]string{"upstream": good, "model": model, "outcome": "success"}, n},
			{"caddy_llm_proxy_requests_total", map[string]string{"outcome": "success"}, n},
			{"caddy_llm_proxy_requests_total", map[string]string{"outcome": "invalid_request"}, 1},
			{"caddy_llm_proxy_upstream_attempts_total", map[string]string{"upstream": bad, "outcome": "http_5xx"}, n},
			{"caddy_llm_proxy_upstream_attempts_total", map[string]string{"upstream": good, "outcome": "success"}, n},
			{"caddy_llm_proxy_upstream_attempts_total", nil, 2 * n},
			{"caddy_llm_proxy_ttft_seconds_count", map[string]string{"upstream": good, "model": model}, n},
			{"caddy_llm_proxy_ttft_seconds_count", nil, n}, // failed attempts have no TTFT
			{"caddy_llm_proxy_events_relayed_total", nil, eventsPerStream * n},
		}
	}
	// check waits for the counters to settle (a request is counted just
	// after its last byte), then compares them exactly.
	check := func(when string, streams int) {
		t.Helper()
		var samples []metricSample
		mismatch := func() string {
			samples = gw.scrapeMetrics()
			for _, w := range expect(streams) {
				if got, _ := metricValue(samples, w.name, w.labels); got != w.value {
					return fmt.Sprintf("%s%v = %v, want %v", w.name, w.labels, got, w.value)
				}
			}
			return ""
		}
		var last string
		if !waitFor(3*time.Second, func() bool { last = mismatch(); return last == "" }) {
			t.Errorf("%s: %s", when, last)
			for _, s := range samples {
				if strings.HasPrefix(s.Name, "caddy_llm_proxy_") && !strings.Contains(s.Name, "_bucket") {
					t.Logf("  %s%v %v", s.Name, s.Labels, s.Value)
				}
			}
		}
	}
	check("after 3 streams", 3)

	// A reload that changes the config: a response header, visible below.
	gw.reload(site("\theader X-Config reloaded\n"))
	check("after reload", 3)
	resp := post(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("Count me.", true), "X-Mock-Tokens: 4", "X-Mock-Token-Interval: 0")
	_, _, _ = readEvents(resp.Body, nil)
	resp.Body.Close()
	if resp.Header.Get("X-Config") != "reloaded" {
		t.Fatalf("the reloaded config is not serving (no X-Config header)")
	}
	check("after reload and one more stream", 4)
}

// TestAccessLogCarriesLLMPlaceholders: the {http.llm_proxy.*} placeholders
// (upstream, attempts, ttft_ms, outcome, model) reach the JSON access log
// through log_append, for a failover success, an upstream error and a
// gateway refusal.
func TestAccessLogCarriesLLMPlaceholders(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, PerReplica: map[int]mockllm.Behavior{
		0: {Fault: mockllm.Fault{Kind: mockllm.FaultStatus, Status: 503}},
	}})
	bad, good := fleet.Replica(0).Addr(), fleet.Replica(1).Addr()
	logFile := filepath.Join(t.TempDir(), "access.log")
	gw := startGateway(t, fmt.Sprintf(`	log {
		output file %s
		format json
	}
	log_append llm_upstream {http.llm_proxy.upstream}
	log_append llm_attempts {http.llm_proxy.attempts}
	log_append llm_ttft_ms {http.llm_proxy.ttft_ms}
	log_append llm_outcome {http.llm_proxy.outcome}
	log_append llm_model {http.llm_proxy.model}
	llm_proxy %s %s {
		lb_policy first
		max_attempts 2
	}`, logFile, bad, good))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	url := gw.URL + "/v1/chat/completions"

	// 1: the first upstream answers 503, the second serves after 150ms.
	s := streamRequest(ctx, t, c, url, chatBody("Log me.", true), "X-Mock-TTFT: 150ms", "X-Mock-Tokens: 3", "X-Mock-Token-Interval: 0")
	checkCleanStream(t, s)
	// 2: both answer 503; the last one passes through.
	r2, err := doPlain(ctx, c, url, chatBody("Log me too.", true), "X-Mock-Fault: status=503")
	if err != nil || r2.Status != http.StatusServiceUnavailable {
		t.Fatalf("all-503 request: %v, status %v", err, r2)
	}
	// 3: refused by the gateway.
	r3, err := doPlain(ctx, c, url, `not json`)
	if err != nil || r3.Status != http.StatusBadRequest {
		t.Fatalf("invalid request: %v, status %v", err, r3)
	}

	var entries []map[string]any
	if !waitFor(5*time.Second, func() bool { entries = readJSONLines(t, logFile); return len(entries) >= 3 }) {
		t.Fatalf("access log has %d entries after 5s, want 3", len(entries))
	}
	type want struct {
		status   int
		upstream string
		attempts int
		outcome  string
		minTTFT  int // ms; -1: must be 0
	}
	wants := []want{
		{200, good, 2, "success", 150},
		{503, good, 2, "upstream_error", -1},
		{400, "", 0, "invalid_request", -1},
	}
	for i, w := range wants {
		e := entries[i]
		if got, _ := asInt(e["status"]); got != w.status {
			t.Errorf("entry %d: status %v, want %d", i, e["status"], w.status)
		}
		if e["llm_upstream"] != w.upstream {
			t.Errorf("entry %d: llm_upstream %v, want %q", i, e["llm_upstream"], w.upstream)
		}
		if got, ok := asInt(e["llm_attempts"]); !ok || got != w.attempts {
			t.Errorf("entry %d: llm_attempts %v, want %d", i, e["llm_attempts"], w.attempts)
		}
		if e["llm_outcome"] != w.outcome {
			t.Errorf("entry %d: llm_outcome %v, want %q", i, e["llm_outcome"], w.outcome)
		}
		ttft, ok := asInt(e["llm_ttft_ms"])
		switch {
		case !ok:
			t.Errorf("entry %d: llm_ttft_ms %v is not a whole number", i, e["llm_ttft_ms"])
		case w.minTTFT < 0 && ttft != 0:
			t.Errorf("entry %d: llm_ttft_ms %d for a request that never committed, want 0", i, ttft)
		case w.minTTFT >= 0 && (ttft < w.minTTFT || ttft > 5000):
			t.Errorf("entry %d: llm_ttft_ms %d, want at least the upstream's %dms TTFT", i, ttft, w.minTTFT)
		}
		if i < 2 && e["llm_model"] != "mock-llama" {
			t.Errorf("entry %d: llm_model %v, want mock-llama", i, e["llm_model"])
		}
	}
	if t.Failed() {
		for i, e := range entries {
			b, _ := json.Marshal(e)
			t.Logf("access log entry %d: %s", i, b)
		}
	}
}

// readJSONLines reads a JSON-lines file; a missing file is empty.
func readJSONLines(t *testing.T, path string) []map[string]any {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("access log line is not JSON: %q", sc.Text())
		}
		out = append(out, m)
	}
	return out
}

// asInt reads a whole number logged as a JSON number or a numeric string.
func asInt(v any) (int, bool) {
	switch x := v.(type) {
	case float64:
		return int(x), x == float64(int(x))
	case string:
		n, err := strconv.Atoi(x)
		return n, err == nil
	}
	return 0, false
}
