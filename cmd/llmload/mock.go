package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"time"
)

// The mock fleet's statistics endpoints (internal/mockllm): any replica
// answers for the whole fleet.
const (
	mockStatsPath = "/mock/stats"
	mockResetPath = "/mock/reset"
)

// Outcomes of a request record in the mock's statistics.
const (
	mockCompleted = "completed"
	mockCancelled = "cancelled"
)

// mockFleetStats is the part of GET /mock/stats that llmload reads. The
// types are declared here, not imported, so that llmload speaks to the mock
// over HTTP only, as to any server.
type mockFleetStats struct {
	Replicas []mockReplicaStats `json:"replicas"`
}

type mockReplicaStats struct {
	Addr      string             `json:"addr"`
	Requests  int64              `json:"requests"`
	Completed int64              `json:"completed"`
	Cancelled int64              `json:"cancelled"`
	Faults    map[string]int64   `json:"faults"`
	InFlight  int                `json:"in_flight"`
	Recent    []mockRequestEntry `json:"recent"`
}

type mockRequestEntry struct {
	Started    time.Time `json:"started"`
	Ended      time.Time `json:"ended"`
	Outcome    string    `json:"outcome"`
	TokensSent int       `json:"tokens_sent"`
}

// MockReplica is what one mock replica counted during a run.
type MockReplica struct {
	Addr      string `json:"addr"`
	Requests  int64  `json:"requests"`
	Completed int64  `json:"completed"`
	Cancelled int64  `json:"cancelled"`
}

// MockSummary is what the mock fleet counted during a run (its statistics
// are reset just before the run starts).
type MockSummary struct {
	URL string `json:"url"`
	// Requests counts the completion requests the fleet received (exact:
	// counters, not records); with a gateway in front, its upstream
	// attempts. Completed were answered in full, Cancelled were abandoned
	// by their client (a hedge's loser, a client that hung up), Faults
	// ended by an injected fault.
	Requests  int64 `json:"requests"`
	Completed int64 `json:"completed"`
	Cancelled int64 `json:"cancelled"`
	Faults    int64 `json:"faults"`
	// Records is how many per-request records the token counts below come
	// from: the mock keeps the last 1000 per replica, so Records <
	// Requests means the token counts cover only the latest requests.
	Records int64 `json:"records"`
	// UsefulTokens are the tokens sent on requests answered in full;
	// WastedTokens those sent on requests that were not (cancelled or
	// faulted): generated for nobody.
	UsefulTokens int64 `json:"useful_tokens"`
	WastedTokens int64 `json:"wasted_tokens"`
	// CancelledSeconds is the total time cancelled requests were held by
	// the fleet, from arrival to cancellation (queue, prefill, stall).
	CancelledSeconds float64 `json:"cancelled_seconds"`
	// Replicas is sorted by address.
	Replicas []MockReplica `json:"replicas"`
}

// summarizeMock condenses the fleet's statistics.
func summarizeMock(base string, fs *mockFleetStats) MockSummary {
	m := MockSummary{URL: base}
	for _, r := range fs.Replicas {
		m.Requests += r.Requests
		m.Completed += r.Completed
		m.Cancelled += r.Cancelled
		for _, n := range r.Faults {
			m.Faults += n
		}
		m.Replicas = append(m.Replicas, MockReplica{Addr: r.Addr, Requests: r.Requests, Completed: r.Completed, Cancelled: r.Cancelled})
		for _, e := range r.Recent {
			m.Records++
			switch e.Outcome {
			case mockCompleted:
				m.UsefulTokens += int64(e.TokensSent)
			case "in_flight":
				// Not over yet: neither useful nor wasted so far.
			default:
				m.WastedTokens += int64(e.TokensSent)
			}
			if e.Outcome == mockCancelled && !e.Ended.IsZero() && e.Ended.After(e.Started) {
				m.CancelledSeconds += e.Ended.Sub(e.Started).Seconds()
			}
		}
	}
	sort.Slice(m.Replicas, func(i, j int) bool { return m.Replicas[i].Addr < m.Replicas[j].Addr })
	return m
}

// WastedPct is the wasted tokens as a percentage of the useful ones.
func (m *MockSummary) WastedPct() float64 {
	if m.UsefulTokens == 0 {
		return 0
	}
	return 100 * float64(m.WastedTokens) / float64(m.UsefulTokens)
}

// mockBase checks and normalizes the --mock URL: the scheme and host of a
// replica, any path dropped.
func mockBase(raw string, allowRemote bool) (string, error) {
	u, err := checkTarget(raw, allowRemote)
	if err != nil {
		return "", err
	}
	return (&url.URL{Scheme: u.Scheme, Host: u.Host}).String(), nil
}

// resetMock clears the fleet's statistics (POST /mock/reset).
func resetMock(ctx context.Context, client *http.Client, base string) error {
	_, err := mockCall(ctx, client, http.MethodPost, base+mockResetPath)
	return err
}

// fetchMock reads the fleet's statistics (GET /mock/stats).
func fetchMock(ctx context.Context, client *http.Client, base string) (*mockFleetStats, error) {
	b, err := mockCall(ctx, client, http.MethodGet, base+mockStatsPath)
	if err != nil {
		return nil, err
	}
	var fs mockFleetStats
	if err := json.Unmarshal(b, &fs); err != nil {
		return nil, fmt.Errorf("mock stats %s: %w", base+mockStatsPath, err)
	}
	return &fs, nil
}

func mockCall(ctx context.Context, client *http.Client, method, u string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, u, nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("mock %s %s: %w", method, u, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 256<<20))
	if err != nil {
		return nil, fmt.Errorf("mock %s %s: %w", method, u, err)
	}
	if resp.StatusCode/100 != 2 {
		return nil, fmt.Errorf("mock %s %s: status %d: %s", method, u, resp.StatusCode, truncate(strings.TrimSpace(string(b)), 200))
	}
	return b, nil
}
