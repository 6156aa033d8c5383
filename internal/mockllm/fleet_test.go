package mockllm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

func TestCancellationIsRecordedPromptly(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	r := f.Replica(0)
	for _, tc := range []struct {
		name    string
		headers []string
		events  int // events to read before hanging up
	}{
		{"between tokens", []string{"X-Mock-Token-Interval: 10s", "X-Mock-Tokens: 3"}, 2},
		{"during ttft", []string{"X-Mock-TTFT: 10s", "X-Mock-Fault: comment_every=1h"}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r.ResetStats()
			ctx, cancel := context.WithCancel(context.Background())
			resp, err := post(t, client(t), ctx, r.URL()+"/v1/chat/completions", chatBody, tc.headers...)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			buf := make([]byte, 1)
			seen := 0
			var last byte
			for seen < tc.events {
				if _, err := resp.Body.Read(buf); err != nil {
					t.Fatal(err)
				}
				if buf[0] == '\n' && last == '\n' {
					seen++
				}
				last = buf[0]
			}
			hungUp := time.Now()
			cancel()
			var rec RequestRecord
			waitFor(t, time.Second, "cancellation", func() bool {
				rec = r.Stats().Recent[0]
				return rec.Outcome == OutcomeCancelled
			})
			if d := rec.Ended.Sub(hungUp); d > 100*time.Millisecond {
				t.Errorf("cancellation recorded %s after the client hung up", d)
			}
			if s := r.Stats(); s.Cancelled != 1 || s.InFlight != 0 || s.Running != 0 {
				t.Errorf("stats %+v", s)
			}
		})
	}
}

func TestCapacityQueuesFIFOWithFlatTokenInterval(t *testing.T) {
	const (
		ttft     = 60 * time.Millisecond
		interval = 10 * time.Millisecond
		tokens   = 3
	)
	b := Behavior{TTFT: Fixed(ttft), Tokens: tokens, TokenInterval: interval}
	f := startFleet(t, FleetConfig{Behavior: b, Capacity: 1})
	r := f.Replica(0)
	c := client(t)
	type result struct {
		first time.Time // first token event
		gaps  []time.Duration
	}
	results := make([]result, 3)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := post(t, c, context.Background(), r.URL()+"/v1/chat/completions", chatBody)
			if err != nil {
				t.Error(err)
				return
			}
			defer resp.Body.Close()
			er := newEventReader(resp.Body)
			var prev time.Time
			for {
				d, err := er.next()
				if err != nil || d == "[DONE]" {
					break
				}
				now := time.Now()
				if strings.Contains(d, `"role"`) {
					continue
				}
				if prev.IsZero() {
					results[i].first = now
				} else {
					results[i].gaps = append(results[i].gaps, now.Sub(prev))
				}
				prev = now
			}
		}()
		// Let each request take its place in the queue before the next
		// is sent, so that the FIFO order is known. (InFlight counts a
		// request before it is queued: waiting on it let the check below
		// see the third request in flight but not yet waiting.)
		waitFor(t, time.Second, "the request to be queued", func() bool {
			s := r.Stats()
			return s.Running+s.Waiting == i+1
		})
	}
	if s := r.Stats(); s.Running != 1 || s.Waiting != 2 {
		t.Errorf("while queued: running %d, waiting %d", s.Running, s.Waiting)
	}
	wg.Wait()
	// Request k waits for the k requests before it, each holding the slot
	// for ttft + (tokens-1)*interval; the token interval does not change.
	// Delays on a loaded machine only add, so lower bounds are tight and
	// upper bounds generous.
	hold := ttft + (tokens-1)*interval
	for i, res := range results {
		want := time.Duration(i)*hold + ttft
		if got := res.first.Sub(start); got < want-5*time.Millisecond || got > want+250*time.Millisecond {
			t.Errorf("request %d: first token after %s, want about %s", i, got, want)
		}
		if i > 0 && !res.first.After(results[i-1].first) {
			t.Errorf("request %d started before request %d", i, i-1)
		}
		if len(res.gaps) != tokens-1 {
			t.Errorf("request %d: %d gaps", i, len(res.gaps))
			continue
		}
		// The last token cannot leave the mock before its slot's start +
		// ttft + (tokens-1) intervals, however late the client reads the
		// first: a bound on the sum of the gaps that a slow reader cannot
		// shrink (the gaps alone can: a first token read late makes the
		// next gap short).
		last := res.first
		for _, g := range res.gaps {
			last = last.Add(g)
		}
		wantLast := want + (tokens-1)*interval
		if got := last.Sub(start); got < wantLast-5*time.Millisecond || got > wantLast+250*time.Millisecond {
			t.Errorf("request %d: last token after %s (gaps %v), want about %s", i, got, res.gaps, wantLast)
		}
	}
	if got := results[2].first.Sub(start); got < 3*ttft {
		t.Errorf("third request's first token after %s, want at least 3x %s", got, ttft)
	}
}

