package e2e

// Helpers of the tenant and admission tests (tenants_test.go,
// admission_test.go): a gateway that knows its keys and checks, when its
// test ends, that none of them appears in caddy's log, its metrics or its
// admin API; the admin API's tenant views; refusal and x-ratelimit-*
// checks.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// newKey returns a fresh API key for a test: "sk-e2e-<name>-<32 hex>", so
// that its random part cannot appear anywhere by chance.
func newKey(name string) string {
	var b [16]byte
	rand.Read(b[:])
	return "sk-e2e-" + name + "-" + hex.EncodeToString(b[:])
}

// tenantGateway is a gateway with tenants. It knows every key the test
// uses; when the test ends it fails it if one of them — whole, or the
// first 16 hex digits of its random part — appears in the metrics, the
// admin API (/llm_proxy/tenants, /config/) or caddy's log (debug level:
// everything the gateway writes).
type tenantGateway struct {
	*gateway
	keys []string
}

// startTenantGateway starts a gateway with debug logging and registers
// the key checks. keys are every key the test presents (known or not).
func startTenantGateway(t *testing.T, o gatewayOptions, keys ...string) *tenantGateway {
	t.Helper()
	tg := &tenantGateway{keys: keys}
	// Registered before the gateway's own cleanup, so it runs after the
	// process has exited: the log is complete.
	t.Cleanup(func() {
		if tg.gateway != nil {
			tg.checkNoKey("caddy's log", tg.logs.String())
		}
	})
	o.Debug = true
	tg.gateway = startGatewayWith(t, o)
	// Runs first, while the gateway still serves.
	t.Cleanup(func() {
		tg.checkNoKey("the metrics (GET /metrics)", tg.rawAdmin("/metrics"))
		tg.checkNoKey("the admin API (GET /llm_proxy/tenants)", tg.rawAdmin("/llm_proxy/tenants"))
		tg.checkNoKey("the admin API (GET /config/)", tg.rawAdmin("/config/"))
	})
	return tg
}

// addKeys adds keys that the test presents later (e.g. unknown ones).
func (tg *tenantGateway) addKeys(keys ...string) { tg.keys = append(tg.keys, keys...) }

