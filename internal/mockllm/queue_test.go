package mockllm

import (
	"context"
	"io"
	"strings"
	"sync"
	"testing"
	"time"
)

// scheduled reports whether s holds its slot.
func scheduled(s *schedReq) bool {
	if s.ready == nil {
		return true
	}
	select {
	case <-s.ready:
		return true
	default:
		return false
	}
}

func TestSchedulerHoldsBlocksForPromptAndGeneratedTokens(t *testing.T) {
	q := newScheduler(0, 10, 16)
	s := q.enqueue(20) // ceil(20/16) = 2 blocks
	if !scheduled(s) || s.waited != 0 {
		t.Fatalf("not scheduled at once: %+v", s)
	}
	for _, tc := range []struct{ tokens, used int }{{21, 2}, {32, 2}, {33, 3}, {48, 3}, {49, 4}, {40, 4}} {
		q.grow(s, tc.tokens)
		if l := q.load(); l.used != tc.used || l.running != 1 {
			t.Errorf("after %d tokens: %+v, want %d blocks used", tc.tokens, l, tc.used)
		}
	}
	if u := q.load().kvUsage(); u != 0.4 {
		t.Errorf("usage %v, want 0.4", u)
	}
	q.release(s)
	if l := q.load(); l.used != 0 || l.running != 0 || l.kvUsage() != 0 {
		t.Errorf("after release: %+v", l)
	}
}

func TestSchedulerWaitsForFreeBlocksInFIFOOrder(t *testing.T) {
	q := newScheduler(0, 4, 16)
	a := q.enqueue(48) // 3 blocks
	b := q.enqueue(32) // needs 2, 1 free: waits although capacity is unlimited
	c := q.enqueue(1)  // needs 1 and would fit, but waits behind b
	if !scheduled(a) || scheduled(b) || scheduled(c) {
		t.Fatalf("scheduled a=%v b=%v c=%v, want a only", scheduled(a), scheduled(b), scheduled(c))
	}
	if l := q.load(); l.running != 1 || l.waiting != 2 || l.used != 3 {
		t.Errorf("load %+v", l)
	}
	q.release(a)
	if !scheduled(b) || !scheduled(c) {
		t.Fatalf("after a's release: b=%v c=%v", scheduled(b), scheduled(c))
	}
	if b.waited <= 0 || c.waited <= 0 {
		t.Errorf("queue times %v, %v: want above 0", b.waited, c.waited)
	}
	if l := q.load(); l.running != 2 || l.waiting != 0 || l.used != 3 {
		t.Errorf("load %+v", l)
	}
}

func TestSchedulerGrowthOvercommitsAndHoldsBackNewRequests(t *testing.T) {
	q := newScheduler(0, 2, 1)
	a := q.enqueue(1)
	q.grow(a, 5) // no preemption: granted past the cache
	if l := q.load(); l.used != 5 || l.kvUsage() != 1 {
		t.Errorf("load %+v, usage %v", l, l.kvUsage())
	}
	b := q.enqueue(1)
	if scheduled(b) {
		t.Fatal("scheduled into an overcommitted cache")
	}
	q.release(a)
	if !scheduled(b) {
		t.Fatal("not scheduled once the cache emptied")
	}
}

func TestSchedulerRunsAPromptLargerThanTheCacheAlone(t *testing.T) {
	q := newScheduler(0, 4, 16)
	big := q.enqueue(1000)
	if !scheduled(big) {
		t.Fatal("an oversized prompt on an idle replica waits forever")
	}
	small := q.enqueue(1)
	if scheduled(small) {
		t.Fatal("scheduled beside an oversized prompt")
	}
	q.release(big)
	if !scheduled(small) {
		t.Fatal("not scheduled after the oversized prompt ended")
	}
	q.release(small)
	a := q.enqueue(16)
	big = q.enqueue(1000) // waits for the replica to be idle
	if scheduled(big) {
		t.Fatal("an oversized prompt scheduled beside another request")
	}
	q.release(a)
	if !scheduled(big) {
		t.Fatal("an oversized prompt not scheduled on an idle replica")
	}
}

