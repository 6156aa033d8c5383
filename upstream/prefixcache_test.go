package upstream

import (
	"fmt"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/prefix"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/saturation"
)

// prefixLog records PrefixCache's decisions.
type prefixLog struct {
	mu      sync.Mutex
	results []PrefixResult
	matched []int
}

func (l *prefixLog) PrefixRouted(m, _ int, r PrefixResult) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.results, l.matched = append(l.results, r), append(l.matched, m)
}

func (l *prefixLog) last() (int, PrefixResult) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.matched[len(l.matched)-1], l.results[len(l.results)-1]
}

// chat is one conversation: a long system prompt of its own and turns.
type chat struct{ segs []string }

func newChat(id int) *chat {
	return &chat{segs: []string{fmt.Sprintf("conversation %03d. ", id) + strings.Repeat("You are a careful, concise assistant. ", 160)}}
}

// turn adds a user message and returns the prompt of the turn.
func (c *chat) turn() []string {
	c.segs = append(c.segs, fmt.Sprintf("question %d: %s", len(c.segs), strings.Repeat("why? ", 60)))
	return slices.Clone(c.segs)
}

// reply adds the assistant's answer to the conversation.
func (c *chat) reply() {
	c.segs = append(c.segs, "answer: "+strings.Repeat("because. ", 50))
}

func pickPrompt(p *Pool, segs []string, tried ...string) (proxy.Upstream, error) {
	return p.Pick(httptest.NewRecorder(), httptest.NewRequest("POST", "/", nil), proxy.PickRequest{Tried: tried,
		Prompt: func(yield func(string) bool) {
			for _, s := range segs {
				if !yield(s) {
					return
				}
			}
		}})
}

func mustPickPrompt(t *testing.T, p *Pool, segs []string, tried ...string) proxy.Upstream {
	t.Helper()
	up, err := pickPrompt(p, segs, tried...)
	if err != nil {
		t.Fatal(err)
	}
	return up
}

var fleet3 = []string{"10.0.21.1:8000", "10.0.21.2:8000", "10.0.21.3:8000"}

func prefixPool(t *testing.T, reg *Registry, sel *PrefixCache, addrs ...string) *Pool {
	return startPool(t, reg, Config{Key: "prefix|" + strings.Join(addrs, ","), Static: targets(addrs...), Selector: sel,
		Breaker: &breaker.Settings{ConsecutiveFailures: 1, OpenFor: time.Hour, MinOpen: -1}})
}

func TestPrefixCacheKeepsEachConversationOnOneUpstream(t *testing.T) {
	log := &prefixLog{}
	p := prefixPool(t, NewRegistry(nil), &PrefixCache{Observer: log}, fleet3...)
	homes := map[string]int{}
	for id := range 12 {
		c := newChat(id)
		home := ""
		for turn := range 4 {
			up := mustPickPrompt(t, p, c.turn())
			if turn == 0 {
				home = up.Addr
				homes[home]++
				if _, r := log.last(); r != PrefixMiss {
					t.Fatalf("conversation %d's first turn routed as %v, want miss", id, r)
				}
			} else {
				if up.Addr != home {
					t.Fatalf("conversation %d turn %d went to %s, its prefix is on %s", id, turn, up.Addr, home)
				}
				if m, r := log.last(); r != PrefixHit || m < 20 {
					t.Fatalf("conversation %d turn %d: %v with %d blocks matched, want a hit of the ~23-block system prompt", id, turn, r, m)
				}
			}
			up.Done(nil)
			c.reply()
		}
	}
	// The first turns went by rendezvous hash among idle upstreams: all
	// three get some of the twelve conversations.
	if len(homes) != 3 {
		t.Fatalf("conversations' homes %v: want all three upstreams used", homes)
	}
}

func TestPrefixCacheLongestMatchWins(t *testing.T) {
	reg := NewRegistry(nil)
	p := prefixPool(t, reg, &PrefixCache{BlockChars: 64}, fleet3...)
	c := newChat(1)
	system := c.turn()[:1]
	// 10.0.21.1 saw the system prompt alone; 10.0.21.3 saw the first turn.
	for addr, segs := range map[string][]string{fleet3[0]: system, fleet3[2]: c.segs} {
		e, _ := reg.Entry(addr)
		e.prefixIndex(0).Insert(prefix.Keys(64, segs...))
	}
	c.reply()
	up := mustPickPrompt(t, p, c.turn())
	defer up.Done(nil)
	if up.Addr != fleet3[2] {
		t.Fatalf("picked %s, want %s, which holds the longest prefix", up.Addr, fleet3[2])
	}
}

