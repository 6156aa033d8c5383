package caddymodule

import (
	"context"
	"encoding/json"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/fleet"
	"github.com/llmproxy/caddy-llm-proxy/internal/redistest"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

const fleetSite = `{
	llm_proxy {
		fleet redis redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster {
			password {env.REDIS_PASSWORD}
			db 2
			key_prefix gw:
			op_timeout 25ms
			refresh 2s
			instance_id gw-1
			expected_instances 3
			min_reporters 2
		}
	}
}
:8080 {
	llm_proxy 127.0.0.1:9000
}
`

// TestFleetOptionAdapts: every fleet setting adapts to JSON (the password
// placeholder kept for load time) and provisions.
func TestFleetOptionAdapts(t *testing.T) {
	t.Setenv("REDIS_PASSWORD", "pw")
	out, err := adapt(t, fleetSite)
	if err != nil {
		t.Fatal(err)
	}
	want := `"llm_proxy":{"fleet":{"redis":"redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster","password":"{env.REDIS_PASSWORD}",` +
		`"db":2,"key_prefix":"gw:","op_timeout":25000000,"refresh":2000000000,"instance_id":"gw-1","expected_instances":3,"min_reporters":2}}`
	if !strings.Contains(string(out), want) {
		t.Fatalf("adapted JSON lacks\n%s\n%s", want, out)
	}
	if err := caddy.Validate(mustConfig(t, out)); err != nil {
		t.Fatalf("provisioning: %v", err)
	}
	out, err = adapt(t, "{\n\tllm_proxy {\n\t\tfleet redis redis://10.0.0.5:6379\n\t}\n}\n:8080 {\n\tllm_proxy 127.0.0.1:9000\n}\n")
	if err != nil {
		t.Fatal(err)
	}
	if want := `"llm_proxy":{"fleet":{"redis":"redis://10.0.0.5:6379"}}`; !strings.Contains(string(out), want) {
		t.Fatalf("adapted JSON lacks %s\n%s", want, out)
	}
}

func TestFleetCaddyfileErrors(t *testing.T) {
	wrap := func(body string) string {
		return "{\n\tllm_proxy {\n" + body + "\n\t}\n}\n:8080 {\n\tllm_proxy 127.0.0.1:9000\n}\n"
	}
	for _, tc := range []struct{ name, src, want string }{
		{"no backend", wrap("\t\tfleet"), "want: fleet redis <url> { … }, at Caddyfile:3"},
		{"other backend", wrap("\t\tfleet etcd http://10.0.0.1:2379"), "want: fleet redis <url> { … }, at Caddyfile:3"},
		{"no URL", wrap("\t\tfleet redis"), "want: fleet redis <url> { … }, at Caddyfile:3"},
		{"two URLs", wrap("\t\tfleet redis redis://a:1 redis://b:1"), "want: fleet redis <url> { … }, at Caddyfile:3"},
		{"twice", wrap("\t\tfleet redis redis://a:1\n\t\tfleet redis redis://b:1"), "fleet already specified, at Caddyfile:4"},
		{"unknown option", wrap("\t\tfleet redis redis://a:1 {\n\t\t\tcluster on\n\t\t}"), `unrecognized fleet option "cluster", at Caddyfile:4`},
		{"option twice", wrap("\t\tfleet redis redis://a:1 {\n\t\t\tdb 1\n\t\t\tdb 2\n\t\t}"), "fleet option db already specified, at Caddyfile:5"},
		{"option without value", wrap("\t\tfleet redis redis://a:1 {\n\t\t\tpassword\n\t\t}"), "want: password <value>, at Caddyfile:4"},
		{"bad db", wrap("\t\tfleet redis redis://a:1 {\n\t\t\tdb -1\n\t\t}"), `bad db "-1": want a database number from 0, at Caddyfile:4`},
		{"bad op_timeout", wrap("\t\tfleet redis redis://a:1 {\n\t\t\top_timeout soon\n\t\t}"), `bad op_timeout "soon"`},
		{"bad refresh", wrap("\t\tfleet redis redis://a:1 {\n\t\t\trefresh 0s\n\t\t}"), `bad refresh "0s"`},
		{"bad expected_instances", wrap("\t\tfleet redis redis://a:1 {\n\t\t\texpected_instances 0\n\t\t}"), `bad expected_instances "0"`},
		{"bad min_reporters", wrap("\t\tfleet redis redis://a:1 {\n\t\t\tmin_reporters two\n\t\t}"), `bad min_reporters "two"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := adapt(t, tc.src)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("adapt = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// TestFleetProvisionResolvesAndNeverConnects: provisioning (caddy validate,
// or a config that fails to load) resolves {env.X} and checks the settings
// but opens no connection.
func TestFleetProvisionResolvesAndNeverConnects(t *testing.T) {
	t.Setenv("REDIS_PASSWORD", "from-env")
	cfg, err := (&FleetConfig{Redis: "redis://10.0.0.5:6379", Password: "{env.REDIS_PASSWORD}"}).config()
	if err != nil || cfg.Password != "from-env" {
		t.Fatalf("config() = %+v, %v; want the password from the environment", cfg, err)
	}

	p := redistest.NewProxy(t, "127.0.0.1:1")
	app := `{"fleet":{"redis":"redis://` + p.Addr() + `","password":"{env.REDIS_PASSWORD}"}}`
	cfgJSON := func(handler string) *caddy.Config {
		return mustConfig(t, []byte(`{"admin":{"disabled":true},"apps":{"llm_proxy":`+app+`,"http":{"servers":{"s":{"listen":["`+freePort(t)+
			`"],"automatic_https":{"disable":true},"routes":[{"handle":[`+handler+`]}]}}}}}`))
	}
	if err := caddy.Validate(cfgJSON(`{"handler":"static_response"}`)); err != nil {
		t.Fatalf("validate: %v", err)
	}
	b, _ := json.Marshal(cfgJSON(`{"handler":"llm_proxy","upstreams":[]}`))
	if err := caddy.Load(b, true); err == nil {
		_ = caddy.Stop()
		t.Fatal("a config with an llm_proxy handler without upstreams loaded")
	}
	if n := p.Accepted(); n != 0 {
		t.Fatalf("%d connections to Redis from configs that never started", n)
	}

	t.Setenv("REDIS_PASSWORD", "")
	if err := caddy.Validate(cfgJSON(`{"handler":"static_response"}`)); err == nil || !strings.Contains(err.Error(), "password {env.REDIS_PASSWORD} is empty") {
		t.Fatalf("an empty env password: %v, want it refused by name", err)
	}
	for _, tc := range []struct{ fleet, want string }{
		{`{"redis":"http://10.0.0.5"}`, `scheme "http"`},
		{`{"redis":"redis://10.0.0.5","op_timeout":"2s"}`, "more than half of refresh"},
		{`{}`, "no redis URL"},
	} {
		app = `{"fleet":` + tc.fleet + `}`
		if err := caddy.Validate(cfgJSON(`{"handler":"static_response"}`)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("fleet %s: %v, want an error containing %q", tc.fleet, err, tc.want)
		}
	}
}

// fleetJSON is GET /llm_proxy/fleet as a client reads it.
type fleetJSON struct {
	Mode       string `json:"mode"`
	InstanceID string `json:"instance_id"`
	Instances  []struct {
		ID       string    `json:"instance_id"`
		LastSeen time.Time `json:"last_seen"`
	} `json:"instances"`
}

func getFleet(t *testing.T) fleetJSON {
	t.Helper()
	rec := httptest.NewRecorder()
	if err := (adminAPI{}).fleet(rec, httptest.NewRequest("GET", "/llm_proxy/fleet", nil)); err != nil {
		t.Fatal(err)
	}
	var v fleetJSON
	if err := json.Unmarshal(rec.Body.Bytes(), &v); err != nil {
		t.Fatalf("%v: %s", err, rec.Body)
	}
	return v
}

// TestFleetAtADeadPortStartsInLocalMode: Redis down when the config
// starts fails nothing: the gateway serves, in local mode, and says so.
func TestFleetAtADeadPortStartsInLocalMode(t *testing.T) {
	initMetrics()
	start := time.Now()
	runConfigWithApp(t, freePort(t), `{"fleet":{"redis":"redis://`+freePort(t)+`","instance_id":"gw-dead"}}`, `{"handler":"static_response","body":"ok"}`)
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("starting took %v", took)
	}
	c := liveFleet()
	if c == nil || !c.Degraded() {
		t.Fatalf("live fleet %v: want one in local mode", c)
	}
	if v := getFleet(t); v.Mode != "local" || v.InstanceID != "gw-dead" || v.Instances == nil || len(v.Instances) != 0 {
		t.Fatalf("GET /llm_proxy/fleet = %+v", v)
	}
	if v := testutil.ToFloat64(metrics.fleetDegraded); v != 1 {
		t.Fatalf("caddy_llm_proxy_fleet_degraded = %v, want 1", v)
	}
}

// TestFleetConnectionAcrossReloads: a reload with the same settings keeps
// the connection (and its generated instance id); new settings open a new
// one and close the old; a config without fleet closes it and is "off".
func TestFleetConnectionAcrossReloads(t *testing.T) {
	initMetrics()
	s := redistest.Start(t, redistest.Options{})
	listen := freePort(t)
	handler := `{"handler":"static_response","body":"ok"}`
	app := `{"fleet":{"redis":"redis://` + s.Addr() + `","refresh":"200ms","op_timeout":"50ms"}}`

	runConfigWithApp(t, listen, app, handler)
	first := liveFleet()
	if first == nil || first.Degraded() {
		t.Fatalf("live fleet %v", first)
	}
	if v := testutil.ToFloat64(metrics.fleetDegraded); v != 0 {
		t.Fatalf("caddy_llm_proxy_fleet_degraded = %v, want 0 while healthy", v)
	}
	v := getFleet(t)
	if v.Mode != "fleet" || v.InstanceID != first.InstanceID() || len(v.Instances) != 1 || v.Instances[0].ID != first.InstanceID() {
		t.Fatalf("GET /llm_proxy/fleet = %+v, want this instance listed in fleet mode", v)
	}
	if age := time.Since(v.Instances[0].LastSeen); age < -time.Second || age > 5*time.Second {
		t.Errorf("last_seen %v", v.Instances[0].LastSeen)
	}

	runConfigWithApp(t, listen, app, handler)
	if liveFleet() != first {
		t.Fatal("a reload with the same fleet settings opened a new connection")
	}

	changed := strings.Replace(app, `"refresh":"200ms"`, `"refresh":"200ms","key_prefix":"other:"`, 1)
	runConfigWithApp(t, listen, changed, handler)
	second := liveFleet()
	if second == nil || second == first {
		t.Fatalf("new settings kept the connection: %v", second)
	}
	if err := first.Do(context.Background(), "probe", func(ctx context.Context, r redis.Cmdable) error { return r.Ping(ctx).Err() }); err != fleet.ErrClosed {
		t.Fatalf("the replaced connection: %v, want closed", err)
	}
	if n, _ := s.Do("EXISTS", "llmproxy:{instances}:"+first.InstanceID()); n != "0" {
		t.Error("the closed connection's heartbeat is still there")
	}

	runConfigWithApp(t, listen, "", handler)
	if liveFleet() != nil {
		t.Fatal("a config without fleet has a live connection")
	}
	if err := second.Do(context.Background(), "probe", func(ctx context.Context, r redis.Cmdable) error { return r.Ping(ctx).Err() }); err != fleet.ErrClosed {
		t.Fatalf("the connection no config wants: %v, want closed", err)
	}
	if v := getFleet(t); v.Mode != "off" || v.InstanceID != "" || v.Instances == nil {
		t.Fatalf("GET /llm_proxy/fleet without fleet = %+v", v)
	}
	if n := testutil.CollectAndCount(metrics.fleetDegraded); n != 0 {
		t.Fatalf("caddy_llm_proxy_fleet_degraded has %d series without a fleet", n)
	}
	if shared.fleets.Len() != 0 {
		t.Fatalf("%d connections held", shared.fleets.Len())
	}
}

// TestFleetLogsThroughTheNewestConfig: the connection outlives the config
// that opened it, so its lines go to the newest running config's logger,
// with the fields given to it.
func TestFleetLogsThroughTheNewestConfig(t *testing.T) {
	oldCore, oldLogs := observer.New(zapcore.InfoLevel)
	newCore, newLogs := observer.New(zapcore.InfoLevel)
	older := &App{logger: zap.New(oldCore)}
	newer := &App{logger: zap.New(newCore)}
	if err := older.Start(); err != nil {
		t.Fatal(err)
	}
	defer older.Stop()
	l := fleetLogger().With(zap.String("instance_id", "gw-1"))
	l.Warn("first")
	if err := newer.Start(); err != nil {
		t.Fatal(err)
	}
	defer newer.Stop()
	l.Warn("second")
	l.Debug("not enabled")
	if got := oldLogs.All(); len(got) != 1 || got[0].Message != "first" {
		t.Fatalf("older config's logger got %v", got)
	}
	got := newLogs.All()
	if len(got) != 1 || got[0].Message != "second" || got[0].LoggerName != "llm_proxy.fleet" || got[0].ContextMap()["instance_id"] != "gw-1" {
		t.Fatalf("newer config's logger got %+v", got)
	}
}

// TestFleetBreakerStoreWired: with a fleet, the upstream breakers share
// their state through it — another gateway's forced open reaches this
// one, and the admin API says it is the fleet's and who opened it; a
// reload without fleet takes the breakers back to local state.
func TestFleetBreakerStoreWired(t *testing.T) {
	initMetrics()
	s := redistest.Start(t, redistest.Options{})
	listen, up := freePort(t), freePort(t)
	app := `{"fleet":{"redis":"redis://` + s.Addr() + `","refresh":"200ms","op_timeout":"50ms","instance_id":"gw-a"}}`
	handler := `{"handler":"llm_proxy","upstreams":[{"dial":"` + up + `"}]}`
	runConfigWithApp(t, listen, app, handler)
	st := liveBreakerStore()
	if st == nil || st.InstanceID() != "gw-a" {
		t.Fatalf("registry's breaker store %v, want the fleet's", st)
	}

	c, err := fleet.Open(fleet.Config{URL: "redis://" + s.Addr(), InstanceID: "gw-b", Refresh: 200 * time.Millisecond, OpTimeout: 50 * time.Millisecond}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	other := fleet.NewBreakers(c, fleet.BreakersOptions{})
	defer func() { other.Close(); _ = c.Close() }()
	// The other gateway runs the same handler: its breaker has the same
	// fleet key ("addr~policy").
	ob := breaker.New(up, breaker.Settings{}, breaker.WithStore(other), breaker.WithStoreKey(getBreaker(t, up).FleetKey))
	defer ob.Close()
	ob.ForceOpen(time.Minute, "maintenance")
	waitFor(t, "the upstream's breaker open", func() bool {
		b := liveBreaker(up)
		return b != nil && b.State() == breaker.Open
	})
	v := getBreaker(t, up)
	if v.Scope != "fleet" || v.OpenedBy != "gw-b" || v.State != breaker.Open {
		t.Fatalf("GET /llm_proxy/breakers/%s = %+v, want open in the fleet, by gw-b", up, v)
	}

	runConfigWithApp(t, listen, "", handler)
	if shared.upstreams.BreakerStore() != nil {
		t.Fatalf("breaker store %v without a fleet", shared.upstreams.BreakerStore())
	}
	if v := getBreaker(t, up); v.Scope != "local" || v.OpenedBy != "" || v.State != breaker.Open {
		t.Fatalf("after a reload without fleet: %+v, want still open, local", v)
	}
}

func getBreaker(t *testing.T, key string) upstream.BreakerView {
	t.Helper()
	rec := httptest.NewRecorder()
	if err := (adminAPI{}).control(rec, httptest.NewRequest("GET", "/llm_proxy/breakers/"+key, nil)); err != nil {
		t.Fatal(err)
	}
	var v upstream.BreakerView
	if err := json.Unmarshal(rec.Body.Bytes(), &v); err != nil {
		t.Fatalf("%v: %s", err, rec.Body)
	}
	return v
}

// liveBreaker returns the first started handler's breaker that key names
// ("addr", "addr|model"), nil when none.
func liveBreaker(key string) *breaker.Breaker {
	if _, vs, ok := shared.upstreams.Find(key); ok {
		return vs[0].Breaker
	}
	return nil
}