func TestQueuedRequestLeavesQueueWhenCancelled(t *testing.T) {
	b := Behavior{TTFT: Fixed(time.Hour)}
	f := startFleet(t, FleetConfig{Behavior: b, Capacity: 1})
	r := f.Replica(0)
	c := client(t)
	ctx1, cancel1 := context.WithCancel(context.Background())
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel1()
	for _, ctx := range []context.Context{ctx1, ctx2} {
		go func() {
			resp, err := post(t, c, ctx, r.URL()+"/v1/chat/completions", chatBody)
			if err == nil {
				resp.Body.Close()
			}
		}()
	}
	waitFor(t, time.Second, "one running, one waiting", func() bool { s := r.Stats(); return s.Running == 1 && s.Waiting == 1 })
	cancel2()
	waitFor(t, time.Second, "the waiter to leave", func() bool { s := r.Stats(); return s.Waiting == 0 && s.Cancelled == 1 })
	cancel1()
	waitFor(t, time.Second, "the slot to be free", func() bool { s := r.Stats(); return s.Running == 0 && s.InFlight == 0 })
}

func TestStragglersReplaceTTFT(t *testing.T) {
	b := fast
	b.Straggler = Straggler{Fraction: 1, Min: 80 * time.Millisecond, Max: 90 * time.Millisecond}
	f := startFleet(t, FleetConfig{Behavior: b})
	start := time.Now()
	resp, err := post(t, client(t), context.Background(), f.Replica(0).URL()+"/v1/chat/completions", chatBody, "X-Mock-Tokens: 1")
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp.Body)
	resp.Body.Close()
	if d := time.Since(start); d < 80*time.Millisecond || d > time.Second {
		t.Errorf("straggler took %s", d)
	}
}

func TestConsecutivePorts(t *testing.T) {
	var f *Fleet
	var err error
	for range 10 {
		ln, lerr := net.Listen("tcp", "127.0.0.1:0")
		if lerr != nil {
			t.Fatal(lerr)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		if port > 65000 {
			continue
		}
		f, err = StartFleet(FleetConfig{Listen: "127.0.0.1:" + strconv.Itoa(port), Replicas: 3, Behavior: fast})
		if err != nil {
			continue // a neighbouring port is taken; try elsewhere
		}
		defer f.Close()
		want := []string{}
		for i := range 3 {
			want = append(want, fmt.Sprintf("127.0.0.1:%d", port+i))
		}
		if got := f.Addrs(); strings.Join(got, " ") != strings.Join(want, " ") {
			t.Fatalf("addrs %v, want %v", got, want)
		}
		return
	}
	t.Fatalf("no free port range: %v", err)
}

func TestMockEndpoints(t *testing.T) {
	f := startFleet(t, FleetConfig{Replicas: 2, Behavior: fast})
	c := client(t)
	r1 := f.Replica(1)
	get := func(url string) (int, string) {
		resp, err := c.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		return resp.StatusCode, string(readAll(t, resp.Body))
	}
	do := func(method, url, body string) (int, string) {
		req, _ := http.NewRequest(method, url, strings.NewReader(body))
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		return resp.StatusCode, string(readAll(t, resp.Body))
	}

	if code, body := get(r1.URL() + "/health"); code != 200 || body != "" {
		t.Errorf("health: %d %q", code, body)
	}
	if code, body := do(http.MethodPut, r1.URL()+"/mock/behavior", "ttft=0; tokens=2; health_status=503; model=other"); code != 200 || !strings.Contains(body, "tokens=2") {
		t.Fatalf("put behavior: %d %q", code, body)
	}
	if code, _ := get(r1.URL() + "/health"); code != 503 {
		t.Errorf("health after put: %d", code)
	}
	if code, _ := do(http.MethodPut, r1.URL()+"/mock/behavior", `{"ttft":"0","tokens":3,"fault":"status=500"}`); code != 200 {
		t.Errorf("put JSON behavior: %d", code)
	}
	if got := r1.Behavior(); got.Tokens != 3 || got.Fault.Status != 500 || got.TTFT != Fixed(0) {
		t.Errorf("behavior after JSON put: %+v", got)
	}
	if code, _ := do(http.MethodPut, r1.URL()+"/mock/behavior", "ttft=soon"); code != 400 {
		t.Errorf("bad put: %d", code)
	}
	if code, body := get(r1.URL() + "/mock/behavior"); code != 200 || strings.TrimSpace(body) != "ttft=0; tokens=3; fault=status=500" {
		t.Errorf("get behavior: %d %q", code, body)
	}
	if f.Replica(0).Behavior() != fast {
		t.Error("PUT /mock/behavior changed another replica")
	}

	code, body := get(f.Replica(0).URL() + "/v1/models")
	var models struct {
		Object string `json:"object"`
		Data   []struct {
			ID     string `json:"id"`
			Object string `json:"object"`
		} `json:"data"`
	}
	if err := json.Unmarshal([]byte(body), &models); err != nil || code != 200 || models.Object != "list" || len(models.Data) != 1 || models.Data[0].ID != DefaultModel {
		t.Errorf("models: %d %s", code, body)
	}

	resp, err := post(t, c, context.Background(), f.Replica(0).URL()+"/v1/chat/completions", chatBody)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp.Body)
	resp.Body.Close()
	code, body = get(r1.URL() + "/mock/stats")
	var stats FleetStats
	if err := json.Unmarshal([]byte(body), &stats); err != nil || code != 200 || len(stats.Replicas) != 2 {
		t.Fatalf("stats: %d %s", code, body)
	}
	if s := stats.Replicas[0]; s.Requests != 1 || s.Completed != 1 || s.Addr != f.Addrs()[0] || len(s.Recent) != 1 {
		t.Errorf("replica 0 stats %+v", s)
	}
	if code, _ := do(http.MethodPost, r1.URL()+"/mock/reset", ""); code != http.StatusNoContent {
		t.Errorf("reset: %d", code)
	}
	if s := f.Stats().Replicas[0]; s.Requests != 0 || len(s.Recent) != 0 || len(s.BodySHA256) != 0 {
		t.Errorf("after reset: %+v", s)
	}
	if code, body := get(r1.URL() + "/nope"); code != 404 || body != `{"detail":"Not Found"}` {
		t.Errorf("unknown path: %d %s", code, body)
	}
}