func TestPrefixCacheOverflowsToLeastLoadedBeyondTheBound(t *testing.T) {
	log := &prefixLog{}
	p := prefixPool(t, NewRegistry(nil), &PrefixCache{Observer: log}, fleet3...)
	c := newChat(7)
	first := mustPickPrompt(t, p, c.turn())
	home := first.Addr
	first.Done(nil)
	c.reply()
	// Hold n other attempts on the home upstream (in-flight load; the
	// others are idle): with load factor 2 it keeps the conversation with
	// 2 in flight (load ≤ 2 × (0 + one request)), not with 3.
	var held []proxy.Upstream
	defer func() {
		for _, up := range held {
			up.Done(nil)
		}
	}()
	hold := func(n int) {
		for len(held) < n {
			up := mustPickPrompt(t, p, c.segs) // the same prefix: goes home
			if up.Addr != home {
				t.Fatalf("holding load: went to %s, not home %s", up.Addr, home)
			}
			held = append(held, up)
		}
	}
	hold(2)
	up := mustPickPrompt(t, p, c.turn())
	if m, r := log.last(); up.Addr != home || r != PrefixHit || m == 0 {
		t.Fatalf("with 2 in flight home: %s (%v, %d blocks), want home %s (hit)", up.Addr, r, m, home)
	}
	up.Done(nil)
	hold(3)
	moved := mustPickPrompt(t, p, c.turn())
	if m, r := log.last(); moved.Addr == home || r != PrefixOverloaded || m != 0 {
		t.Fatalf("with 3 in flight home: %s (%v, %d blocks), want another upstream (overloaded, 0 blocks)", moved.Addr, r, m)
	}
	moved.Done(nil)
	// The index learned the new home, which now holds the longer prefix.
	for _, h := range held {
		h.Done(nil)
	}
	held = nil
	c.reply()
	next := mustPickPrompt(t, p, c.turn())
	defer next.Done(nil)
	if next.Addr != moved.Addr {
		t.Fatalf("the next turn went to %s, want the new home %s", next.Addr, moved.Addr)
	}
}

// Two gateways that never talk send every new conversation to the same
// upstream, whatever the order of their upstream lists; removing an
// upstream moves only the conversations it would have taken.
func TestPrefixCacheRendezvousAgreesAcrossIndependentGateways(t *testing.T) {
	a := prefixPool(t, NewRegistry(nil), &PrefixCache{}, fleet3...)
	b := prefixPool(t, NewRegistry(nil), &PrefixCache{}, fleet3[2], fleet3[0], fleet3[1])
	two := prefixPool(t, NewRegistry(nil), &PrefixCache{}, fleet3[0], fleet3[1])
	for id := range 60 {
		prompt := newChat(100 + id).turn()
		ua, ub, u2 := mustPickPrompt(t, a, prompt), mustPickPrompt(t, b, prompt), mustPickPrompt(t, two, prompt)
		if ua.Addr != ub.Addr {
			t.Fatalf("conversation %d: gateway a chose %s, gateway b %s", id, ua.Addr, ub.Addr)
		}
		if ua.Addr != fleet3[2] && u2.Addr != ua.Addr {
			t.Fatalf("conversation %d moved from %s to %s when %s left", id, ua.Addr, u2.Addr, fleet3[2])
		}
		ua.Done(nil)
		ub.Done(nil)
		u2.Done(nil)
	}
}

func TestPrefixCacheNeverBeatsAnOpenBreaker(t *testing.T) {
	log := &prefixLog{}
	reg := NewRegistry(nil)
	p := prefixPool(t, reg, &PrefixCache{Observer: log}, fleet3...)
	c := newChat(3)
	up := mustPickPrompt(t, p, c.turn())
	home := up.Addr
	up.Done(nil)
	c.reply()
	fail(mustPickPrompt(t, p, c.turn())) // opens home's breaker (1 failure)
	if s := breakerOf(t, reg, home, "").State(); s != breaker.Open {
		t.Fatalf("home breaker %v, want open", s)
	}
	next := mustPickPrompt(t, p, c.turn())
	defer next.Done(nil)
	if next.Addr == home {
		t.Fatal("picked the upstream whose breaker is open")
	}
	if _, r := log.last(); r != PrefixMiss {
		t.Fatalf("routed as %v, want miss (no candidate holds the prefix)", r)
	}
}

