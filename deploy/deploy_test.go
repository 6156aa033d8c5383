// Package deploy holds what an operator loads next to the gateway: the
// Grafana dashboard (grafana/llm-proxy.json), the Prometheus recording
// rules (prometheus/recording.yml) and alerting rules
// (prometheus/alerts.yml). Its tests check them with promtool (Debian's
// prometheus package; scripts/setup-test.sh installs it): the rules load,
// every alert has unit tests that make it fire and stay quiet, every
// dashboard expression parses, and every metric they name is one the
// module registers. e2e/prometheus_test.go evaluates the same expressions
// against a real Prometheus scraping a real gateway.
package deploy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"
)

const (
	dashboardFile = "grafana/llm-proxy.json"
	recordingFile = "prometheus/recording.yml"
	alertsFile    = "prometheus/alerts.yml"
	testsGlob     = "prometheus/tests/*.yml"
)

// promtool returns the path of promtool, failing the test when it is not
// installed: these checks must not pass by being skipped.
func promtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool not found (%v): install Debian's prometheus package (scripts/setup-test.sh does, and `make test` runs it)", err)
	}
	return p
}

// runPromtool runs promtool with args in this directory and fails the
// test with its output when it exits non-zero.
func runPromtool(t *testing.T, args ...string) string {
	t.Helper()
	cmd := exec.Command(promtool(t), args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out.String())
	}
	return out.String()
}

func TestPromtoolCheckRules(t *testing.T) {
	out := runPromtool(t, "check", "rules", recordingFile, alertsFile)
	if !strings.Contains(out, "SUCCESS") {
		t.Fatalf("promtool check rules printed no SUCCESS:\n%s", out)
	}
}

func TestPromtoolTestRules(t *testing.T) {
	files, err := filepath.Glob(testsGlob)
	if err != nil || len(files) == 0 {
		t.Fatalf("no rule unit tests match %s (%v)", testsGlob, err)
	}
	out := runPromtool(t, append([]string{"test", "rules"}, files...)...)
	if n := strings.Count(out, "SUCCESS"); n != len(files) {
		t.Fatalf("promtool test rules: %d SUCCESS for %d files:\n%s", n, len(files), out)
	}
}

// ruleFile is a Prometheus rule file.
type ruleFile struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []rule `yaml:"rules"`
	} `yaml:"groups"`
}

