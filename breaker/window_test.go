package breaker

import (
	"sync"
	"testing"
	"time"
)

func TestWindowExpiresBucketByBucket(t *testing.T) {
	t0 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	w := newWindow(t0, 10*time.Second) // 1s buckets
	for i := range 10 {
		at := t0.Add(time.Duration(i) * time.Second)
		w.record(at, i%2 == 0, i == 9)
	}
	if c := w.sum(t0.Add(9 * time.Second)); c != (counts{requests: 10, failures: 5, slow: 1}) {
		t.Fatalf("full window %+v", c)
	}
	if c := w.sum(t0.Add(10 * time.Second)); c != (counts{requests: 9, failures: 4, slow: 1}) {
		t.Fatalf("after first bucket left %+v", c)
	}
	if c := w.sum(t0.Add(19 * time.Second)); c != (counts{}) {
		t.Fatalf("after the whole window %+v", c)
	}
	// A bucket slot is reused for a new epoch, not added to.
	w.record(t0.Add(20*time.Second), true, false)
	if c := w.sum(t0.Add(20 * time.Second)); c != (counts{requests: 1, failures: 1}) {
		t.Fatalf("reused bucket %+v", c)
	}
	// Times before base count in the first bucket; late events count in the
	// newest bucket.
	w.record(t0.Add(-time.Hour), false, false)
	if c := w.sum(t0.Add(20 * time.Second)); c.requests != 2 {
		t.Fatalf("late event %+v", c)
	}
}

func TestWindowCountsEveryConcurrentEvent(t *testing.T) {
	t0 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	w := newWindow(t0, 10*time.Millisecond) // 1ms buckets
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 1000 {
				// Everyone walks the same 5 epochs, so resets race adds.
				w.record(t0.Add(time.Duration(i/200)*time.Millisecond), g%2 == 0, false)
			}
		}()
	}
	wg.Wait()
	if c := w.sum(t0.Add(4 * time.Millisecond)); c.requests != 8000 || c.failures != 4000 {
		t.Fatalf("counts %+v, want 8000 requests, 4000 failures", c)
	}
}
