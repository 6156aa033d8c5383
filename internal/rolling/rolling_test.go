package rolling

import (
	"sync"
	"testing"
	"time"
)

// t0 is the base of the tests' windows; the tests pass times to Epochs, so
// time is moved by hand and nothing sleeps.
var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

func TestEpochsMapTimesToBuckets(t *testing.T) {
	for _, c := range []struct {
		name   string
		window time.Duration
		width  time.Duration
		// at and want are visited in order, so the cached epoch is
		// exercised going forward, backward and far ahead.
		at   []time.Duration
		want []uint64
	}{
		{"1s buckets", 10 * time.Second, time.Second,
			[]time.Duration{0, 1, time.Second - 1, time.Second, 9*time.Second + 999*time.Millisecond, 10 * time.Second},
			[]uint64{1, 1, 1, 2, 10, 11}},
		{"3s buckets, cache hit and miss", 30 * time.Second, 3 * time.Second,
			[]time.Duration{0, 1, 3*time.Second - 1, 3 * time.Second, 2 * time.Second, 7 * time.Hour, time.Second, 3*time.Second + 1},
			[]uint64{1, 1, 1, 2, 1, 8401, 1, 2}},
		{"times before base fall into epoch 1", 10 * time.Second, time.Second,
			[]time.Duration{5 * time.Second, -time.Nanosecond, -time.Hour, 5 * time.Second},
			[]uint64{6, 1, 1, 6}},
		{"windows below 10ms get 1ms buckets", time.Nanosecond, MinWidth,
			[]time.Duration{0, time.Millisecond - 1, time.Millisecond, time.Second},
			[]uint64{1, 1, 2, 1001}},
		{"window rounds down to the nanosecond", 10*time.Second + 9, time.Second,
			[]time.Duration{time.Second - 1, time.Second},
			[]uint64{1, 2}},
		{"epochs stop at MaxEpoch", 10 * time.Millisecond, time.Millisecond,
			[]time.Duration{(MaxEpoch - 2) * time.Millisecond, (MaxEpoch - 1) * time.Millisecond, MaxEpoch * time.Millisecond, 1<<63 - 1},
			[]uint64{MaxEpoch - 1, MaxEpoch, MaxEpoch, MaxEpoch}},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := NewEpochs(t0, c.window)
			if e.Width() != c.width || !e.Base().Equal(t0) {
				t.Fatalf("width %v, base %v; want %v, %v", e.Width(), e.Base(), c.width, t0)
			}
			for i, d := range c.at {
				if got := e.Epoch(t0.Add(d)); got != c.want[i] {
					t.Fatalf("Epoch(base%+v) = %d, want %d", d, got, c.want[i])
				}
			}
		})
	}
}

func TestInWindow(t *testing.T) {
	for _, c := range []struct {
		e, ep uint64
		want  bool
	}{
		{0, 5, false}, // unused word
		{1, 1, true},
		{1, 10, true},
		{1, 11, false}, // ten buckets later: left the window
		{11, 20, true},
		{21, 20, false}, // newer than the window's end
		{MaxEpoch, MaxEpoch, true},
		{MaxEpoch - Buckets + 1, MaxEpoch, true},
		{MaxEpoch - Buckets, MaxEpoch, false},
	} {
		if got := InWindow(c.e, c.ep); got != c.want {
			t.Errorf("InWindow(%d, %d) = %v, want %v", c.e, c.ep, got, c.want)
		}
	}
}

func TestPackUnpack(t *testing.T) {
	for _, c := range []struct{ ep, n uint64 }{{0, 0}, {1, 1}, {MaxEpoch, CountMask}, {12345, CountMax}} {
		if e, n := Unpack(Pack(c.ep, c.n)); e != c.ep || n != c.n {
			t.Errorf("Unpack(Pack(%d, %d)) = %d, %d", c.ep, c.n, e, n)
		}
	}
	if CountBits+EpochBits != 64 || CountMax >= CountMask || CountMask-CountMax < 1<<20 {
		t.Fatalf("layout: %d+%d bits, max %d, mask %d", CountBits, EpochBits, CountMax, CountMask)
	}
}

func TestCounterAdd(t *testing.T) {
	for _, c := range []struct {
		name     string
		word, ep uint64 // counter's word before Add(ep)
		want     uint64 // word after
	}{
		{"unused counter starts at 1", 0, 7, Pack(7, 1)},
		{"same epoch counts", Pack(7, 41), 7, Pack(7, 42)},
		{"older epoch is reset", Pack(3, 41), 7, Pack(7, 1)},
		{"far older epoch is reset", Pack(1, 41), MaxEpoch, Pack(MaxEpoch, 1)},
		{"late caller counts in the newer epoch", Pack(8, 41), 7, Pack(8, 42)},
		{"saturates at CountMax", Pack(7, CountMax), 7, Pack(7, CountMax)},
		{"saturated late caller", Pack(8, CountMax), 7, Pack(8, CountMax)},
		{"saturated older epoch is reset", Pack(6, CountMax), 7, Pack(7, 1)},
		{"below CountMax still counts", Pack(7, CountMax-1), 7, Pack(7, CountMax)},
	} {
		t.Run(c.name, func(t *testing.T) {
			var k Counter
			k.w.Store(c.word)
			k.Add(c.ep)
			if got := k.Load(); got != c.want {
				ge, gn := Unpack(got)
				we, wn := Unpack(c.want)
				t.Fatalf("word (%d, %d), want (%d, %d)", ge, gn, we, wn)
			}
		})
	}
}

