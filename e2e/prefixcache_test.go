package e2e

// End-to-end tests of lb_policy prefix_cache (issue 21): a mock fleet whose
// replicas model vLLM's prefix cache (an LRU of prompt blocks; a missed
// block costs prefill time), multi-turn conversations with long system
// prompts, and the gateway routing each turn to the replica holding its
// conversation's prefix — unless health or saturation say otherwise.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// prefixFleet is three replicas with a prefix cache of 4,000 blocks each
// (every conversation of a run fits: a miss is never an eviction), 10ms
// base TTFT and 5ms of prefill per missed 64-byte block: a 6,000-character
// system prompt costs about 480ms when missed, so that the prefill, not the
// machine's scheduling noise, makes the TTFT.
func prefixFleet(t *testing.T, capacity int) *mockllm.Fleet {
	return startFleet(t, mockllm.FleetConfig{Replicas: 3, Capacity: capacity,
		Behavior:    mockllm.Behavior{TTFT: mockllm.Fixed(10 * time.Millisecond), Tokens: 4, TokenInterval: time.Millisecond},
		PrefixCache: mockllm.PrefixCacheConfig{Blocks: 4000, PrefillPerBlock: 5 * time.Millisecond}})
}

// conversation is one multi-turn chat with a 6,000-character system prompt
// of its own.
type conversation struct {
	id   int
	msgs []map[string]string
}

func newConversation(run string, id int) *conversation {
	head := fmt.Sprintf("[%s: conversation %02d] You are assistant %02d. ", run, id, id)
	rule := fmt.Sprintf("Rule %02d: answer precisely, cite your sources, keep it short. ", id)
	sys := head + strings.Repeat(rule, 6000/len(rule)+1)
	return &conversation{id: id, msgs: []map[string]string{{"role": "system", "content": sys[:6000]}}}
}

// ask adds the user's next question and returns the request body.
func (c *conversation) ask(turn int) string {
	c.msgs = append(c.msgs, map[string]string{"role": "user", "content": fmt.Sprintf("Question %d of conversation %d: %s", turn, c.id, strings.Repeat("and why? ", 20))})
	b, _ := json.Marshal(map[string]any{"model": "mock-llama", "stream": true, "messages": c.msgs})
	return string(b)
}

// answered adds the assistant's answer to the conversation.
func (c *conversation) answered(turn int) {
	c.msgs = append(c.msgs, map[string]string{"role": "assistant", "content": fmt.Sprintf("Answer %d: %s", turn, strings.Repeat("because. ", 30))})
}

// turnResult is one turn as its client saw it.
type turnResult struct {
	conv, turn int
	replica    string
	ttft       time.Duration
	problem    string // "" when the stream was served in full
}

// runTurns runs turns [from, to) of every conversation, workers of them at
// once, each conversation's turns in order.
func runTurns(ctx context.Context, c *http.Client, url string, convs []*conversation, from, to, workers int) []turnResult {
	var mu sync.Mutex
	var out []turnResult
	next := make(chan *conversation)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for cv := range next {
				for turn := from; turn < to; turn++ {
					r := turnResult{conv: cv.id, turn: turn}
					s, err := doStream(ctx, c, url, cv.ask(turn), "X-Mock-Tokens: 4", "X-Mock-Token-Interval: 1ms")
					for try := 1; err != nil && handOffLost(err) && try <= 3; try++ {
						// A reload's listener hand-off resets a connection
						// queued on the old listener before any handler saw
						// it; the SDKs send such a request again, as here.
						time.Sleep(time.Duration(try) * 20 * time.Millisecond)
						s, err = doStream(ctx, c, url, cv.ask(turn), "X-Mock-Tokens: 4", "X-Mock-Token-Interval: 1ms")
					}
					switch {
					case err != nil:
						r.problem = err.Error()
					case s.Status != http.StatusOK:
						r.problem = fmt.Sprintf("status %d: %s", s.Status, raw(s.Events))
					case s.Err != nil || len(s.dataEvents()) == 0 || !s.Events[len(s.Events)-1].IsDone():
						r.problem = fmt.Sprintf("stream cut: %v", s.Err)
					default:
						r.replica = s.Header.Get("X-Mock-Replica")
						r.ttft = s.dataEvents()[0].At.Sub(s.Sent)
					}
					cv.answered(turn)
					mu.Lock()
					out = append(out, r)
					mu.Unlock()
				}
			}
		})
	}
	for _, cv := range convs {
		next <- cv
	}
	close(next)
	wg.Wait()
	return out
}

func conversations(run string, n int) []*conversation {
	out := make([]*conversation, n)
	for i := range out {
		out[i] = newConversation(run, i)
	}
	return out
}

