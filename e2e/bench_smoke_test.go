package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// suiteTargetColumns are the target columns every table of the benchmark
// suite (scripts/bench.sh) has.
var suiteTargetColumns = []string{"direct", "llm_proxy", "reverse_proxy", "nginx"}

// TestBenchSuiteSmoke runs `make bench` in its smoke mode (BENCH_SMOKE=1: a
// few seconds per scenario, results in a temp dir, docs/ untouched) so that
// the suite cannot rot: every scenario must run against every target (nginx
// is installed by scripts/setup-bench.sh when missing), every table it
// writes must have a number in each proxy's column, and S6 must meet issue
// 19's targets (checkStormTargets).
func TestBenchSuiteSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the benchmark suite's smoke mode (about two minutes)")
	}
	out := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "../scripts/bench.sh")
	cmd.Env = append(os.Environ(), "BENCH_SMOKE=1", "CADDY="+caddyBin, "OUT="+out)
	// The script stops what it started on TERM; give it the time to.
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 15 * time.Second
	var logs bytes.Buffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	start := time.Now()
	if err := cmd.Run(); err != nil {
		t.Fatalf("scripts/bench.sh (smoke): %v after %s; last output:\n%s", err, time.Since(start).Round(time.Second), tail(logs.String(), 60))
	}
	t.Logf("smoke suite took %s", time.Since(start).Round(time.Second))

	md, err := os.ReadFile(filepath.Join(out, "suite.md"))
	if err != nil {
		t.Fatal(err)
	}
	doc := string(md)
	for _, h := range []string{"### Targets of issue 12", "### S1 latency floor", "### S3 stream fidelity",
		"### S4 stream capacity", "### S4b event rate", "### S6 retry storm"} {
		if !strings.Contains(doc, h) {
			t.Errorf("suite.md has no %q section", h)
		}
	}
	// S7 (scripts/bench-hedge.sh) listens on fixed ports; on a shared
	// machine they may be taken, which the suite notes instead of failing.
	if !strings.Contains(doc, "### S7 hedging") {
		if !strings.Contains(doc, "S7: not run, scripts/bench-hedge.sh found its fixed port") {
			t.Error("suite.md has neither an S7 section nor a note why not")
		} else {
			t.Log("S7 not run: its fixed ports were in use")
		}
	}
	// S8 (scripts/bench-prefix.sh) takes free ports: it always runs.
	if !strings.Contains(doc, "### S8 prefix-cache routing") || !strings.Contains(doc, "| prefix_cache | ") {
		t.Error("suite.md has no S8 section with a prefix_cache row")
	}
	tables := markdownTables(doc)
	withTargets := 0
	for _, tb := range tables {
		cols := map[string]int{}
		for i, c := range tb[0] {
			cols[c] = i
		}
		if _, ok := cols["llm_proxy"]; !ok {
			continue
		}
		withTargets++
		for _, name := range suiteTargetColumns {
			i, ok := cols[name]
			if !ok {
				t.Errorf("table %v has no %s column", tb[0], name)
				continue
			}
			for _, row := range tb[1:] {
				cell := ""
				if i < len(row) {
					cell = row[i]
				}
				// direct has no proxy process: its CPU and RSS cells are "—";
				// nginx no Go allocation count.
				if (name == "direct" || name == "nginx" && len(row) > 1 && row[1] == "allocations per request") && cell == "—" {
					continue
				}
				if !strings.ContainsAny(cell, "0123456789") {
					t.Errorf("table %v, row %q: %s cell %q has no number", tb[0], row[:min(2, len(row))], name, cell)
				}
			}
		}
	}
	checkStormTargets(t, tables)
	checkS3Runs(t, filepath.Join(out, "S3.json"))
	// S1, S3, S4, S4b, S6.
	if withTargets < 5 {
		t.Errorf("%d tables with the target columns, want at least 5:\n%s", withTargets, doc)
	}
	for _, png := range []string{"suite-ttft-cdf-100.png", "suite-rss-per-stream.png", "suite-cpu-per-event.png", "suite-amplification.png"} {
		if fi, err := os.Stat(filepath.Join(out, "img", png)); err != nil || fi.Size() == 0 {
			t.Errorf("plot %s: %v", png, err)
		}
	}
	if t.Failed() {
		t.Logf("suite.md:\n%s", doc)
	}
}