func TestSchedulerAbandonedHeadLetsOthersThrough(t *testing.T) {
	q := newScheduler(0, 4, 16)
	a := q.enqueue(48)
	b := q.enqueue(32)
	c := q.enqueue(16)
	q.abandon(b)
	if !scheduled(c) {
		t.Fatal("c still held back by an abandoned b")
	}
	if l := q.load(); l.running != 2 || l.waiting != 0 || l.used != 4 {
		t.Errorf("load %+v", l)
	}
	q.release(a)
	q.release(c)
	if l := q.load(); l.running != 0 || l.used != 0 {
		t.Errorf("load %+v", l)
	}
}

func TestSchedulerCapacityAndCacheSizeChangesScheduleWaiters(t *testing.T) {
	q := newScheduler(1, 4, 16)
	a := q.enqueue(16)
	b := q.enqueue(16)
	if scheduled(b) {
		t.Fatal("capacity 1 ran two requests")
	}
	q.setCapacity(2)
	if !scheduled(b) {
		t.Fatal("not scheduled after the capacity grew")
	}
	c := q.enqueue(48) // 3 blocks, 2 free
	q.setCapacity(0)
	if scheduled(c) {
		t.Fatal("scheduled without the blocks")
	}
	q.setBlocks(8)
	if !scheduled(c) {
		t.Fatal("not scheduled after the cache grew")
	}
	for _, s := range []*schedReq{a, b, c} {
		q.release(s)
	}
	if l := q.load(); l.blocks != 8 || l.used != 0 || l.running != 0 {
		t.Errorf("load %+v", l)
	}
	if q.setBlocks(0); q.load().blocks != DefaultKVBlocks {
		t.Errorf("setBlocks(0): %d blocks, want %d", q.load().blocks, DefaultKVBlocks)
	}
}

// chatPromptTokens is the prompt estimate of chatBody's messages.
var chatPromptTokens = promptTokens([]byte(`[{"role":"user","content":"hi"}]`))

func TestKVUsageGrowsWithGeneratedTokensAndEmptiesAtEnd(t *testing.T) {
	const blocks = 100
	f := startFleet(t, FleetConfig{Behavior: fast, KVBlocks: blocks, KVBlockTokens: 1})
	r := f.Replica(0)
	c := client(t)
	p := chatPromptTokens

	t.Run("stream", func(t *testing.T) {
		// The next token is 150ms away when each check is made.
		resp, err := post(t, c, context.Background(), r.URL()+"/v1/chat/completions", chatBody,
			"X-Mock-Tokens: 3", "X-Mock-Token-Interval: 150ms")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		er := newEventReader(resp.Body)
		tokens := 0
		for tokens < 2 {
			d, err := er.next()
			if err != nil {
				t.Fatal(err)
			}
			if strings.Contains(d, `"role"`) {
				continue
			}
			tokens++
			if got := r.Stats().KVBlocksUsed; got != p+tokens {
				t.Errorf("after %d tokens: %d blocks used, want %d (prompt %d + generated)", tokens, got, p+tokens, p)
			}
		}
		if got, want := gauge(t, scrape(t, c, r.URL()), "vllm:kv_cache_usage_perc"), float64(p+2)/blocks; got != want {
			t.Errorf("vllm:kv_cache_usage_perc %v, want %v", got, want)
		}
		readAll(t, resp.Body)
		waitFor(t, time.Second, "the blocks to be freed", func() bool { return r.Stats().KVBlocksUsed == 0 })
		if got := gauge(t, scrape(t, c, r.URL()), "vllm:kv_cache_usage_perc"); got != 0 {
			t.Errorf("vllm:kv_cache_usage_perc %v after the request, want 0", got)
		}
	})

	t.Run("plain, cancelled", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() {
			resp, err := post(t, c, ctx, r.URL()+"/v1/completions", `{"prompt":"hi"}`, "X-Mock-Tokens: 3", "X-Mock-Token-Interval: 1h")
			if err == nil {
				resp.Body.Close()
			}
		}()
		want := promptTokens([]byte(`"hi"`)) + 1
		waitFor(t, time.Second, "the first token's block", func() bool { return r.Stats().KVBlocksUsed == want })
		cancel()
		waitFor(t, time.Second, "the blocks to be freed", func() bool { s := r.Stats(); return s.KVBlocksUsed == 0 && s.Running == 0 })
	})
}