// fleetHitRatio is the share of prompt blocks the fleet's prefix caches
// found, since the fleet started.
func fleetHitRatio(f *mockllm.Fleet) float64 {
	var q, h int64
	for _, r := range f.Replicas() {
		rq, rh := r.PrefixCacheStats()
		q, h = q+rq, h+rh
	}
	return float64(h) / float64(max(q, 1))
}

// policyRun is what one policy did with 18 conversations of 4 turns.
type policyRun struct {
	hitRatio  float64
	meanTTFT  time.Duration
	byReplica map[string]int
	results   []turnResult
}

func runPolicy(t *testing.T, policy string) policyRun {
	fleet := prefixFleet(t, 0)
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet)+" {\n\t\tlb_policy "+policy+"\n\t}")
	c := newClient(t)
	ctx := testContext(t, 2*time.Minute)
	rs := runTurns(ctx, c, gw.URL+"/v1/chat/completions", conversations(policy, 18), 0, 4, 6)
	run := policyRun{hitRatio: fleetHitRatio(fleet), byReplica: map[string]int{}, results: rs}
	var sum time.Duration
	for _, r := range rs {
		if r.problem != "" {
			t.Errorf("%s: conversation %d turn %d: %s", policy, r.conv, r.turn, r.problem)
			continue
		}
		sum += r.ttft
		run.byReplica[r.replica]++
	}
	run.meanTTFT = sum / time.Duration(max(len(rs), 1))
	return run
}

// TestPrefixCacheKeepsConversationsWhereTheirPrefixIs: 18 conversations of
// 4 turns with 6,000-character system prompts, 6 at a time, on three
// replicas with a prefix cache: prefix_cache finds at least 0.65 of the
// prompt blocks in cache and 1.5 × what round_robin finds, its mean TTFT is
// at most 0.6 × round_robin's, and no replica takes more than half the
// requests. It does not run in parallel with the other tests: it compares
// mean TTFTs, which CPU contention would blur.
func TestPrefixCacheKeepsConversationsWhereTheirPrefixIs(t *testing.T) {
	rr := runPolicy(t, "round_robin")
	pc := runPolicy(t, "prefix_cache")
	if t.Failed() {
		return
	}
	t.Logf("round_robin:  hit ratio %.2f, mean TTFT %v, requests %v", rr.hitRatio, rr.meanTTFT, rr.byReplica)
	t.Logf("prefix_cache: hit ratio %.2f, mean TTFT %v, requests %v", pc.hitRatio, pc.meanTTFT, pc.byReplica)
	if pc.hitRatio < 0.65 || pc.hitRatio < 1.5*rr.hitRatio {
		t.Errorf("prefix_cache hit ratio %.3f, want ≥ 0.65 and ≥ 1.5 × round_robin's %.3f", pc.hitRatio, rr.hitRatio)
	}
	if float64(pc.meanTTFT) > 0.6*float64(rr.meanTTFT) {
		t.Errorf("prefix_cache mean TTFT %v, want ≤ 0.6 × round_robin's %v", pc.meanTTFT, rr.meanTTFT)
	}
	if len(pc.byReplica) != 3 {
		t.Errorf("prefix_cache used replicas %v, want all three", pc.byReplica)
	}
	for addr, n := range pc.byReplica {
		if n > len(pc.results)/2 {
			t.Errorf("replica %s took %d of %d requests, want at most half", addr, n, len(pc.results))
		}
	}
	// Each conversation's later turns stay on one replica, save a move
	// when its replica was loaded beyond the bound.
	moves := 0
	last := map[int]string{}
	for _, r := range pc.results {
		if prev, ok := last[r.conv]; ok && prev != r.replica {
			moves++
		}
		last[r.conv] = r.replica
	}
	t.Logf("prefix_cache: %d moves of a conversation to another replica", moves)
	if moves > 6 {
		t.Errorf("conversations changed replica %d times in 54 later turns, want a few at most", moves)
	}
}

// homes returns, for each conversation, the replica that served its turn
// (of results holding one turn per conversation).
func homes(rs []turnResult) map[int]string {
	out := map[int]string{}
	for _, r := range rs {
		out[r.conv] = r.replica
	}
	return out
}

func checkServed(t *testing.T, what string, rs []turnResult) {
	t.Helper()
	for _, r := range rs {
		if r.problem != "" {
			t.Errorf("%s: conversation %d turn %d: %s", what, r.conv, r.turn, r.problem)
		}
	}
}

