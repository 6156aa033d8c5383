package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestManyReloadsThatMoveAndSwapUnnamedSitesKeepVerdictsAndSeries: two
// unnamed handlers of one site in front of one dead server (connection
// refused), A with consecutive_failures 2 and B with 10; A's breaker is
// open, B's closed. Thirty reloads that move both handlers' lines (and,
// every other one, swap their order) keep A answering 503 at once and B
// reaching the server (502); they report no breaker transition, keep one
// breaker_state series per handler, list one breaker per handler, and
// leave the process's goroutines where they were.
func TestManyReloadsThatMoveAndSwapUnnamedSitesKeepVerdictsAndSeries(t *testing.T) {
	t.Parallel()
	dead := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	handler := func(path string, n int) string {
		return fmt.Sprintf("\thandle_path %s {\n\t\tllm_proxy %s {\n\t\t\tmax_attempts 1\n\t\t\tbreaker {\n\t\t\t\tconsecutive_failures %d\n"+
			"\t\t\t\topen_for 5m\n\t\t\t\tmin_open 5m\n\t\t\t}\n\t\t}\n\t}\n", path, dead, n)
	}
	site := func(i int) string {
		pad := strings.Repeat("\t# moved\n", i%7)
		if i%2 == 1 {
			return pad + handler("/b/*", 10) + handler("/a/*", 2)
		}
		return pad + handler("/a/*", 2) + handler("/b/*", 10)
	}
	gw := startGateway(t, site(0))
	c := newClient(t)
	send := func(path string) int {
		t.Helper()
		ctx := testContext(t, 10*time.Second)
		return postAcrossReload(ctx, t, c, gw.URL+path+"/v1/chat/completions", chatBody("hi", false))
	}
	send("/a")
	send("/a")
	if code := send("/a"); code != http.StatusServiceUnavailable {
		t.Fatalf("site A after 2 refused connections: status %d, want 503", code)
	}
	transitions := func() float64 {
		v, ok := metricValue(gw.scrapeMetrics(), "caddy_llm_proxy_breaker_transitions_total", map[string]string{"upstream": dead})
		if !ok {
			t.Fatalf("no breaker_transitions_total series of %s", dead)
		}
		return v
	}
	series := func() int {
		n := 0
		for _, s := range gw.scrapeMetrics() {
			if s.Name == "caddy_llm_proxy_breaker_state" && s.Labels["upstream"] == dead {
				n++
			}
		}
		return n
	}
	goroutines := func() float64 {
		v, ok := metricValue(gw.scrapeMetrics(), "go_goroutines", nil)
		if !ok {
			t.Fatal("no go_goroutines in /metrics")
		}
		return v
	}
	before, seriesBefore := transitions(), series()
	var g0 float64
	for i := 1; i <= 30; i++ {
		gw.reload(fmt.Sprintf("\theader X-Config %d\n", i) + site(i))
		if code := send("/a"); code != http.StatusServiceUnavailable {
			t.Fatalf("site A after reload %d: status %d, want 503 (its breaker was open)", i, code)
		}
		if code := send("/b"); code != http.StatusBadGateway {
			t.Fatalf("site B after reload %d: status %d, want 502 (its own breaker is closed)", i, code)
		}
		if i == 5 {
			g0 = goroutines()
		}
	}
	if after := transitions(); after != before {
		t.Errorf("breaker transitions of %s: %v before 30 reloads, %v after; want no change", dead, before, after)
	}
	if n := series(); n != seriesBefore || n != 2 {
		t.Errorf("breaker_state series of %s: %d before 30 reloads, %d after; want 2 (one per handler)", dead, seriesBefore, n)
	}
	var open, closed int
	for _, v := range gw.breakerList() {
		if v.Upstream != dead {
			continue
		}
		switch v.State {
		case "open":
			open++
		case "closed":
			closed++
		}
	}
	if open != 1 || closed != 1 {
		t.Errorf("the admin API lists %d open and %d closed breakers of %s after 30 reloads, want 1 and 1", open, closed, dead)
	}
	if g := goroutines(); g > g0+20 {
		t.Errorf("go_goroutines %v after 30 reloads, %v after 5: a reload leaks goroutines", g, g0)
	}
}

// breakerList is GET /llm_proxy/breakers as listed: one view per
// handler's breaker (breakers keys them by key, which several handlers
// share).
func (g *gateway) breakerList() []breakerView {
	g.t.Helper()
	status, body := g.admin(http.MethodGet, "/llm_proxy/breakers")
	if status != http.StatusOK {
		g.t.Fatalf("GET /llm_proxy/breakers: status %d: %s", status, body)
	}
	var views []breakerView
	if err := json.Unmarshal(body, &views); err != nil {
		g.t.Fatalf("GET /llm_proxy/breakers: %v: %s", err, body)
	}
	return views
}

// postAcrossReload POSTs body to url and returns the status, sending it
// again (up to 3 times) when it was lost in a reload's listener hand-off
// (EOF or a reset before any response: no handler saw it), as a client
// would; post fails the test on it.
func postAcrossReload(ctx context.Context, t testing.TB, c *http.Client, url, body string) int {
	t.Helper()
	for try := 0; ; try++ {
		req, err := newRequest(ctx, url, body)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := c.Do(req)
		if err != nil && handOffLost(err) && try < 3 {
			time.Sleep(time.Duration(try+1) * 20 * time.Millisecond)
			continue
		}
		if err != nil {
			t.Fatalf("POST %s: %v", url, err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
}