func TestRequestWaitsForKVBlocksWithUnlimitedCapacity(t *testing.T) {
	p := chatPromptTokens
	f := startFleet(t, FleetConfig{Behavior: Behavior{TTFT: Fixed(time.Hour)}, KVBlocks: 2*p - 1, KVBlockTokens: 1})
	r := f.Replica(0)
	c := client(t)
	ctxA, cancelA := context.WithCancel(context.Background())
	defer cancelA()
	ctxB, cancelB := context.WithCancel(context.Background())
	defer cancelB()
	for _, ctx := range []context.Context{ctxA, ctxB} {
		go func() {
			resp, err := post(t, c, ctx, r.URL()+"/v1/chat/completions", chatBody)
			if err == nil {
				resp.Body.Close()
			}
		}()
	}
	waitFor(t, time.Second, "one running, one waiting for blocks", func() bool {
		s := r.Stats()
		return s.Running == 1 && s.Waiting == 1 && s.KVBlocksUsed == p
	})
	if got := gauge(t, scrape(t, c, r.URL()), "vllm:num_requests_waiting"); got != 1 {
		t.Errorf("vllm:num_requests_waiting %v, want 1", got)
	}
	cancelA()
	waitFor(t, time.Second, "the second to run", func() bool { s := r.Stats(); return s.Running == 1 && s.Waiting == 0 })
}

func TestQueueTimeObservedWhenScheduled(t *testing.T) {
	// Capacity 1 and requests that hold their slot until cancelled: the
	// test decides how long each waits. Lower bounds are exact, upper
	// bounds leave 180ms and more for a loaded machine.
	f := startFleet(t, FleetConfig{Behavior: Behavior{TTFT: Fixed(time.Hour)}, Capacity: 1})
	r := f.Replica(0)
	c := client(t)
	var wg sync.WaitGroup
	defer wg.Wait()
	cancels := make([]context.CancelFunc, 4) // a runs; b, c, d wait; d gives up
	for i := range cancels {
		ctx, cancel := context.WithCancel(context.Background())
		cancels[i] = cancel
		defer cancel()
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := post(t, c, ctx, r.URL()+"/v1/chat/completions", chatBody)
			if err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
		waitFor(t, time.Second, "the request to be queued", func() bool { s := r.Stats(); return s.Running == 1 && s.Waiting == i })
	}
	h := histogram(t, scrape(t, c, r.URL()), "vllm:request_queue_time_seconds")
	if h.GetSampleCount() != 1 || h.GetSampleSum() != 0 {
		t.Errorf("with one scheduled at once: count %d, sum %v; want 1, 0", h.GetSampleCount(), h.GetSampleSum())
	}
	cancels[3]()
	waitFor(t, time.Second, "d to give up", func() bool { return r.Stats().Waiting == 2 })
	time.Sleep(320 * time.Millisecond)
	cancels[0]() // b is scheduled after at least 320ms
	waitFor(t, time.Second, "b to run", func() bool { return r.Stats().Waiting == 1 })
	time.Sleep(250 * time.Millisecond)
	cancels[1]() // c after at least 570ms
	waitFor(t, time.Second, "c to run", func() bool { return r.Stats().Waiting == 0 })
	cancels[2]()

	h = histogram(t, scrape(t, c, r.URL()), "vllm:request_queue_time_seconds")
	if h.GetSampleCount() != 3 {
		t.Errorf("count %d, want 3 (the request that gave up is not observed)", h.GetSampleCount())
	}
	if s := h.GetSampleSum(); s < 0.89 || s > 1.3 {
		t.Errorf("sum %vs, want about 0.32 + 0.57", s)
	}
	want := map[float64]uint64{0.3: 1, 0.5: 2, 0.8: 3, 7680: 3}
	for _, b := range h.GetBucket() {
		if n, ok := want[b.GetUpperBound()]; ok && b.GetCumulativeCount() != n {
			t.Errorf("bucket le=%v: %d, want %d", b.GetUpperBound(), b.GetCumulativeCount(), n)
		}
	}
	if len(h.GetBucket()) != len(queueTimeBuckets)+1 {
		t.Errorf("%d buckets, want vLLM's %d and +Inf", len(h.GetBucket()), len(queueTimeBuckets))
	}
}
