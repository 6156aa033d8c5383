package caddymodule

import (
	"fmt"
	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/prometheus/client_golang/prometheus"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// Two sites of one config in front of one failing server with different
// breaker settings (A: consecutive_failures 2, B: 10). A's breaker opens;
// a reload of the unchanged config (caddy reload, POST /load) must keep it
// open: A's requests keep getting 503 without reaching the server, while
// B, which heard A's two failures but wants ten, serves.
func TestReloadKeepsSiteBreakerOpenWithTwoPolicies(t *testing.T) {
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		http.Error(w, `{"error":"down"}`, http.StatusInternalServerError)
	}))
	t.Cleanup(srv.Close)
	dial := strings.TrimPrefix(srv.URL, "http://")
	listen := freePort(t)
	siteA := siteRoute{"a", `{"consecutive_failures":2,"open_for":60000000000,"min_open":60000000000}`}
	siteB := siteRoute{"b", `{"consecutive_failures":10,"open_for":60000000000,"min_open":60000000000}`}
	cfg := sitesConfig(listen, dial, siteA, siteB)
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatalf("loading config: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	// A new connection per request: a kept-alive one may be reset by the
	// listener a reload closes.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	post := func(site string) int { t.Helper(); return postSite(t, client, listen, site) }
	post("a")
	post("a")
	if code := post("a"); code != http.StatusServiceUnavailable {
		t.Fatalf("site A after 2 failures: status %d, want 503", code)
	}
	for reload := 1; reload <= 2; reload++ {
		if err := caddy.Load(cfg, true); err != nil {
			t.Fatalf("reload %d: %v", reload, err)
		}
		before := hits.Load()
		if code := post("a"); code != http.StatusServiceUnavailable {
			t.Fatalf("site A after reload %d of the unchanged config: status %d, want 503 (its breaker was open)", reload, code)
		}
		if n := hits.Load() - before; n != 0 {
			t.Fatalf("site A's request after reload %d reached the failing server", reload)
		}
	}
	if code := post("b"); code == http.StatusServiceUnavailable {
		t.Fatalf("site B (consecutive_failures 10, no failures) refused with 503")
	}
	// A reload that swaps the sites' order keeps A's breaker open and B's
	// closed.
	if err := caddy.Load(sitesConfig(listen, dial, siteB, siteA), true); err != nil {
		t.Fatalf("reload with the sites swapped: %v", err)
	}
	before := hits.Load()
	if code := post("a"); code != http.StatusServiceUnavailable || hits.Load() != before {
		t.Fatalf("site A after a reload that swapped the sites: status %d, %d requests at the server; want 503 and none (its breaker was open)", code, hits.Load()-before)
	}
	if code := post("b"); code == http.StatusServiceUnavailable {
		t.Fatalf("site B after a reload that swapped the sites refused with 503: A's open state went to B")
	}
}

