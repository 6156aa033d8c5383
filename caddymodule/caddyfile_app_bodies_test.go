package caddymodule

import (
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/llmproxy/caddy-llm-proxy/internal/registry"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// max_buffered_bodies takes a size as Caddy's sizes are written; a bad
// one is refused with the directive's name.
func TestMaxBufferedBodiesCaddyfile(t *testing.T) {
	cases := []struct {
		src  string
		want int64
		err  string
	}{
		{src: "llm_proxy {\n max_buffered_bodies 64MiB\n}", want: 64 << 20},
		{src: "llm_proxy {\n max_buffered_bodies 1GB\n}", want: 1_000_000_000},
		{src: "llm_proxy {\n}", want: 0},
		{src: "llm_proxy {\n max_buffered_bodies\n}", err: "wrong argument count"},
		{src: "llm_proxy {\n max_buffered_bodies 0\n}", err: "bad max_buffered_bodies"},
		{src: "llm_proxy {\n max_buffered_bodies lots\n}", err: "bad max_buffered_bodies"},
		{src: "llm_proxy {\n max_buffered_bodies 1MiB 2MiB\n}", err: "wrong argument count"},
	}
	for _, tc := range cases {
		var a App
		err := a.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.src))
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: error %v, want one containing %q", tc.src, err, tc.err)
			}
			continue
		}
		if err != nil || a.MaxBufferedBodies != tc.want {
			t.Errorf("%q: MaxBufferedBodies %d, %v; want %d", tc.src, a.MaxBufferedBodies, err, tc.want)
		}
	}
}

// Configs of the same max_buffered_bodies share one budget (its charges
// survive a reload); the default is 256MiB; a negative size is an error;
// the budget goes with the last config that claims it.
func TestBodyBudgetSharedBySize(t *testing.T) {
	var old, next registry.Claims
	a, _ := bodyBudgetFor(&old, 0)
	b, _ := bodyBudgetFor(&next, proxy.DefaultMaxBufferedBodies)
	c, _ := bodyBudgetFor(&next, 1<<20)
	if a != b || a.Size() != 256<<20 || c == a || c.Size() != 1<<20 {
		t.Fatalf("budgets %p %p %p, sizes %d %d", a, b, c, a.Size(), c.Size())
	}
	if _, err := bodyBudgetFor(&next, -1); err == nil {
		t.Fatal("a negative max_buffered_bodies was accepted")
	}
	old.Release() // the reload's old config
	if got, _ := bodyBudgetFor(&next, 0); got != a {
		t.Fatal("the budget of a size the new config keeps was dropped with the old config")
	}
	next.Release()
	if _, ok := shared.bodies.Peek(strconv.FormatInt(1<<20, 10)); ok {
		t.Fatal("a budget outlived every config that claimed it")
	}
}