// TestPrefixCacheRoutesAroundASaturatedReplica: the replica holding some
// conversations' prefixes has a full queue (load from another client); while
// it stays saturated it receives at most two of the gateway's requests, and
// every turn is served.
func TestPrefixCacheRoutesAroundASaturatedReplica(t *testing.T) {
	t.Parallel()
	fleet := prefixFleet(t, 2)
	gw := startGateway(t, satSite(fleet, "interval 200ms", "lb_policy prefix_cache"))
	c := newClient(t)
	ctx := testContext(t, 2*time.Minute)
	url := gw.URL + "/v1/chat/completions"
	convs := conversations("saturated", 9)
	first := runTurns(ctx, c, url, convs, 0, 1, 1)
	checkServed(t, "first turns", first)
	held := map[string]int{}
	for _, addr := range homes(first) {
		held[addr]++
	}
	hot := homes(first)[0]
	var replica *mockllm.Replica
	for _, r := range fleet.Replicas() {
		if r.Addr() == hot {
			replica = r
		}
	}
	if replica == nil {
		t.Fatalf("conversation 0's replica %q is not in the fleet", hot)
	}
	// 2 running and 6 waiting, for 10s: queue 6 ≥ queue_threshold 5.
	load := startDirectLoad(t, replica, 8, false, "", "X-Mock-Tokens: 1000", "X-Mock-Token-Interval: 10ms")
	defer load.stop()
	if v, ok := gw.waitSaturation(hot, 5*time.Second, func(v satView) bool { return v.ScoreKnown && v.Score >= 1 }); !ok {
		t.Fatalf("the loaded replica never read saturated: %+v", v)
	}
	before := replica.Stats().Requests
	rest := runTurns(ctx, c, url, convs, 1, 4, 3)
	got := replica.Stats().Requests - before
	checkServed(t, "later turns", rest)
	if v := gw.saturation()[hot]; !v.ScoreKnown || v.Score < 1 {
		t.Fatalf("the replica stopped being saturated during the turns (%+v): the test proves nothing", v)
	}
	t.Logf("conversations per replica after the first turn: %v; the saturated %s got %d of %d later turns", held, hot, got, len(rest))
	if got > 2 {
		t.Errorf("the saturated replica received %d of the gateway's requests while saturated, want at most 2", got)
	}
	// The decisions are counted, and the scraper reports each serving
	// replica's own hit ratio next to them.
	samples := gw.scrapeMetrics()
	if hits, _ := metricValue(samples, "caddy_llm_proxy_prefix_routed_total", map[string]string{"result": "hit"}); hits < 1 {
		t.Errorf("caddy_llm_proxy_prefix_routed_total{result=hit} = %v, want the later turns that stayed home", hits)
	}
	if n, _ := metricValue(samples, "caddy_llm_proxy_prefix_match_blocks_count", nil); n != float64(len(first)+len(rest)) {
		t.Errorf("caddy_llm_proxy_prefix_match_blocks_count = %v, want one per pick, %d", n, len(first)+len(rest))
	}
	// The gauge holds each replica's ratio over its latest scrape interval
	// with queries; a replica whose latest such interval held only the
	// first turns of moved conversations reads 0, so at least one of the
	// replicas that served later turns must read a ratio in (0, 1], and
	// none may read outside [0, 1].
	servedLater := map[string]bool{}
	for _, r := range rest {
		servedLater[r.replica] = true
	}
	ratios := map[string]float64{}
	waitFor(3*time.Second, func() bool {
		samples := gw.scrapeMetrics()
		positive := false
		for addr := range servedLater {
			if v, found := metricValue(samples, "caddy_llm_proxy_upstream_prefix_cache_hit_ratio", map[string]string{"upstream": addr}); found {
				ratios[addr] = v
				positive = positive || (v > 0 && v <= 1)
			}
		}
		return positive
	})
	positive := false
	for addr, v := range ratios {
		if v < 0 || v > 1 {
			t.Errorf("caddy_llm_proxy_upstream_prefix_cache_hit_ratio{upstream=%s} = %v, want a ratio in [0, 1]", addr, v)
		}
		positive = positive || v > 0
	}
	if !positive {
		t.Errorf("caddy_llm_proxy_upstream_prefix_cache_hit_ratio of the replicas that served later turns = %v, want one in (0, 1]", ratios)
	}
}

