package prefix

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

func TestBlockKeysChain(t *testing.T) {
	text := strings.Repeat("abcdefgh", 64) // 512 bytes: 8 blocks of 64
	base := Keys(64, text)
	if len(base) != 8 {
		t.Fatalf("keys of 512 bytes in 64-byte blocks = %d, want 8", len(base))
	}
	// A change in block 2 changes key 2 and every later key, never an
	// earlier one.
	changed := []byte(text)
	changed[2*64+5] = 'X'
	got := Keys(64, string(changed))
	for i := range base {
		same := got[i] == base[i]
		if i < 2 && !same {
			t.Errorf("key %d changed by an edit in block 2", i)
		}
		if i >= 2 && same {
			t.Errorf("key %d unchanged by an edit in block 2: a block must match only with its whole prefix", i)
		}
	}
	// The same block content after a different prefix has another key.
	if k := Keys(64, strings.Repeat("abcdefgh", 8)); k[0] != base[0] {
		t.Fatalf("first block keyed differently alone: %x vs %x", k[0], base[0])
	}
	if base[1] == base[0] {
		t.Fatal("two identical blocks at different positions share a key")
	}
}

func TestKeysIgnoreTrailingPartialBlock(t *testing.T) {
	if k := Keys(100, strings.Repeat("a", 99)); len(k) != 0 {
		t.Fatalf("99 bytes in 100-byte blocks gave %d keys, want 0", len(k))
	}
	a, b := Keys(100, strings.Repeat("a", 250)), Keys(100, strings.Repeat("a", 200))
	if !slices.Equal(a, b) {
		t.Fatal("a trailing partial block changed the keys")
	}
}

func TestKeysSeparateSegments(t *testing.T) {
	a := Keys(8, "abcd", "efg")     // abcd␞efg: one block
	b := Keys(8, "abc", "defg")     // abc␞defg
	c := Keys(8, "abcd", "efg", "") // the same block, then a separator
	if len(a) != 1 || len(b) != 1 {
		t.Fatalf("got %d and %d keys, want 1 each", len(a), len(b))
	}
	if a[0] == b[0] {
		t.Fatal("segment boundaries do not change the keys")
	}
	if c[0] != a[0] {
		t.Fatal("the same first block keyed differently")
	}
}

func TestKeyerBoundsKeysAndReusesBuffer(t *testing.T) {
	var k Keyer
	buf := make([]uint64, 0, 16)
	k.Reset(10, 3, buf)
	k.Write(strings.Repeat("z", 1000))
	if got := len(k.Keys()); got != 3 {
		t.Fatalf("kept %d keys, want the bound 3", got)
	}
	if &k.Keys()[0] != &buf[:1][0] {
		t.Fatal("keys not appended to the given buffer")
	}
	if !slices.Equal(k.Keys(), Keys(10, strings.Repeat("z", 30))) {
		t.Fatal("bounded keys differ from the prompt's first keys")
	}
}

func TestKeyerAllocatesNothing(t *testing.T) {
	var k Keyer
	buf := make([]uint64, 0, 64)
	text := strings.Repeat("the quick brown fox ", 300) // 6,000 bytes
	allocs := testing.AllocsPerRun(100, func() {
		k.Reset(DefaultBlockChars, 0, buf)
		k.Write(text)
		k.Write("user turn")
	})
	if allocs != 0 {
		t.Fatalf("Keyer allocated %v times per prompt, want 0", allocs)
	}
}

func TestWeightIsDeterministicAndSpreads(t *testing.T) {
	nodes := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
	wins := map[string]int{}
	for i := range 3000 {
		first := Keys(16, fmt.Sprintf("%08d: system prompt", i))[0]
		best, bw := "", uint64(0)
		for _, n := range nodes {
			if w := Weight(first, n); best == "" || w > bw {
				best, bw = n, w
			}
		}
		if Weight(first, best) != bw {
			t.Fatal("Weight is not deterministic")
		}
		wins[best]++
	}
	for _, n := range nodes {
		if wins[n] < 850 || wins[n] > 1150 {
			t.Errorf("%s won %d of 3000 first blocks, want about 1000: %v", n, wins[n], wins)
		}
	}
}

// FuzzKeysExtendPrefix: appending text to a prompt never changes the keys
// of its full blocks, and the keys of any prefix of the prompt's text are
// a prefix of its keys.
func FuzzKeysExtendPrefix(f *testing.F) {
	f.Add("system", "hello", "more text", 4)
	f.Add(strings.Repeat("x", 300), "", "y", 64)
	f.Add("é日本語", "ü", "\x1e", 3)
	f.Fuzz(func(t *testing.T, a, b, c string, block int) {
		block = 1 + (block&0xff)%97
		whole := Keys(block, a, b, c)
		part := Keys(block, a, b)
		if !slices.Equal(whole[:len(part)], part) {
			t.Fatalf("keys of a prefix are not a prefix of the keys")
		}
		if len(whole) != (len(a)+len(b)+len(c)+2)/block {
			t.Fatalf("%d keys for %d bytes in %d-byte blocks", len(whole), len(a)+len(b)+len(c)+2, block)
		}
	})
}