// checkS3Runs asserts what issue 22 added to S3: its 100-stream level
// measured in three runs, each with every target and llm_proxy_tenants
// (tenants + saturation) serving every request; each caddy process's CPU
// and allocations per request known and plausible (a Go HTTP proxy
// allocates tens to hundreds of objects and spends tens of µs or more of
// CPU per streamed request; none spends more than 50 ms).
func checkS3Runs(t *testing.T, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var rep struct {
		Levels []struct {
			Streams, Run int
			Targets      []struct {
				Name             string
				Requests, Errors int64
				CPU              *float64 `json:"cpu_per_request_us"`
				Allocs           *float64 `json:"allocs_per_request"`
			}
		}
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	runs := 0
	for _, l := range rep.Levels {
		if l.Streams != 100 {
			continue
		}
		runs++
		if l.Run != runs {
			t.Errorf("100-stream level %d has run %d", runs, l.Run)
		}
		seen := map[string]bool{}
		for _, tg := range l.Targets {
			seen[tg.Name] = true
			if tg.Requests == 0 || tg.Errors != 0 {
				t.Errorf("run %d, %s: %d requests, %d errors; want all served", l.Run, tg.Name, tg.Requests, tg.Errors)
			}
			switch tg.Name {
			case "llm_proxy", "llm_proxy_tenants", "reverse_proxy":
				if tg.CPU == nil || *tg.CPU < 10 || *tg.CPU > 50_000 {
					t.Errorf("run %d, %s: CPU per request %v µs, want known, 10 µs to 50 ms", l.Run, tg.Name, tg.CPU)
				}
				if tg.Allocs == nil || *tg.Allocs < 20 || *tg.Allocs > 20_000 {
					t.Errorf("run %d, %s: %v allocations per request, want known, 20 to 20,000", l.Run, tg.Name, tg.Allocs)
				}
			case "nginx":
				if tg.CPU == nil || tg.Allocs != nil {
					t.Errorf("run %d, nginx: CPU %v, allocations %v; want CPU known, no allocation count", l.Run, tg.CPU, tg.Allocs)
				}
			}
		}
		for _, name := range []string{"direct", "llm_proxy", "llm_proxy_tenants", "reverse_proxy", "nginx"} {
			if !seen[name] {
				t.Errorf("run %d has no %s target", l.Run, name)
			}
		}
	}
	if runs != 3 {
		t.Errorf("S3 measured its 100-stream level %d times, want 3", runs)
	}
}

// stormCell reads an S6 cell, "1.05 · 60% ok": attempts per request and
// the share served in percent.
func stormCell(cell string) (attempts, served float64, ok bool) {
	_, err := fmt.Sscanf(cell, "%f · %f%% ok", &attempts, &served)
	return attempts, served, err == nil
}

// checkStormTargets asserts issue 19's targets on the S6 table: at every
// error rate llm_proxy serves at least what direct serves less 5 points,
// and sends no more attempts per request than its budget's bound (the
// "(≤ x)" of the attempts column). The smoke run has 100 requests a point,
// so direct's own share is known to ±10 points (two standard deviations at
// 50%): the served target is checked with that allowance; the attempts
// target exactly.
func checkStormTargets(t *testing.T, tables [][][]string) {
	t.Helper()
	for _, tb := range tables {
		cols := map[string]int{}
		for i, c := range tb[0] {
			cols[c] = i
		}
		bc, ok := cols["target: llm_proxy attempts ≤ 1 + ratio + floor"]
		if !ok {
			continue
		}
		for _, row := range tb[1:] {
			if len(row) <= bc {
				t.Fatalf("S6 row %q is short", row)
			}
			la, ls, ok1 := stormCell(row[cols["llm_proxy"]])
			_, ds, ok2 := stormCell(row[cols["direct"]])
			var bound float64
			_, err := fmt.Sscanf(row[bc][strings.Index(row[bc], "(≤ "):], "(≤ %f)", &bound)
			if !ok1 || !ok2 || err != nil {
				t.Fatalf("S6 row %q: cells not as expected (%v)", row, err)
			}
			if ls < ds-5-10 {
				t.Errorf("S6 at %s: llm_proxy served %.0f%%, direct %.0f%%: below direct − 5 points (and the smoke run's ±10)", row[0], ls, ds)
			}
			if la > bound {
				t.Errorf("S6 at %s: llm_proxy sent %.2f attempts per request, over its budget's bound %.2f", row[0], la, bound)
			}
		}
		return
	}
	t.Error("no S6 table with the targets")
}

// markdownTables returns the tables of a markdown document: each a header
// row and data rows of trimmed cells (the separator row dropped).
func markdownTables(doc string) [][][]string {
	var tables [][][]string
	var cur [][]string
	flush := func() {
		if len(cur) > 1 {
			tables = append(tables, cur)
		}
		cur = nil
	}
	for line := range strings.SplitSeq(doc, "\n") {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, "|") {
			flush()
			continue
		}
		var cells []string
		for _, c := range strings.Split(strings.Trim(line, "|"), "|") {
			cells = append(cells, strings.TrimSpace(c))
		}
		if strings.Trim(strings.Join(cells, ""), "-: ") == "" {
			continue // the separator row
		}
		cur = append(cur, cells)
	}
	flush()
	return tables
}

// tail returns the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
