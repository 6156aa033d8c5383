package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestMetricsDocListsTheModules: the metrics table of docs/operating.md
// names every metric the module registers, and every caddy_llm_proxy_*
// name in README.md and docs/ (benchmarks.md aside: it quotes past runs)
// is one the module registers, so the documentation cannot keep a renamed
// or removed metric.
func TestMetricsDocListsTheModules(t *testing.T) {
	names, histograms := moduleMetrics(t)
	const operating = "../docs/operating.md"
	b, err := os.ReadFile(operating)
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(b), "\n## Metrics\n")
	if !ok {
		t.Fatalf("%s has no \"## Metrics\" section", operating)
	}
	section, _, _ = strings.Cut(section, "\n## ")
	for n := range names {
		if !strings.Contains(section, "`"+n+"`") {
			t.Errorf("%s: the Metrics section does not list %s, which caddymodule registers", operating, n)
		}
	}

	files, err := filepath.Glob("../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	metricName := regexp.MustCompile(`\bcaddy_llm_proxy_[a-z0-9_]+`)
	// Recording rules' names (level:metric:operations) hold metric names.
	recorded := regexp.MustCompile(`[a-z_]+:[a-z0-9_]+(?::[a-z0-9_]+)?`)
	for _, f := range append(files, "../README.md") {
		if filepath.Base(f) == "benchmarks.md" {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(b), "\n") {
			for _, n := range metricName.FindAllString(recorded.ReplaceAllString(line, ""), -1) {
				if names[n] {
					continue
				}
				base := n
				for _, suf := range []string{"_bucket", "_sum", "_count"} {
					if s, ok := strings.CutSuffix(n, suf); ok && histograms[s] {
						base = s
					}
				}
				if !names[base] {
					t.Errorf("%s:%d names %s, which caddymodule does not register", f, i+1, n)
				}
			}
		}
	}
}
