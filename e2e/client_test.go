package e2e

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// TestClientDisconnectCancelsUpstream: a client that goes away mid-stream
// (after 3 events) gets its upstream request cancelled within 500ms.
func TestClientDisconnectCancelsUpstream(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet))
	c := newClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	resp := post(ctx, t, c, gw.URL+"/v1/chat/completions", chatBody("A long answer nobody waits for.", true),
		"X-Mock-Tokens: 200", "X-Mock-Token-Interval: 100ms")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	events, _, err := readEvents(resp.Body, func(_ event, n int) bool { return n < 3 })
	if err != nil || len(events) != 3 {
		t.Fatalf("read %d events (%v), want 3", len(events), err)
	}
	// Going away: the connection closes under the unfinished response.
	gone := time.Now()
	cancel()
	resp.Body.Close()

	var rec mockllm.RequestRecord
	if !waitFor(3*time.Second, func() bool {
		if r := fleet.Replica(0).Stats().Recent; len(r) == 1 {
			rec = r[0]
		}
		return rec.Outcome == mockllm.OutcomeCancelled
	}) {
		t.Fatalf("upstream request outcome %q after 3s, want %q", rec.Outcome, mockllm.OutcomeCancelled)
	}
	if d := rec.Ended.Sub(gone); d > 500*time.Millisecond {
		t.Errorf("upstream saw the cancellation %v after the client left, want within 500ms", d)
	} else {
		t.Logf("upstream cancelled %v after the client left (%d tokens sent)", d.Round(time.Millisecond), rec.TokensSent)
	}
	if rec.TokensSent >= 200 {
		t.Errorf("upstream sent all %d tokens", rec.TokensSent)
	}
	// A client that goes away is neutral for the upstream.
	var samples []metricSample
	if !waitFor(2*time.Second, func() bool {
		samples = gw.scrapeMetrics()
		n, _ := metricValue(samples, "caddy_llm_proxy_requests_total", map[string]string{"outcome": "client_gone"})
		return n == 1
	}) {
		t.Errorf("caddy_llm_proxy_requests_total{outcome=client_gone} never reached 1")
	}
	if n, _ := metricValue(samples, "caddy_llm_proxy_upstream_attempts_total", map[string]string{"outcome": "canceled"}); n != 1 {
		t.Errorf("caddy_llm_proxy_upstream_attempts_total{outcome=canceled} = %v, want 1", n)
	}
	if n, _ := metricValue(samples, "caddy_llm_proxy_upstream_attempts_total", nil); n != 1 {
		t.Errorf("caddy_llm_proxy_upstream_attempts_total = %v, want 1 (one attempt, canceled)", n)
	}
}

// TestClientDisconnectBeforeFirstEventCancelsUpstream: a client that goes
// away while the upstream is still before its first token gets its
// upstream request cancelled within 500ms.
func TestClientDisconnectBeforeFirstEventCancelsUpstream(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet))
	c := newClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	req, err := newRequest(ctx, gw.URL+"/v1/chat/completions", chatBody("Think for a long time.", true), "X-Mock-TTFT: 20s")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		resp, err := c.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	if !waitFor(5*time.Second, func() bool { return fleet.Replica(0).Stats().InFlight == 1 }) {
		t.Fatal("the request never reached the upstream")
	}
	time.Sleep(100 * time.Millisecond)
	gone := time.Now()
	cancel()
	<-done

	var rec mockllm.RequestRecord
	if !waitFor(3*time.Second, func() bool {
		if r := fleet.Replica(0).Stats().Recent; len(r) == 1 {
			rec = r[0]
		}
		return rec.Outcome == mockllm.OutcomeCancelled
	}) {
		t.Fatalf("upstream request outcome %q after 3s, want %q", rec.Outcome, mockllm.OutcomeCancelled)
	}
	if d := rec.Ended.Sub(gone); d > 500*time.Millisecond {
		t.Errorf("upstream saw the cancellation %v after the client left, want within 500ms", d)
	}
}
