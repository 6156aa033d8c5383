package e2e

// Helpers of the Prometheus end-to-end test (prometheus_test.go): a real
// prometheus process (Debian's package) on a free loopback port with its
// own config and data directory, its HTTP API, and the queries of the
// Grafana dashboard in deploy/.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// deployDir is the repository's deploy/ directory, from e2e/.
const deployDir = "../deploy"

// promServer is a running prometheus process.
type promServer struct {
	t *testing.T
	// URL is its HTTP API's base URL, "http://127.0.0.1:PORT".
	URL    string
	logs   *lockedBuffer
	cmd    *exec.Cmd
	exited chan struct{}
}

// startPrometheus runs prometheus scraping target (host:port, path
// /metrics) every second and evaluating ruleFiles every second, with its
// config and TSDB in a temporary directory and its API on a free loopback
// port. It is stopped when the test ends (SIGTERM, then SIGKILL); its log
// is added to the output of a failed test. A missing prometheus binary
// fails the test: scripts/setup-test.sh installs it.
func startPrometheus(t *testing.T, target string, ruleFiles ...string) *promServer {
	t.Helper()
	bin, err := exec.LookPath("prometheus")
	if err != nil {
		t.Fatalf("prometheus not found (%v): install Debian's prometheus package (scripts/setup-test.sh does)", err)
	}
	dir := t.TempDir()
	var rules []string
	for _, f := range ruleFiles {
		abs, err := filepath.Abs(f)
		if err != nil {
			t.Fatal(err)
		}
		rules = append(rules, fmt.Sprintf("  - %q", abs))
	}
	cfg := fmt.Sprintf(`global:
  scrape_interval: 1s
  scrape_timeout: 900ms
  evaluation_interval: 1s
rule_files:
%s
scrape_configs:
  - job_name: caddy
    metrics_path: /metrics
    static_configs:
      - targets: [%q]
`, strings.Join(rules, "\n"), target)
	cfgFile := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgFile, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	p := &promServer{t: t, URL: fmt.Sprintf("http://127.0.0.1:%d", port), logs: new(lockedBuffer), exited: make(chan struct{})}
	p.cmd = exec.Command(bin,
		"--config.file="+cfgFile,
		"--storage.tsdb.path="+filepath.Join(dir, "data"),
		fmt.Sprintf("--web.listen-address=127.0.0.1:%d", port),
		"--log.level=warn",
	)
	p.cmd.Dir = dir
	startProcess(t, "prometheus", p.cmd, p.logs, p.exited)
	t.Cleanup(func() {
		p.stop()
		if t.Failed() {
			t.Logf("prometheus config:\n%s\nprometheus log:\n%s", cfg, p.logs.String())
		}
	})
	c := &http.Client{Timeout: time.Second}
	if !waitFor(20*time.Second, func() bool {
		select {
		case <-p.exited:
			return true
		default:
		}
		resp, err := c.Get(p.URL + "/-/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}) {
		t.Fatalf("prometheus not ready after 20s:\n%s", p.logs.String())
	}
	select {
	case <-p.exited:
		t.Fatalf("prometheus exited at start:\n%s", p.logs.String())
	default:
	}
	return p
}

// stop sends SIGTERM and waits, killing it after 5s.
func (p *promServer) stop() { stopProcess(p.t, "prometheus", p.cmd, p.exited) }

// promResponse is the envelope of every Prometheus API answer.
type promResponse struct {
	Status    string          `json:"status"`
	ErrorType string          `json:"errorType"`
	Error     string          `json:"error"`
	Data      json.RawMessage `json:"data"`
}

// api GETs an API path with a query and returns its data, or the error
// Prometheus gave (a bad expression is an error, not a test failure).
func (p *promServer) api(ctx context.Context, path string, q url.Values) (json.RawMessage, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.URL+path+"?"+q.Encode(), nil)
	if err != nil {
		return nil, err
	}
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	var r promResponse
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("%s: status %d, not JSON: %q", path, resp.StatusCode, b)
	}
	if r.Status != "success" {
		return nil, fmt.Errorf("%s: %s: %s", path, r.ErrorType, r.Error)
	}
	return r.Data, nil
}

