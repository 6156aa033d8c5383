package e2e

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// TestStreamRunningAcrossReloadCompletes: a stream that started before a
// config reload keeps going on the old handler, after that handler's
// Cleanup and past the 1s grace period, and ends normally; requests after
// the reload use the new config.
func TestStreamRunningAcrossReloadCompletes(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{})
	site := func(tag string) string {
		return fmt.Sprintf("\theader X-Config %s\n\tllm_proxy %s {\n\t\ttransport http {\n\t\t\tkeepalive 30s\n\t\t}\n\t}", tag, upstreams(fleet))
	}
	gw := startGateway(t, site("before"))
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)

	const tokens = 12
	body := chatBody("Outlive the config that started me.", true)
	headers := []string{"X-Request-Id: e2e-reload", fmt.Sprintf("X-Mock-Tokens: %d", tokens), "X-Mock-Token-Interval: 200ms"}
	resp := post(ctx, t, c, gw.URL+"/v1/chat/completions", body, headers...)
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Config") != "before" {
		t.Fatalf("status %d, X-Config %q", resp.StatusCode, resp.Header.Get("X-Config"))
	}
	reloaded := make(chan struct{})
	events, tail, err := readEvents(resp.Body, func(_ event, n int) bool {
		if n == 3 {
			gw.reload(site("after")) // mid-stream; returns once the new config runs
			close(reloaded)
		}
		return true
	})
	select {
	case <-reloaded:
	default:
		t.Fatalf("stream ended after %d events, before the reload", len(events))
	}
	if err != nil || len(tail) > 0 {
		t.Errorf("stream ended with %v (tail %q) after the reload, want a clean end", err, tail)
	}
	s := &stream{Status: resp.StatusCode, Events: events, Err: err, Tail: tail}
	checkCleanStream(t, s)
	if len(events) != tokens+2 {
		t.Errorf("got %d events, want %d", len(events), tokens+2)
	}
	if d := events[len(events)-1].At.Sub(events[3].At); d < 1500*time.Millisecond {
		t.Errorf("the stream went on for only %v after the reload; the test wants it to outlive the 1s grace period", d)
	}
	direct := streamRequest(ctx, t, c, fleet.Replica(0).URL()+"/v1/chat/completions", body, headers...)
	checkSameEvents(t, events, direct.Events)

	after, err := doPlain(ctx, c, gw.URL+"/v1/chat/completions", chatBody("New config.", false), "X-Mock-Tokens: 2")
	if err != nil || after.Status != http.StatusOK || after.Header.Get("X-Config") != "after" {
		t.Errorf("request after the reload: %v, status %v, X-Config %q", err, after.Status, after.Header.Get("X-Config"))
	}
}
