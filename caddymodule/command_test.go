package caddymodule

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/fleet"
	"github.com/llmproxy/caddy-llm-proxy/internal/statusview"
	"github.com/llmproxy/caddy-llm-proxy/saturation"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// statusFixture is a gateway's state in the module's own types, as the
// admin API serves it: an upstream breaker forced open by an operator and
// opened fleet-wide by another instance, its saturation snapshot, a busy
// tenant with an open tenant breaker, a fleet of two.
func statusFixture(now time.Time) map[string]any {
	since := now.Add(-41 * time.Second)
	return map[string]any{
		"breakers": []upstream.BreakerView{{
			Snapshot: breaker.Snapshot{Key: "10.0.0.2:8000", State: breaker.Open, Since: since, ConsecutiveFailures: 3,
				OpenUntil: now.Add(19 * time.Second), Forced: true, LastFailure: "http_5xx", LastFailureAt: since},
			Upstream: "10.0.0.2:8000", Inflight: 3, Scope: "fleet", OpenedBy: "gw-2",
		}},
		"saturation": []saturation.View{{
			Upstream: "10.0.0.2:8000", ScrapedAt: &since, AgeSeconds: 1.5, LastError: "dial tcp: refused",
			Score: 0.82, ScoreKnown: true, Inflight: 3,
		}},
		"tenants": []admission.TenantView{{
			Tenant: "acme", Tier: "gold", Inflight: 2, Queued: 1, RequestsInWindow: 7, TokensInWindow: 1234,
			MaxConcurrent: 4, RPM: 60, TPM: 100000,
			Breaker: &breaker.Snapshot{Key: "tenant:acme", State: breaker.HalfOpen, Since: since, Observed: true,
				LastFailure: "slow call", LastFailureAt: since},
		}},
		"fleet": fleetView{Mode: "fleet", InstanceID: "gw-1", Since: &since,
			Instances: []fleet.Instance{{ID: "gw-1", LastSeen: now}, {ID: "gw-2", LastSeen: since}}},
		"pools": []upstream.PoolStatus{{Key: "10.0.0.2:8000", Handler: "chat", MaxEjection: 0.3, PanicThreshold: 0.5, MaxEjected: 1,
			Failed: true, FailedSince: since, FailedReason: "40 of its last 40 attempts, across 2 upstreams, failed", Failures: 1}},
	}
}

// fakeAdmin serves the fixture's bodies at /llm_proxy/<endpoint> as the
// admin API writes them (writeJSON) and returns its address in Caddy's
// form ("127.0.0.1:PORT").
func fakeAdmin(t *testing.T, bodies map[string]any) (addr string, hits *atomic.Int64) {
	t.Helper()
	hits = new(atomic.Int64)
	mux := http.NewServeMux()
	for e, v := range bodies {
		mux.HandleFunc("/llm_proxy/"+e, func(w http.ResponseWriter, r *http.Request) {
			hits.Add(1)
			if r.Method != http.MethodGet {
				http.Error(w, "GET only", http.StatusMethodNotAllowed)
				return
			}
			_ = writeJSON(w, v)
		})
	}
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String(), hits
}