// promSeries is one series of a range query: its labels and its values.
type promSeries struct {
	Metric map[string]string `json:"metric"`
	Values [][2]any          `json:"values"`
}

// maxValue is the largest finite value of the series (NaN and ±Inf, which
// Prometheus writes as strings, are skipped); ok is false when none is.
func (s promSeries) maxValue() (v float64, ok bool) {
	for _, pt := range s.Values {
		str, _ := pt[1].(string)
		f, err := strconv.ParseFloat(str, 64)
		if err != nil || f != f || f > 1e308 || f < -1e308 {
			continue
		}
		if !ok || f > v {
			v, ok = f, true
		}
	}
	return v, ok
}

// queryRange evaluates expr from start to end every step, as a Grafana
// panel does (/api/v1/query_range).
func (p *promServer) queryRange(ctx context.Context, expr string, start, end time.Time, step time.Duration) ([]promSeries, error) {
	q := url.Values{
		"query": {expr},
		"start": {strconv.FormatFloat(float64(start.UnixMilli())/1000, 'f', 3, 64)},
		"end":   {strconv.FormatFloat(float64(end.UnixMilli())/1000, 'f', 3, 64)},
		"step":  {step.String()},
	}
	data, err := p.api(ctx, "/api/v1/query_range", q)
	if err != nil {
		return nil, err
	}
	var m struct {
		ResultType string       `json:"resultType"`
		Result     []promSeries `json:"result"`
	}
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("query_range %q: %v: %s", expr, err, data)
	}
	if m.ResultType != "matrix" {
		return nil, fmt.Errorf("query_range %q: result type %q, want matrix", expr, m.ResultType)
	}
	return m.Result, nil
}

// query evaluates expr at one instant (/api/v1/query) and returns the
// number of series or samples in the answer.
func (p *promServer) query(ctx context.Context, expr string) (int, error) {
	data, err := p.api(ctx, "/api/v1/query", url.Values{"query": {expr}})
	if err != nil {
		return 0, err
	}
	var m struct {
		ResultType string            `json:"resultType"`
		Result     []json.RawMessage `json:"result"`
	}
	if err := json.Unmarshal(data, &m); err != nil {
		return 0, fmt.Errorf("query %q: %v: %s", expr, err, data)
	}
	return len(m.Result), nil
}

// labelValues lists the values of label on the series that match
// selector (/api/v1/label/<label>/values), as a Grafana label_values
// variable does.
func (p *promServer) labelValues(ctx context.Context, label, selector string, start, end time.Time) ([]string, error) {
	q := url.Values{"match[]": {selector},
		"start": {strconv.FormatInt(start.Unix(), 10)}, "end": {strconv.FormatInt(end.Unix(), 10)}}
	data, err := p.api(ctx, "/api/v1/label/"+url.PathEscape(label)+"/values", q)
	if err != nil {
		return nil, err
	}
	var vals []string
	if err := json.Unmarshal(data, &vals); err != nil {
		return nil, fmt.Errorf("label values of %s: %v: %s", label, err, data)
	}
	return vals, nil
}

// promRule is one rule as /api/v1/rules reports it after evaluation.
type promRule struct {
	Name      string `json:"name"`
	Query     string `json:"query"`
	Type      string `json:"type"` // "recording" or "alerting"
	Health    string `json:"health"`
	LastError string `json:"lastError"`
	// State is an alert's: "inactive", "pending" or "firing".
	State string `json:"state"`
	// LastEvaluation is when it last ran ("0001-01-01..." before the first).
	LastEvaluation time.Time `json:"lastEvaluation"`
}

// rules lists every loaded rule of every group.
func (p *promServer) rules(ctx context.Context) ([]promRule, error) {
	data, err := p.api(ctx, "/api/v1/rules", nil)
	if err != nil {
		return nil, err
	}
	var m struct {
		Groups []struct {
			Name  string     `json:"name"`
			File  string     `json:"file"`
			Rules []promRule `json:"rules"`
		} `json:"groups"`
	}
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("rules: %v: %s", err, data)
	}
	var out []promRule
	for _, g := range m.Groups {
		out = append(out, g.Rules...)
	}
	return out, nil
}

