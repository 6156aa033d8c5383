// Package prefix is the prompt-prefix index behind lb_policy prefix_cache:
// a prompt's text cut into fixed-size blocks, each keyed by a
// hash chained over the blocks before it (Keyer), a bounded
// least-recently-used set of such keys per upstream (Index), and the
// rendezvous weight that lets independent gateways agree on a new
// conversation's first upstream (Weight). It imports neither Caddy nor
// net/http and allocates nothing on its hot paths (Keyer.Write, Index.Match,
// Weight; Index.Insert only while the index grows to its bound).
//
// The model is vLLM's automatic prefix caching (vllm/v1/core/kv_cache_utils.py:
// a KV block's hash covers its parent block's hash and its own tokens, so a
// block is reused only with its whole prefix), with characters standing in
// for tokens because the gateway does not tokenize.
package prefix

import (
	"encoding/binary"

	"github.com/cespare/xxhash/v2"
)

// DefaultBlockChars is the block size in characters (bytes of UTF-8 text):
// 256, about 64 tokens at 4 characters per token, or four of vLLM's default
// 16-token KV blocks. Smaller blocks match a prompt more finely and cost
// more keys per request and more index memory per character remembered.
const DefaultBlockChars = 256

// separator is written between two segments of a prompt, so that "ab"+"c"
// and "a"+"bc" differ; it counts as one character.
const separator = "\x1e" // ASCII record separator

// Keyer computes the chained block keys of one prompt given as ordered
// text segments (system prompt, tool definitions, each message's text...).
// Key i is xxhash64(key i−1 as 8 little-endian bytes ‖ the block's bytes),
// key −1 being 0, so a block's key changes with any change before it. Only
// full blocks are keyed: a trailing partial block is not (an inference
// server caches only full blocks). The zero Keyer is not usable; call
// Reset. A Keyer is not safe for concurrent use.
type Keyer struct {
	d     xxhash.Digest
	block int // block size in bytes
	fill  int // bytes written into the current block
	prev  [8]byte
	keys  []uint64
	max   int // most keys kept
	wrote bool
}

// Reset starts a new prompt with blockChars-byte blocks (≤ 0:
// DefaultBlockChars), keeping at most maxKeys keys (≤ 0: no bound), appended
// to dst[:0] (pass a reused slice to allocate nothing).
func (k *Keyer) Reset(blockChars, maxKeys int, dst []uint64) {
	if blockChars <= 0 {
		blockChars = DefaultBlockChars
	}
	k.block, k.fill, k.max, k.wrote = blockChars, 0, maxKeys, false
	k.prev = [8]byte{}
	k.keys = dst[:0]
	k.startBlock()
}

func (k *Keyer) startBlock() {
	k.d.Reset()
	_, _ = k.d.Write(k.prev[:])
}

// Full reports whether maxKeys keys are kept: later text is ignored, so a
// caller may stop writing.
func (k *Keyer) Full() bool { return k.max > 0 && len(k.keys) >= k.max }

// Write adds the next segment of the prompt (a separator goes before every
// segment but the first).
func (k *Keyer) Write(segment string) {
	if k.wrote {
		k.writeString(separator)
	}
	k.wrote = true
	k.writeString(segment)
}

func (k *Keyer) writeString(s string) {
	for len(s) > 0 && !k.Full() {
		n := min(k.block-k.fill, len(s))
		_, _ = k.d.WriteString(s[:n])
		k.fill += n
		s = s[n:]
		if k.fill == k.block {
			key := k.d.Sum64()
			k.keys = append(k.keys, key)
			binary.LittleEndian.PutUint64(k.prev[:], key)
			k.fill = 0
			k.startBlock()
		}
	}
}

// Keys returns the keys of the full blocks written so far, in prompt order
// (the slice given to Reset, grown as needed).
func (k *Keyer) Keys() []uint64 { return k.keys }

// Keys returns the chained keys of the prompt made of segments, blockChars
// bytes per block (≤ 0: DefaultBlockChars); a convenience for tests and
// callers off the hot path.
func Keys(blockChars int, segments ...string) []uint64 {
	var k Keyer
	k.Reset(blockChars, 0, nil)
	for _, s := range segments {
		k.Write(s)
	}
	return k.Keys()
}

// Weight is the rendezvous (highest random weight) hashing weight of node
// (an upstream's dial address) for a prompt whose first block key is first
// (Thaler and Ravishankar 1998): every gateway computes the same weights
// without talking, so among equally loaded upstreams every gateway sends a
// new conversation to the one with the highest weight, and removing an
// upstream moves only the conversations it held.
func Weight(first uint64, node string) uint64 {
	return mix(first ^ xxhash.Sum64String(node))
}

// mix is splitmix64's finalizer (Steele, Lea and Flood 2014): it spreads
// every input bit over the output.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}
