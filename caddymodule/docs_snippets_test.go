package caddymodule

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"

	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// The documentation's Caddyfile snippets, checked against the grammar so the
// docs cannot drift from the parser. The rules, for whoever writes docs:
//
//   - Every fenced block tagged caddyfile (```caddyfile) in README.md and
//     docs/*.md is a snippet. A block with another tag or none that holds a
//     Caddyfile-looking line (one whose first word is llm_proxy, or a matcher
//     "@name llm_model") fails the test: tag it caddyfile.
//   - A snippet that starts with a global options block ("{") or a site
//     address (":8080 {", "example.com {", "http://…") is a whole Caddyfile
//     and is adapted as it is. Any other snippet is a fragment of a site —
//     a lone "llm_proxy … { … }", a "log { … }", matchers and handle blocks —
//     and is adapted wrapped in a site ":8080 { … }".
//   - A snippet right after the line <!-- caddyfile grammar --> is a grammar
//     summary (placeholders such as <n>, alternatives a|b): it is not
//     adapted. Instead every directive it lists, with the blocks it sits in
//     (llm_proxy > breaker > probe > uri), must appear in some Caddyfile
//     that adapts: a snippet of the docs or a file of caddyfile-examples/.
//     So a grammar line naming a directive the parser no longer knows, or
//     one no working example shows, fails.
//
// Adapting is what `caddy adapt` does (the caddyfile adapter with this
// module registered); provisioning is left to TestExamplesAdaptAndProvision,
// since doc snippets name upstreams, files and keys that exist only on the
// reader's machine. A snippet that does not adapt fails with the markdown
// file and line: the snippet is padded so the adapter's own line numbers
// are the markdown file's.

// docSnippet is one fenced caddyfile block of a markdown file.
type docSnippet struct {
	file    string // path from the repository's root, e.g. docs/caddyfile.md
	line    int    // 1-based line of the opening fence
	body    string // the lines between the fences
	grammar bool   // preceded by the grammar marker
}

const grammarMarker = "<!-- caddyfile grammar -->"

// caddyfileLooking matches a line that only a Caddyfile would hold.
var caddyfileLooking = regexp.MustCompile(`^\s*(llm_proxy\b|@\S+\s+llm_model\b)`)

// docFiles lists README.md and every markdown file under docs/, as paths
// from the repository's root (the test runs in caddymodule/: read them
// through fromRoot).
func docFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(fromRoot("docs/*.md"))
	if err != nil {
		t.Fatal(err)
	}
	out := []string{"README.md"}
	for _, f := range files {
		rel, err := filepath.Rel("..", f)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, filepath.ToSlash(rel))
	}
	return out
}

// fromRoot turns a path from the repository's root into one from the
// test's directory.
func fromRoot(path string) string { return filepath.Join("..", path) }

// readSnippets returns the caddyfile snippets of one markdown file, and an
// error for each fence with another tag that looks like a Caddyfile.
func readSnippets(file string, src string) ([]docSnippet, []error) {
	var (
		snippets []docSnippet
		errs     []error
		lines    = strings.Split(src, "\n")
	)
	for i := 0; i < len(lines); i++ {
		open := strings.TrimSpace(lines[i])
		if !strings.HasPrefix(open, "```") {
			continue
		}
		tag := strings.ToLower(strings.TrimSpace(strings.TrimPrefix(open, "```")))
		start := i
		var body []string
		for i++; i < len(lines) && strings.TrimSpace(lines[i]) != "```"; i++ {
			body = append(body, lines[i])
		}
		s := docSnippet{
			file:    file,
			line:    start + 1,
			body:    strings.Join(body, "\n"),
			grammar: start > 0 && strings.TrimSpace(lines[start-1]) == grammarMarker,
		}
		if tag == "caddyfile" {
			snippets = append(snippets, s)
			continue
		}
		for j, l := range body {
			if caddyfileLooking.MatchString(l) {
				errs = append(errs, fmt.Errorf("%s:%d: a Caddyfile in a fence tagged %q: tag it caddyfile", file, start+2+j, tag))
				break
			}
		}
	}
	return snippets, errs
}

