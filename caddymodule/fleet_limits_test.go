package caddymodule

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/fleet"
	"github.com/llmproxy/caddy-llm-proxy/internal/redistest"
)

// TestFailClosedAdapts: fail_closed in a tier block is "fail_closed": true;
// it takes no argument.
func TestFailClosedAdapts(t *testing.T) {
	src := "{\n\tllm_proxy {\n\t\ttenants {\n\t\t\tkey sk-a acme\n\t\t}\n\t\ttier default {\n\t\t\trpm 60\n\t\t\tfail_closed\n\t\t}\n\t}\n}\n:8080 {\n\tllm_proxy 127.0.0.1:9000\n}\n"
	out, err := adapt(t, src)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), `"tiers":[{"name":"default","rpm":60,"fail_closed":true}]`) {
		t.Fatalf("adapted: %s", out)
	}
	if err := caddy.Validate(mustConfig(t, out)); err != nil {
		t.Fatal(err)
	}
	_, err = adapt(t, strings.Replace(src, "fail_closed\n", "fail_closed yes\n", 1))
	if err == nil || !strings.Contains(err.Error(), "Caddyfile:8") {
		t.Fatalf("fail_closed with an argument: %v", err)
	}
}

// tenantsApp is an llm_proxy app of one key (sk-<tenant>) per tenant on
// tier default, with fleet JSON when fleetJSON is set.
func tenantsApp(tier, fleetJSON string, tenants ...string) string {
	var keys []string
	for _, tn := range tenants {
		h := sha256.Sum256([]byte("sk-" + tn))
		keys = append(keys, `{"sha256":"`+hex.EncodeToString(h[:])+`","tenant":"`+tn+`"}`)
	}
	app := `{"tenants":{"keys":[` + strings.Join(keys, ",") + `]},"tiers":[` + tier + `]`
	if fleetJSON != "" {
		app += `,"fleet":` + fleetJSON
	}
	return app + "}"
}

// TestTenantLimitsUseTheFleetWhenItRuns: with a fleet, the controller
// counts tenants' limits in Redis (the tenant's window appears there);
// a reload without one brings them back home, exactly as before.
func TestTenantLimitsUseTheFleetWhenItRuns(t *testing.T) {
	s := redistest.Start(t, redistest.Options{})
	r := redis.NewClient(&redis.Options{Addr: s.Addr()})
	defer r.Close()
	listen := freePort(t)
	up := `{"handler":"llm_proxy","upstreams":[{"dial":"` + freePort(t) + `"}]}`
	fleetJSON := `{"redis":"redis://` + s.Addr() + `","refresh":"200ms","op_timeout":"50ms","instance_id":"gw-a"}`

	runConfigWithApp(t, listen, tenantsApp(`{"name":"default","rpm":3}`, fleetJSON, "acme"), up)
	ctl := liveController()
	if _, ok := ctl.LimitStore().(*fleet.FailOpenLimits); !ok {
		t.Fatalf("limit store %T, want the fleet's", ctl.LimitStore())
	}
	tk, rf := ctl.Reserve(admission.Request{Tenant: "acme"})
	if rf != nil {
		t.Fatal(rf)
	}
	if n, _ := r.HGet(context.Background(), "llmproxy:{tenant:acme}:win", "R").Int(); n != 1 {
		t.Fatalf("requests in redis: %d, want 1", n)
	}
	if liveLimitStore() == nil {
		t.Fatal("no live fleet limit store")
	}
	tk.Settle(admission.Usage{}, 0)

	// Two more fill rpm 3 fleet-wide; a request through the gateway is
	// refused, charged to Redis's count.
	for range 2 {
		tk, rf := ctl.Reserve(admission.Request{Tenant: "acme"})
		if rf != nil {
			t.Fatal(rf)
		}
		tk.Settle(admission.Usage{}, 0)
	}
	if status, hdr := send(t, listen, "sk-acme"); status != http.StatusTooManyRequests || hdr.Get("X-Ratelimit-Remaining-Requests") != "0" {
		t.Fatalf("fourth request: %d %v, want 429 with nothing remaining", status, hdr)
	}

	runConfigWithApp(t, listen, tenantsApp(`{"name":"default","rpm":3}`, "", "acme"), up)
	if s := liveController().LimitStore(); s != nil {
		t.Fatalf("limit store %T without a fleet, want the controller's own", s)
	}
}

// TestFailClosedTierGets503WhileRedisIsAway: Redis down when the config
// starts (local mode): a fail_closed tier's request is refused with 503
// and Retry-After before any upstream is tried; another tier runs on its
// share of the limits (rpm 4 ÷ expected_instances 2 = 2).
func TestFailClosedTierGets503WhileRedisIsAway(t *testing.T) {
	listen := freePort(t)
	up := `{"handler":"llm_proxy","upstreams":[{"dial":"` + freePort(t) + `"}]}`
	fleetJSON := `{"redis":"redis://` + freePort(t) + `","expected_instances":2}`
	tiers := `{"name":"default","rpm":4},{"name":"strict","rpm":4,"fail_closed":true}`
	app := strings.Replace(tenantsApp(tiers, fleetJSON, "acme", "bank"), `"tenant":"bank"`, `"tenant":"bank","tier":"strict"`, 1)
	runConfigWithApp(t, listen, app, up)
	if c := liveFleet(); c == nil || !c.Degraded() {
		t.Fatalf("fleet %v, want local mode", c)
	}
	status, hdr := send(t, listen, "sk-bank")
	if status != http.StatusServiceUnavailable || hdr.Get("Retry-After") == "" {
		t.Fatalf("fail_closed tier while redis is away: %d %v, want 503 with Retry-After", status, hdr)
	}
	ctl := liveController()
	for i := range 3 {
		tk, rf := ctl.Reserve(admission.Request{Tenant: "acme"})
		if (rf == nil) != (i < 2) {
			t.Fatalf("request %d in local mode: refusal %v (want 2 of rpm 4 ÷ 2)", i, rf)
		}
		if tk != nil {
			tk.Settle(admission.Usage{}, 0)
		}
	}
}

// send posts a chat completion with key and returns the status and headers.
func send(t *testing.T, gateway, key string) (int, http.Header) {
	t.Helper()
	req, _ := http.NewRequest("POST", "http://"+gateway+"/v1/chat/completions", strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode, resp.Header
}