func TestPrefixCacheRoutesAroundASaturatedHome(t *testing.T) {
	reg := NewRegistry(nil)
	p := satPool(t, reg, &PrefixCache{}, nil, fleet3...)
	feeders := map[string]*feeder{}
	for _, a := range fleet3 {
		feeders[a] = newFeeder(t, p, a)
		feeders[a].scrape(time.Second, idle())
	}
	c := newChat(5)
	up := mustPickPrompt(t, p, c.turn())
	home := up.Addr
	up.Done(nil)
	c.reply()
	// Home's queue is full (6 waiting ≥ queue_threshold 5): saturated.
	feeders[home].scrape(time.Second, saturation.Readings{Waiting: saturation.Known(6), Running: saturation.Known(4), KVUsage: saturation.Known(0.5)})
	for turn := range 3 {
		up := mustPickPrompt(t, p, c.turn())
		if up.Addr == home {
			t.Fatalf("turn %d went to the saturated home %s", turn, home)
		}
		up.Done(nil)
		c.reply()
	}
	// Unsaturated again: the conversation stays where its later turns went
	// (the index learned the longer prefix there).
	feeders[home].scrape(time.Second, idle())
	up = mustPickPrompt(t, p, c.turn())
	defer up.Done(nil)
	if up.Addr == home {
		t.Fatalf("went back to %s, which holds only the shorter prefix", home)
	}
}

func TestPrefixIndexSurvivesReload(t *testing.T) {
	reg := NewRegistry(nil)
	cfg := Config{Key: "reload", Static: targets(fleet3...), Selector: &PrefixCache{}}
	p := startPool(t, reg, cfg)
	c := newChat(9)
	up := mustPickPrompt(t, p, c.turn())
	home := up.Addr
	up.Done(nil)
	c.reply()
	cfg.Selector = &PrefixCache{} // the new config's own policy
	p = reload(t, p, cfg)
	// Load the home a little so that, without the index, a least-loaded
	// choice would go elsewhere.
	e, _ := reg.Entry(home)
	if e.PrefixBlocks() == 0 {
		t.Fatal("the reload dropped the home's index")
	}
	busy := mustPickPrompt(t, p, c.segs)
	defer busy.Done(nil)
	next := mustPickPrompt(t, p, c.turn())
	defer next.Done(nil)
	if next.Addr != home {
		t.Fatalf("after reload the turn went to %s, its prefix is on %s", next.Addr, home)
	}
}

func TestPrefixCacheWithoutPromptIsLeastLoaded(t *testing.T) {
	log := &prefixLog{}
	p := prefixPool(t, NewRegistry(nil), &PrefixCache{Observer: log}, fleet3...)
	seen := map[string]bool{}
	var ups []proxy.Upstream
	for range 3 {
		up := mustPickPrompt(t, p, []string{"hi"}) // shorter than a block
		seen[up.Addr] = true
		ups = append(ups, up)
	}
	for _, up := range ups {
		up.Done(nil)
	}
	if len(seen) != 3 {
		t.Fatalf("three held picks of a short prompt went to %v, want three upstreams", seen)
	}
	if _, r := log.last(); r != PrefixMiss {
		t.Fatalf("a prompt without a block routed as %v, want miss", r)
	}
	up := mustPick(t, p, "") // no prompt at all
	up.Done(nil)
}

func TestPrefixCacheValidate(t *testing.T) {
	for _, tc := range []struct {
		s  *PrefixCache
		ok bool
	}{
		{&PrefixCache{}, true},
		{&PrefixCache{BlockChars: 64, MaxBlocks: 100, LoadFactor: 1}, true},
		{&PrefixCache{LoadFactor: 0.5}, false},
		{&PrefixCache{BlockChars: -1}, false},
	} {
		if err := tc.s.Validate(); (err == nil) != tc.ok {
			t.Errorf("%+v: Validate() = %v", tc.s, err)
		}
	}
}

// BenchmarkPrefixCachePick is one pick of a 3-upstream pool for the fourth
// turn of a conversation with a 6,000-character system prompt (~33 blocks).
func BenchmarkPrefixCachePick(b *testing.B) {
	p, err := NewRegistry(nil).NewPool(Config{Key: "bench", Static: targets(fleet3...), Selector: &PrefixCache{}})
	if err != nil {
		b.Fatal(err)
	}
	defer p.Release()
	p.Activate()
	c := newChat(1)
	for range 3 {
		c.turn()
		c.reply()
	}
	segs := c.turn()
	w, r := httptest.NewRecorder(), httptest.NewRequest("POST", "/", nil)
	req := proxy.PickRequest{Prompt: func(yield func(string) bool) {
		for _, s := range segs {
			if !yield(s) {
				return
			}
		}
	}}
	b.ReportAllocs()
	for b.Loop() {
		up, err := p.Pick(w, r, req)
		if err != nil {
			b.Fatal(err)
		}
		up.Done(nil)
	}
}
