package prefix

import (
	"fmt"
	"runtime"
	"strings"
	"testing"
)

func conversation(system string, turns int) []uint64 {
	segs := []string{system}
	for i := range turns {
		segs = append(segs, fmt.Sprintf("user turn %d: %s", i, strings.Repeat("q", 200)),
			fmt.Sprintf("assistant turn %d: %s", i, strings.Repeat("a", 300)))
	}
	return Keys(DefaultBlockChars, segs...)
}

func TestIndexLongestPrefixMatch(t *testing.T) {
	x := NewIndex(0)
	sys := strings.Repeat("You are a careful assistant. ", 200) // 5,800 bytes
	turn1 := conversation(sys, 1)
	x.Insert(turn1)
	turn3 := conversation(sys, 3)
	if got := x.Match(turn3); got != len(turn1)-1 && got != len(turn1) {
		// The first turn's last full block may straddle into the next
		// message; everything before it matches.
		t.Fatalf("turn 3 matched %d blocks of turn 1's %d", got, len(turn1))
	}
	if got := x.Match(turn1); got != len(turn1) {
		t.Fatalf("turn 1 matched %d of its own %d blocks", got, len(turn1))
	}
	other := conversation(strings.Repeat("You are a pirate. ", 300), 3)
	if got := x.Match(other); got != 0 {
		t.Fatalf("another system prompt matched %d blocks", got)
	}
	// A prompt that differs only in its first block matches nothing, even
	// though its later blocks' text is the same.
	edited := conversation("!"+sys[1:], 1)
	if got := x.Match(edited); got != 0 {
		t.Fatalf("a prompt with an edited first block matched %d blocks", got)
	}
}

func TestIndexEvictsLeastRecentlyUsedWithinBound(t *testing.T) {
	x := NewIndex(50)
	a := Keys(10, strings.Repeat("a", 300)) // 30 blocks
	b := Keys(10, strings.Repeat("b", 300))
	x.Insert(a)
	x.Insert(b) // 60 keys for 50 places: a's last 10 go
	if x.Len() != 50 {
		t.Fatalf("index holds %d keys, want its bound 50", x.Len())
	}
	if got := x.Match(b); got != 30 {
		t.Fatalf("b, most recent, matched %d of 30", got)
	}
	if got := x.Match(a); got != 20 {
		t.Fatalf("a matched %d blocks, want 20: a prefix is forgotten from its end", got)
	}
	// Using a again makes it recent: b's end goes now.
	x.Insert(a[:20])
	x.Insert(Keys(10, strings.Repeat("c", 100)))
	if got := x.Match(a); got != 20 {
		t.Fatalf("recently used a matched %d, want 20", got)
	}
	if got := x.Match(b); got != 20 {
		t.Fatalf("b matched %d, want 20 after 10 new keys", got)
	}
	for range 100 {
		x.Insert(Keys(10, fmt.Sprint(x.Len())+strings.Repeat("d", 95)))
	}
	if x.Len() != 50 {
		t.Fatalf("index holds %d keys after churn, want 50", x.Len())
	}
}

func TestIndexInsertLongerThanBound(t *testing.T) {
	x := NewIndex(5)
	keys := Keys(1, strings.Repeat("k", 20))
	x.Insert(keys)
	if x.Len() != 5 || x.Match(keys) != 5 {
		t.Fatalf("len %d, match %d: want the first 5 blocks", x.Len(), x.Match(keys))
	}
	x.Clear()
	if x.Len() != 0 || x.Match(keys) != 0 {
		t.Fatal("Clear left keys")
	}
	x.Grow(10)
	x.Grow(3)
	if x.Max() != 10 {
		t.Fatalf("max %d after Grow(10), Grow(3), want 10", x.Max())
	}
}

func TestIndexMatchAndFullInsertAllocateNothing(t *testing.T) {
	x := NewIndex(64)
	for i := range 20 {
		x.Insert(Keys(8, fmt.Sprintf("%08d", i)+strings.Repeat("p", 64)))
	}
	keys := Keys(8, strings.Repeat("n", 160))
	allocs := testing.AllocsPerRun(100, func() {
		x.Match(keys)
		x.Insert(keys)
	})
	if allocs != 0 {
		t.Fatalf("Match+Insert on a full index allocated %v times, want 0", allocs)
	}
}

// TestIndexMemoryPerBlock measures the heap a full index of the default
// size holds and checks BytesPerBlock against it.
func TestIndexMemoryPerBlock(t *testing.T) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	x := NewIndex(DefaultMaxBlocks)
	keys := make([]uint64, 1024)
	for round := range DefaultMaxBlocks / len(keys) {
		for i := range keys {
			keys[i] = mix(uint64(round*len(keys) + i + 1))
		}
		x.Insert(keys)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	per := float64(after.HeapAlloc-before.HeapAlloc) / float64(x.Len())
	t.Logf("index of %d blocks: %.0f KiB, %.1f bytes per block", x.Len(), per*float64(x.Len())/1024, per)
	if x.Len() != DefaultMaxBlocks {
		t.Fatalf("len %d", x.Len())
	}
	if per > BytesPerBlock*1.25 || per < BytesPerBlock*0.5 {
		t.Fatalf("%.1f bytes per block; BytesPerBlock says %d", per, BytesPerBlock)
	}
	runtime.KeepAlive(x)
}

func BenchmarkKeys6000(b *testing.B) {
	var k Keyer
	buf := make([]uint64, 0, 64)
	text := strings.Repeat("the quick brown fox ", 300)
	b.SetBytes(int64(len(text)))
	for b.Loop() {
		k.Reset(DefaultBlockChars, 0, buf)
		k.Write(text)
	}
}
