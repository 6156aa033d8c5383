package registry

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
)

// counter builds values numbered in order of construction and records
// their destruction.
type counter struct {
	mu        sync.Mutex
	built     int
	destroyed map[string]int
}

func (c *counter) build() (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.built++
	return c.built, nil
}

func (c *counter) destroy(key string, _ int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.destroyed == nil {
		c.destroyed = map[string]int{}
	}
	c.destroyed[key]++
}

func (c *counter) destroyedCount(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.destroyed[key]
}

func TestAcquireSharesValueAndCountsRefs(t *testing.T) {
	var cnt counter
	tb := NewTable(cnt.destroy)
	var a, b Claims
	va, err := tb.Acquire(&a, "k", cnt.build, nil)
	if err != nil {
		t.Fatal(err)
	}
	vb, err := tb.Acquire(&b, "k", cnt.build, nil)
	if err != nil {
		t.Fatal(err)
	}
	if va != vb || cnt.built != 1 {
		t.Fatalf("values %d and %d, %d built: want one shared value", va, vb, cnt.built)
	}
	if n := tb.Refs("k"); n != 2 {
		t.Fatalf("refs %d, want 2", n)
	}
	a.Release()
	if n := tb.Refs("k"); n != 1 || cnt.destroyedCount("k") != 0 {
		t.Fatalf("after one release: refs %d, destroyed %d", n, cnt.destroyedCount("k"))
	}
	if v, ok := tb.Peek("k"); !ok || v != va {
		t.Fatalf("Peek %d %t", v, ok)
	}
	b.Release()
	if n := tb.Refs("k"); n != 0 || tb.Len() != 0 {
		t.Fatalf("after the last release: refs %d, len %d", n, tb.Len())
	}
	if n := cnt.destroyedCount("k"); n != 1 {
		t.Fatalf("destroyed %d times, want once", n)
	}
	if _, ok := tb.Peek("k"); ok {
		t.Fatal("Peek found a destroyed value")
	}
}

func TestClaimsHoldOneRefPerKey(t *testing.T) {
	var cnt counter
	tb := NewTable(cnt.destroy)
	var c Claims
	released := 0
	for range 3 {
		if _, err := tb.Acquire(&c, "k", cnt.build, func(int) { released++ }); err != nil {
			t.Fatal(err)
		}
	}
	if n := tb.Refs("k"); n != 1 {
		t.Fatalf("three Acquires through one Claims counted %d refs, want 1", n)
	}
	c.Release()
	if released != 1 || cnt.destroyedCount("k") != 1 {
		t.Fatalf("onRelease ran %d times and destroy %d times, want once each", released, cnt.destroyedCount("k"))
	}
}

// The same Claims holds one reference per table and key: two tables with
// the same key are two references.
func TestClaimsKeysAreTableScoped(t *testing.T) {
	var cnt counter
	t1, t2 := NewTable(cnt.destroy), NewTable[int](nil)
	var c Claims
	_, _ = t1.Acquire(&c, "k", cnt.build, nil)
	_, _ = t2.Acquire(&c, "k", cnt.build, nil)
	if t1.Refs("k") != 1 || t2.Refs("k") != 1 {
		t.Fatalf("refs %d and %d, want one in each table", t1.Refs("k"), t2.Refs("k"))
	}
	c.Release()
	if t1.Len() != 0 || t2.Len() != 0 {
		t.Fatal("Release left values behind")
	}
}

func TestOnReleaseRunsBeforeTheCountDrops(t *testing.T) {
	tb := NewTable[int](nil)
	var c Claims
	refsSeen := -1
	_, _ = tb.Acquire(&c, "k", func() (int, error) { return 7, nil }, func(v int) {
		if v != 7 {
			t.Errorf("onRelease got %d", v)
		}
		refsSeen = tb.Refs("k")
	})
	c.Release()
	if refsSeen != 1 {
		t.Fatalf("onRelease saw %d refs, want 1 (before the count goes down)", refsSeen)
	}
}