// TestPrefixCacheMovesConversationsOffAnOpenBreaker: the replica holding
// some conversations' prefixes goes down; their next turns fail over to
// another replica without a failed request, its breaker opens, and each
// moved conversation then stays on its new replica.
func TestPrefixCacheMovesConversationsOffAnOpenBreaker(t *testing.T) {
	t.Parallel()
	fleet := prefixFleet(t, 0)
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet)+" {\n\t\tlb_policy prefix_cache\n\t}")
	c := newClient(t)
	ctx := testContext(t, 2*time.Minute)
	url := gw.URL + "/v1/chat/completions"
	convs := conversations("breaker", 9)
	first := runTurns(ctx, c, url, convs, 0, 1, 1)
	checkServed(t, "first turns", first)
	down := homes(first)[0]
	var moved []int
	for conv, addr := range homes(first) {
		if addr == down {
			moved = append(moved, conv)
		}
	}
	for _, r := range fleet.Replicas() {
		if r.Addr() == down {
			if err := r.Stop(); err != nil {
				t.Fatal(err)
			}
		}
	}
	rest := runTurns(ctx, c, url, convs, 1, 4, 1)
	checkServed(t, "later turns", rest)
	if b := gw.breaker(down); b.State != "open" {
		t.Errorf("the stopped replica's breaker is %q, want open", b.State)
	}
	for _, conv := range moved {
		var on []string
		for _, r := range rest {
			if r.conv == conv {
				on = append(on, r.replica)
			}
		}
		if len(on) != 3 || on[0] == down || on[1] != on[0] || on[2] != on[0] {
			t.Errorf("conversation %d (on %s) went to %v for turns 2-4, want one other replica for all three", conv, down, on)
		}
	}
	if len(moved) == 0 {
		t.Fatal("no conversation was on the stopped replica")
	}
}

// TestPrefixCacheIndexSurvivesReload: the index lives with the upstreams'
// entries, so after `caddy reload` (a changed prefix_cache block) every
// conversation's next turn is still routed as a hit to its replica.
func TestPrefixCacheIndexSurvivesReload(t *testing.T) {
	t.Parallel()
	fleet := prefixFleet(t, 0)
	site := func(block string) string {
		return "\tllm_proxy " + upstreams(fleet) + " {\n\t\tlb_policy prefix_cache" + block + "\n\t}"
	}
	gw := startGateway(t, site(""))
	c := newClient(t)
	ctx := testContext(t, 2*time.Minute)
	url := gw.URL + "/v1/chat/completions"
	convs := conversations("reload", 6)
	first := runTurns(ctx, c, url, convs, 0, 1, 1)
	checkServed(t, "first turns", first)
	routed := func(result string) float64 {
		v, _ := metricValue(gw.scrapeMetrics(), "caddy_llm_proxy_prefix_routed_total", map[string]string{"result": result})
		return v
	}
	hits, misses := routed("hit"), routed("miss")
	if misses != 6 || hits != 0 {
		t.Fatalf("first turns routed: %v hits, %v misses; want 6 misses", hits, misses)
	}
	gw.reload(site(" {\n\t\t\tload_factor 3\n\t\t}"))
	c.CloseIdleConnections() // the reload closed the old server's idle connections
	second := runTurns(ctx, c, url, convs, 1, 2, 1)
	checkServed(t, "second turns", second)
	if h, m := routed("hit")-hits, routed("miss")-misses; h != 6 || m != 0 {
		t.Errorf("after the reload the second turns were %v hits and %v misses, want 6 hits: the index must survive the reload", h, m)
	}
	before := homes(first)
	for conv, addr := range homes(second) {
		if addr != before[conv] {
			t.Errorf("conversation %d moved from %s to %s across the reload", conv, before[conv], addr)
		}
	}
}

// TestPrefixCacheGatewaysAgreeWithoutTalking: two gateways in front of one
// fleet, sharing nothing (no fleet block, no Redis), send each new
// conversation's first turn to the same replica: the rendezvous hash of
// the prompt's first block decides among equally loaded replicas.
func TestPrefixCacheGatewaysAgreeWithoutTalking(t *testing.T) {
	t.Parallel()
	fleet := prefixFleet(t, 0)
	a := startGateway(t, "\tllm_proxy "+upstreams(fleet)+" {\n\t\tlb_policy prefix_cache\n\t}")
	// The other gateway lists the replicas in another order.
	addrs := fleet.Addrs()
	b := startGateway(t, "\tllm_proxy "+strings.Join([]string{addrs[2], addrs[0], addrs[1]}, " ")+" {\n\t\tlb_policy prefix_cache\n\t}")
	c := newClient(t)
	ctx := testContext(t, 2*time.Minute)
	viaA := runTurns(ctx, c, a.URL+"/v1/chat/completions", conversations("agree", 12), 0, 1, 1)
	viaB := runTurns(ctx, c, b.URL+"/v1/chat/completions", conversations("agree", 12), 0, 1, 1)
	checkServed(t, "gateway a", viaA)
	checkServed(t, "gateway b", viaB)
	ha, hb := homes(viaA), homes(viaB)
	used := map[string]bool{}
	for conv, addr := range ha {
		used[addr] = true
		if hb[conv] != addr {
			t.Errorf("conversation %d: gateway a chose %s, gateway b %s", conv, addr, hb[conv])
		}
	}
	if len(used) < 2 {
		t.Errorf("12 conversations all went to %v: the hash does not spread them", used)
	}
}