// TestAdminJSONDecodesIntoStatusView asserts that the JSON the admin API
// writes from the module's types (upstream.BreakerView, SaturationView,
// admission.TenantView, fleetView, upstream.PoolStatus) is what statusview decodes: a renamed
// field would show as an empty cell, not an error.
func TestAdminJSONDecodesIntoStatusView(t *testing.T) {
	now := time.Date(2026, 12, 1, 14, 30, 0, 0, time.UTC)
	since := now.Add(-41 * time.Second)
	raw, err := json.Marshal(statusFixture(now))
	if err != nil {
		t.Fatal(err)
	}
	s, err := statusview.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	want := statusview.Status{
		Breakers: []statusview.Breaker{{Key: "10.0.0.2:8000", Upstream: "10.0.0.2:8000", Inflight: 3, Scope: "fleet", OpenedBy: "gw-2",
			BreakerState: statusview.BreakerState{State: "open", Since: since, OpenUntil: now.Add(19 * time.Second), Forced: true,
				ConsecutiveFailures: 3, LastFailure: "http_5xx", LastFailureAt: since}}},
		Saturation: []statusview.Saturation{{Upstream: "10.0.0.2:8000", AgeSeconds: 1.5, LastError: "dial tcp: refused",
			Score: 0.82, ScoreKnown: true, Inflight: 3}},
		Tenants: []statusview.Tenant{{Tenant: "acme", Tier: "gold", Inflight: 2, Queued: 1, RequestsInWindow: 7, TokensInWindow: 1234,
			MaxConcurrent: 4, RPM: 60, TPM: 100000,
			Breaker: &statusview.BreakerState{State: "half_open", Since: since, Observed: true, LastFailure: "slow call", LastFailureAt: since}}},
		Fleet: statusview.Fleet{Mode: "fleet", InstanceID: "gw-1", Since: &since,
			Instances: []statusview.Instance{{ID: "gw-1", LastSeen: now}, {ID: "gw-2", LastSeen: since}}},
		Pools: []statusview.Pool{{Key: "10.0.0.2:8000", Handler: "chat", MaxEjected: 1,
			Failed: true, FailedSince: since, FailedReason: "40 of its last 40 attempts, across 2 upstreams, failed"}},
	}
	if !reflect.DeepEqual(s, want) {
		t.Errorf("decoded\n%+v\nwant\n%+v\nfrom %s", s, want, raw)
	}
}

// TestStatusEndpointsAreTheAdminRoutes asserts that every endpoint the
// command reads is a route of the admin module, and reads them from the
// real handlers of a process with no config: empty lists, fleet off.
func TestStatusEndpointsAreTheAdminRoutes(t *testing.T) {
	mux := http.NewServeMux()
	patterns := map[string]bool{}
	for _, r := range (adminAPI{}).Routes() {
		patterns[r.Pattern] = true
		h := r.Handler
		mux.HandleFunc(r.Pattern, func(w http.ResponseWriter, req *http.Request) {
			if err := h.ServeHTTP(w, req); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
			}
		})
	}
	for _, e := range statusview.Endpoints {
		if !patterns["/llm_proxy/"+e] {
			t.Errorf("the command reads /llm_proxy/%s, which the admin module does not route", e)
		}
	}
	srv := httptest.NewServer(mux)
	defer srv.Close()
	combined, err := fetchStatus(srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s, err := statusview.Parse(combined)
	if err != nil {
		t.Fatalf("%v: %s", err, combined)
	}
	if len(s.Breakers) != 0 || len(s.Tenants) != 0 || s.Fleet.Mode != "off" {
		t.Errorf("a process without config: %+v, want no breakers, no tenants, fleet off", s)
	}
}

// runCLI runs `caddy <args>` through the registered command, as Caddy's
// main does, with stdout captured.
func runCLI(t *testing.T, args ...string) (stdout string, err error) {
	t.Helper()
	c, ok := caddycmd.Commands()["llm-proxy"]
	if !ok {
		t.Fatal("no command llm-proxy registered")
	}
	sub := &cobra.Command{Use: c.Name, Short: c.Short, Long: c.Long}
	c.CobraFunc(sub)
	root := &cobra.Command{Use: "caddy", SilenceUsage: true}
	root.AddCommand(sub)
	root.SetArgs(args)

	r, w, perr := os.Pipe()
	if perr != nil {
		t.Fatal(perr)
	}
	saved := os.Stdout
	os.Stdout = w
	var out bytes.Buffer
	done := make(chan struct{})
	go func() { _, _ = io.Copy(&out, r); close(done) }()
	err = root.Execute()
	os.Stdout = saved
	w.Close()
	<-done
	r.Close()
	return out.String(), err
}

// TestStatusCLIJSONIsTheAdminAPIs runs `caddy llm-proxy status --address
// <admin> --json`: one object whose key per endpoint holds exactly what
// that endpoint answered.
func TestStatusCLIJSONIsTheAdminAPIs(t *testing.T) {
	now := time.Now().UTC()
	bodies := statusFixture(now)
	addr, _ := fakeAdmin(t, bodies)
	out, err := runCLI(t, "llm-proxy", "status", "--address", addr, "--json")
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("--json printed no JSON object: %v: %q", err, out)
	}
	want := map[string]any{}
	for e, v := range bodies {
		b, _ := json.Marshal(v)
		var decoded any
		_ = json.Unmarshal(b, &decoded)
		want[e] = decoded
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("--json printed\n%s\nwant the admin API's bodies\n%v", out, want)
	}
	if strings.Count(out, "\n") != 1 || !strings.HasSuffix(out, "\n") {
		t.Errorf("--json without --watch must print one line, got %q", out)
	}
}