func TestReleaseIsNewestFirstAndIdempotent(t *testing.T) {
	var order []string
	destroy := func(k string, _ int) { order = append(order, k) }
	tb := NewTable(destroy)
	var c Claims
	for _, k := range []string{"a", "b", "c"} {
		_, _ = tb.Acquire(&c, k, func() (int, error) { return 0, nil }, nil)
	}
	c.Release()
	c.Release()
	if fmt.Sprint(order) != "[c b a]" {
		t.Fatalf("destroyed in order %v, want newest first, once each", order)
	}
	if !c.Released() {
		t.Fatal("Released false after Release")
	}
}

func TestAcquireAfterReleaseReturnsErrReleased(t *testing.T) {
	var cnt counter
	tb := NewTable(cnt.destroy)
	var live, old Claims
	v, _ := tb.Acquire(&live, "held", cnt.build, nil)
	old.Release()
	got, err := tb.Acquire(&old, "held", cnt.build, nil)
	if !errors.Is(err, ErrReleased) || got != v {
		t.Fatalf("Acquire on released claims: %d %v, want the current value %d and ErrReleased", got, err, v)
	}
	if n := tb.Refs("held"); n != 1 {
		t.Fatalf("released claims took a ref: %d", n)
	}
	got, err = tb.Acquire(&old, "absent", cnt.build, nil)
	if !errors.Is(err, ErrReleased) || got != 0 {
		t.Fatalf("Acquire of an absent key on released claims: %d %v", got, err)
	}
	if _, ok := tb.Peek("absent"); ok || cnt.built != 1 {
		t.Fatalf("released claims built a value (%d built)", cnt.built)
	}
}

func TestBuildErrorStoresNothing(t *testing.T) {
	tb := NewTable[int](nil)
	var c Claims
	boom := errors.New("boom")
	if _, err := tb.Acquire(&c, "k", func() (int, error) { return 0, boom }, nil); !errors.Is(err, boom) {
		t.Fatalf("err %v, want build's", err)
	}
	if tb.Len() != 0 || tb.Refs("k") != 0 {
		t.Fatal("a failed build left a value")
	}
	if v, err := tb.Acquire(&c, "k", func() (int, error) { return 3, nil }, nil); err != nil || v != 3 || tb.Refs("k") != 1 {
		t.Fatalf("Acquire after a failed build: %d %v refs %d", v, err, tb.Refs("k"))
	}
}

func TestDropReleasesOneKey(t *testing.T) {
	var cnt counter
	tb := NewTable(cnt.destroy)
	var c, other Claims
	onRel := 0
	_, _ = tb.Acquire(&c, "gone", cnt.build, func(int) { onRel++ })
	_, _ = tb.Acquire(&c, "kept", cnt.build, nil)
	_, _ = tb.Acquire(&other, "shared", cnt.build, nil)
	_, _ = tb.Acquire(&c, "shared", cnt.build, nil)

	Drop(&c, tb, "gone")
	Drop(&c, tb, "gone")   // not held any more: nothing
	Drop(&c, tb, "never")  // never held: nothing
	Drop(&c, tb, "shared") // drops c's ref only
	if onRel != 1 || cnt.destroyedCount("gone") != 1 {
		t.Fatalf("Drop: onRelease %d, destroy %d, want once each", onRel, cnt.destroyedCount("gone"))
	}
	if tb.Refs("kept") != 1 || tb.Refs("shared") != 1 {
		t.Fatalf("Drop touched other keys: kept %d shared %d", tb.Refs("kept"), tb.Refs("shared"))
	}
	// Re-acquiring a dropped key takes a new reference.
	_, _ = tb.Acquire(&c, "gone", cnt.build, nil)
	if tb.Refs("gone") != 1 {
		t.Fatalf("re-acquired refs %d", tb.Refs("gone"))
	}
	c.Release()
	if tb.Len() != 1 || tb.Refs("shared") != 1 {
		t.Fatalf("after Release: %d values, shared refs %d", tb.Len(), tb.Refs("shared"))
	}
	if n := cnt.destroyedCount("gone"); n != 2 {
		t.Fatalf("the re-acquired key destroyed %d times in all, want 2", n)
	}
}