// targetHealth is the health of the scrape target ("up", "down",
// "unknown") and its last error.
func (p *promServer) targetHealth(ctx context.Context) (string, string, error) {
	data, err := p.api(ctx, "/api/v1/targets", url.Values{"state": {"active"}})
	if err != nil {
		return "", "", err
	}
	var m struct {
		ActiveTargets []struct {
			Health    string `json:"health"`
			LastError string `json:"lastError"`
		} `json:"activeTargets"`
	}
	if err := json.Unmarshal(data, &m); err != nil {
		return "", "", fmt.Errorf("targets: %v: %s", err, data)
	}
	if len(m.ActiveTargets) != 1 {
		return "", "", fmt.Errorf("targets: %d active, want 1: %s", len(m.ActiveTargets), data)
	}
	return m.ActiveTargets[0].Health, m.ActiveTargets[0].LastError, nil
}

// dashboardQuery is one query of a dashboard panel.
type dashboardQuery struct {
	Panel, Row, RefID string
	Expr              string
}

// dashboardVariable is one label_values template variable.
type dashboardVariable struct {
	Name, Label, Selector string
}

// labelValuesDef matches a variable's label_values(<selector>, <label>).
var labelValuesDef = regexp.MustCompile(`^label_values\((.+),\s*(\w+)\)$`)

// readDashboard returns every query of the Grafana dashboard at path
// (panels inside rows included) with the row it belongs to, and its
// label_values variables.
func readDashboard(t *testing.T, path string) ([]dashboardQuery, []dashboardVariable) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	type panel struct {
		Type    string `json:"type"`
		Title   string `json:"title"`
		Targets []struct {
			Expr  string `json:"expr"`
			RefID string `json:"refId"`
		} `json:"targets"`
		Panels json.RawMessage `json:"panels"`
	}
	var d struct {
		Panels     []json.RawMessage `json:"panels"`
		Templating struct {
			List []struct {
				Name       string `json:"name"`
				Definition string `json:"definition"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	var qs []dashboardQuery
	row := ""
	var walk func(raws []json.RawMessage)
	walk = func(raws []json.RawMessage) {
		for _, raw := range raws {
			var p panel
			if err := json.Unmarshal(raw, &p); err != nil {
				t.Fatalf("%s: panel: %v", path, err)
			}
			if p.Type == "row" {
				row = p.Title
			}
			for _, tg := range p.Targets {
				qs = append(qs, dashboardQuery{Panel: p.Title, Row: row, RefID: tg.RefID, Expr: tg.Expr})
			}
			if len(p.Panels) > 0 {
				var inner []json.RawMessage
				if err := json.Unmarshal(p.Panels, &inner); err != nil {
					t.Fatalf("%s: panels of %q: %v", path, p.Title, err)
				}
				walk(inner)
			}
		}
	}
	walk(d.Panels)
	var vars []dashboardVariable
	for _, v := range d.Templating.List {
		m := labelValuesDef.FindStringSubmatch(v.Definition)
		if m == nil {
			t.Fatalf("%s: variable %s: %q is not label_values(<selector>, <label>)", path, v.Name, v.Definition)
		}
		vars = append(vars, dashboardVariable{Name: v.Name, Selector: m[1], Label: m[2]})
	}
	if len(qs) == 0 || len(vars) == 0 {
		t.Fatalf("%s: %d queries and %d variables", path, len(qs), len(vars))
	}
	return qs, vars
}

// grafanaExpr substitutes the dashboard's variables as Grafana does with
// "All" selected (allValue .*) and a rate interval of rateInterval.
func grafanaExpr(expr string, rateInterval time.Duration) string {
	return strings.NewReplacer("$__rate_interval", fmt.Sprintf("%ds", int(rateInterval.Seconds())), "$__interval", "1s",
		"$upstream", ".*", "$model", ".*", "$tier", ".*").Replace(expr)
}