// wholeCaddyfile reports whether a snippet starts with a global options
// block or a site address, rather than with something inside a site.
func wholeCaddyfile(body string) bool {
	for _, l := range strings.Split(body, "\n") {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		if l == "{" {
			return true
		}
		first := strings.Fields(l)[0]
		return strings.HasPrefix(first, ":") || strings.Contains(first, "://") ||
			first == "localhost" || (strings.Contains(first, ".") && strings.HasSuffix(l, "{"))
	}
	return false
}

// snippetSource is the Caddyfile the adapter reads for a snippet: padded
// with newlines so that its tokens keep their markdown line numbers, and
// wrapped in a site when it is a fragment (the site's line is the fence's).
func snippetSource(s docSnippet) string {
	if wholeCaddyfile(s.body) {
		return strings.Repeat("\n", s.line) + s.body + "\n"
	}
	return strings.Repeat("\n", s.line-1) + ":8080 {\n" + s.body + "\n}\n"
}

// adaptAt adapts src as `caddy adapt` does, naming file in its errors.
func adaptAt(src, file string) error {
	_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(src), map[string]any{"filename": file})
	return err
}

// TestDocSnippetsAdapt adapts every Caddyfile snippet of README.md and
// docs/ by the rules above, and checks each grammar summary against the
// Caddyfiles that adapt.
func TestDocSnippetsAdapt(t *testing.T) {
	var all []docSnippet
	for _, f := range docFiles(t) {
		src, err := os.ReadFile(fromRoot(f))
		if err != nil {
			t.Fatal(err)
		}
		snippets, errs := readSnippets(f, string(src))
		for _, err := range errs {
			t.Error(err)
		}
		all = append(all, snippets...)
	}
	if len(all) == 0 {
		t.Fatal("no caddyfile snippets found in README.md and docs/")
	}

	// Directive paths of every Caddyfile that adapts: the examples, then
	// the snippets that are not grammar summaries.
	known := map[string]bool{}
	examples, err := filepath.Glob(fromRoot("caddyfile-examples/*.Caddyfile"))
	if err != nil || len(examples) == 0 {
		t.Fatalf("no examples found: %v", err)
	}
	for _, f := range examples {
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := adaptAt(string(src), f); err != nil {
			t.Errorf("%s does not adapt: %v", f, err)
			continue
		}
		for _, p := range directivePaths(string(src)) {
			known[p.path] = true
		}
	}
	adapted := 0
	for _, s := range all {
		if s.grammar {
			continue
		}
		src := snippetSource(s)
		if err := adaptAt(src, s.file); err != nil {
			t.Errorf("%s:%d: the snippet does not adapt: %v", s.file, s.line, err)
			continue
		}
		adapted++
		for _, p := range directivePaths(src) {
			known[p.path] = true
		}
	}
	grammars := 0
	for _, s := range all {
		if !s.grammar {
			continue
		}
		grammars++
		for _, p := range directivePaths(s.body) {
			if !known[p.path] {
				t.Errorf("%s:%d: grammar lists %q, which no Caddyfile of the docs or caddyfile-examples/ that adapts uses: add a working example, or fix the grammar", s.file, s.line+p.line, p.path)
			}
		}
	}
	t.Logf("%d snippets adapted, %d grammar summaries checked, %d directive paths known", adapted, grammars, len(known))
}

// directivePath is one directive with the blocks it sits in, from its
// llm_proxy (handler or global option) or llm_model matcher down, e.g.
// "llm_proxy > breaker > probe > uri" or "global llm_proxy > tier > rpm".
type directivePath struct {
	path string
	line int // 1-based line within the source
}

// directivePaths lists the directives under every llm_proxy and llm_model
// of a Caddyfile or grammar summary. A grammar line's alternatives
// ("capacity <n> | per_upstream <n>") each count; a block written on one
// line ("transport http { … }") is not entered.
func directivePaths(src string) []directivePath {
	var (
		out   []directivePath
		stack []string // the names of the open blocks, outermost first
	)
	for i, raw := range strings.Split(src, "\n") {
		l := raw
		if j := strings.Index(l, " #"); j >= 0 {
			l = l[:j]
		}
		if j := strings.Index(l, "\t#"); j >= 0 {
			l = l[:j]
		}
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		if l == "}" {
			if len(stack) > 0 {
				stack = stack[:len(stack)-1]
			}
			continue
		}
		opens := strings.HasSuffix(l, "{")
		var names []string
		for _, alt := range strings.Split(l, " | ") {
			f := strings.Fields(alt)
			if len(f) == 0 {
				continue
			}
			name := f[0]
			if strings.HasPrefix(name, "@") && len(f) > 1 && f[1] == "llm_model" {
				name = "llm_model"
			}
			if name == "llm_proxy" && len(stack) == 1 && stack[0] == "{" {
				name = "global llm_proxy"
			}
			names = append(names, name)
		}
		root := slices.IndexFunc(stack, func(s string) bool {
			return s == "llm_proxy" || s == "global llm_proxy" || s == "llm_model"
		})
		for _, name := range names {
			switch {
			case root >= 0:
				out = append(out, directivePath{strings.Join(append(slices.Clone(stack[root:]), name), " > "), i + 1})
			case name == "llm_proxy" || name == "global llm_proxy" || name == "llm_model":
				out = append(out, directivePath{name, i + 1})
			}
		}
		if opens {
			name := "{"
			if len(names) > 0 {
				name = names[0]
			}
			stack = append(stack, name)
		}
	}
	return out
}