// TestStatusCLITablesNameTheState runs the command without --json: the
// open breaker with its reason and opener, the saturation score, the busy
// tenant against its limits, the fleet's instances; no line over 80.
func TestStatusCLITablesNameTheState(t *testing.T) {
	addr, _ := fakeAdmin(t, statusFixture(time.Now().UTC()))
	out, err := runCLI(t, "llm-proxy", "status", "--address", addr)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"of " + addr, "10.0.0.2:8000", "open 41s forced", "41s ago: http_5xx", "0.82", "1.5s",
		"opened fleet-wide by gw-2", "scrape of 10.0.0.2:8000 failed: dial tcp: refused",
		"acme", "gold", "2/4", "7/60", "1.2k/100k", "half_open 41s sat", "FLEET fleet", "gw-2", "pool chat failed as a whole 41s ago"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	for line := range strings.SplitSeq(out, "\n") {
		if len([]rune(line)) > 80 {
			t.Errorf("line of %d columns: %q", len([]rune(line)), line)
		}
	}
	if strings.Contains(out, "\x1b") {
		t.Errorf("escape codes on a stdout that is not a terminal: %q", out)
	}
}

// TestStatusCLIRefusesBadInput asserts the errors a user sees: an
// unknown subcommand, a bad --interval, an admin endpoint that is down.
func TestStatusCLIRefusesBadInput(t *testing.T) {
	if _, err := runCLI(t, "llm-proxy", "stauts"); err == nil || !strings.Contains(err.Error(), "stauts") {
		t.Errorf("caddy llm-proxy stauts: err = %v, want an unknown command error naming it", err)
	}
	if _, err := runCLI(t, "llm-proxy", "status", "--interval", "soon"); err == nil || !strings.Contains(err.Error(), "--interval") {
		t.Errorf("--interval soon: err = %v, want one naming --interval", err)
	}
	srv := httptest.NewServer(http.NotFoundHandler())
	addr := srv.Listener.Addr().String()
	srv.Close()
	if _, err := runCLI(t, "llm-proxy", "status", "--address", addr); err == nil || !strings.Contains(err.Error(), "GET /llm_proxy/breakers from the admin API at "+addr) {
		t.Errorf("admin endpoint down: err = %v, want one naming the request and address", err)
	}
	// A Caddy without the module answers 404 for the endpoints.
	other := httptest.NewServer(http.NotFoundHandler())
	defer other.Close()
	if _, err := runCLI(t, "llm-proxy", "status", "--address", other.Listener.Addr().String()); err == nil || !strings.Contains(err.Error(), "HTTP 404") {
		t.Errorf("endpoint missing: err = %v, want the admin API's 404", err)
	}
}

