package e2e

// End-to-end tests of a pool's admission (issue 8): capacity, shedding of
// sheddable tiers, the priority queue, its bounds and displacement.

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// admissionMetric reads caddy_llm_proxy_admission_total{tier,decision}.
func admissionMetric(t *testing.T, samples []metricSample, tier, decision string) float64 {
	t.Helper()
	return metricValueOrZero(t, samples, "caddy_llm_proxy_admission_total", map[string]string{"tier": tier, "decision": decision})
}

// waitQueueDepth waits until caddy_llm_proxy_queue_depth{tier} is n.
func waitQueueDepth(t *testing.T, gw *gateway, tier string, n float64, d time.Duration) {
	t.Helper()
	var got float64
	var found bool
	if !waitFor(d, func() bool {
		got, found = metricValue(gw.scrapeMetrics(), "caddy_llm_proxy_queue_depth", map[string]string{"tier": tier})
		return found && got == n
	}) {
		t.Fatalf("caddy_llm_proxy_queue_depth{tier=%s} = %v (series found: %v) after %v, want %v: the request is not queued, or the gauge does not show it",
			tier, got, found, d, n)
	}
}

// TestAdmissionSaturatedPoolShedsAndServesHigherTierFirst asserts priority
// admission on a pool with capacity 2 held by two standard requests: a
// sheddable (priority −1) request is refused at once with 429 saturated
// and Retry-After, reaching no upstream; a standard and then a premium
// request wait; when the first holder ends, the premium one is sent
// upstream first, within 250ms (no capacity sits idle while an admissible
// request waits), and the standard one as soon as the premium one ends;
// the upstream never holds more than 2; with the pool idle again a
// sheddable request is served at once (work-conserving); the admission,
// queue-wait, queue-depth and in-flight metrics say so.
func TestAdmissionSaturatedPoolShedsAndServesHigherTierFirst(t *testing.T) {
	t.Parallel()
	keyB, keyS, keyP := newKey("batch"), newKey("std"), newKey("prem")
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 1, TokenInterval: mockllm.NoDelay}})
	gw := startTenantGateway(t, gatewayOptions{
		Globals: fmt.Sprintf(`	llm_proxy {
		tenants {
			key %s batchy tier batch
			key %s stdy tier standard
			key %s premy tier premium
		}
		tier batch {
			priority -1
		}
		tier standard {
			priority 0
			queue_timeout 10s
		}
		tier premium {
			priority 10
			queue_timeout 10s
		}
	}`, keyB, keyS, keyP),
		Site: fmt.Sprintf(`	llm_proxy %s {
		admission {
			capacity 2
		}
	}`, upstreams(fleet)),
	}, keyB, keyS, keyP)
	tr := &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 8}
	t.Cleanup(tr.CloseIdleConnections)
	c := &http.Client{Transport: tr}
	ctx := testContext(t, 25*time.Second)
	url := gw.URL + "/v1/chat/completions"
	body := chatOf("pool", false, nil)

	h1 := asyncSend(ctx, c, url, body, bearer(keyS), "X-Request-Id: h1", "X-Mock-TTFT: 1s")
	h2 := asyncSend(ctx, c, url, body, bearer(keyS), "X-Request-Id: h2", "X-Mock-TTFT: 4s")
	waitInFlight(t, fleet, 2, 3*time.Second)

	r := mustSend(ctx, t, c, url, body, bearer(keyB), "X-Request-Id: shed")
	checkRefusal(t, "a sheddable request at a saturated pool", r, http.StatusTooManyRequests, "saturated", true, 60)
	if r.Took > 300*time.Millisecond {
		t.Errorf("the sheddable request was refused after %v, want at once (never queued)", r.Took)
	}
	if n := fleetRequests(fleet); n != 2 {
		t.Errorf("the fleet received %d requests, want 2: the shed request reached an upstream", n)
	}

	qs := asyncSend(ctx, c, url, body, bearer(keyS), "X-Request-Id: qs")
	waitQueueDepth(t, gw.gateway, "standard", 1, 2*time.Second)
	qp := asyncSend(ctx, c, url, body, bearer(keyP), "X-Request-Id: qp")
	waitQueueDepth(t, gw.gateway, "premium", 1, 2*time.Second)
	if v := gw.tenant("premy"); v.Queued != 1 {
		t.Errorf("admin API: premy queued %d, want 1", v.Queued)
	}

	for name, w := range map[string]func() reply{"h1": h1, "h2": h2, "qs": qs, "qp": qp} {
		if r := w(); r.Err != nil || r.Status != http.StatusOK {
			t.Errorf("request %s: status %d, %v: %s", name, r.Status, r.Err, r.Body)
		}
	}
	rec := map[string]mockllm.RequestRecord{}
	for _, id := range []string{"h1", "h2", "qs", "qp"} {
		x, ok := recordByID(fleet, id)
		if !ok {
			t.Fatalf("the mock has no record of request %s", id)
		}
		rec[id] = x
	}
	if _, ok := recordByID(fleet, "shed"); ok {
		t.Errorf("the shed request reached the mock")
	}
	switch {
	case !rec["qp"].Started.Before(rec["qs"].Started):
		t.Errorf("the standard request reached the upstream at %v, the premium one at %v: the higher tier must be served first",
			rec["qs"].Started.Format("15:04:05.000"), rec["qp"].Started.Format("15:04:05.000"))
	default:
		if gap := rec["qp"].Started.Sub(rec["h1"].Ended); gap > 250*time.Millisecond {
			t.Errorf("the premium request reached the upstream %v after the first holder ended: capacity sat idle while it waited", gap.Round(time.Millisecond))
		}
		if gap := rec["qs"].Started.Sub(rec["qp"].Ended); gap > 250*time.Millisecond {
			t.Errorf("the standard request reached the upstream %v after the premium one ended: capacity sat idle while it waited", gap.Round(time.Millisecond))
		}
	}
	if m := fleet.Replica(0).Stats().MaxInFlight; m > 2 {
		t.Errorf("the upstream held %d requests at once, over the pool's capacity 2", m)
	}

	r = mustSend(ctx, t, c, url, body, bearer(keyB))
	if r.Status != http.StatusOK {
		t.Errorf("a sheddable request at an idle pool: status %d: %s; a lower tier may use idle capacity", r.Status, r.Body)
	}

	samples := gw.scrapeMetrics()
	for _, m := range []struct {
		tier, decision string
		want           float64
	}{
		{"batch", "saturated", 1}, {"batch", "admitted", 1}, {"standard", "admitted", 2},
		{"standard", "queued_admitted", 1}, {"premium", "queued_admitted", 1},
	} {
		if got := admissionMetric(t, samples, m.tier, m.decision); got != m.want {
			t.Errorf("caddy_llm_proxy_admission_total{tier=%s,decision=%s} = %v, want %v", m.tier, m.decision, got, m.want)
		}
	}
	if mustMetricFamily(t, samples, "caddy_llm_proxy_queue_wait_seconds") {
		n, _ := metricValue(samples, "caddy_llm_proxy_queue_wait_seconds_count", map[string]string{"tier": "premium"})
		sum, _ := metricValue(samples, "caddy_llm_proxy_queue_wait_seconds_sum", map[string]string{"tier": "premium"})
		if n < 1 || sum < 0.3 {
			t.Errorf("caddy_llm_proxy_queue_wait_seconds{tier=premium}: count %v, sum %vs; want the premium request's wait (about 0.5–1s) observed", n, sum)
		}
	}
	for _, tier := range []string{"standard", "premium"} {
		if got := metricValueOrZero(t, samples, "caddy_llm_proxy_queue_depth", map[string]string{"tier": tier}); got != 0 {
			t.Errorf("caddy_llm_proxy_queue_depth{tier=%s} = %v at the end, want 0", tier, got)
		}
		if got := metricValueOrZero(t, samples, "caddy_llm_proxy_inflight", map[string]string{"tier": tier}); got != 0 {
			t.Errorf("caddy_llm_proxy_inflight{tier=%s} = %v at the end, want 0", tier, got)
		}
	}
}

