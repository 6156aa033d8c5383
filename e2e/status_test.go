package e2e

// End-to-end test of `caddy llm-proxy status` (issue 13): the real caddy
// binary's subcommand against a running gateway.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os/exec"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// TestStatusCommandNamesTheOpenBreakerAndTheBusyTenant runs a gateway in
// front of a refused upstream and two mock replicas with saturation
// scraping, trips the refused upstream's breaker with user traffic, keeps
// a slow stream of tenant "busy" in flight, and runs
// `caddy llm-proxy status --address <admin>`: the upstream table shows the
// refused upstream open with its last failure (connect_error), the live
// replicas closed with a saturation score, the tenant table shows busy
// with 1 of its 4 slots in flight and its usage against its limits, fleet
// off; no line is wider than 80 columns. `--json` parses, and each key
// is what the admin API's endpoint of that name answers.
func TestStatusCommandNamesTheOpenBreakerAndTheBusyTenant(t *testing.T) {
	t.Parallel()
	key := newKey("busy")
	fleet := startFleet(t, mockllm.FleetConfig{Replicas: 2, Behavior: mockllm.Behavior{
		TTFT: mockllm.Fixed(5 * time.Millisecond), Tokens: 2, TokenInterval: mockllm.NoDelay}})
	dead := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	gw := startTenantGateway(t, gatewayOptions{
		Globals: fmt.Sprintf(`	llm_proxy {
		tenants {
			key %s busy tier gold
		}
		tier gold {
			max_concurrent 4
			rpm 100
			tpm 100000
			breaker {
				consecutive_failures 3
			}
		}
	}`, key),
		Site: fmt.Sprintf(`	llm_proxy %s %s {
		lb_policy round_robin
		max_attempts 3
		breaker {
			consecutive_failures 2
			open_for 5m
		}
		saturation {
			interval 10s
		}
	}`, dead, upstreams(fleet)),
	}, key)
	c := newClient(t)
	ctx := testContext(t, 30*time.Second)
	url := gw.URL + "/v1/chat/completions"

	// Trip the refused upstream's breaker: round robin sends every third
	// attempt to it; each request fails over and succeeds.
	for i := 0; ; i++ {
		if v, ok := gw.breakers()[dead]; ok && v.State == "open" {
			break
		}
		if i == 12 {
			t.Fatalf("the refused upstream's breaker is not open after %d requests: %+v", i, gw.breakers()[dead])
		}
		r := mustSend(ctx, t, c, url, chatOf("trip", false, nil), bearer(key))
		if r.Status != http.StatusOK {
			t.Fatalf("request %d: status %d, want 200 after failing over: %s", i+1, r.Status, r.Body)
		}
	}
	gw.waitScraped(fleet, 5*time.Second)

	// A slow stream for busy (200 tokens 50ms apart: 10s), in flight
	// while the command runs.
	sctx, stopStream := context.WithCancel(ctx)
	defer stopStream()
	req, err := newRequest(sctx, url, chatOf("a slow stream", true, nil), bearer(key), "X-Mock-Tokens: 200", "X-Mock-Token-Interval: 50ms")
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("the slow stream: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("the slow stream: status %d, want 200", resp.StatusCode)
	}
	if got := 0; func() bool {
		readEvents(resp.Body, func(e event, n int) bool { got = n; return n < 1 })
		return got < 1
	}() {
		t.Fatalf("the slow stream ended before its first event")
	}
	if v := gw.tenant("busy"); v.Inflight != 1 {
		t.Fatalf("tenant busy has %d in flight, want 1 (the slow stream)", v.Inflight)
	}

	admin := strings.TrimPrefix(gw.AdminURL, "http://")
	out := runStatus(ctx, t, "--address", admin)
	t.Logf("caddy llm-proxy status --address %s:\n%s", admin, out)
	lines := strings.Split(out, "\n")
	row := func(prefix string) string {
		for _, l := range lines {
			if strings.HasPrefix(l, prefix) {
				return l
			}
		}
		t.Errorf("no line starts with %q:\n%s", prefix, out)
		return ""
	}
	if l := row(dead + " "); !strings.Contains(l, "open ") || !strings.Contains(l, "connect_error") {
		t.Errorf("the refused upstream's row %q: want its breaker open and its last failure connect_error", l)
	}
	for _, a := range fleet.Addrs() {
		if l := row(a + " "); !strings.Contains(l, "closed") || !strings.Contains(l, "0.") {
			t.Errorf("replica %s's row %q: want its breaker closed and a saturation score", a, l)
		}
	}
	if l := row("busy "); !strings.Contains(l, "gold") || !strings.Contains(l, "1/4") || !strings.Contains(l, "/100") ||
		!strings.Contains(l, "/100k") || !strings.Contains(l, "closed") {
		t.Errorf("tenant busy's row %q: want tier gold, 1/4 in flight, requests of 100 and tokens of 100k, breaker closed", l)
	}
	for _, want := range []string{"UPSTREAMS (3)", "TENANTS (1)", "FLEET off", "scrape of " + dead + " failed"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	for i, l := range lines {
		if n := len([]rune(l)); n > 80 {
			t.Errorf("line %d has %d columns, want at most 80: %q", i+1, n, l)
		}
	}
	if strings.Contains(out, key) {
		t.Errorf("the output holds the tenant's key")
	}

	// --json: each key is its endpoint's body. What moves between two
	// reads (a scrape's age, a rolling window) is allowed to move: it
	// must equal the admin API's answer just before or just after.
	var matched bool
	for attempt := 0; attempt < 3 && !matched; attempt++ {
		before := adminState(t, gw)
		var got map[string]any
		raw := runStatus(ctx, t, "--address", admin, "--json")
		if err := json.Unmarshal([]byte(raw), &got); err != nil {
			t.Fatalf("--json is not a JSON object: %v: %q", err, raw)
		}
		after := adminState(t, gw)
		if len(got) != len(before) {
			t.Fatalf("--json has keys %v, want the endpoints %v", keysOf(got), keysOf(before))
		}
		matched = true
		for e := range before {
			g := withoutAges(got[e])
			if !reflect.DeepEqual(g, withoutAges(before[e])) && !reflect.DeepEqual(g, withoutAges(after[e])) {
				matched = false
				t.Logf("attempt %d: --json %q differs from GET /llm_proxy/%s:\n%v\nbefore: %v\nafter: %v", attempt+1, e, e, got[e], before[e], after[e])
			}
		}
	}
	if !matched {
		t.Errorf("--json did not match the admin API in 3 attempts")
	}
	stopStream()
}

// runStatus runs `caddy llm-proxy status <args>` and returns its stdout,
// failing the test when it exits non-zero.
func runStatus(ctx context.Context, t *testing.T, args ...string) string {
	t.Helper()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, caddyBin, append([]string{"llm-proxy", "status"}, args...)...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("caddy llm-proxy status %v: %v\nstdout: %s\nstderr: %s", args, err, stdout.String(), stderr.String())
	}
	return stdout.String()
}

// adminState reads the endpoints the command combines, decoded.
func adminState(t *testing.T, gw *tenantGateway) map[string]any {
	t.Helper()
	out := map[string]any{}
	for _, e := range []string{"breakers", "saturation", "tenants", "fleet", "pools"} {
		status, body := gw.admin(http.MethodGet, "/llm_proxy/"+e)
		if status != http.StatusOK {
			t.Fatalf("GET /llm_proxy/%s: status %d: %s", e, status, body)
		}
		var v any
		if err := json.Unmarshal(body, &v); err != nil {
			t.Fatalf("GET /llm_proxy/%s: %v: %s", e, err, body)
		}
		out[e] = v
	}
	return out
}

// withoutAges drops the fields that grow with every read by themselves
// (a saturation snapshot's age_seconds).
func withoutAges(v any) any {
	switch x := v.(type) {
	case map[string]any:
		m := make(map[string]any, len(x))
		for k, e := range x {
			if k != "age_seconds" {
				m[k] = withoutAges(e)
			}
		}
		return m
	case []any:
		s := make([]any, len(x))
		for i, e := range x {
			s[i] = withoutAges(e)
		}
		return s
	}
	return v
}

func keysOf(m map[string]any) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	return ks
}