// TestStatusAddressDefaultsAsCaddyStop asserts the address resolution of
// `caddy stop`: --address, else the --config file's admin listen address,
// else localhost:2019.
func TestStatusAddressDefaultsAsCaddyStop(t *testing.T) {
	addr, hits := fakeAdmin(t, statusFixture(time.Now()))
	cfg := t.TempDir() + "/caddy.json"
	if err := os.WriteFile(cfg, []byte(`{"admin":{"listen":"`+addr+`"}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := runCLI(t, "llm-proxy", "status", "--config", cfg, "--json"); err != nil {
		t.Fatalf("--config with admin.listen %s: %v", addr, err)
	}
	if hits.Load() != int64(len(statusview.Endpoints)) {
		t.Errorf("the config's admin address got %d requests, want %d", hits.Load(), len(statusview.Endpoints))
	}
	if got, _ := caddycmd.DetermineAdminAPIAddress("", nil, "", ""); got != caddy.DefaultAdminListen {
		t.Errorf("no flags: %q, want %q", got, caddy.DefaultAdminListen)
	}
}

// syncBuffer is a bytes.Buffer for a writer goroutine and a reader.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestStatusWatchRefreshesInPlace asserts --watch: on a terminal every
// print starts by clearing the screen; elsewhere no escape codes; with
// --json one object per line; a failed read is shown and the next
// interval tries again; the end of its context (Ctrl-C) ends it cleanly.
func TestStatusWatchRefreshesInPlace(t *testing.T) {
	addr, _ := fakeAdmin(t, statusFixture(time.Now().UTC()))
	watch := func(r statusRun, frames int) string {
		t.Helper()
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var out syncBuffer
		done := make(chan error, 1)
		go func() { done <- r.run(ctx, &out) }()
		marker := "every 10ms"
		if r.json {
			marker = "\n"
		}
		deadline := time.Now().Add(10 * time.Second)
		for strings.Count(out.String(), marker) < frames && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		cancel()
		if err := <-done; err != nil {
			t.Errorf("watch ended with %v, want nil at Ctrl-C", err)
		}
		return out.String()
	}
	base := statusRun{addr: addr, watch: true, interval: 10 * time.Millisecond, timeout: 5 * time.Second}

	tty := base
	tty.tty = true
	out := watch(tty, 3)
	if n := strings.Count(out, "\x1b[H\x1b[2J"); n < 3 || !strings.HasPrefix(out, "\x1b[H\x1b[2J") {
		t.Errorf("on a terminal: %d screen clears in %d prints, want one before each", n, strings.Count(out, "every 10ms"))
	}
	if n := strings.Count(out, "UPSTREAMS (1)"); n < 3 {
		t.Errorf("on a terminal: %d prints of the tables, want at least 3", n)
	}

	out = watch(base, 2)
	if strings.Contains(out, "\x1b") {
		t.Errorf("not a terminal: escape codes in %q", out)
	}

	js := base
	js.json = true
	out = watch(js, 3)
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	for i, l := range lines {
		if !json.Valid([]byte(l)) {
			t.Errorf("--watch --json line %d is not a JSON object: %q", i+1, l)
		}
	}

	down := base
	srv := httptest.NewServer(http.NotFoundHandler())
	down.addr = srv.Listener.Addr().String()
	srv.Close()
	out = watch(down, 2)
	if strings.Count(out, "GET /llm_proxy/breakers from the admin API at "+down.addr) < 2 {
		t.Errorf("admin API down: want its error on every print, got %q", out)
	}
	// With --json, stdout stays JSON lines: a failed read goes to stderr.
	jsDown := down
	jsDown.json = true
	var errs syncBuffer
	jsDown.errOut = &errs
	ctx, cancel := context.WithCancel(context.Background())
	var stdout syncBuffer
	done := make(chan error, 1)
	go func() { done <- jsDown.run(ctx, &stdout) }()
	deadline := time.Now().Add(10 * time.Second)
	for strings.Count(errs.String(), "GET /llm_proxy/breakers") < 2 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	<-done
	if stdout.String() != "" || strings.Count(errs.String(), "GET /llm_proxy/breakers") < 2 {
		t.Errorf("--watch --json with the admin API down: stdout %q, stderr %q", stdout.String(), errs.String())
	}
}

// TestStatusFetchWaitsForAHungRead asserts that an admin API that does
// not answer times the command out, and that the next read (--watch)
// waits for the hung one instead of piling up another request.
func TestStatusFetchWaitsForAHungRead(t *testing.T) {
	release := make(chan struct{})
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		<-release
		_, _ = io.WriteString(w, "[]")
	}))
	defer srv.Close()
	defer close(release)
	f := &statusFetcher{addr: srv.Listener.Addr().String()}
	for i := range 3 {
		if _, err := f.get(context.Background(), 50*time.Millisecond); err == nil || !strings.Contains(err.Error(), "no answer within 50ms") {
			t.Fatalf("read %d of a hung admin API: err = %v, want a timeout", i+1, err)
		}
	}
	if n := hits.Load(); n != 1 {
		t.Errorf("3 timed-out reads sent %d requests, want 1 (the hung one, waited for)", n)
	}
}
