package caddymodule

import (
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// fakeSource is a dynamic upstream source returning fixed addresses.
type fakeSource struct{ dials []string }

func (f fakeSource) GetUpstreams(*http.Request) ([]*reverseproxy.Upstream, error) {
	var out []*reverseproxy.Upstream
	for _, d := range f.dials {
		out = append(out, &reverseproxy.Upstream{Dial: d})
	}
	return out, nil
}

func staticHandler(t *testing.T, sel func(*Handler) reverseproxy.Selector, dials ...string) *Handler {
	t.Helper()
	h := &Handler{dynamicTargets: new(sync.Map), dynamicSweep: new(dynamicSweep)}
	for _, d := range dials {
		tg, err := newTarget(&reverseproxy.Upstream{Dial: d}, new(upstreamState))
		if err != nil {
			t.Fatal(err)
		}
		h.static = append(h.static, tg)
	}
	h.selector = sel(h)
	return h
}

func pick(t *testing.T, b balancer, tried ...string) proxy.Upstream {
	t.Helper()
	up, err := b.Pick(httptest.NewRecorder(), httptest.NewRequest("POST", "/", nil), proxy.PickRequest{Tried: tried})
	if err != nil {
		t.Fatal(err)
	}
	return up
}

func TestPickSkipsTriedUntilAllTried(t *testing.T) {
	h := staticHandler(t, func(*Handler) reverseproxy.Selector { return new(reverseproxy.FirstSelection) },
		"10.0.0.1:8000", "10.0.0.2:8000")
	b := balancer{h: h}
	if got := pick(t, b).Addr; got != "10.0.0.1:8000" {
		t.Fatalf("first pick %s", got)
	}
	if got := pick(t, b, "10.0.0.1:8000").Addr; got != "10.0.0.2:8000" {
		t.Fatalf("after trying the first, got %s", got)
	}
	if got := pick(t, b, "10.0.0.1:8000", "10.0.0.2:8000").Addr; got != "10.0.0.1:8000" {
		t.Fatalf("with all tried, the policy chooses among all again; got %s", got)
	}
}

func TestLeastConnCountsGatewayAttemptsInFlight(t *testing.T) {
	h := staticHandler(t, func(h *Handler) reverseproxy.Selector { return leastConn{inflight: h.inflightOf} },
		"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
	b := balancer{h: h}
	// Three picks without release land on three different upstreams.
	seen := map[string]bool{}
	var ups []proxy.Upstream
	for range 3 {
		up := pick(t, b)
		seen[up.Addr] = true
		ups = append(ups, up)
	}
	if len(seen) != 3 {
		t.Fatalf("least_conn spread 3 in-flight attempts over %d upstreams", len(seen))
	}
	// Release one: the next pick goes to it.
	ups[1].Done(nil)
	if got := pick(t, b).Addr; got != ups[1].Addr {
		t.Fatalf("picked %s, want the idle %s", got, ups[1].Addr)
	}
	for _, tg := range h.static {
		if n := tg.state.inflight.Load(); n != 1 {
			t.Fatalf("%s has %d in flight, want 1", tg.addr, n)
		}
	}
}

func TestRandomChooseAvoidsTheBusierOfTwo(t *testing.T) {
	h := staticHandler(t, func(h *Handler) reverseproxy.Selector { return randomChoose{choose: 2, inflight: h.inflightOf} },
		"10.0.0.1:8000", "10.0.0.2:8000")
	b := balancer{h: h}
	h.static[0].state.inflight.Store(5)
	for range 50 {
		up := pick(t, b)
		if up.Addr != "10.0.0.2:8000" {
			t.Fatalf("random_choose 2 over both upstreams picked the busier one")
		}
		up.Done(nil)
	}
}

func TestDynamicSourceTargetsAreReused(t *testing.T) {
	h := &Handler{dynamicTargets: new(sync.Map), dynamicSweep: new(dynamicSweep), dynamic: fakeSource{dials: []string{"10.0.0.7:8000", "10.0.0.8:8000"}}}
	h.selector = leastConn{inflight: h.inflightOf}
	b := balancer{h: h}
	a := pick(t, b)
	c := pick(t, b, a.Addr)
	if a.Addr == c.Addr {
		t.Fatalf("the second pick should avoid the tried %s", a.Addr)
	}
	if n := h.inflightOf(&reverseproxy.Upstream{Dial: a.Addr}); n != 1 {
		t.Fatalf("in flight for dynamic %s = %d, want 1", a.Addr, n)
	}
	a.Done(nil)
	c.Done(nil)
	if n := h.inflightOf(&reverseproxy.Upstream{Dial: c.Addr}); n != 0 {
		t.Fatalf("in flight after release = %d", n)
	}
}

func TestParseUpstreamAddr(t *testing.T) {
	cases := []struct{ in, dial, scheme string }{
		{"10.0.0.1:8000", "10.0.0.1:8000", ""},
		{"http://10.0.0.1:8000", "10.0.0.1:8000", "http"},
		{"https://vllm.internal", "vllm.internal:443", "https"},
		{"http://vllm.internal", "vllm.internal:80", "http"},
		{"h2c://10.0.0.1:8000", "10.0.0.1:8000", "h2c"},
		{"[::1]:8000", "[::1]:8000", ""},
		{"unix//run/vllm.sock", "unix//run/vllm.sock", ""},
	}
	for _, tc := range cases {
		dial, scheme, err := parseUpstreamAddr(tc.in)
		if err != nil || dial != tc.dial || scheme != tc.scheme {
			t.Errorf("parseUpstreamAddr(%q) = %q, %q, %v; want %q, %q", tc.in, dial, scheme, err, tc.dial, tc.scheme)
		}
	}
}
