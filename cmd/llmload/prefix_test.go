package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// TestPrefixRunMeasuresTheFleetsHitRatio: conversations sent straight to
// one replica with a prefix cache find their earlier turns there: the run
// reads the hit ratio from the replica's vllm:prefix_cache_* counters,
// counts the requests per replica, and the table shows them.
func TestPrefixRunMeasuresTheFleetsHitRatio(t *testing.T) {
	f, err := mockllm.StartFleet(mockllm.FleetConfig{Listen: "127.0.0.1:0", Seed: 1,
		Behavior:    mockllm.Behavior{TTFT: mockllm.Fixed(time.Millisecond), TokenInterval: time.Millisecond},
		PrefixCache: mockllm.PrefixCacheConfig{Blocks: 5000, PrefillPerBlock: 100 * time.Microsecond}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r := f.Replica(0)
	cfg := PrefixConfig{Mock: r.URL(), Conversations: 3, Turns: 3, SystemChars: 3000, Concurrency: 2, Tokens: 2, Timeout: 10 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	run, err := runPrefixTarget(ctx, newHTTPClient(4), &cfg, OverloadTarget{Name: "direct", URL: r.URL()})
	if err != nil {
		t.Fatal(err)
	}
	// Turn 1 misses its ~48 blocks; turns 2 and 3 find all but their last
	// few: about (0 + 48 + 55) / (48 + 52 + 59).
	if run.Requests != 9 || run.Failed != 0 || run.ByReplica[r.Addr()] != 9 {
		t.Fatalf("requests %d, failed %d, by replica %v; want 9 on %s", run.Requests, run.Failed, run.ByReplica, r.Addr())
	}
	if run.HitRatio < 0.5 || run.HitRatio > 0.8 {
		t.Fatalf("hit ratio %.2f, want about 0.65", run.HitRatio)
	}
	if run.TTFT.Count != 9 || len(run.ttfts) != 9 {
		t.Fatalf("%d TTFTs", run.TTFT.Count)
	}
	md := prefixTable(&PrefixReport{Config: cfg, Runs: []PrefixRun{run}})
	if !strings.Contains(md, "| direct | 0.") || !strings.Contains(md, "9 (100%)") {
		t.Fatalf("table:\n%s", md)
	}
}