func TestCounterGet(t *testing.T) {
	var k Counter
	if got := k.Get(1); got != 0 {
		t.Fatalf("unused counter: %d", got)
	}
	k.w.Store(Pack(5, 3))
	for _, c := range []struct{ ep, want uint64 }{{4, 0}, {5, 3}, {14, 3}, {15, 0}} {
		if got := k.Get(c.ep); got != c.want {
			t.Errorf("Get(%d) = %d, want %d", c.ep, got, c.want)
		}
	}
}

func TestRingExpiresBucketByBucket(t *testing.T) {
	e := NewEpochs(t0, 10*time.Second) // 1s buckets
	var r Ring
	for i := range 10 {
		for range i + 1 {
			r.Add(e.Epoch(t0.Add(time.Duration(i) * time.Second)))
		}
	}
	at := func(d time.Duration) uint64 { return r.Sum(e.Epoch(t0.Add(d))) }
	for _, c := range []struct {
		at   time.Duration
		want uint64
	}{
		{9 * time.Second, 55},               // 1+2+…+10
		{10*time.Second - 1, 55},            // last instant of the first bucket's window
		{10 * time.Second, 54},              // the 1 event at t=0 left
		{15 * time.Second, 55 - 21},         // t=0…5s (1+…+6 events) left
		{19*time.Second + time.Second/2, 0}, // everything left
		{1000 * time.Hour, 0},               // a long idle forgets without wrapping
		{-time.Second, 1},                   // a stale reading counts from epoch 1
	} {
		if got := at(c.at); got != c.want {
			t.Errorf("Sum at base%+v = %d, want %d", c.at, got, c.want)
		}
	}
	// A slot is reused for a new epoch, not added to.
	ep := e.Epoch(t0.Add(20 * time.Second))
	r.Add(ep)
	if got := r.Sum(ep); got != 1 {
		t.Fatalf("reused slot: %d, want 1", got)
	}
}

func TestRingCountsEveryConcurrentAdd(t *testing.T) {
	// Run with -race. 1ms buckets: every goroutine walks the same 5
	// epochs, so resets race adds and late callers race resets.
	e := NewEpochs(t0, 10*time.Millisecond)
	var r Ring
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 1000 {
				// Half the goroutines lag a bucket behind.
				d := time.Duration(i/200-g%2) * time.Millisecond
				r.Add(e.Epoch(t0.Add(max(d, 0))))
			}
		})
	}
	wg.Wait()
	if got := r.Sum(e.Epoch(t0.Add(4 * time.Millisecond))); got != 8000 {
		t.Fatalf("counted %d events, want 8000", got)
	}
}

func TestConcurrentSaturationNeverCarriesIntoTheEpoch(t *testing.T) {
	var k Counter
	k.w.Store(Pack(9, CountMax-100))
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 1000 {
				k.Add(9)
			}
		})
	}
	wg.Wait()
	// Adders that raced past the saturation check may each have added
	// one more: at most one per goroutine, and never into the epoch.
	if e, n := Unpack(k.Load()); e != 9 || n < CountMax || n > CountMax+8 {
		t.Fatalf("word (%d, %d), want epoch 9 and a count in [%d, %d]", e, n, CountMax, CountMax+8)
	}
	if got := k.Get(9); got != CountMax {
		t.Fatalf("Get = %d, want the saturated %d", got, CountMax)
	}
}

func TestHotPathAllocatesNothing(t *testing.T) {
	e := NewEpochs(t0, 10*time.Second)
	var r Ring
	now := t0
	for _, c := range []struct {
		name string
		f    func()
	}{
		{"Epoch", func() { _ = e.Epoch(now) }},
		{"Epoch and Ring.Add", func() { r.Add(e.Epoch(now)) }},
		{"Ring.Sum", func() { _ = r.Sum(e.Epoch(now)) }},
		{"Add across buckets", func() { now = now.Add(time.Second); r.Add(e.Epoch(now)) }},
	} {
		if a := testing.AllocsPerRun(1000, c.f); a != 0 {
			t.Errorf("%s: %v allocs", c.name, a)
		}
	}
}

// BenchmarkRingAdd: one Epoch and one Ring.Add per operation, from parallel
// goroutines sharing one window, at a fixed time (the cached-epoch path).
func BenchmarkRingAdd(b *testing.B) {
	e := NewEpochs(t0, 10*time.Second)
	var r Ring
	now := t0.Add(5 * time.Second)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			r.Add(e.Epoch(now))
		}
	})
}