func TestMetricsUseVLLMNames(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast, Capacity: 4})
	c := client(t)
	resp, err := post(t, c, context.Background(), f.Replica(0).URL()+"/v1/chat/completions", chatBody)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp.Body)
	resp.Body.Close()
	resp, err = c.Get(f.Replica(0).URL() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body := string(readAll(t, resp.Body))
	for _, want := range []string{
		`vllm:num_requests_running{model_name="mock-llama"} 0`,
		`vllm:num_requests_waiting{model_name="mock-llama"} 0`,
		`vllm:kv_cache_usage_perc{model_name="mock-llama"} 0`,
		`vllm:time_to_first_token_seconds_count{model_name="mock-llama"} 1`,
		`vllm:time_to_first_token_seconds_bucket{model_name="mock-llama",le="0.001"} 0`,
		`vllm:request_success_total{finished_reason="stop",model_name="mock-llama"} 1`,
		`vllm:generation_tokens_total{model_name="mock-llama"} 5`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
	if t.Failed() {
		t.Log(body)
	}
}

func TestStopRefusesConnectionsUntilStart(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	r := f.Replica(0)
	c := client(t)
	if err := r.Stop(); err != nil {
		t.Fatal(err)
	}
	_, err := post(t, c, context.Background(), r.URL()+"/v1/chat/completions", chatBody)
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("err %v, want connection refused", err)
	}
	if err := r.Start(); err != nil {
		t.Fatal(err)
	}
	resp, err := post(t, c, context.Background(), r.URL()+"/v1/chat/completions", chatBody)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d after restart", resp.StatusCode)
	}
}

func TestShutdownWaitsThenCloses(t *testing.T) {
	f, err := StartFleet(FleetConfig{Behavior: fast})
	if err != nil {
		t.Fatal(err)
	}
	c := client(t)
	errc := make(chan error, 1)
	go func() {
		_, err := post(t, c, context.Background(), f.Replica(0).URL()+"/v1/chat/completions", chatBody, "X-Mock-Fault: hang")
		errc <- err
	}()
	waitFor(t, time.Second, "the request", func() bool { return f.Stats().Replicas[0].InFlight == 1 })
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := f.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("shutdown: %v", err)
	}
	if err := <-errc; err == nil {
		t.Error("hanging request succeeded")
	}
}

func TestStartFleetRejectsBadConfig(t *testing.T) {
	for _, cfg := range []FleetConfig{
		{Replicas: -1},
		{Capacity: -1},
		{Listen: "nonsense"},
		{Replicas: 2, PerReplica: map[int]Behavior{2: {}}},
		{Behavior: Behavior{TokenBytes: -1}},
		{Behavior: Behavior{Fault: Fault{Kind: "explode"}}},
	} {
		if f, err := StartFleet(cfg); err == nil {
			f.Close()
			t.Errorf("StartFleet(%+v) succeeded", cfg)
		}
	}
}

// eventReader reads SSE data payloads one at a time.
type eventReader struct {
	r   io.Reader
	buf []byte
}

func newEventReader(r io.Reader) *eventReader { return &eventReader{r: r} }

func (e *eventReader) next() (string, error) {
	for {
		if i := strings.Index(string(e.buf), "\n\n"); i >= 0 {
			ev := string(e.buf[:i])
			e.buf = e.buf[i+2:]
			if d, ok := strings.CutPrefix(ev, "data: "); ok {
				return d, nil
			}
			continue
		}
		p := make([]byte, 4096)
		n, err := e.r.Read(p)
		e.buf = append(e.buf, p[:n]...)
		if err != nil && n == 0 {
			return "", err
		}
	}
}