// TestDirectivePaths pins the walk the grammar check relies on.
func TestDirectivePaths(t *testing.T) {
	src := "{\n\tllm_proxy {\n\t\ttier gold {\n\t\t\trpm 10 # per minute\n\t\t\tbreaker { … }\n\t\t}\n\t}\n}\n" +
		":8080 {\n\t@big llm_model a* {\n\t\tmax_body 1MiB\n\t}\n\thandle @big {\n\t\tllm_proxy 10.0.0.1:8000 {\n" +
		"\t\t\tadmission {\n\t\t\t\tcapacity <n> | per_upstream <n>\n\t\t\t}\n\t\t\ttransport http { ... }\n\t\t}\n\t}\n}\n"
	var got []string
	for _, p := range directivePaths(src) {
		got = append(got, fmt.Sprintf("%d %s", p.line, p.path))
	}
	want := []string{
		"2 global llm_proxy",
		"3 global llm_proxy > tier",
		"4 global llm_proxy > tier > rpm",
		"5 global llm_proxy > tier > breaker",
		"10 llm_model",
		"11 llm_model > max_body",
		"14 llm_proxy",
		"15 llm_proxy > admission",
		"16 llm_proxy > admission > capacity",
		"16 llm_proxy > admission > per_upstream",
		"18 llm_proxy > transport",
	}
	if !slices.Equal(got, want) {
		t.Errorf("paths:\n got %q\nwant %q", got, want)
	}
}

// TestDocSnippetRules pins how snippets are found and wrapped: a Caddyfile
// in an untagged fence is an error, a fragment is wrapped in a site on the
// fence's line, and adapter errors name the markdown file and line.
func TestDocSnippetRules(t *testing.T) {
	md := "# T\n\n```\nllm_proxy 10.0.0.1:8000\n```\n\n" + grammarMarker + "\n```caddyfile\nllm_proxy <n>\n```\n\n```caddyfile\nllm_proxy 10.0.0.1:8000 {\n\tbogus 1\n}\n```\n"
	snippets, errs := readSnippets("x.md", md)
	if len(errs) != 1 || !strings.Contains(errs[0].Error(), "x.md:4:") {
		t.Errorf("untagged Caddyfile: errors %v, want one at x.md:4", errs)
	}
	if len(snippets) != 2 || !snippets[0].grammar || snippets[1].grammar || snippets[1].line != 12 {
		t.Fatalf("snippets %+v, want a grammar summary and a snippet at line 12", snippets)
	}
	err := adaptAt(snippetSource(snippets[1]), "x.md")
	if err == nil || !strings.Contains(err.Error(), "x.md:14") {
		t.Errorf("adapting a snippet with an unknown subdirective on line 14: %v", err)
	}
	if !wholeCaddyfile("# c\n:8080 {\n}") || !wholeCaddyfile("{\n\tadmin off\n}") || wholeCaddyfile("llm_proxy a:1 {\n}") || wholeCaddyfile("log {\n}") {
		t.Error("wholeCaddyfile misjudges a site, a global block, or a fragment")
	}
}

