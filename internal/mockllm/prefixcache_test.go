package mockllm

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// chatTurn is the body of turn n of a conversation with system prompt sys.
func chatTurn(sys string, n int) string {
	msgs := []map[string]string{{"role": "system", "content": sys}}
	for i := range n {
		msgs = append(msgs, map[string]string{"role": "user", "content": fmt.Sprintf("question %d", i)})
		if i < n-1 {
			msgs = append(msgs, map[string]string{"role": "assistant", "content": fmt.Sprintf("answer %d", i)})
		}
	}
	b, _ := json.Marshal(map[string]any{"model": "m1", "messages": msgs})
	return string(b)
}

// timeTurn sends body and returns the time to its complete (non-streamed)
// answer.
func timeTurn(t *testing.T, c *http.Client, url, body string) time.Duration {
	t.Helper()
	start := time.Now()
	resp, err := post(t, c, context.Background(), url+"/v1/chat/completions", body, "X-Mock-Tokens: 1", "X-Mock-TTFT: 1ms")
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp.Body)
	resp.Body.Close()
	return time.Since(start)
}

func TestPrefixCacheChargesMissedBlocksAndCountsHits(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast, PrefixCache: PrefixCacheConfig{Blocks: 1000, PrefillPerBlock: 3 * time.Millisecond}})
	r := f.Replica(0)
	c := client(t)
	sys := strings.Repeat("You are terse. ", 400) // 6,000 bytes: ~94 blocks of 64
	cold := timeTurn(t, c, r.URL(), chatTurn(sys, 1))
	q1, h1 := r.PrefixCacheStats()
	if h1 != 0 || q1 < 90 {
		t.Fatalf("first turn: %d blocks queried, %d hit; want ~94, 0", q1, h1)
	}
	warm := timeTurn(t, c, r.URL(), chatTurn(sys, 2))
	q2, h2 := r.PrefixCacheStats()
	if hit := h2 - h1; hit < (q2-q1)-3 {
		t.Fatalf("second turn hit %d of %d blocks, want all but its last few", hit, q2-q1)
	}
	// 94 missed blocks × 3ms ≈ 280ms against a few blocks' prefill.
	if cold < 250*time.Millisecond || warm > cold/3 {
		t.Fatalf("cold turn %v, warm turn %v: want ≥ 250ms and under a third of it", cold, warm)
	}
	body := scrape(t, c, r.URL())
	qs := series(t, body, "vllm:prefix_cache_queries_total").GetCounter().GetValue()
	hs := series(t, body, "vllm:prefix_cache_hits_total").GetCounter().GetValue()
	if qs != float64(q2*16) || hs != float64(h2*16) {
		t.Fatalf("metrics queries %v hits %v, want %d and %d tokens (16 per block)", qs, hs, q2*16, h2*16)
	}
}

func TestPrefixCacheEvictsBeyondItsCapacity(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast, PrefixCache: PrefixCacheConfig{Blocks: 120}})
	r := f.Replica(0)
	c := client(t)
	a, b := strings.Repeat("a", 6000), strings.Repeat("b", 6000) // ~94 blocks each
	timeTurn(t, c, r.URL(), chatTurn(a, 1))
	timeTurn(t, c, r.URL(), chatTurn(b, 1)) // evicts most of a
	_, before := r.PrefixCacheStats()
	timeTurn(t, c, r.URL(), chatTurn(a, 1))
	if _, after := r.PrefixCacheStats(); after-before > 30 {
		t.Fatalf("a hit %d blocks after b filled the 120-block cache, want at most 26", after-before)
	}
}

func TestPrefixCacheOffByDefault(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	r := f.Replica(0)
	c := client(t)
	timeTurn(t, c, r.URL(), chatTurn("sys", 1))
	if q, _ := r.PrefixCacheStats(); q != 0 {
		t.Fatalf("queries %d without a prefix cache", q)
	}
	if strings.Contains(scrape(t, c, r.URL()), "prefix_cache") {
		t.Fatal("/metrics shows prefix cache counters without a prefix cache")
	}
	if _, err := StartFleet(FleetConfig{PrefixCache: PrefixCacheConfig{Blocks: -1}}); err == nil {
		t.Fatal("a negative capacity was accepted")
	}
}
