// Package e2e runs the real caddy binary, built with llm_proxy by
// ../xcaddy.sh, in front of an in-process mockllm fleet, and checks what
// clients see: bytes, timing, status codes, metrics and logs.
//
// Every test starts its own fleet and its own caddy process on free
// loopback ports, so tests run in parallel and share nothing.
//
// TestMain builds caddy once (cached by source hash) and fails the run if
// the build fails. E2E_CADDY=/path/to/caddy runs the tests against a
// prebuilt binary instead.
package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// caddyBin is the caddy binary built by TestMain.
var caddyBin string

func TestMain(m *testing.M) {
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	if bin := os.Getenv("E2E_CADDY"); bin != "" {
		// A prebuilt binary, e.g. while the tree does not build.
		fmt.Fprintf(os.Stderr, "e2e: using E2E_CADDY=%s instead of building\n", bin)
		caddyBin = bin
		return m.Run()
	}
	dir, err := os.MkdirTemp("", "llm-proxy-e2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	defer os.RemoveAll(dir)
	// xcaddy.sh reuses a cached build when the sources are unchanged; a cold
	// build takes minutes.
	cmd := exec.Command("../xcaddy.sh", filepath.Join(dir, "caddy"))
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2e: building caddy with ../xcaddy.sh failed: %v\n", err)
		return 1
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	caddyBin = strings.TrimSpace(lines[len(lines)-1])
	if fi, err := os.Stat(caddyBin); err != nil || fi.Mode()&0o111 == 0 {
		fmt.Fprintf(os.Stderr, "e2e: ../xcaddy.sh printed %q, which is not an executable: %v\n", caddyBin, err)
		return 1
	}
	return m.Run()
}

// freePort returns a loopback TCP port that was free a moment ago. Nothing
// listens on it afterwards, so it also serves as a refused upstream.
func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// lockedBuffer collects a process's output from its writer goroutines.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// gateway is a running caddy process with llm_proxy.
type gateway struct {
	t *testing.T
	// URL is the site's base URL, "http://127.0.0.1:PORT".
	URL string
	// AdminURL is the admin API's base URL.
	AdminURL string
	// Dir is the process's private directory (Caddyfile, HOME, logs).
	Dir string

	port, adminPort int
	// globals are extra global options (e.g. an llm_proxy { … } block);
	// env is added to the process's environment.
	globals    string
	env        []string
	forceDebug bool
	logs       *lockedBuffer
	cmd        *exec.Cmd
	exited     chan struct{}
}

// caddyfile is the whole Caddyfile for a site block body: global options
// that keep caddy on loopback and quick to stop, and one plain-HTTP site.
func (g *gateway) caddyfile(site string) string {
	debug := ""
	if testing.Verbose() || g.forceDebug {
		debug = "debug"
	}
	return fmt.Sprintf(`{
	admin 127.0.0.1:%d
	grace_period 1s
	default_bind 127.0.0.1
	auto_https off
	persist_config off
	storage file_system %s
	%s
%s
}

http://127.0.0.1:%d {
%s
}
`, g.adminPort, filepath.Join(g.Dir, "storage"), debug, g.globals, g.port, site)
}

// startGateway writes a Caddyfile with the given site block body, runs
// caddy on free loopback ports and waits until it serves. The process is
// stopped (SIGTERM, then SIGKILL) when the test ends; its log is added to
// the test output when the test failed.
func startGateway(t *testing.T, site string) *gateway {
	t.Helper()
	return startGatewayWith(t, gatewayOptions{Site: site})
}

// gatewayOptions are what startGatewayWith runs.
type gatewayOptions struct {
	// Site is the site block body.
	Site string
	// Globals are extra global options, e.g. "llm_proxy { tenants {…} }".
	Globals string
	// Env is added to caddy's environment ("NAME=value").
	Env []string
	// Debug turns on debug logging whatever -v says (so that a test that
	// greps the log sees everything the gateway can write).
	Debug bool
}

// startGatewayWith is startGateway with global options, environment and
// log level.
func startGatewayWith(t *testing.T, o gatewayOptions) *gateway {
	t.Helper()
	site := o.Site
	g := &gateway{t: t, Dir: t.TempDir(), logs: new(lockedBuffer), exited: make(chan struct{}),
		globals: o.Globals, env: o.Env, forceDebug: o.Debug}
	g.port, g.adminPort = freePort(t), freePort(t)
	for g.adminPort == g.port {
		g.adminPort = freePort(t)
	}
	g.URL = fmt.Sprintf("http://127.0.0.1:%d", g.port)
	g.AdminURL = fmt.Sprintf("http://127.0.0.1:%d", g.adminPort)
	file := filepath.Join(g.Dir, "Caddyfile")
	if err := os.WriteFile(file, []byte(g.caddyfile(site)), 0o644); err != nil {
		t.Fatal(err)
	}

	g.cmd = exec.Command(caddyBin, "run", "--config", file, "--adapter", "caddyfile")
	g.cmd.Dir = g.Dir
	g.cmd.Env = append(os.Environ(),
		"HOME="+g.Dir,
		"XDG_CONFIG_HOME="+filepath.Join(g.Dir, "config"),
		"XDG_DATA_HOME="+filepath.Join(g.Dir, "data"),
	)
	g.cmd.Env = append(g.cmd.Env, g.env...)
	startProcess(t, "caddy", g.cmd, g.logs, g.exited)
	t.Cleanup(func() {
		g.stop()
		g.checkLog()
		if t.Failed() {
			t.Logf("caddy Caddyfile:\n%s\ncaddy log:\n%s", g.caddyfile(site), g.logs.String())
		}
	})
	g.waitReady()
	return g
}

// stop sends SIGTERM and waits for the process to exit, killing it if it
// takes too long.
func (g *gateway) stop() { stopProcess(g.t, "caddy", g.cmd, g.exited) }

// startProcess starts cmd with its output in logs; exited closes when it
// has ended.
func startProcess(t testing.TB, name string, cmd *exec.Cmd, logs io.Writer, exited chan struct{}) {
	t.Helper()
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", name, err)
	}
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
}

