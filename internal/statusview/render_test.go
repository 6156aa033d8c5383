package statusview

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden from the current output")

// fixtureNow is the time the fixtures in testdata were taken at.
var fixtureNow = time.Date(2026, 12, 1, 14, 30, 0, 0, time.UTC)

func loadFixture(t *testing.T, name string) Status {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("testdata", name+".json"))
	if err != nil {
		t.Fatal(err)
	}
	s, err := Parse(raw)
	if err != nil {
		t.Fatalf("%s.json: %v", name, err)
	}
	return s
}

func render(t *testing.T, s Status, width int) string {
	t.Helper()
	var b bytes.Buffer
	if err := Render(&b, s, Options{Now: fixtureNow, Width: width, Address: "localhost:2019"}); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// TestRenderMatchesGolden compares the text of each fixture (busy: a
// fleet of gateways with open, forced, saturation-tripped and per-model
// breakers, scrape errors, long host names and tenants near their limits;
// local: Redis away, no tenants; empty: nothing configured) with its
// golden file. go test -run TestRenderMatchesGolden -update rewrites them.
func TestRenderMatchesGolden(t *testing.T) {
	for _, name := range []string{"busy", "local", "empty"} {
		t.Run(name, func(t *testing.T) {
			got := render(t, loadFixture(t, name), 0)
			path := filepath.Join("testdata", name+".golden")
			if *update {
				if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (run with -update to create it)", err)
			}
			if got != string(want) {
				t.Errorf("output differs from %s (-update rewrites it after review):\n--- got\n%s--- want\n%s", path, got, want)
			}
		})
	}
}

// TestNoLineWiderThanWidth renders the busiest fixture at 80 columns
// (the default) and at narrower and wider widths: no line is wider.
func TestNoLineWiderThanWidth(t *testing.T) {
	s := loadFixture(t, "busy")
	for _, width := range []int{0, 60, 80, 100, 132} {
		limit := width
		if limit == 0 {
			limit = DefaultWidth
		}
		out := render(t, s, width)
		for i, line := range strings.Split(strings.TrimSuffix(out, "\n"), "\n") {
			if n := runes(line); n > limit {
				t.Errorf("width %d: line %d has %d columns:\n%s", width, i+1, n, line)
			}
		}
	}
}

// TestBusyNamesWhatMatters asserts what an operator reads off the busy
// fixture at 80 columns: every upstream, its breaker state and time in
// it, in-flight counts, scores and ages, the last failure's reason, the
// tenants' usage against their limits, the fleet's instances.
func TestBusyNamesWhatMatters(t *testing.T) {
	out := render(t, loadFixture(t, "busy"), 0)
	for _, want := range []string{
		"UPSTREAMS (6)", "TENANTS (4)",
		"10.0.0.2:8000", "open 41s", "41s ago: http_5xx",
		"  10.0.0.5:8000: 1m20s ago: saturation: KV-cache usage 0.97 above 0.95", // a cut reason in full below
		"open 7m30s forced", "half_open 2.5s sat", // time in state, forced, tripped by saturation
		"0.82", "1.37", "0.4s", "1m05s", // scores and scrape ages
		"vllm-la…er.local:8000", "  Qwen/Qwen2.5-7B", // a long host cut in the middle, models below it
		"scrape of 10.0.0.6:8000 failed: get http://10.0.0.6:8000/metrics",
		"10.0.0.2:8000 opened fleet-wide by gw-eu-2",
		"48/64", "1.2k/5.0k", "2.4M/5.0M", "600/600", "open 2m05s", // tenants
		"FLEET fleet since 11:02:00 UTC (3h28m ago), instance gw-eu-1",
		"gw-eu-3-canary-7f9c8d6b5-x2x9q", "0.3s ago",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	// The newline inside the probe's reason must not break the table.
	if strings.Contains(out, "503\nmodel") {
		t.Errorf("a reason's newline reached the output:\n%s", out)
	}
}

// TestEmptyStatesSayNone asserts that nothing configured reads as such,
// not as an empty table: no upstreams, no tenants, fleet off.
func TestEmptyStatesSayNone(t *testing.T) {
	out := render(t, loadFixture(t, "empty"), 0)
	for _, want := range []string{
		"UPSTREAMS (0)\n  none: no llm_proxy handler has upstreams yet",
		"TENANTS (0)\n  none with state",
		"FLEET off: no fleet configured",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "TENANT ") || strings.Contains(out, "INSTANCE") {
		t.Errorf("an empty state printed a table header:\n%s", out)
	}
}

// TestLocalFleetSaysRedisAway asserts that a gateway running on local
// state says so, with the listing error, and lists no instances.
func TestLocalFleetSaysRedisAway(t *testing.T) {
	out := render(t, loadFixture(t, "local"), 0)
	for _, want := range []string{
		"FLEET local since 14:25:00 UTC (5m00s ago), instance gw-1\n  Redis away",
		"listing instances failed: dial tcp 10.0.9.9:6379: i/o timeout",
		"127.0.0.1:8002", "open 30s", "30s ago: connect_error",
		"TENANTS (0)",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "INSTANCE") {
		t.Errorf("local mode printed an instance table:\n%s", out)
	}
}

// TestParseRefusesAMissingEndpoint asserts that a combined object without
// one of the endpoints is an error naming it, not an idle gateway.
func TestParseRefusesAMissingEndpoint(t *testing.T) {
	for _, e := range Endpoints {
		parts := []string{}
		for _, o := range Endpoints {
			if o != e {
				v := "[]"
				if o == "fleet" {
					v = `{"mode":"off"}`
				}
				parts = append(parts, `"`+o+`":`+v)
			}
		}
		_, err := Parse([]byte("{" + strings.Join(parts, ",") + "}"))
		if err == nil || !strings.Contains(err.Error(), "/llm_proxy/"+e) {
			t.Errorf("without %q: err = %v, want one naming GET /llm_proxy/%s", e, err, e)
		}
	}
	if _, err := Parse([]byte(`{"breakers":{},"saturation":[],"tenants":[],"fleet":{}}`)); err == nil || !strings.Contains(err.Error(), "/llm_proxy/breakers") {
		t.Errorf("breakers as an object: err = %v, want one naming GET /llm_proxy/breakers", err)
	}
}

func TestCut(t *testing.T) {
	for _, c := range []struct {
		in   string
		n    int
		addr bool
		want string
	}{
		{"10.0.0.2:8000", 21, true, "10.0.0.2:8000"},
		{"vllm-large-0.vllm-large.inference.svc.cluster.local:8000", 21, true, "vllm-la…er.local:8000"},
		{"[2001:db8::1]:8000", 12, true, "[20…:1]:8000"},
		{"a long reason text", 8, false, "a long …"},
		{"abc", 1, false, "…"},
		{"abc", 0, false, ""},
	} {
		if got := cut(c.in, c.n, c.addr); got != c.want || runes(got) > c.n {
			t.Errorf("cut(%q, %d, %v) = %q, want %q", c.in, c.n, c.addr, got, c.want)
		}
	}
}

func TestDurationAndCount(t *testing.T) {
	for d, want := range map[time.Duration]string{
		-time.Second: "0.0s", 400 * time.Millisecond: "0.4s", 41 * time.Second: "41s",
		125 * time.Second: "2m05s", 3*time.Hour + 7*time.Minute: "3h07m", 53 * time.Hour: "2d05h",
	} {
		if got := duration(d); got != want {
			t.Errorf("duration(%v) = %q, want %q", d, got, want)
		}
	}
	for n, want := range map[int]string{0: "0", 999: "999", 1240: "1.2k", 98120: "98k", 200000: "200k", 2350000: "2.4M"} {
		if got := count(n); got != want {
			t.Errorf("count(%d) = %q, want %q", n, got, want)
		}
	}
}

// FuzzParseRender feeds any bytes to Parse and, when they parse, renders
// them at 80 columns: Render must not fail, and no line may be wider,
// whatever the strings and numbers (control characters, huge counts,
// times far off). The fixtures are the seed corpus.
func FuzzParseRender(f *testing.F) {
	for _, name := range []string{"busy", "local", "empty"} {
		raw, err := os.ReadFile(filepath.Join("testdata", name+".json"))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(raw)
	}
	f.Add([]byte(`{"breakers":[{"key":"a\tb","upstream":"a\u2028b:1","state":"open","since":"0001-01-01T00:00:00Z","inflight":-99999999999}],"saturation":[{"upstream":"x","age_seconds":1e300,"score":-1e300,"score_known":true}],"tenants":[{"tenant":"t","inflight":2147483647,"tpm":-1,"breaker":{"state":"\u001b[2J"}}],"fleet":{"mode":"fleet","since":"9999-12-31T23:59:59Z","instances":[{"instance_id":""}]}}`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		s, err := Parse(raw)
		if err != nil {
			return
		}
		var b bytes.Buffer
		if err := Render(&b, s, Options{Now: fixtureNow}); err != nil {
			t.Fatal(err)
		}
		for line := range strings.SplitSeq(strings.TrimSuffix(b.String(), "\n"), "\n") {
			if runes(line) > DefaultWidth {
				t.Fatalf("line of %d columns: %q", runes(line), line)
			}
			if strings.ContainsRune(line, '\x1b') {
				t.Fatalf("an escape sequence from the admin API reached the output: %q", line)
			}
		}
	})
}

// Two handlers with different breaker settings in front of one upstream:
// each breaker gets a row, and a note per handler names the breakers that
// serve it; with one policy, one breaker serves both handlers; a gateway
// that lists only pools is named by them.
func TestBreakersNameTheHandlersTheyServe(t *testing.T) {
	s := Status{Breakers: []Breaker{
		{Key: "10.0.0.9:8000", Upstream: "10.0.0.9:8000", BreakerState: BreakerState{State: "closed", Since: fixtureNow.Add(-time.Minute)},
			Pools: []string{"10.0.0.9:8000"}, Handlers: []string{"site-b"}},
		{Key: "10.0.0.9:8000~b1a2b3c4", Upstream: "10.0.0.9:8000", Policy: "b1a2b3c4",
			BreakerState: BreakerState{State: "open", Since: fixtureNow.Add(-5 * time.Second), OpenUntil: fixtureNow.Add(time.Minute)},
			Pools:        []string{"10.0.0.9:8000~b1a2b3c4"}, Handlers: []string{"site-a"}},
		{Key: "10.0.0.10:8000", Upstream: "10.0.0.10:8000", BreakerState: BreakerState{State: "closed", Since: fixtureNow.Add(-time.Minute)},
			Pools: []string{"10.0.0.10:8000"}, Handlers: []string{"Caddyfile:12", "Caddyfile:20"}},
		{Key: "10.0.0.11:8000", Upstream: "10.0.0.11:8000", BreakerState: BreakerState{State: "closed", Since: fixtureNow.Add(-time.Minute)},
			Pools: []string{"old-pool"}},
	}}
	out := render(t, s, 0)
	for _, want := range []string{"  ~b1a2b3c4", "open 5.0s",
		"breakers of site-b: 10.0.0.9:8000\n", "breakers of site-a: 10.0.0.9:8000~b1a2b3c4\n",
		"breakers of Caddyfile:12; Caddyfile:20: 10.0.0.10:8000\n", "breakers of old-pool: 10.0.0.11:8000\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

// A pool that is not plainly serving gets a note: failed as a whole (with
// its age and reason), in panic, or with upstreams ejected; a healthy pool
// none. A breaker whose cooldown has passed says a probe is due.
func TestPoolNotesAndProbeDue(t *testing.T) {
	s := Status{
		Breakers: []Breaker{{Key: "10.0.0.9:8000", Upstream: "10.0.0.9:8000",
			BreakerState: BreakerState{State: "open", Since: fixtureNow.Add(-time.Minute), ProbeDue: true}}},
		Pools: []Pool{
			{Key: "a", Handler: "chat", Failed: true, FailedSince: fixtureNow.Add(-3 * time.Second), FailedReason: "40 of its last 40 attempts failed"},
			{Key: "b", Handler: "embed", Panic: true, Ejected: 2, MaxEjected: 1},
			{Key: "c", Ejected: 1, MaxEjected: 3},
			{Key: "d", Handler: "healthy", MaxEjected: 1},
		},
	}
	out := render(t, s, 120)
	for _, want := range []string{"open 1m00s due", "pool chat failed as a whole 3.0s ago (40 of its last 40 attempts failed): 503 but for probes",
		"pool embed in panic: routes over its 2 ejected upstream(s)", "pool c: 1 of at most 3 upstream(s) ejected"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "healthy") {
		t.Errorf("a note for a healthy pool:\n%s", out)
	}
}

// Each handler has its own breaker on an upstream: where they agree, the
// upstream's row shows the state once; where they differ, each handler's
// breaker gets an indented row named by its handler, open or not.
func TestHandlersBreakersRowsWhereTheyDisagree(t *testing.T) {
	closed := BreakerState{State: "closed", Since: fixtureNow.Add(-time.Minute)}
	open := BreakerState{State: "open", Since: fixtureNow.Add(-5 * time.Second), OpenUntil: fixtureNow.Add(time.Minute)}
	s := Status{Breakers: []Breaker{
		{Key: "10.0.0.9:8000", Upstream: "10.0.0.9:8000", Policy: "b1", Handler: "site-a", Handlers: []string{"site-a"}, BreakerState: open},
		{Key: "10.0.0.9:8000", Upstream: "10.0.0.9:8000", Policy: "b2", Handler: "site-b", Handlers: []string{"site-b"}, BreakerState: closed},
		{Key: "10.0.0.10:8000", Upstream: "10.0.0.10:8000", Policy: "b1", Handler: "site-a", Handlers: []string{"site-a"}, BreakerState: closed},
		{Key: "10.0.0.10:8000", Upstream: "10.0.0.10:8000", Policy: "b1", Handler: "site-c", Handlers: []string{"site-c"}, BreakerState: closed},
	}}
	out := render(t, s, 0)
	lines := strings.Split(out, "\n")
	row := func(prefix string) string {
		for _, l := range lines {
			if strings.HasPrefix(strings.TrimSpace(l), prefix) {
				return l
			}
		}
		return ""
	}
	if r := row("site-a"); !strings.Contains(r, "open 5.0s") {
		t.Errorf("site-a's row %q, want its open breaker:\n%s", r, out)
	}
	if r := row("site-b"); !strings.Contains(r, "closed") {
		t.Errorf("site-b's row %q, want its closed breaker:\n%s", r, out)
	}
	if r := row("10.0.0.10:8000"); !strings.Contains(r, "closed") || strings.Count(out, "  site-c") != 0 {
		t.Errorf("agreeing handlers: upstream row %q, want closed and no per-handler rows:\n%s", r, out)
	}
}

// Two sites with scope model over one upstream: each has its own breaker
// for model llama, site-a's open and site-b's closed. The status table must
// say whose is whose: rows for the same model of different handlers are
// named by their handler, as per-upstream breakers are (upstreams: a
// model row is labelled by its handler only when the upstream also has
// per-upstream breakers of more than one handler, so here both rows read
// "llama", one open and one closed).
func TestScopeModelBreakersOfSeveralHandlersNameTheirHandler(t *testing.T) {
	closed := BreakerState{State: "closed", Since: fixtureNow.Add(-time.Minute)}
	open := BreakerState{State: "open", Since: fixtureNow.Add(-5 * time.Second), OpenUntil: fixtureNow.Add(time.Minute)}
	s := Status{Breakers: []Breaker{
		{Key: "10.0.0.9:8000|llama", Upstream: "10.0.0.9:8000", Model: "llama", Policy: "b1", Handler: "site-a", Handlers: []string{"site-a"}, BreakerState: open},
		{Key: "10.0.0.9:8000|llama", Upstream: "10.0.0.9:8000", Model: "llama", Policy: "b2", Handler: "site-b", Handlers: []string{"site-b"}, BreakerState: closed},
	}}
	out := render(t, s, 0)
	var a, b string
	for _, l := range strings.Split(out, "\n") {
		switch f := strings.Fields(l); {
		case len(f) >= 2 && f[0] == "site-a" && f[1] == "llama":
			a = l
		case len(f) >= 2 && f[0] == "site-b" && f[1] == "llama":
			b = l
		}
	}
	if !strings.Contains(a, "open") || !strings.Contains(b, "closed") {
		t.Errorf("rows of site-a's llama breaker %q and site-b's %q, want each named by its handler with its state:\n%s", a, b, out)
	}
}