// rawAdmin GETs an admin path and returns its body ("" on error: the
// test's own checks report an admin API that does not answer).
func (tg *tenantGateway) rawAdmin(path string) string {
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get(tg.AdminURL + path)
	if err != nil {
		tg.t.Logf("GET %s for the key check: %v", path, err)
		return ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// checkNoKey fails the test when text holds one of the keys.
func (tg *tenantGateway) checkNoKey(where, text string) {
	for _, k := range tg.keys {
		needles := []string{k}
		if i := strings.LastIndexByte(k, '-'); i >= 0 && len(k)-i-1 >= 16 {
			needles = append(needles, k[i+1:i+17])
		}
		for _, n := range needles {
			if i := strings.Index(text, n); i >= 0 {
				lo, hi := max(0, i-120), min(len(text), i+len(n)+60)
				what := "the key"
				if n != k {
					what = "part of the key"
				}
				tg.t.Errorf("%s holds %s %q (keys must never appear in logs, metrics or the admin API): …%s…", where, what, k, text[lo:hi])
				break
			}
		}
	}
}

// bearer is the Authorization header presenting key.
func bearer(key string) string { return "Authorization: Bearer " + key }

// tenantView is one tenant as GET /llm_proxy/tenants lists it.
type tenantView struct {
	Tenant           string `json:"tenant"`
	Tier             string `json:"tier"`
	Inflight         int    `json:"inflight"`
	Queued           int    `json:"queued"`
	RequestsInWindow int    `json:"requests_in_window"`
	TokensInWindow   int    `json:"tokens_in_window"`
	MaxConcurrent    int    `json:"max_concurrent"`
	RPM              int    `json:"rpm"`
	TPM              int    `json:"tpm"`
	Breaker          *struct {
		State     string    `json:"state"`
		OpenUntil time.Time `json:"open_until"`
		Forced    bool      `json:"forced"`
	} `json:"breaker"`
}

// breakerState is the tenant's breaker state, "none" without a breaker.
func (v tenantView) breakerState() string {
	if v.Breaker == nil {
		return "none"
	}
	return v.Breaker.State
}

// tenants lists the tenants with state (GET /llm_proxy/tenants) by id.
func (g *gateway) tenants() map[string]tenantView {
	g.t.Helper()
	status, body := g.admin(http.MethodGet, "/llm_proxy/tenants")
	if status != http.StatusOK {
		g.t.Fatalf("GET /llm_proxy/tenants: status %d: %s", status, body)
	}
	var views []tenantView
	if err := json.Unmarshal(body, &views); err != nil {
		g.t.Fatalf("GET /llm_proxy/tenants: not a JSON array of tenants: %v: %s", err, body)
	}
	out := make(map[string]tenantView, len(views))
	for _, v := range views {
		if _, dup := out[v.Tenant]; dup {
			g.t.Errorf("GET /llm_proxy/tenants lists tenant %q twice: %s", v.Tenant, body)
		}
		out[v.Tenant] = v
	}
	return out
}

// tenant returns one tenant (GET /llm_proxy/tenants/<id>), failing the
// test when the admin API does not know it.
func (g *gateway) tenant(id string) tenantView {
	g.t.Helper()
	status, body := g.admin(http.MethodGet, "/llm_proxy/tenants/"+id)
	if status != http.StatusOK {
		g.t.Fatalf("GET /llm_proxy/tenants/%s: status %d: %s", id, status, body)
	}
	var v tenantView
	if err := json.Unmarshal(body, &v); err != nil {
		g.t.Fatalf("GET /llm_proxy/tenants/%s: %v: %s", id, err, body)
	}
	if v.Tenant != id {
		g.t.Errorf("GET /llm_proxy/tenants/%s answered tenant %q", id, v.Tenant)
	}
	return v
}

// waitTenantIdle waits until the admin API shows the tenant with nothing
// in flight or queued (its last request settled), failing the test after d.
func (g *gateway) waitTenantIdle(id string, d time.Duration) tenantView {
	g.t.Helper()
	var v tenantView
	if !waitFor(d, func() bool { v = g.tenant(id); return v.Inflight == 0 && v.Queued == 0 }) {
		g.t.Fatalf("tenant %s still has %d in flight and %d queued after %v: a slot was not released", id, v.Inflight, v.Queued, d)
	}
	return v
}

// reply is a non-streamed response as the client saw it.
type reply struct {
	Status int
	Header http.Header
	Body   []byte
	// Took is from sending the request to the end of the body.
	Took time.Duration
	Err  error
}

// send POSTs body and reads the whole response; errors are in the reply,
// so it may run in other goroutines than the test's.
func send(ctx context.Context, c *http.Client, url, body string, headers ...string) reply {
	req, err := newRequest(ctx, url, body, headers...)
	if err != nil {
		return reply{Err: err}
	}
	start := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		return reply{Err: err, Took: time.Since(start)}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return reply{Status: resp.StatusCode, Header: resp.Header, Body: b, Took: time.Since(start), Err: err}
}

// mustSend is send for the test's goroutine: a transport error fails it.
func mustSend(ctx context.Context, t testing.TB, c *http.Client, url, body string, headers ...string) reply {
	t.Helper()
	r := send(ctx, c, url, body, headers...)
	if r.Err != nil {
		t.Fatalf("POST %s: %v", url, r.Err)
	}
	return r
}

// errorCode returns the "code" of an OpenAI error body, "" if none.
func errorCode(body []byte) string {
	var v struct {
		Error struct {
			Code any `json:"code"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &v) != nil || v.Error.Code == nil {
		return ""
	}
	return fmt.Sprint(v.Error.Code)
}

// checkRefusal checks a refusal that the gateway wrote: status, OpenAI's
// error shape with code, and Retry-After (integer seconds in [1, maxRetry]
// when wantRetry, absent otherwise). It returns the error message.
func checkRefusal(t testing.TB, what string, r reply, status int, code string, wantRetry bool, maxRetry int) string {
	t.Helper()
	if r.Status != status {
		t.Errorf("%s: status %d, want %d with code %s; body %s", what, r.Status, status, code, r.Body)
		return ""
	}
	msg, _, got := openAIError(t, r.Body)
	if got != code {
		t.Errorf("%s: error code %q, want %q; body %s", what, got, code, r.Body)
	}
	ra := r.Header.Get("Retry-After")
	switch {
	case !wantRetry && ra != "":
		t.Errorf("%s: Retry-After %q, want none (waiting cannot help)", what, ra)
	case wantRetry && ra == "":
		t.Errorf("%s: no Retry-After header; every 429 %s must carry one", what, code)
	case wantRetry:
		n, err := strconv.Atoi(ra)
		if err != nil || n < 1 || n > maxRetry {
			t.Errorf("%s: Retry-After %q, want integer seconds in [1, %d]", what, ra, maxRetry)
		}
	}
	return msg
}

// rateHeaders are the x-ratelimit-* values a response should carry: for
// each limit, its value and what remains; a limit of 0 means the tenant
// has none, so neither header of that kind may be present.
type rateHeaders struct {
	ReqLimit, ReqRemaining int
	TokLimit, TokRemaining int
}

// checkRateHeaders checks the x-ratelimit-* headers of a response: each
// present exactly for the limits the tenant has, with those values, and
// reset durations in Go's syntax within [0, 1m].
func checkRateHeaders(t testing.TB, what string, h http.Header, want rateHeaders) {
	t.Helper()
	for _, k := range []struct {
		kind             string
		limit, remaining int
	}{{"requests", want.ReqLimit, want.ReqRemaining}, {"tokens", want.TokLimit, want.TokRemaining}} {
		names := []string{"x-ratelimit-limit-" + k.kind, "x-ratelimit-remaining-" + k.kind, "x-ratelimit-reset-" + k.kind}
		if k.limit == 0 {
			for _, n := range names {
				if v := h.Values(n); len(v) > 0 {
					t.Errorf("%s: %s: %q, want no such header (the tenant has no %s limit, so no placeholder value either)", what, n, v, k.kind)
				}
			}
			continue
		}
		num := func(n string) (int, bool) {
			t.Helper()
			v := h.Get(n)
			if v == "" {
				t.Errorf("%s: no %s header (want %s limit headers)", what, n, k.kind)
				return 0, false
			}
			x, err := strconv.Atoi(v)
			if err != nil {
				t.Errorf("%s: %s = %q, not an integer", what, n, v)
				return 0, false
			}
			return x, true
		}
		if v, ok := num(names[0]); ok && v != k.limit {
			t.Errorf("%s: %s = %d, want %d", what, names[0], v, k.limit)
		}
		if v, ok := num(names[1]); ok && v != k.remaining {
			t.Errorf("%s: %s = %d, want %d", what, names[1], v, k.remaining)
		}
		if v := h.Get(names[2]); v == "" {
			t.Errorf("%s: no %s header", what, names[2])
		} else if d, err := time.ParseDuration(v); err != nil || d < 0 || d > time.Minute {
			t.Errorf("%s: %s = %q, want a Go duration (e.g. 1s, 6m0s) within the minute window", what, names[2], v)
		}
	}
}

// chatOf is a chat body with one user message of content and extra
// top-level fields.
func chatOf(content string, stream bool, extra map[string]any) string {
	m := map[string]any{
		"model":    "mock-llama",
		"messages": []map[string]string{{"role": "user", "content": content}},
		"stream":   stream,
	}
	for k, v := range extra {
		m[k] = v
	}
	b, _ := json.Marshal(m)
	return string(b)
}

// content40 is 40 ASCII characters: a prompt estimate of exactly 10
// tokens (⌈40 ÷ 4⌉; the role is not text content).
const content40 = "Count me: forty characters of content.!!"

// recordByID returns the mock's record of the request sent with
// X-Request-Id id (the record's ID is "chatcmpl-<id>").
func recordByID(f *mockllm.Fleet, id string) (mockllm.RequestRecord, bool) {
	for _, r := range f.Stats().Replicas {
		for _, rec := range r.Recent {
			if rec.ID == "chatcmpl-"+id || rec.ID == "cmpl-"+id {
				return rec, true
			}
		}
	}
	return mockllm.RequestRecord{}, false
}

// endedRecordByID is recordByID once the mock has recorded the request's
// end (with its usage): the client can have the whole answer a moment
// before the mock's handler returns and records it.
func endedRecordByID(f *mockllm.Fleet, id string) (mockllm.RequestRecord, bool) {
	waitFor(2*time.Second, func() bool {
		rec, ok := recordByID(f, id)
		return ok && !rec.Ended.IsZero()
	})
	return recordByID(f, id)
}

// lastRecord returns the most recent request the fleet received.
func lastRecord(t testing.TB, f *mockllm.Fleet) (mockllm.RequestRecord, mockllm.ReplicaStats) {
	t.Helper()
	var best mockllm.RequestRecord
	var bestStats mockllm.ReplicaStats
	found := false
	for _, r := range f.Stats().Replicas {
		if n := len(r.Recent); n > 0 && (!found || r.Recent[n-1].Started.After(best.Started)) {
			best, bestStats, found = r.Recent[n-1], r, true
		}
	}
	if !found {
		t.Fatalf("the mock fleet received no request")
	}
	return best, bestStats
}

// waitInFlight waits until the fleet holds n requests in flight.
func waitInFlight(t testing.TB, f *mockllm.Fleet, n int, d time.Duration) {
	t.Helper()
	in := 0
	if !waitFor(d, func() bool {
		in = 0
		for _, r := range f.Stats().Replicas {
			in += r.InFlight
		}
		return in == n
	}) {
		t.Fatalf("the mock fleet has %d requests in flight after %v, want %d", in, d, n)
	}
}

// asyncSend runs send in a goroutine; wait returns its reply.
func asyncSend(ctx context.Context, c *http.Client, url, body string, headers ...string) (wait func() reply) {
	var r reply
	var wg sync.WaitGroup
	wg.Go(func() { r = send(ctx, c, url, body, headers...) })
	return func() reply { wg.Wait(); return r }
}

// minuteWindow matches how a 429's message may name the rolling minute.
var minuteWindow = regexp.MustCompile(`(?i)minute|\b1m\b|\b60 ?s\b|\b1m0s\b|per min`)