// TestAdmissionQueueBoundsTimeoutAndDisplacement asserts that nothing
// waits without a bound, on a pool with capacity 1 and a queue of 1 held by
// one request: a queued request whose tier's queue_timeout (300ms) passes
// gets 429 queue_timeout with Retry-After after about that long and is
// never sent upstream; with the queue full, a request of the same priority
// gets 429 queue_full at once, and a higher-priority arrival displaces the
// queued one (429 displaced with Retry-After, at once) and is served when
// the holder ends; the upstream sees only the holder and that request.
func TestAdmissionQueueBoundsTimeoutAndDisplacement(t *testing.T) {
	t.Parallel()
	keyQ, keyL, keyH := newKey("quick"), newKey("low"), newKey("high")
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 1, TokenInterval: mockllm.NoDelay}})
	gw := startTenantGateway(t, gatewayOptions{
		Globals: fmt.Sprintf(`	llm_proxy {
		tenants {
			key %s quicky tier lowquick
			key %s lowy tier low
			key %s highy tier high
		}
		tier lowquick {
			priority 0
			queue_timeout 300ms
		}
		tier low {
			priority 0
			queue_timeout 10s
		}
		tier high {
			priority 5
			queue_timeout 10s
		}
	}`, keyQ, keyL, keyH),
		Site: fmt.Sprintf(`	llm_proxy %s {
		admission {
			capacity 1
			queue 1
		}
	}`, upstreams(fleet)),
	}, keyQ, keyL, keyH)
	tr := &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 8}
	t.Cleanup(tr.CloseIdleConnections)
	c := &http.Client{Transport: tr}
	ctx := testContext(t, 25*time.Second)
	url := gw.URL + "/v1/chat/completions"
	body := chatOf("queue", false, nil)

	holder := asyncSend(ctx, c, url, body, bearer(keyH), "X-Request-Id: holder", "X-Mock-TTFT: 3s")
	waitInFlight(t, fleet, 1, 3*time.Second)

	r := mustSend(ctx, t, c, url, body, bearer(keyQ), "X-Request-Id: expired")
	checkRefusal(t, "a queued request past its tier's queue_timeout 300ms", r, http.StatusTooManyRequests, "queue_timeout", true, 60)
	if r.Took < 250*time.Millisecond || r.Took > 1500*time.Millisecond {
		t.Errorf("the queue_timeout refusal came after %v, want about 300ms", r.Took.Round(time.Millisecond))
	}

	low := asyncSend(ctx, c, url, body, bearer(keyL), "X-Request-Id: displaced")
	waitQueueDepth(t, gw.gateway, "low", 1, 2*time.Second)
	r = mustSend(ctx, t, c, url, body, bearer(keyL), "X-Request-Id: full")
	checkRefusal(t, "a request at a full queue (same priority)", r, http.StatusTooManyRequests, "queue_full", true, 60)
	if r.Took > 300*time.Millisecond {
		t.Errorf("the queue_full refusal came after %v, want at once", r.Took.Round(time.Millisecond))
	}
	sentHigh := time.Now()
	high := asyncSend(ctx, c, url, body, bearer(keyH), "X-Request-Id: high")
	r = low()
	checkRefusal(t, "the queued low request when a higher tier arrives at the full queue", r, http.StatusTooManyRequests, "displaced", true, 60)
	if d := time.Since(sentHigh); d > 500*time.Millisecond {
		t.Errorf("the displaced request was answered %v after the higher-priority arrival, want at once", d.Round(time.Millisecond))
	}
	for name, w := range map[string]func() reply{"holder": holder, "high": high} {
		if r := w(); r.Err != nil || r.Status != http.StatusOK {
			t.Errorf("request %s: status %d, %v: %s", name, r.Status, r.Err, r.Body)
		}
	}
	for _, id := range []string{"expired", "displaced", "full"} {
		if _, ok := recordByID(fleet, id); ok {
			t.Errorf("the refused request %s reached the upstream", id)
		}
	}
	if n := fleetRequests(fleet); n != 2 {
		t.Errorf("the fleet received %d requests, want 2 (the holder and the high-priority one)", n)
	}
	samples := gw.scrapeMetrics()
	for _, m := range []struct {
		tier, decision string
	}{{"lowquick", "queue_timeout"}, {"low", "queue_full"}, {"low", "displaced"}, {"high", "queued_admitted"}} {
		if got := admissionMetric(t, samples, m.tier, m.decision); got != 1 {
			t.Errorf("caddy_llm_proxy_admission_total{tier=%s,decision=%s} = %v, want 1", m.tier, m.decision, got)
		}
	}
}

