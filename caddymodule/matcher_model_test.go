package caddymodule

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/tidwall/match"

	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

func TestModelMatcherCaddyfile(t *testing.T) {
	cases := []struct {
		src      string
		patterns []string
		maxBody  int64
		err      string
	}{
		{src: "llm_model llama-70b*", patterns: []string{"llama-70b*"}},
		{src: "llm_model a b?c", patterns: []string{"a", "b?c"}},
		{src: "llm_model llama-8b* {\n max_body 1MiB\n}", patterns: []string{"llama-8b*"}, maxBody: 1 << 20},
		{src: "llm_model a\nllm_model b", patterns: []string{"a", "b"}},
		{src: "llm_model", err: "at least one model pattern"},
		{src: "llm_model a {\n max_body\n}", err: "wrong argument count"},
		{src: "llm_model a {\n max_body many\n}", err: "bad max_body"},
		{src: "llm_model a {\n max_body 0\n}", err: "bad max_body"},
		{src: "llm_model a {\n size 1MiB\n}", err: "unrecognized llm_model option"},
	}
	for _, tc := range cases {
		var m MatchModel
		err := m.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.src))
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: error %v, want one containing %q", tc.src, err, tc.err)
			}
			continue
		}
		if err != nil || strings.Join(m.Patterns, " ") != strings.Join(tc.patterns, " ") || m.MaxBody != tc.maxBody {
			t.Errorf("%q: patterns %q max_body %d, %v; want %q %d", tc.src, m.Patterns, m.MaxBody, err, tc.patterns, tc.maxBody)
		}
	}
}

// A site's named matcher adapts to the module's JSON and provisions.
func TestModelMatcherAdaptsAndProvisions(t *testing.T) {
	src := `{
	admin off
}
:8080 {
	@big llm_model llama-70b* {
		max_body 2MiB
	}
	handle @big {
		llm_proxy 127.0.0.1:9001
	}
	handle {
		llm_proxy 127.0.0.1:9002
	}
}`
	out, err := adapt(t, src)
	if err != nil {
		t.Fatal(err)
	}
	if want := `"match":[{"llm_model":{"patterns":["llama-70b*"],"max_body":2097152}}]`; !bytes.Contains(out, []byte(want)) {
		t.Fatalf("adapted JSON lacks %s:\n%s", want, out)
	}
	if err := caddy.Validate(mustConfig(t, out)); err != nil {
		t.Fatalf("provisioning: %v", err)
	}
}

// newMatcher is a provisioned-like matcher over its own budget.
func newMatcher(t *testing.T, maxBody, budget int64, patterns ...string) (*MatchModel, *proxy.BodyBudget) {
	t.Helper()
	b, err := proxy.NewBodyBudget(budget, 0)
	if err != nil {
		t.Fatal(err)
	}
	m := &MatchModel{Patterns: patterns, MaxBody: maxBody, budget: b}
	if err := m.Validate(); err != nil {
		t.Fatal(err)
	}
	return m, b
}

// countingBody counts reads of the client's body.
type countingBody struct {
	io.Reader
	reads int
}

func (c *countingBody) Read(p []byte) (int, error) { c.reads++; return c.Reader.Read(p) }
func (c *countingBody) Close() error               { return nil }

func modelRequest(ctx context.Context, body string) (*http.Request, *countingBody) {
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body)).WithContext(ctx)
	r.Header.Set("Content-Type", "application/json")
	cb := &countingBody{Reader: strings.NewReader(body)}
	r.Body = cb
	return r, cb
}

// The matcher matches by the body's model, reads the client's body once
// however many llm_model matchers look at it, and leaves the identical
// bytes for the handlers after it.
func TestModelMatcherMatchesAndRestoresBody(t *testing.T) {
	big, budget := newMatcher(t, 0, 1<<20, "llama-70b*", "*/Llama-3.1-70B*")
	small := &MatchModel{Patterns: []string{"llama-8b*"}, budget: budget}
	cases := []struct {
		body     string
		big, sml bool
	}{
		{body: `{"model":"llama-70b-instruct","messages":[{"role":"user","content":"hi"}]}`, big: true},
		{body: `{"model":"meta-llama/Llama-3.1-70B-Instruct","stream":true}`, big: true},
		{body: `{"model":"llama-8b","prompt":"x"}`, sml: true},
		{body: `{"model":"LLAMA-70B"}`},                           // case-sensitive
		{body: `{"model":"llama-70b","model":"llama-8b"}`},        // ambiguous: matches nothing
		{body: `{"Model":"llama-70b"}`},                           // not the field servers read
		{body: `{"model":"llama-70b",`},                           // invalid JSON
		{body: `{"prompt":"no model"}`},                           // no model
		{body: `{"model":7}`},                                     // not a string
		{body: "{\"model\" : \"llama-8b\\u0031\" }\n", sml: true}, // escapes decoded, bytes kept
	}
	for _, tc := range cases {
		ctx, cancel := context.WithCancel(context.Background())
		r, cb := modelRequest(ctx, tc.body)
		gotBig, err1 := big.MatchWithError(r)
		reads := cb.reads
		gotSmall, err2 := small.MatchWithError(r)
		if err1 != nil || err2 != nil || gotBig != tc.big || gotSmall != tc.sml {
			t.Errorf("%s: big %v small %v (%v, %v); want %v %v", tc.body, gotBig, gotSmall, err1, err2, tc.big, tc.sml)
		}
		if cb.reads != reads {
			t.Errorf("%s: the second matcher read the client's body again", tc.body)
		}
		rest, _ := io.ReadAll(r.Body)
		if string(rest) != tc.body {
			t.Errorf("%s: the handlers after the matcher read %q", tc.body, rest)
		}
		cancel()
	}
}