// An SRE's gateway: two sites over shared upstreams (one with saturation,
// active probes, least_queue and a gate; one with breakers off and a
// fallback), tenants and tiers, reloaded with changed settings, then a
// site and an upstream removed, then every site removed. After each step
// the shared registry holds only what the running config uses, and at the
// end nothing: no entry, gate, body budget, tenant controller, probe or
// scrape loop, and no goroutine left behind.
func TestReloadsLeaveNoStateOrGoroutinesBehind(t *testing.T) {
	m1, m2, m3 := newMockVLLM(t), newMockVLLM(t), newMockVLLM(t)
	d1, d2, d3 := strings.TrimPrefix(m1.URL, "http://"), strings.TrimPrefix(m2.URL, "http://"), strings.TrimPrefix(m3.URL, "http://")
	pa, pb := freePort(t), freePort(t)
	base := runtime.NumGoroutine()
	site := func(listen, body string) string { return "http://" + listen + " {\n" + body + "\n}\n" }
	global := func(tiers string) string {
		return "{\n\tadmin off\n\tpersist_config off\n\tllm_proxy {\n\t\ttenants {\n\t\t\tkey k1 t1 tier gold\n\t\t\tunknown bronze\n\t\t}\n" + tiers + "\t}\n}\n"
	}
	siteA := func(interval string, ups ...string) string {
		return site(pa, "\tllm_proxy {\n\t\tto "+strings.Join(ups, " ")+"\n\t\tlb_policy least_queue\n\t\tsaturation {\n\t\t\tinterval "+interval+
			"\n\t\t}\n\t\tbreaker {\n\t\t\tconsecutive_failures 2\n\t\t\tprobe {\n\t\t\t\turi /health\n\t\t\t\tinterval 50ms\n\t\t\t}\n\t\t}\n\t\tadmission {\n\t\t\tcapacity 8\n\t\t}\n\t}")
	}
	siteB := func(ups ...string) string {
		return site(pb, "\tllm_proxy {\n\t\tto "+strings.Join(ups, " ")+"\n\t\tbreaker off\n\t\tfallback small {\n\t\t\tto "+d3+"\n\t\t\twhen unavailable\n\t\t}\n\t}")
	}
	tiers1 := "\t\ttier gold {\n\t\t\tpriority 10\n\t\t}\n\t\ttier bronze {\n\t\t\tpriority -1\n\t\t\tmax_concurrent 4\n\t\t}\n"
	tiers2 := "\t\ttier gold {\n\t\t\tpriority 5\n\t\t\tmax_concurrent 3\n\t\t}\n\t\ttier bronze {\n\t\t\tpriority -1\n\t\t}\n"
	load := func(step, src string) {
		t.Helper()
		cfg, err := adapt(t, src)
		if err != nil {
			t.Fatalf("%s: adapt: %v\n%s", step, err, src)
		}
		if err := caddy.Load(cfg, true); err != nil {
			t.Fatalf("%s: load: %v", step, err)
		}
	}
	send := func(listen string) {
		t.Helper()
		for range 3 {
			req, _ := http.NewRequest("POST", "http://"+listen+"/v1/chat/completions",
				strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
			req.Header.Set("Authorization", "Bearer k1")
			resp, err := http.DefaultClient.Do(req)
			for try := 0; err != nil && try < 3; try++ {
				// A connection accepted by a listener the reload just
				// closed is reset: the client tries again, as clients do.
				time.Sleep(50 * time.Millisecond)
				req, _ = http.NewRequest("POST", "http://"+listen+"/v1/chat/completions",
					strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
				req.Header.Set("Authorization", "Bearer k1")
				resp, err = http.DefaultClient.Do(req)
			}
			if err != nil {
				t.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("%s: status %d", listen, resp.StatusCode)
			}
			resp, err = http.Get("http://" + listen + "/v1/models")
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
		}
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	load("first", global(tiers1)+siteA("200ms", d1, d2)+siteB(d1, d2))
	send(pa)
	send(pb)
	load("reload with changes", global(tiers2)+siteB(d1, d2)+siteA("300ms", d1, d2))
	send(pa)
	send(pb)
	load("reload, site A drops an upstream", global(tiers2)+siteA("300ms", d1)+siteB(d1, d2))
	send(pa)
	waitFor(t, "one scrape loop (d1's)", func() bool { return shared.upstreams.ScrapeLoops() == 1 })
	load("reload, site B removed", global(tiers2)+siteA("300ms", d1))
	send(pa)
	if es := shared.upstreams.Entries(); len(es) != 1 || es[0].Addr() != d1 {
		var addrs []string
		for _, e := range es {
			addrs = append(addrs, e.Addr())
		}
		t.Fatalf("entries after site B left: %v, want only %s", addrs, d1)
	}
	if err := caddy.Load([]byte(`{"admin":{"disabled":true,"config":{"persist":false}}}`), true); err != nil {
		t.Fatalf("no sites: %v", err)
	}
	check := func() string {
		switch {
		case len(shared.upstreams.Entries()) != 0:
			return fmt.Sprintf("%d upstream entries", len(shared.upstreams.Entries()))
		case shared.upstreams.ProbeLoops() != 0:
			return fmt.Sprintf("%d probe loops", shared.upstreams.ProbeLoops())
		case shared.upstreams.ScrapeLoops() != 0:
			return fmt.Sprintf("%d scrape loops", shared.upstreams.ScrapeLoops())
		case shared.gates.Len() != 0:
			return fmt.Sprintf("%d gates", shared.gates.Len())
		case shared.bodies.Len() != 0:
			return fmt.Sprintf("%d body budgets", shared.bodies.Len())
		case shared.tenants.Len() != 0:
			return fmt.Sprintf("%d tenant controllers", shared.tenants.Len())
		case shared.live.Models.Len() != 0:
			return fmt.Sprintf("%d model lists", shared.live.Models.Len())
		case shared.live.Newest() != nil:
			return "a config still in force"
		case len(runningPools()) != 0:
			return fmt.Sprintf("%d running pools", len(runningPools()))
		}
		return ""
	}
	http.DefaultClient.CloseIdleConnections()
	deadline := time.Now().Add(5 * time.Second)
	for {
		left := check()
		n := runtime.NumGoroutine()
		if left == "" && n <= base+2 {
			break
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			t.Fatalf("after every site left: %s; %d goroutines, %d before the first load\n%s", left, n, base, buf)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Two sites of one config in front of the same upstream with admission
// capacities of their own: site A allows 1 request in flight, site B 100
// (declared after A). While A's one request runs, A's second must wait (it
// must not reach the upstream): each handler's requests obey its own
// capacity ("the most requests in flight through this handler"). The
// gate was shared by upstream set, and the last handler's settings applied.
func TestTwoSitesOneUpstreamEachObeyTheirAdmissionCapacity(t *testing.T) {
	var hits atomic.Int64
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		select {
		case <-release:
		case <-r.Context().Done():
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}`))
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) })
	dial := strings.TrimPrefix(srv.URL, "http://")
	listen := freePort(t)
	route := func(path, admission string) string {
		return `{"match":[{"path":["` + path + `"]}],"handle":[` +
			`{"handler":"llm_proxy","max_attempts":1,"upstreams":[{"dial":"` + dial + `"}],"admission":` + admission + `}]}`
	}
	cfg := `{"admin":{"disabled":true,"config":{"persist":false}},"apps":{"http":{"servers":{"s":{"listen":["` + listen +
		`"],"automatic_https":{"disable":true},"routes":[` +
		route("/a/*", `{"capacity":1}`) + `,` + route("/b/*", `{"capacity":100}`) + `]}}}}}`
	if err := caddy.Load([]byte(cfg), true); err != nil {
		t.Fatalf("loading config: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	send := func(timeout time.Duration) {
		c := &http.Client{Timeout: timeout}
		resp, err := c.Post("http://"+listen+"/a/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
		if err == nil {
			resp.Body.Close()
		}
	}
	go send(10 * time.Second)
	waitFor(t, "site A's first request at the upstream", func() bool { return hits.Load() == 1 })
	send(300 * time.Millisecond)
	if n := hits.Load(); n != 1 {
		t.Fatalf("site A (capacity 1) had %d requests at the upstream at once: site B's capacity 100 applied to it", n)
	}
	// A reload of the same config keeps each site's gate: the request
	// still running through the old config's site A fills the new one's.
	if err := caddy.Load([]byte(cfg), true); err != nil {
		t.Fatalf("reload: %v", err)
	}
	send(300 * time.Millisecond)
	if n := hits.Load(); n != 1 {
		t.Fatalf("after a reload site A (capacity 1) had %d requests at the upstream at once", n)
	}
}

// Two sites in front of one dead server with different breaker policies:
// A's breaker opens, B's stays closed. caddy_llm_proxy_breaker_state has
// a series for each (their pool label is the same upstream set, so each
// gets its policy after "~"): one reads open, the other closed. Before,
// the collector kept the first pool's series of a (pool, upstream, model)
// and dropped the other site's breaker: B's closed breaker was invisible
// and min by (pool) said every upstream of the pool was open while B's
// clients were served.
func TestBreakerStateShowsEachSitesBreaker(t *testing.T) {
	initMetrics()
	dial := "127.0.0.1:" + strings.Split(freePort(t), ":")[1] // nothing listens: refused
	listen := freePort(t)
	route := func(path string, n int) string {
		return fmt.Sprintf(`{"match":[{"path":["%s"]}],"handle":[{"handler":"llm_proxy","max_attempts":1,"upstreams":[{"dial":"%s"}],`+
			`"breaker":{"consecutive_failures":%d,"open_for":60000000000,"min_open":60000000000}}]}`, path, dial, n)
	}
	cfg := `{"admin":{"disabled":true,"config":{"persist":false}},"apps":{"http":{"servers":{"s":{"listen":["` + listen +
		`"],"automatic_https":{"disable":true},"routes":[` + route("/a/*", 2) + `,` + route("/b/*", 10) + `]}}}}}`
	if err := caddy.Load([]byte(cfg), true); err != nil {
		t.Fatalf("loading config: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	for range 2 {
		resp, err := http.Post("http://"+listen+"/a/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	r := prometheus.NewRegistry()
	if err := registerMetrics(r); err != nil {
		t.Fatal(err)
	}
	fams, err := r.Gather()
	if err != nil {
		t.Fatal(err)
	}
	states := map[float64]int{}
	var pools []string
	for _, f := range fams {
		if f.GetName() != "caddy_llm_proxy_breaker_state" {
			continue
		}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["upstream"] == dial {
				states[m.GetGauge().GetValue()]++
				pools = append(pools, labels["pool"])
			}
		}
	}
	if states[float64(breaker.Open)] != 1 || states[float64(breaker.Closed)] != 1 {
		t.Fatalf("breaker_state series of %s: %v by state (pools %q), want one open (site A) and one closed (site B)", dial, states, pools)
	}
}