// stopProcess sends cmd SIGTERM and waits for exited to close, killing it
// (and failing t) when it takes more than 5s. A process gone already is
// left alone.
func stopProcess(t testing.TB, name string, cmd *exec.Cmd, exited <-chan struct{}) {
	select {
	case <-exited:
		return
	default:
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(5 * time.Second):
		t.Errorf("%s did not exit within 5s of SIGTERM; killing it", name)
		_ = cmd.Process.Kill()
		<-exited
	}
}

// logAlarms are log texts that mean the gateway misbehaved whatever the
// test checks: a recovered panic, a double WriteHeader, a data race.
var logAlarms = []string{"panic", "superfluous response.WriteHeader", "WARNING: DATA RACE", "response.Write on hijacked"}

// checkLog fails the test when caddy's log holds one of logAlarms.
func (g *gateway) checkLog() {
	log := g.logs.String()
	for _, a := range logAlarms {
		if i := strings.Index(log, a); i >= 0 {
			lo := strings.LastIndexByte(log[:i], '\n') + 1
			hi := strings.IndexByte(log[i:], '\n')
			if hi < 0 {
				hi = len(log) - i
			}
			g.t.Errorf("caddy log holds %q: %s", a, log[lo:i+hi])
		}
	}
}

// waitReady waits until the admin API answers and the site port accepts
// connections.
func (g *gateway) waitReady() {
	g.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	c := &http.Client{Timeout: time.Second}
	for {
		select {
		case <-g.exited:
			g.t.Fatalf("caddy exited before it was ready:\n%s", g.logs.String())
		default:
		}
		if time.Now().After(deadline) {
			g.t.Fatalf("caddy not ready after 20s:\n%s", g.logs.String())
		}
		resp, err := c.Get(g.AdminURL + "/config/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				if conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", g.port), time.Second); err == nil {
					conn.Close()
					return
				}
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// reload replaces the running config with a new site block body through
// the admin API (POST /load with a Caddyfile), as `caddy reload` does.
func (g *gateway) reload(site string) {
	g.t.Helper()
	req, err := http.NewRequest(http.MethodPost, g.AdminURL+"/load", strings.NewReader(g.caddyfile(site)))
	if err != nil {
		g.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "text/caddyfile")
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		g.t.Fatalf("reload: %v", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		g.t.Fatalf("reload: status %d: %s", resp.StatusCode, body)
	}
}

// metricSample is one line of the Prometheus text format.
type metricSample struct {
	Name   string
	Labels map[string]string
	Value  float64
}

// scrapeMetrics reads the admin API's /metrics.
func (g *gateway) scrapeMetrics() []metricSample {
	g.t.Helper()
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get(g.AdminURL + "/metrics")
	if err != nil {
		g.t.Fatalf("scraping metrics: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		g.t.Fatalf("scraping metrics: status %d", resp.StatusCode)
	}
	samples, err := parseMetrics(resp.Body)
	if err != nil {
		g.t.Fatalf("parsing metrics: %v", err)
	}
	return samples
}

// metricLine matches `name{labels} value` and `name value` (no timestamps:
// client_golang does not write them).
var metricLine = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$`)

// labelPair matches one label="value" with Prometheus' escapes.
var labelPair = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)

func parseMetrics(r io.Reader) ([]metricSample, error) {
	var out []metricSample
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		m := metricLine.FindStringSubmatch(line)
		if m == nil {
			return nil, fmt.Errorf("unparsable metrics line %q", line)
		}
		v, err := strconv.ParseFloat(m[3], 64)
		if err != nil {
			return nil, fmt.Errorf("metrics line %q: %v", line, err)
		}
		s := metricSample{Name: m[1], Labels: map[string]string{}, Value: v}
		for _, lp := range labelPair.FindAllStringSubmatch(m[2], -1) {
			val := strings.NewReplacer(`\\`, `\`, `\"`, `"`, `\n`, "\n").Replace(lp[2])
			s.Labels[lp[1]] = val
		}
		out = append(out, s)
	}
	return out, sc.Err()
}

// metricValue sums the samples named name whose labels include all of
// labels; found is false when no sample matched.
func metricValue(samples []metricSample, name string, labels map[string]string) (sum float64, found bool) {
next:
	for _, s := range samples {
		if s.Name != name {
			continue
		}
		for k, v := range labels {
			if s.Labels[k] != v {
				continue next
			}
		}
		sum += s.Value
		found = true
	}
	return sum, found
}

// metricFamilyExposed reports whether the scrape holds any sample of the
// metric family name (for a histogram, name's _bucket, _sum or _count).
func metricFamilyExposed(samples []metricSample, name string) bool {
	for _, s := range samples {
		switch s.Name {
		case name, name + "_bucket", name + "_sum", name + "_count":
			return true
		}
	}
	return false
}

// mustMetricFamily fails the test unless the scrape exposes the metric
// family name at all, and reports whether it does: a renamed or
// unregistered metric must not read as a counter that stayed at 0.
func mustMetricFamily(t testing.TB, samples []metricSample, name string) bool {
	t.Helper()
	if metricFamilyExposed(samples, name) {
		return true
	}
	var names []string
	seen := map[string]bool{}
	for _, s := range samples {
		if strings.HasPrefix(s.Name, "caddy_llm_proxy_") && !seen[s.Name] {
			seen[s.Name] = true
			names = append(names, s.Name)
		}
	}
	t.Errorf("the gateway exposes no metric %s at all (renamed or never registered?); its caddy_llm_proxy_* samples: %v", name, names)
	return false
}

// metricValueOrZero is metricValue for checks that may want 0: the sum of
// the samples of name whose labels include labels, 0 when no series
// matches (a counter series that was never incremented is legitimately
// absent), but the test fails when the family itself is not exposed.
//
// A counter vector with no series at all is not exposed either (client_golang
// writes no empty family), so use it only where the family must be there:
// something else was counted in it first. Where nothing may have been
// counted yet, check again after a control step that counts something,
// which proves the name.
func metricValueOrZero(t testing.TB, samples []metricSample, name string, labels map[string]string) float64 {
	t.Helper()
	if !mustMetricFamily(t, samples, name) {
		return 0
	}
	v, _ := metricValue(samples, name, labels)
	return v
}

// adapt converts a site block body into the JSON config that the gateway
// would run (POST /adapt with the whole Caddyfile).
func (g *gateway) adapt(site string) map[string]any {
	g.t.Helper()
	req, err := http.NewRequest(http.MethodPost, g.AdminURL+"/adapt", strings.NewReader(g.caddyfile(site)))
	if err != nil {
		g.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "text/caddyfile")
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		g.t.Fatalf("adapt: %v", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		g.t.Fatalf("adapt: status %d: %s", resp.StatusCode, body)
	}
	var out struct {
		Result map[string]any `json:"result"`
	}
	if err := json.Unmarshal(body, &out); err != nil || out.Result == nil {
		g.t.Fatalf("adapt: %v: %s", err, body)
	}
	return out.Result
}

// loadJSON posts a JSON config to the admin API's /load and returns the
// status and body; unlike reload, a refused config does not fail the test.
func (g *gateway) loadJSON(cfg map[string]any) (int, []byte) {
	g.t.Helper()
	b, err := json.Marshal(cfg)
	if err != nil {
		g.t.Fatal(err)
	}
	req, err := http.NewRequest(http.MethodPost, g.AdminURL+"/load", bytes.NewReader(b))
	if err != nil {
		g.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		g.t.Fatalf("load: %v", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, body
}

// llmProxyHandlers returns every llm_proxy handler object in a JSON config
// (at any depth: the Caddyfile adapter nests site routes in subroutes), so
// a test can set what the Caddyfile cannot express.
func llmProxyHandlers(cfg any) []map[string]any {
	var out []map[string]any
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			if v["handler"] == "llm_proxy" {
				out = append(out, v)
			}
			for _, c := range v {
				walk(c)
			}
		case []any:
			for _, c := range v {
				walk(c)
			}
		}
	}
	walk(cfg)
	return out
}

// startFleet starts an in-process mock fleet on loopback, closed when the
// test ends (after the gateway, which is started later).
func startFleet(t *testing.T, cfg mockllm.FleetConfig) *mockllm.Fleet {
	t.Helper()
	if cfg.Listen == "" {
		cfg.Listen = "127.0.0.1:0"
	}
	if cfg.Seed == 0 {
		cfg.Seed = 1
	}
	f, err := mockllm.StartFleet(cfg)
	if err != nil {
		t.Fatalf("starting mock fleet: %v", err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return f
}

// fleetRequests is the number of completion requests the fleet received.
func fleetRequests(f *mockllm.Fleet) int64 {
	var n int64
	for _, r := range f.Stats().Replicas {
		n += r.Requests
	}
	return n
}

// newClient returns a client with a transport of its own that does not
// ask for compression, so bodies arrive exactly as the gateway wrote them.
func newClient(t testing.TB) *http.Client {
	t.Helper()
	tr := &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 4}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// chatBody is a chat completion request for a prompt.
func chatBody(prompt string, stream bool) string {
	b, _ := json.Marshal(map[string]any{
		"model":    "mock-llama",
		"messages": []map[string]string{{"role": "user", "content": prompt}},
		"stream":   stream,
	})
	return string(b)
}

// completionBody is a legacy completion request for a prompt.
func completionBody(prompt string, stream bool) string {
	b, _ := json.Marshal(map[string]any{"model": "mock-llama", "prompt": prompt, "stream": stream})
	return string(b)
}

// post sends a JSON POST with extra headers given as "Name: value".
func post(ctx context.Context, t testing.TB, c *http.Client, url, body string, headers ...string) *http.Response {
	t.Helper()
	req, err := newRequest(ctx, url, body, headers...)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	return resp
}

// newRequest builds a JSON POST with extra headers given as "Name: value".
func newRequest(ctx context.Context, url, body string, headers ...string) (*http.Request, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	for _, h := range headers {
		k, v, ok := strings.Cut(h, ":")
		if !ok {
			return nil, fmt.Errorf("bad header %q", h)
		}
		req.Header.Set(strings.TrimSpace(k), strings.TrimSpace(v))
	}
	return req, nil
}

// testContext is a context that ends with the test or after d.
func testContext(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// event is one SSE event as received: its raw bytes, including the blank
// line that ends it, and when that blank line arrived.
type event struct {
	Raw []byte
	At  time.Time
}

// Data is the event's data lines joined by "\n", as an SSE client sees it.
func (e event) Data() string {
	var lines []string
	for _, l := range strings.Split(strings.TrimRight(string(e.Raw), "\r\n"), "\n") {
		l = strings.TrimSuffix(l, "\r")
		if v, ok := strings.CutPrefix(l, "data:"); ok {
			lines = append(lines, strings.TrimPrefix(v, " "))
		}
	}
	return strings.Join(lines, "\n")
}

// IsComment reports whether the event holds only comment lines.
func (e event) IsComment() bool {
	for _, l := range strings.Split(strings.TrimRight(string(e.Raw), "\r\n"), "\n") {
		if !strings.HasPrefix(l, ":") {
			return false
		}
	}
	return true
}

// IsDone reports whether the event is "data: [DONE]".
func (e event) IsDone() bool { return e.Data() == "[DONE]" }

// ErrorObject returns the "error" object of an in-band error event.
func (e event) ErrorObject() (map[string]any, bool) {
	var v struct {
		Error map[string]any `json:"error"`
	}
	if json.Unmarshal([]byte(e.Data()), &v) != nil || v.Error == nil {
		return nil, false
	}
	return v.Error, true
}

// stream is a streamed response as the client saw it.
type stream struct {
	Status int
	Header http.Header
	// Sent is when the request was sent.
	Sent   time.Time
	Events []event
	// Err is what ended the body other than a clean EOF; Tail holds the
	// bytes of an unterminated last event.
	Err  error
	Tail []byte
}

// readEvents splits an SSE body into events as they arrive. onEvent, when
// set, is called with each event and the number received so far; reading
// stops when it returns false.
func readEvents(body io.Reader, onEvent func(e event, n int) bool) (events []event, tail []byte, err error) {
	br := bufio.NewReader(body)
	var cur []byte
	for {
		line, rerr := br.ReadBytes('\n')
		if len(line) > 0 && rerr == nil {
			if string(line) == "\n" || string(line) == "\r\n" {
				if len(cur) == 0 {
					continue // stray blank line
				}
				e := event{Raw: append(cur, line...), At: time.Now()}
				events = append(events, e)
				cur = nil
				if onEvent != nil && !onEvent(e, len(events)) {
					return events, nil, nil
				}
				continue
			}
			cur = append(cur, line...)
			continue
		}
		cur = append(cur, line...)
		if errors.Is(rerr, io.EOF) {
			if len(cur) > 0 {
				return events, cur, io.ErrUnexpectedEOF
			}
			return events, nil, nil
		}
		return events, cur, rerr
	}
}

// streamRequest sends a POST and reads its SSE response to the end.
func streamRequest(ctx context.Context, t testing.TB, c *http.Client, url, body string, headers ...string) *stream {
	t.Helper()
	s, err := doStream(ctx, c, url, body, headers...)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// doStream is streamRequest for other goroutines than the test's: it
// returns the error of the request instead of failing the test.
func doStream(ctx context.Context, c *http.Client, url, body string, headers ...string) (*stream, error) {
	req, err := newRequest(ctx, url, body, headers...)
	if err != nil {
		return nil, err
	}
	s := &stream{Sent: time.Now()}
	resp, err := c.Do(req)
	if err != nil {
		return nil, fmt.Errorf("POST %s: %w", url, err)
	}
	defer resp.Body.Close()
	s.Status, s.Header = resp.StatusCode, resp.Header
	s.Events, s.Tail, s.Err = readEvents(resp.Body, nil)
	return s, nil
}

// dataEvents returns the events that carry data (not comments).
func (s *stream) dataEvents() []event {
	var out []event
	for _, e := range s.Events {
		if !e.IsComment() {
			out = append(out, e)
		}
	}
	return out
}

// raw is the concatenated raw bytes of the events.
func raw(events []event) []byte {
	var b []byte
	for _, e := range events {
		b = append(b, e.Raw...)
	}
	return b
}

// createdField matches the "created" timestamp (unix seconds) of OpenAI
// objects: the one part of mockllm's output that depends on when the
// request arrived (ids follow X-Request-Id).
var createdField = regexp.MustCompile(`"created":\d+`)

// sameUpstreamBytes compares a gateway response with the upstream's own:
// exactly, or, when the two requests straddled a second boundary, with
// only the "created" values normalised. It says which comparison held.
func sameUpstreamBytes(got, want []byte) (same bool, how string) {
	if bytes.Equal(got, want) {
		return true, "identical bytes"
	}
	norm := func(b []byte) []byte { return createdField.ReplaceAll(b, []byte(`"created":0`)) }
	if bytes.Equal(norm(got), norm(want)) {
		return true, `identical bytes except "created" (the requests straddled a second)`
	}
	return false, ""
}

// firstDiff describes where two byte slices first differ.
func firstDiff(a, b []byte) string {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			lo, hi := max(0, i-40), min(n, i+40)
			return fmt.Sprintf("at byte %d: got %q, want %q", i, a[lo:min(hi, len(a))], b[lo:min(hi, len(b))])
		}
	}
	return fmt.Sprintf("lengths differ: got %d bytes, want %d", len(a), len(b))
}

// sha256Hex is the hex SHA-256 of b.
func sha256Hex(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// upstreams joins the replicas' addresses for a Caddyfile.
func upstreams(f *mockllm.Fleet) string { return strings.Join(f.Addrs(), " ") }

// openAIError decodes a gateway error body and checks its shape:
// {"error":{"message","type","code"}}, all three present and strings.
func openAIError(t testing.TB, body []byte) (message, typ, code string) {
	t.Helper()
	var v struct {
		Error map[string]json.RawMessage `json:"error"`
	}
	if err := json.Unmarshal(body, &v); err != nil || v.Error == nil {
		t.Fatalf("body is not OpenAI's error shape {\"error\":{...}}: %q", body)
	}
	field := func(k string) string {
		raw, ok := v.Error[k]
		if !ok {
			t.Errorf("error body lacks %q: %s", k, body)
			return ""
		}
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			t.Errorf("error.%s is not a string: %s", k, raw)
		}
		return s
	}
	message, typ, code = field("message"), field("type"), field("code")
	if message == "" {
		t.Errorf("error.message is empty: %s", body)
	}
	return message, typ, code
}

// waitFor polls cond every 10ms until it holds or d passes.
func waitFor(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// breakerView is one breaker as the admin API shows it
// (GET /llm_proxy/breakers, and the answer to a POST on one).
type breakerView struct {
	Key string `json:"key"`
	// FleetKey is its key in the fleet's Redis ("addr~policy").
	FleetKey            string    `json:"fleet_key"`
	Handler             string    `json:"handler"`
	Upstream            string    `json:"upstream"`
	Model               string    `json:"model"`
	Policy              string    `json:"policy"`
	State               string    `json:"state"`
	Since               time.Time `json:"since"`
	ConsecutiveFailures int       `json:"consecutive_failures"`
	FailuresInWindow    int       `json:"failures_in_window"`
	OpenUntil           time.Time `json:"open_until"`
	Forced              bool      `json:"forced"`
	ProbesInFlight      int       `json:"probes_in_flight"`
	ProbeSuccesses      int       `json:"probe_successes"`
	Reopens             int       `json:"reopens"`
	LastFailure         string    `json:"last_failure"`
	LastFailureAt       time.Time `json:"last_failure_at"`
	// Scope is "fleet" or "local" in a fleet, "" otherwise; OpenedBy the
	// instance that opened it fleet-wide.
	Scope    string `json:"scope"`
	OpenedBy string `json:"opened_by"`
}

// admin sends a request without a body to the admin API and returns the
// status and body; a transport error fails the test.
func (g *gateway) admin(method, path string) (int, []byte) {
	g.t.Helper()
	req, err := http.NewRequest(method, g.AdminURL+path, nil)
	if err != nil {
		g.t.Fatal(err)
	}
	client := &http.Client{Timeout: 10 * time.Second}
	resp, err := client.Do(req)
	for try := 1; err != nil && method == http.MethodGet && handOffLost(err) && try <= 3; try++ {
		// Each config load replaces Caddy's admin server: a connection
		// the kernel queued on the old listener as it closed is reset
		// before any handler saw it (caddy.replaceLocalAdminServer). A
		// GET that never reached the API is sent again, as a client would.
		time.Sleep(time.Duration(try) * 20 * time.Millisecond)
		resp, err = client.Do(req)
	}
	if err != nil {
		g.t.Fatalf("admin %s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		g.t.Fatalf("admin %s %s: reading body: %v", method, path, err)
	}
	return resp.StatusCode, body
}

// handOffLost reports whether err is how a request lost in a reload's
// listener hand-off (the admin server's replacement, or a site's) fails:
// EOF before any response, or a reset or refusal.
func handOffLost(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED)
}

// breakers lists the breakers (GET /llm_proxy/breakers) by key.
func (g *gateway) breakers() map[string]breakerView {
	g.t.Helper()
	status, body := g.admin(http.MethodGet, "/llm_proxy/breakers")
	if status != http.StatusOK {
		g.t.Fatalf("GET /llm_proxy/breakers: status %d: %s", status, body)
	}
	var views []breakerView
	if err := json.Unmarshal(body, &views); err != nil {
		g.t.Fatalf("GET /llm_proxy/breakers: %v: %s", err, body)
	}
	out := make(map[string]breakerView, len(views))
	for _, v := range views {
		out[v.Key] = v
	}
	return out
}

// breaker returns the breaker of key as the admin API lists it.
func (g *gateway) breaker(key string) breakerView {
	g.t.Helper()
	v, ok := g.breakers()[key]
	if !ok {
		g.t.Fatalf("the admin API lists no breaker %q", key)
	}
	return v
}

// breakerAction POSTs /llm_proxy/breakers/<key>/<action> (action may carry
// a query, "open?for=2s") and returns the status and, on 200, the view.
func (g *gateway) breakerAction(key, action string) (int, breakerView) {
	g.t.Helper()
	status, vs := g.breakerActions(key, action)
	for _, v := range vs {
		if v.Key == key {
			return status, v
		}
	}
	if len(vs) > 0 {
		return status, vs[0]
	}
	return status, breakerView{}
}

// breakerActions POSTs an action to a breaker key and returns the status
// and the breakers the answer lists as changed (a plain dial address acts
// on every breaker of the upstream).
func (g *gateway) breakerActions(key, action string) (int, []breakerView) {
	g.t.Helper()
	status, body := g.admin(http.MethodPost, "/llm_proxy/breakers/"+key+"/"+action)
	var vs []breakerView
	if status == http.StatusOK {
		if err := json.Unmarshal(body, &vs); err != nil {
			g.t.Fatalf("POST %s/%s: %v: %s", key, action, err, body)
		}
	}
	return status, vs
}

// waitBreaker polls the admin API until the breaker of key satisfies cond
// or d passes; it returns the last view and whether cond held.
func (g *gateway) waitBreaker(key string, d time.Duration, cond func(breakerView) bool) (breakerView, bool) {
	g.t.Helper()
	var v breakerView
	ok := waitFor(d, func() bool {
		v = g.breaker(key)
		return cond(v)
	})
	return v, ok
}