// The matcher reads a body as its path's API does: a Responses or Messages
// request matches by its model whatever Chat would make of its other
// fields (a Responses "max_tokens" is not its limit, so its type does not
// matter there).
func TestModelMatcherReadsTheAPIOfThePath(t *testing.T) {
	m, _ := newMatcher(t, 0, 1<<20, "llama-70b*")
	const body = `{"model":"llama-70b","max_tokens":"n/a","input":[{"role":"user","content":"hi"}]}`
	for path, want := range map[string]bool{
		"/v1/responses":        true,
		"/v1/chat/completions": false, // a string max_tokens is invalid in Chat
		"/v1/messages":         false, // and in Messages
	} {
		r, _ := modelRequest(context.Background(), body)
		r.URL.Path = path
		if got, err := m.MatchWithError(r); err != nil || got != want {
			t.Errorf("%s: match %v (%v), want %v", path, got, err, want)
		}
	}
	r, _ := modelRequest(context.Background(), `{"model":"llama-70b-instruct","max_tokens":1024,"system":[{"type":"text","text":"be brief"}],"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}`)
	r.URL.Path = "/anthropic/v1/messages"
	if got, err := m.MatchWithError(r); err != nil || !got {
		t.Errorf("a Messages request did not match: %v", err)
	}
}

// A body over max_body ends the request with 413 (declared or not); one
// that does not fit the body budget with 503; nothing stays charged.
func TestModelMatcherRefusals(t *testing.T) {
	m, budget := newMatcher(t, 100, 1000, "*")
	body := `{"model":"m","prompt":"` + strings.Repeat("x", 200) + `"}`
	for _, declared := range []bool{true, false} {
		r, _ := modelRequest(context.Background(), body)
		if !declared {
			r.ContentLength = -1
		}
		_, err := m.MatchWithError(r)
		if he, ok := errors.AsType[caddyhttp.HandlerError](err); !ok || he.StatusCode != http.StatusRequestEntityTooLarge {
			t.Fatalf("declared %v: error %v, want a 413 HandlerError", declared, err)
		}
	}
	if budget.InUse() != 0 {
		t.Fatalf("%d bytes left charged by refused bodies", budget.InUse())
	}

	m, _ = newMatcher(t, 0, 100, "*")
	_, err := m.MatchWithError(func() *http.Request { r, _ := modelRequest(context.Background(), body); return r }())
	if he, ok := errors.AsType[caddyhttp.HandlerError](err); !ok || he.StatusCode != http.StatusRequestEntityTooLarge {
		t.Fatalf("body larger than the whole budget: %v, want 413", err)
	}
	m, budget = newMatcher(t, 0, 1000, "*")
	hold, _ := modelRequest(context.Background(), body)
	ctx, cancel := context.WithCancel(context.Background())
	hold = hold.WithContext(ctx)
	if _, err := m.MatchWithError(hold); err != nil {
		t.Fatal(err)
	}
	r, _ := modelRequest(context.Background(), strings.Repeat(" ", 500)+body)
	_, err = m.MatchWithError(r)
	if he, ok := errors.AsType[caddyhttp.HandlerError](err); !ok || he.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("budget full: %v, want 503", err)
	}
	cancel() // the request ends: its charge goes back
	budgetFree(t, budget)
}

func budgetFree(t *testing.T, b *proxy.BodyBudget) {
	t.Helper()
	for range 1_000_000 {
		if b.InUse() == 0 {
			return
		}
		runtime.Gosched()
	}
	t.Fatalf("%d bytes still charged after the request ended", b.InUse())
}

// Uploads (multipart, binary, media) are not read and match nothing.
func TestModelMatcherLeavesUploadsUnread(t *testing.T) {
	m, _ := newMatcher(t, 0, 1<<20, "*")
	r, cb := modelRequest(context.Background(), `{"model":"m"}`)
	r.Header.Set("Content-Type", "multipart/form-data; boundary=x")
	if ok, err := m.MatchWithError(r); ok || err != nil || cb.reads != 0 {
		t.Fatalf("multipart: match %v, %v, %d reads; want no match and no read", ok, err, cb.reads)
	}
}

// FuzzModelMatcher: whatever the body, the matcher does not panic, leaves
// the identical bytes, and matches exactly when ParseRequest finds a model
// that the glob matches.
func FuzzModelMatcher(f *testing.F) {
	for _, s := range []string{`{"model":"llama-70b"}`, `{"model":"llama-70b","model":"x"}`, `{"model":"a\u002fb"}`, `{"model":null}`, ``, `[1]`, `{"model":"x"`} {
		f.Add([]byte(s), "llama-*")
	}
	f.Fuzz(func(t *testing.T, body []byte, pattern string) {
		if pattern == "" {
			return
		}
		m, _ := newMatcher(t, 1<<16, 1<<20, pattern)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		r, _ := modelRequest(ctx, string(body))
		ok, err := m.MatchWithError(r)
		if len(body) > 1<<16 {
			return
		}
		if err != nil {
			t.Fatalf("error %v", err)
		}
		rest, _ := io.ReadAll(r.Body)
		if !bytes.Equal(rest, body) {
			t.Fatalf("body %q left as %q", body, rest)
		}
		info, perr := proxy.ParseRequest(body)
		matched, stopped := match.MatchLimit(info.Model, pattern, matchEffort)
		want := perr == nil && info.Model != "" && matched && !stopped
		if ok != want {
			t.Fatalf("body %q pattern %q: match %v, want %v", body, pattern, ok, want)
		}
	})
}
