package main

import (
	"encoding/json"
	"math"
	"testing"
)

// A /mock/stats answer cut down to what llmload reads, with fields it
// ignores: a completed request, a hedge loser cancelled after 2 tokens, a
// straggler cancelled before its first token, one still in flight and one
// ended by a fault.
const mockStatsJSON = `{"replicas":[
 {"index":1,"addr":"127.0.0.1:9302","requests":3,"completed":1,"cancelled":1,"faults":{"cut":1},"in_flight":0,
  "recent":[
   {"outcome":"completed","tokens_sent":16,"started":"2025-01-01T00:00:00Z","ended":"2025-01-01T00:00:00.5Z"},
   {"outcome":"cancelled","tokens_sent":2,"started":"2025-01-01T00:00:00Z","ended":"2025-01-01T00:00:00.25Z"},
   {"outcome":"fault:cut","tokens_sent":8,"started":"2025-01-01T00:00:00Z","ended":"2025-01-01T00:00:01Z"}]},
 {"index":0,"addr":"127.0.0.1:9301","requests":3,"completed":1,"cancelled":1,"faults":{},
  "recent":[
   {"outcome":"completed","tokens_sent":16,"started":"2025-01-01T00:00:00Z","ended":"2025-01-01T00:00:00.5Z"},
   {"outcome":"cancelled","tokens_sent":0,"started":"2025-01-01T00:00:00Z","ended":"2025-01-01T00:00:02Z"},
   {"outcome":"in_flight","tokens_sent":3,"started":"2025-01-01T00:00:00Z"}]}
]}`

func TestSummarizeMockCountsWastedTokens(t *testing.T) {
	var fs mockFleetStats
	if err := json.Unmarshal([]byte(mockStatsJSON), &fs); err != nil {
		t.Fatal(err)
	}
	m := summarizeMock("http://127.0.0.1:9301", &fs)
	if m.Requests != 6 || m.Completed != 2 || m.Cancelled != 2 || m.Faults != 1 || m.Records != 6 {
		t.Fatalf("counts %+v", m)
	}
	// Useful: the two completed (32). Wasted: the loser's 2 and the cut
	// stream's 8; the request in flight is neither.
	if m.UsefulTokens != 32 || m.WastedTokens != 10 {
		t.Errorf("useful %d wasted %d, want 32 and 10", m.UsefulTokens, m.WastedTokens)
	}
	if got := m.WastedPct(); math.Abs(got-31.25) > 1e-9 {
		t.Errorf("wasted = %v%%, want 31.25%%", got)
	}
	if math.Abs(m.CancelledSeconds-2.25) > 1e-9 {
		t.Errorf("cancelled held %vs, want 2.25s", m.CancelledSeconds)
	}
	if len(m.Replicas) != 2 || m.Replicas[0].Addr != "127.0.0.1:9301" {
		t.Errorf("replicas not sorted by address: %+v", m.Replicas)
	}
}

func TestWastedPctWithoutUsefulTokens(t *testing.T) {
	m := MockSummary{WastedTokens: 5}
	if m.WastedPct() != 0 {
		t.Fatalf("%v", m.WastedPct())
	}
}

func TestMockBaseDropsThePathAndRefusesRemote(t *testing.T) {
	got, err := mockBase("http://127.0.0.1:9301/mock/stats", false)
	if err != nil || got != "http://127.0.0.1:9301" {
		t.Fatalf("mockBase = %q, %v", got, err)
	}
	if _, err := mockBase("http://10.0.0.1:9301", false); err == nil {
		t.Fatal("a remote mock was accepted without --allow-remote")
	}
}
