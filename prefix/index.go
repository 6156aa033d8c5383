package prefix

import "sync"

// DefaultMaxBlocks is the number of block keys an Index remembers per
// upstream by default: 8,192 blocks of DefaultBlockChars characters are
// 2 MiB of prompt text, about 500,000 tokens, about what the KV cache of a
// vLLM server on one 80 GB GPU holds for an 8B model (128 KiB per token in
// 16-bit precision, some 60 GB free for the cache). At BytesPerBlock that
// is about 420 KiB per upstream when full.
const DefaultMaxBlocks = 8192

// BytesPerBlock is about the memory an Index holds per remembered block,
// measured by TestIndexMemoryPerBlock (Go 1.26, amd64: 48.5 bytes when
// 8,192 blocks are held, 51.8 at 16,384): a 16-byte list node (the key and
// two int32 links) and a map[uint64]int32 entry with its share of the map's
// empty slots.
const BytesPerBlock = 52

// Index is one upstream's bounded set of recently sent block keys, least
// recently used evicted first. Insert touches a prompt's keys from the last
// to the first, so the first blocks of a prompt are the most recent and a
// prefix is forgotten from its end, as a server's cache evicts it. It is
// safe for concurrent use; its memory grows with use up to its bound
// (BytesPerBlock per key).
type Index struct {
	mu    sync.Mutex
	max   int
	pos   map[uint64]int32
	nodes []node
	// head is the most recently used node, tail the least; -1 when empty.
	head, tail int32
}

type node struct {
	key        uint64
	prev, next int32
}

// NewIndex returns an empty index that remembers at most maxBlocks keys
// (≤ 0: DefaultMaxBlocks).
func NewIndex(maxBlocks int) *Index {
	if maxBlocks <= 0 {
		maxBlocks = DefaultMaxBlocks
	}
	return &Index{max: maxBlocks, pos: map[uint64]int32{}, head: -1, tail: -1}
}

// Match returns how many of keys, from the first, the index holds: the
// matched prefix in blocks. It does not change recency.
func (x *Index) Match(keys []uint64) int {
	x.mu.Lock()
	defer x.mu.Unlock()
	for i, k := range keys {
		if _, ok := x.pos[k]; !ok {
			return i
		}
	}
	return len(keys)
}

// Insert remembers keys (a prompt's chained keys, in order) as just sent,
// evicting the least recently used keys beyond the bound. When keys are
// more than the bound, only their first max are remembered.
func (x *Index) Insert(keys []uint64) {
	x.mu.Lock()
	defer x.mu.Unlock()
	keys = keys[:min(len(keys), x.max)]
	for i := len(keys) - 1; i >= 0; i-- {
		x.touch(keys[i])
	}
}

// touch makes key the most recent, adding it (and evicting the least
// recent when full).
func (x *Index) touch(key uint64) {
	if i, ok := x.pos[key]; ok {
		x.unlink(i)
		x.pushFront(i)
		return
	}
	var i int32
	if len(x.nodes) < x.max {
		i = int32(len(x.nodes))
		x.nodes = append(x.nodes, node{})
	} else {
		i = x.tail
		x.unlink(i)
		delete(x.pos, x.nodes[i].key)
	}
	x.nodes[i].key = key
	x.pos[key] = i
	x.pushFront(i)
}

func (x *Index) unlink(i int32) {
	n := &x.nodes[i]
	if n.prev >= 0 {
		x.nodes[n.prev].next = n.next
	} else {
		x.head = n.next
	}
	if n.next >= 0 {
		x.nodes[n.next].prev = n.prev
	} else {
		x.tail = n.prev
	}
}

func (x *Index) pushFront(i int32) {
	n := &x.nodes[i]
	n.prev, n.next = -1, x.head
	if x.head >= 0 {
		x.nodes[x.head].prev = i
	}
	x.head = i
	if x.tail < 0 {
		x.tail = i
	}
}

// Len returns the number of keys remembered.
func (x *Index) Len() int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return len(x.pos)
}

// Max returns the bound on the keys remembered.
func (x *Index) Max() int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.max
}

// Grow raises the bound to maxBlocks when that is larger (several configs
// sharing an upstream with different max_blocks: the largest applies). It
// never shrinks the index.
func (x *Index) Grow(maxBlocks int) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.max = max(x.max, maxBlocks)
}

// Clear forgets every key (the upstream restarted: its cache is empty).
func (x *Index) Clear() {
	x.mu.Lock()
	defer x.mu.Unlock()
	clear(x.pos)
	x.nodes = x.nodes[:0]
	x.head, x.tail = -1, -1
}