type rule struct {
	Record      string            `yaml:"record"`
	Alert       string            `yaml:"alert"`
	Expr        string            `yaml:"expr"`
	For         string            `yaml:"for"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

func readRules(t *testing.T, path string) []rule {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var f ruleFile
	if err := yaml.Unmarshal(b, &f); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	var out []rule
	for _, g := range f.Groups {
		out = append(out, g.Rules...)
	}
	if len(out) == 0 {
		t.Fatalf("%s holds no rules", path)
	}
	return out
}

// unitTestFile is a promtool test file, as far as alerts go.
type unitTestFile struct {
	Tests []struct {
		Name          string `yaml:"name"`
		AlertRuleTest []struct {
			Alertname string `yaml:"alertname"`
			ExpAlerts []any  `yaml:"exp_alerts"`
		} `yaml:"alert_rule_test"`
	} `yaml:"tests"`
}

// TestEveryAlertFiresAndStaysQuietInUnitTests: each alert has at least one
// promtool case where it fires and one where it does not, a for: duration,
// a severity, and its summary, description and runbook.
func TestEveryAlertFiresAndStaysQuietInUnitTests(t *testing.T) {
	alerts := readRules(t, alertsFile)
	fires, quiet := map[string]int{}, map[string]int{}
	files, _ := filepath.Glob(testsGlob)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var u unitTestFile
		if err := yaml.Unmarshal(b, &u); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		for _, tc := range u.Tests {
			for _, a := range tc.AlertRuleTest {
				if len(a.ExpAlerts) > 0 {
					fires[a.Alertname]++
				} else {
					quiet[a.Alertname]++
				}
			}
		}
	}
	for _, a := range alerts {
		if a.Alert == "" {
			t.Errorf("%s holds a recording rule %q: keep them in %s", alertsFile, a.Record, recordingFile)
			continue
		}
		if fires[a.Alert] == 0 {
			t.Errorf("alert %s: no unit test in %s expects it to fire", a.Alert, testsGlob)
		}
		if quiet[a.Alert] == 0 {
			t.Errorf("alert %s: no unit test in %s expects it to stay quiet", a.Alert, testsGlob)
		}
		if a.For == "" {
			t.Errorf("alert %s has no for: duration (one bad scrape would page)", a.Alert)
		}
		if a.Labels["severity"] == "" {
			t.Errorf("alert %s has no severity label", a.Alert)
		}
		for _, k := range []string{"summary", "description", "runbook"} {
			if strings.TrimSpace(a.Annotations[k]) == "" {
				t.Errorf("alert %s has no %s annotation", a.Alert, k)
			}
		}
	}
	for name := range fires {
		if !slices.ContainsFunc(alerts, func(r rule) bool { return r.Alert == name }) {
			t.Errorf("unit tests expect alert %s, which %s does not define", name, alertsFile)
		}
	}
}

// dashboard is the part of a Grafana dashboard the tests read.
type dashboard struct {
	Inputs []struct {
		Name     string `json:"name"`
		Type     string `json:"type"`
		PluginID string `json:"pluginId"`
	} `json:"__inputs"`
	SchemaVersion int     `json:"schemaVersion"`
	UID           string  `json:"uid"`
	Title         string  `json:"title"`
	Panels        []panel `json:"panels"`
	Templating    struct {
		List []struct {
			Name       string          `json:"name"`
			Type       string          `json:"type"`
			Definition string          `json:"definition"`
			Query      json.RawMessage `json:"query"`
			Datasource datasource      `json:"datasource"`
			IncludeAll bool            `json:"includeAll"`
			AllValue   string          `json:"allValue"`
		} `json:"list"`
	} `json:"templating"`
}

type datasource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type panel struct {
	ID         int        `json:"id"`
	Type       string     `json:"type"`
	Title      string     `json:"title"`
	Datasource datasource `json:"datasource"`
	GridPos    struct {
		H, W, X, Y int
	} `json:"gridPos"`
	Targets []struct {
		Expr       string     `json:"expr"`
		RefID      string     `json:"refId"`
		Datasource datasource `json:"datasource"`
	} `json:"targets"`
	Panels []panel `json:"panels"`
}

func readDashboard(t *testing.T) dashboard {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s is not JSON: %v", dashboardFile, err)
	}
	return d
}

// allPanels flattens rows (a collapsed row keeps its panels inside).
func allPanels(ps []panel) []panel {
	var out []panel
	for _, p := range ps {
		out = append(out, p)
		out = append(out, allPanels(p.Panels)...)
	}
	return out
}

// substitute replaces the dashboard's variables as Grafana would with
// "All" selected and a 5m rate interval.
func substitute(expr string) string {
	return strings.NewReplacer("$__rate_interval", "5m", "$__interval", "1m", "$__range", "1h",
		"$upstream", ".*", "$model", ".*", "$tier", ".*").Replace(expr)
}

// TestDashboardIsImportable checks what Grafana's import needs and what the
// issue pins: the DS_PROMETHEUS input used by every panel and target, the
// upstream/model/tier variables from label_values, one row per subject,
// panels that fit the 24-column grid, unique ids.
func TestDashboardIsImportable(t *testing.T) {
	d := readDashboard(t)
	if len(d.Inputs) != 1 || d.Inputs[0].Name != "DS_PROMETHEUS" || d.Inputs[0].Type != "datasource" || d.Inputs[0].PluginID != "prometheus" {
		t.Errorf("__inputs = %+v, want one prometheus datasource input DS_PROMETHEUS", d.Inputs)
	}
	if d.SchemaVersion < 39 {
		t.Errorf("schemaVersion %d, want a current Grafana schema (39 or later)", d.SchemaVersion)
	}
	if d.UID == "" || d.Title == "" {
		t.Errorf("uid %q, title %q: both are needed for a stable import", d.UID, d.Title)
	}
	const ds = "${DS_PROMETHEUS}"
	vars := map[string]bool{}
	for _, v := range d.Templating.List {
		vars[v.Name] = true
		if v.Type != "query" || !strings.HasPrefix(v.Definition, "label_values(") || v.Datasource.UID != ds {
			t.Errorf("variable %s: type %q, definition %q, datasource %+v; want a label_values query on %s", v.Name, v.Type, v.Definition, v.Datasource, ds)
		}
		if !v.IncludeAll || v.AllValue != ".*" {
			t.Errorf("variable %s: includeAll %v, allValue %q; want All as .* (so an empty label value matches too)", v.Name, v.IncludeAll, v.AllValue)
		}
	}
	for _, want := range []string{"upstream", "model", "tier"} {
		if !vars[want] {
			t.Errorf("no template variable %q", want)
		}
	}
	ids := map[int]string{}
	var rows []string
	for _, p := range allPanels(d.Panels) {
		if prev, dup := ids[p.ID]; dup {
			t.Errorf("panels %q and %q share id %d", prev, p.Title, p.ID)
		}
		ids[p.ID] = p.Title
		if g := p.GridPos; g.W < 1 || g.X < 0 || g.X+g.W > 24 || g.H < 1 {
			t.Errorf("panel %q: gridPos %+v outside the 24-column grid", p.Title, g)
		}
		if p.Type == "row" {
			rows = append(rows, p.Title)
			continue
		}
		if p.Datasource.UID != ds {
			t.Errorf("panel %q: datasource %+v, want uid %s", p.Title, p.Datasource, ds)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			if strings.TrimSpace(tg.Expr) == "" || tg.Datasource.UID != ds {
				t.Errorf("panel %q, query %s: expr %q, datasource %+v", p.Title, tg.RefID, tg.Expr, tg.Datasource)
			}
		}
	}
	// The rows the issue asks for, in its order.
	for i, want := range []string{"traffic", "first token", "inter-event gap", "breaker", "retries", "hedg",
		"admission", "saturation", "fleet", "degraded"} {
		if i >= len(rows) || !strings.Contains(strings.ToLower(rows[i]), want) {
			t.Errorf("row %d is %q, want one about %q (rows: %q)", i, at(rows, i), want, rows)
		}
	}
}

func at(s []string, i int) string {
	if i < len(s) {
		return s[i]
	}
	return ""
}

// TestDashboardExpressionsParse hands every dashboard query, variables
// substituted, and every variable's metric selector to promtool as
// recording rules: a query Prometheus would refuse fails here without a
// server.
func TestDashboardExpressionsParse(t *testing.T) {
	d := readDashboard(t)
	var b strings.Builder
	b.WriteString("groups:\n  - name: dashboard\n    rules:\n")
	n := 0
	add := func(expr string) {
		n++
		q, _ := json.Marshal(substitute(expr))
		fmt.Fprintf(&b, "      - record: dashboard_query_%d\n        expr: %s\n", n, q)
	}
	for _, p := range allPanels(d.Panels) {
		for _, tg := range p.Targets {
			add(tg.Expr)
		}
	}
	labelValues := regexp.MustCompile(`^label_values\((.+),\s*(\w+)\)$`)
	for _, v := range d.Templating.List {
		m := labelValues.FindStringSubmatch(v.Definition)
		if m == nil {
			t.Errorf("variable %s: %q is not label_values(<selector>, <label>)", v.Name, v.Definition)
			continue
		}
		add(m[1])
	}
	path := filepath.Join(t.TempDir(), "dashboard.yml")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	out := runPromtool(t, "check", "rules", path)
	if !strings.Contains(out, fmt.Sprintf("SUCCESS: %d rules found", n)) {
		t.Fatalf("promtool check rules of the %d dashboard queries:\n%s", n, out)
	}
}

// TestDashboardReadsPercentilesFromRecordingRules: no panel computes a
// histogram_quantile itself (those are the recording rules' job), every
// recorded series a panel or alert reads is defined, and every recording
// rule is read by something.
func TestDashboardReadsPercentilesFromRecordingRules(t *testing.T) {
	d := readDashboard(t)
	recorded := map[string]bool{}
	for _, r := range readRules(t, recordingFile) {
		if r.Record == "" {
			t.Errorf("%s holds alert %q: keep alerts in %s", recordingFile, r.Alert, alertsFile)
		}
		recorded[r.Record] = true
	}
	used := map[string]bool{}
	recordedName := regexp.MustCompile(`[a-z_]+:[a-z0-9_]+(?::[a-z0-9_]+)?`)
	check := func(where, expr string) {
		for _, name := range recordedName.FindAllString(expr, -1) {
			used[name] = true
			if !recorded[name] {
				t.Errorf("%s reads %s, which %s does not record", where, name, recordingFile)
			}
		}
	}
	for _, p := range allPanels(d.Panels) {
		for _, tg := range p.Targets {
			if strings.Contains(tg.Expr, "histogram_quantile") {
				t.Errorf("panel %q computes a histogram_quantile on each refresh; read a recording rule instead: %s", p.Title, tg.Expr)
			}
			check("panel "+strconvQuote(p.Title), tg.Expr)
		}
	}
	for _, a := range readRules(t, alertsFile) {
		check("alert "+a.Alert, a.Expr)
	}
	for name := range recorded {
		if !used[name] {
			t.Errorf("recording rule %s is read by no panel and no alert", name)
		}
	}
}

func strconvQuote(s string) string { q, _ := json.Marshal(s); return string(q) }

// moduleMetrics reads the metric names the module registers from the
// caddymodule sources (Name: "..." in the collectors' options, with the
// caddy/llm_proxy namespace as constants or literals, and the
// fleet_degraded descriptor): histograms also answer to _bucket, _sum and
// _count.
func moduleMetrics(t *testing.T) (names map[string]bool, histograms map[string]bool) {
	t.Helper()
	files, err := filepath.Glob("../caddymodule/*.go")
	if err != nil || len(files) == 0 {
		t.Fatalf("no caddymodule sources (%v)", err)
	}
	names, histograms = map[string]bool{}, map[string]bool{}
	opt := regexp.MustCompile(`(Counter|Gauge|Histogram|Summary)Opts\{\s*Namespace:\s*(?:ns|"caddy"),\s*Subsystem:\s*(?:sub|"llm_proxy"),\s*Name:\s*"(\w+)"`)
	desc := regexp.MustCompile(`NewDesc\(ns\s*\+\s*"_"\s*\+\s*sub\s*\+\s*"_(\w+)"`)
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range opt.FindAllStringSubmatch(string(b), -1) {
			n := "caddy_llm_proxy_" + m[2]
			names[n] = true
			if m[1] == "Histogram" {
				histograms[n] = true
			}
		}
		for _, m := range desc.FindAllStringSubmatch(string(b), -1) {
			names["caddy_llm_proxy_"+m[1]] = true
		}
	}
	if len(names) < 20 {
		t.Fatalf("read only %d metric names from caddymodule (%v): has metrics.go changed its shape?", len(names), names)
	}
	return names, histograms
}

// TestMetricNamesAreTheModules: every caddy_llm_proxy_* name in the
// dashboard and the rules is one the module registers, and every metric
// the module registers is shown by the dashboard (directly or through a
// recording rule it reads).
func TestMetricNamesAreTheModules(t *testing.T) {
	names, histograms := moduleMetrics(t)
	known := func(n string) bool {
		if names[n] {
			return true
		}
		for _, suf := range []string{"_bucket", "_sum", "_count"} {
			if b, ok := strings.CutSuffix(n, suf); ok && histograms[b] {
				return true
			}
		}
		return false
	}
	metricName := regexp.MustCompile(`\bcaddy_llm_proxy_[a-z0-9_]+`)
	base := func(n string) string {
		for _, suf := range []string{"_bucket", "_sum", "_count"} {
			if b, ok := strings.CutSuffix(n, suf); ok && histograms[b] {
				return b
			}
		}
		return n
	}
	shown := map[string]bool{}
	check := func(where, expr string, show bool) {
		// Recorded names (level:metric:ops) contain metric names: drop them.
		expr = regexp.MustCompile(`[a-z_]+:[a-z0-9_]+(?::[a-z0-9_]+)?`).ReplaceAllString(expr, "")
		for _, n := range metricName.FindAllString(expr, -1) {
			if show {
				shown[base(n)] = true
			}
			if !known(n) {
				t.Errorf("%s uses %s, which caddymodule does not register", where, n)
			}
		}
	}
	d := readDashboard(t)
	for _, p := range allPanels(d.Panels) {
		for _, tg := range p.Targets {
			check("panel "+strconvQuote(p.Title), tg.Expr, true)
		}
	}
	for _, v := range d.Templating.List {
		check("variable "+v.Name, v.Definition, false)
	}
	for _, r := range readRules(t, recordingFile) {
		check("recording rule "+r.Record, r.Expr, true)
	}
	for _, r := range readRules(t, alertsFile) {
		check("alert "+r.Alert, r.Expr, false)
	}
	var missing []string
	for n := range names {
		if !shown[n] {
			missing = append(missing, n)
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Errorf("the dashboard shows no panel of %v", missing)
	}
}