// A reload: the new config takes its references before the old releases.
func TestReloadKeepsSharedValues(t *testing.T) {
	var cnt counter
	tb := NewTable(cnt.destroy)
	var old, next Claims
	v1, _ := tb.Acquire(&old, "shared", cnt.build, nil)
	_, _ = tb.Acquire(&old, "removed", cnt.build, nil)
	v2, _ := tb.Acquire(&next, "shared", cnt.build, nil)
	old.Release()
	if v1 != v2 || cnt.destroyedCount("shared") != 0 || cnt.destroyedCount("removed") != 1 {
		t.Fatalf("shared %d→%d destroyed %d, removed destroyed %d", v1, v2, cnt.destroyedCount("shared"), cnt.destroyedCount("removed"))
	}
	keys, vals := tb.Snapshot()
	if fmt.Sprint(keys, vals) != fmt.Sprint([]string{"shared"}, []int{v1}) {
		t.Fatalf("snapshot %v %v", keys, vals)
	}
}

func TestZeroClaimsAreReady(t *testing.T) {
	var c Claims
	if c.Released() {
		t.Fatal("zero Claims released")
	}
	c.Release()
	Drop(&c, NewTable[int](nil), "k")
}

// Concurrent configs acquiring and releasing the same keys: every value is
// destroyed exactly once, when its last reference goes, and the table ends
// empty. Run with -race.
func TestConcurrentAcquireRelease(t *testing.T) {
	var builds, destroys atomic.Int64
	var live sync.Map // value id → destroyed flag
	tb := NewTable(func(_ string, v int64) {
		destroys.Add(1)
		if _, loaded := live.LoadAndDelete(v); !loaded {
			t.Errorf("value %d destroyed twice", v)
		}
	})
	build := func() (int64, error) {
		id := builds.Add(1)
		live.Store(id, true)
		return id, nil
	}
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Go(func() {
			for i := range 300 {
				var c Claims
				for k := range 4 {
					key := fmt.Sprintf("k%d", (g+i+k)%6)
					v, err := tb.Acquire(&c, key, build, nil)
					if err != nil {
						t.Error(err)
						return
					}
					if _, ok := live.Load(v); !ok {
						t.Errorf("Acquire returned destroyed value %d", v)
					}
				}
				if i%3 == 0 {
					Drop(&c, tb, fmt.Sprintf("k%d", (g+i)%6))
				}
				var rel sync.WaitGroup
				rel.Go(c.Release)
				rel.Go(c.Release) // concurrent double release
				rel.Wait()
				if _, err := tb.Acquire(&c, "k0", build, nil); !errors.Is(err, ErrReleased) {
					t.Errorf("Acquire after Release: %v", err)
				}
			}
		})
	}
	wg.Wait()
	if tb.Len() != 0 {
		t.Fatalf("%d values left after every claim was released", tb.Len())
	}
	if b, d := builds.Load(), destroys.Load(); b != d {
		t.Fatalf("%d values built, %d destroyed", b, d)
	}
}

// Regression: Drop left the key in the Claims' release order, so a config
// whose dynamic source churned through addresses grew that list without
// bound until it was replaced.
func TestDropForgetsTheKeyFromClaims(t *testing.T) {
	var order []string
	tb := NewTable(func(k string, _ int) { order = append(order, k) })
	var c Claims
	build := func() (int, error) { return 0, nil }
	for i := range 10000 {
		k := fmt.Sprintf("pod-%d", i)
		_, _ = tb.Acquire(&c, k, build, nil)
		Drop(&c, tb, k)
	}
	c.mu.Lock()
	n := len(c.order)
	c.mu.Unlock()
	if n > 64 {
		t.Fatalf("claims remember %d keys after every one was dropped", n)
	}
	// Release still goes newest first, once per key, after the list was
	// compacted, also for a key dropped and acquired again.
	order = nil
	for _, k := range []string{"a", "b", "c"} {
		_, _ = tb.Acquire(&c, k, build, nil)
	}
	Drop(&c, tb, "a")
	_, _ = tb.Acquire(&c, "a", build, nil)
	for i := range 200 {
		k := fmt.Sprintf("churn-%d", i)
		_, _ = tb.Acquire(&c, k, build, nil)
		Drop(&c, tb, k)
	}
	order = nil
	c.Release()
	if fmt.Sprint(order) != "[a c b]" {
		t.Fatalf("released in order %v, want [a c b]", order)
	}
}