// markdownLink matches an inline link's target: [text](target).
var markdownLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// headingAnchors returns the anchors GitHub gives the headings of a
// markdown file (outside fences): lower case, letters, digits, '-' and '_'
// kept, spaces turned into '-', everything else dropped; a repeated
// heading gets -1, -2….
func headingAnchors(src string) map[string]bool {
	anchors := map[string]bool{}
	seen := map[string]int{}
	fenced := false
	for _, l := range strings.Split(src, "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "```") {
			fenced = !fenced
			continue
		}
		if fenced || !strings.HasPrefix(l, "#") {
			continue
		}
		text := strings.TrimSpace(strings.TrimLeft(l, "#"))
		var b strings.Builder
		for _, r := range strings.ToLower(text) {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
				b.WriteRune(r)
			}
		}
		a := b.String()
		if n := seen[a]; n > 0 {
			anchors[fmt.Sprintf("%s-%d", a, n)] = true
		} else {
			anchors[a] = true
		}
		seen[a]++
	}
	return anchors
}

// TestDocLinksResolve checks every relative link of README.md and docs/:
// the file or folder exists, and a #fragment names a heading of its page,
// so moving a section cannot leave a dead link behind.
func TestDocLinksResolve(t *testing.T) {
	anchorsOf := map[string]map[string]bool{}
	anchors := func(path string) (map[string]bool, error) {
		if a, ok := anchorsOf[path]; ok {
			return a, nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		anchorsOf[path] = headingAnchors(string(src))
		return anchorsOf[path], nil
	}
	for _, f := range docFiles(t) {
		src, err := os.ReadFile(fromRoot(f))
		if err != nil {
			t.Fatal(err)
		}
		fenced := false
		for i, l := range strings.Split(string(src), "\n") {
			if strings.HasPrefix(strings.TrimSpace(l), "```") {
				fenced = !fenced
				continue
			}
			if fenced {
				continue
			}
			for _, m := range markdownLink.FindAllStringSubmatch(l, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				path, frag, _ := strings.Cut(target, "#")
				rel := f
				if path != "" {
					rel = filepath.ToSlash(filepath.Join(filepath.Dir(f), path))
				}
				full := fromRoot(rel)
				if _, err := os.Stat(full); err != nil {
					t.Errorf("%s:%d: link to %s: %v", f, i+1, target, err)
					continue
				}
				if frag == "" || !strings.HasSuffix(full, ".md") {
					continue
				}
				a, err := anchors(full)
				if err != nil {
					t.Fatal(err)
				}
				if !a[frag] {
					t.Errorf("%s:%d: link to %s: %s has no heading with anchor #%s", f, i+1, target, rel, frag)
				}
			}
		}
	}
}

// fileSection returns the part of a file after the first start and before
// the next end (or the file's end); a file without start fails the test.
func fileSection(t *testing.T, path, start, end string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	_, after, ok := strings.Cut(string(b), start)
	if !ok {
		t.Fatalf("%s has no %q", path, start)
	}
	section, _, _ := strings.Cut(after, end)
	return section
}

// TestPlaceholdersDocListsTheModules: the Placeholders section of
// docs/operating.md names every {http.llm_proxy.*} placeholder that
// Handler.placeholder answers, and README.md and docs/ name no other.
func TestPlaceholdersDocListsTheModules(t *testing.T) {
	body := fileSection(t, "module.go", "func (h *Handler) placeholder(", "\n}\n")
	served := map[string]bool{}
	for _, m := range regexp.MustCompile(`case ((?:"\w+",?\s*)+):`).FindAllStringSubmatch(body, -1) {
		for _, n := range regexp.MustCompile(`"(\w+)"`).FindAllStringSubmatch(m[1], -1) {
			served[n[1]] = true
		}
	}
	if len(served) < 10 {
		t.Fatalf("read only %d placeholders from Handler.placeholder (%v): has it changed its shape?", len(served), served)
	}

	section := fileSection(t, fromRoot("docs/operating.md"), "\n## Placeholders\n", "\n## ")
	for n := range served {
		if !strings.Contains(section, "{http.llm_proxy."+n+"}") {
			t.Errorf("docs/operating.md: the Placeholders section does not list {http.llm_proxy.%s}", n)
		}
	}

	named := regexp.MustCompile(`\{http\.llm_proxy\.(\w+)\}`)
	for _, f := range docFiles(t) {
		b, err := os.ReadFile(fromRoot(f))
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(b), "\n") {
			for _, m := range named.FindAllStringSubmatch(line, -1) {
				if !served[m[1]] {
					t.Errorf("%s:%d names {http.llm_proxy.%s}, which the handler does not set", f, i+1, m[1])
				}
			}
		}
	}
}