// TestAdmissionCapacitySurvivesReload: a reload keeps the pool's gate, so
// a request in flight through the old config still counts against the new
// config's capacity (a new gate per config admitted past capacity 1), and
// the new config's capacity applies once it starts.
func TestAdmissionCapacitySurvivesReload(t *testing.T) {
	t.Parallel()
	keyB := newKey("batch")
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 1, TokenInterval: mockllm.NoDelay}})
	// Each config differs (an identical one is not reloaded at all).
	site := func(capacity, attempts int) string {
		return fmt.Sprintf("\tllm_proxy %s {\n\t\tmax_attempts %d\n\t\tadmission {\n\t\t\tcapacity %d\n\t\t}\n\t}", upstreams(fleet), attempts, capacity)
	}
	gw := startTenantGateway(t, gatewayOptions{
		Globals: fmt.Sprintf("\tllm_proxy {\n\t\ttenants {\n\t\t\tkey %s batchy tier batch\n\t\t}\n\t\ttier batch {\n\t\t\tpriority -1\n\t\t}\n\t}", keyB),
		Site:    site(1, 2),
	}, keyB)
	c := newClient(t)
	ctx := testContext(t, 20*time.Second)
	url := gw.URL + "/v1/chat/completions"
	body := chatOf("reload", false, nil)

	held := asyncSend(ctx, c, url, body, bearer(keyB), "X-Mock-TTFT: 3s")
	waitInFlight(t, fleet, 1, 3*time.Second)
	// After a reload the old server's idle connections are closed, and a
	// connection it accepted as it shut down may be closed unanswered
	// (Caddy, before any handler): new connections, and once more on EOF.
	afterReload := func() reply {
		c.CloseIdleConnections()
		r := send(ctx, c, url, body, bearer(keyB))
		if r.Err != nil {
			t.Logf("request after reload: %v; retrying once", r.Err)
			r = mustSend(ctx, t, c, url, body, bearer(keyB))
		}
		return r
	}
	gw.gateway.reload(site(1, 3))
	r := afterReload()
	checkRefusal(t, "after a reload, with the old config's request in flight", r, http.StatusTooManyRequests, "saturated", true, 60)

	gw.gateway.reload(site(2, 3))
	r = afterReload()
	if r.Status != http.StatusOK {
		t.Errorf("after a reload to capacity 2: status %d: %s; want the new capacity in force", r.Status, r.Body)
	}
	if r := held(); r.Err != nil || r.Status != http.StatusOK {
		t.Errorf("the request held across the reloads: status %d, %v", r.Status, r.Err)
	}
}
