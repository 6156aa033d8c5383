package upstream

import (
	"errors"
	"fmt"
	"math"
	"net/http"
	"sync"

	"github.com/llmproxy/caddy-llm-proxy/prefix"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/saturation"
)

// DefaultPrefixLoadFactor is PrefixCache's default LoadFactor: the
// upstream holding a conversation's prefix keeps it while its load is at
// most twice the least loaded candidate's plus one request. Prefilling a
// long prompt again costs more than sharing a batch with a few more
// requests; saturation, not this factor, protects a full server.
const DefaultPrefixLoadFactor = 2.0

// PrefixCache is the prefix-cache-aware selection policy (lb_policy
// prefix_cache; DESIGN §7): it sends a request to the upstream
// most likely to hold its prompt's prefix in its KV cache, as this gateway
// remembers it, unless that upstream is loaded well beyond the least
// loaded candidate (consistent hashing with bounded loads, Mirrokni,
// Thorup and Zadimoghaddam 2018).
//
// Every upstream's shared Entry keeps a prefix.Index of the chained keys
// of the prompts recently sent to it (BlockChars characters per block, at
// most MaxBlocks blocks, least recently used forgotten first), so the index
// is shared by every handler and survives reloads. Among the candidates the
// pool has already filtered (breakers, saturation, max_requests, already
// tried):
//
//   - the candidate with the longest matched prefix (ties: the less loaded,
//     then the higher rendezvous weight) wins while its load is at most
//     LoadFactor × (least load + one request): result "hit";
//   - when it is loaded beyond that, the least loaded candidate wins
//     (ties: the longer match, then the rendezvous weight): "overloaded";
//   - when no candidate matches a block, the least loaded wins, ties broken
//     by the rendezvous weight of the prompt's first block
//     (prefix.Weight), so independent gateways send a new conversation's
//     first turn to the same upstream without talking: "miss".
//
// The chosen upstream's index then learns the prompt's blocks (a
// conversation that moved has a new home). Load is the candidate's
// saturation score (Candidate.Score: the queue and KV-cache signals when
// the pool reads them, else in-flight attempts ÷ DefaultQueueThreshold);
// loads within half a request of the least count as equally loaded. A
// request whose prompt is shorter than one block goes to the least loaded,
// ties broken at random. The zero value uses every default; a PrefixCache
// is safe for concurrent use and must not be copied after first use.
type PrefixCache struct {
	// BlockChars is the block size in characters (bytes of UTF-8 text).
	// Default prefix.DefaultBlockChars (256).
	BlockChars int
	// MaxBlocks bounds each upstream's index (and the blocks read of one
	// prompt). Default prefix.DefaultMaxBlocks (8,192). Handlers sharing
	// an upstream share its index; the largest MaxBlocks applies.
	MaxBlocks int
	// LoadFactor bounds how much more loaded than the least loaded
	// candidate the upstream holding the prefix may be. Default
	// DefaultPrefixLoadFactor (2); at least 1.
	LoadFactor float64
	// Observer, when set, is told of each routing decision (metrics).
	Observer PrefixObserver

	bufs sync.Pool // *[]uint64 key buffers
}

// PrefixResult is how PrefixCache routed one pick, the result label of
// caddy_llm_proxy_prefix_routed_total.
type PrefixResult uint8

const (
	// PrefixHit: the upstream with the longest matched prefix took it.
	PrefixHit PrefixResult = iota
	// PrefixMiss: no candidate matched a block of the prompt.
	PrefixMiss
	// PrefixOverloaded: a candidate matched but was loaded beyond the
	// bound; the least loaded took it.
	PrefixOverloaded
)

// String returns "hit", "miss" or "overloaded".
func (r PrefixResult) String() string {
	switch r {
	case PrefixHit:
		return "hit"
	case PrefixMiss:
		return "miss"
	case PrefixOverloaded:
		return "overloaded"
	}
	return fmt.Sprintf("result(%d)", r)
}

// PrefixObserver receives PrefixCache's decisions. Implementations must be
// safe for concurrent use and cheap.
type PrefixObserver interface {
	// PrefixRouted reports one pick: the blocks of the prompt the chosen
	// upstream's index held, the prompt's blocks (at most MaxBlocks), and
	// how the choice was made.
	PrefixRouted(matchedBlocks, promptBlocks int, result PrefixResult)
}

// Validate checks the settings: no negative size, a LoadFactor of at least
// 1 (or 0 for the default).
func (s *PrefixCache) Validate() error {
	var errs []error
	if s.BlockChars < 0 || s.MaxBlocks < 0 {
		errs = append(errs, errors.New("prefix_cache: block_chars and max_blocks must not be negative"))
	}
	if s.LoadFactor != 0 && !(s.LoadFactor >= 1 && !math.IsInf(s.LoadFactor, 0)) {
		errs = append(errs, fmt.Errorf("prefix_cache: load_factor %v must be at least 1", s.LoadFactor))
	}
	return errors.Join(errs...)
}

func (s *PrefixCache) blockChars() int {
	if s.BlockChars > 0 {
		return s.BlockChars
	}
	return prefix.DefaultBlockChars
}

func (s *PrefixCache) maxBlocks() int {
	if s.MaxBlocks > 0 {
		return s.MaxBlocks
	}
	return prefix.DefaultMaxBlocks
}

func (s *PrefixCache) loadFactor() float64 {
	if s.LoadFactor >= 1 {
		return s.LoadFactor
	}
	return DefaultPrefixLoadFactor
}

// Select implements Selector for a pick without a prompt: the least
// loaded candidate, ties broken at random (as LeastQueue).
func (s *PrefixCache) Select(cs []Candidate, r *http.Request, w http.ResponseWriter) int {
	return LeastQueue{}.Select(cs, r, w)
}

func (*PrefixCache) wantsScores() {}

// prefixIndex returns the entry's prefix index, created on first use with
// room for maxBlocks (grown when a config asks for more).
func (e *Entry) prefixIndex(maxBlocks int) *prefix.Index {
	x := e.prefix.Load()
	if x == nil {
		e.prefix.CompareAndSwap(nil, prefix.NewIndex(maxBlocks))
		x = e.prefix.Load()
	}
	x.Grow(maxBlocks)
	return x
}

// PrefixBlocks returns how many prefix blocks the upstream's index holds
// (0 when no prefix_cache policy has used it).
func (e *Entry) PrefixBlocks() int {
	if x := e.prefix.Load(); x != nil {
		return x.Len()
	}
	return 0
}

// choose is the selection step of Pick: the pool's selector, given the
// prompt when it routes by prefix.
func (p *Pool) choose(cs []Candidate, r *http.Request, w http.ResponseWriter, req *proxy.PickRequest) int {
	pc, ok := p.sel.(*PrefixCache)
	if !ok || req.Prompt == nil {
		return p.sel.Select(cs, r, w)
	}
	step := 1.0 / saturation.DefaultQueueThreshold
	if p.sat != nil {
		step = 1 / p.sat.QueueThreshold
	}
	return pc.pick(cs, req.Prompt, step, r, w)
}

// pick is PrefixCache's choice among cs for the prompt; step is one
// request's share of a score (1 ÷ queue_threshold).
func (s *PrefixCache) pick(cs []Candidate, prompt func(func(string) bool), step float64, r *http.Request, w http.ResponseWriter) int {
	bp, _ := s.bufs.Get().(*[]uint64)
	if bp == nil {
		bp = new([]uint64)
	}
	defer s.bufs.Put(bp)
	var k prefix.Keyer
	k.Reset(s.blockChars(), s.maxBlocks(), *bp)
	prompt(func(seg string) bool {
		k.Write(seg)
		return !k.Full()
	})
	keys := k.Keys()
	*bp = keys[:0]
	if len(keys) == 0 {
		i := s.Select(cs, r, w)
		s.learn(cs, i, keys, 0, PrefixMiss)
		return i
	}
	var mbuf [16]int
	matched := mbuf[:0]
	least := math.Inf(1)
	for _, c := range cs {
		matched = append(matched, c.Entry.prefixIndex(s.maxBlocks()).Match(keys))
		least = min(least, c.Score)
	}
	tie := least + step/2
	// The preferred candidate: the longest match, then the less loaded,
	// then the rendezvous weight.
	pref := -1
	for i, c := range cs {
		if pref < 0 || better(matched[i], matched[pref], c, cs[pref], keys[0]) {
			pref = i
		}
	}
	if matched[pref] > 0 && cs[pref].Score <= s.loadFactor()*(least+step)+1e-9 {
		s.learn(cs, pref, keys, matched[pref], PrefixHit)
		return pref
	}
	// The least loaded: the longer match, then the rendezvous weight.
	best := -1
	for i, c := range cs {
		if c.Score > tie {
			continue
		}
		if best < 0 || matched[i] > matched[best] ||
			(matched[i] == matched[best] && prefix.Weight(keys[0], c.Target.Addr) > prefix.Weight(keys[0], cs[best].Target.Addr)) {
			best = i
		}
	}
	result := PrefixMiss
	if matched[pref] > 0 {
		result = PrefixOverloaded
	}
	s.learn(cs, best, keys, matched[best], result)
	return best
}

// better reports whether candidate a (matched ma) is preferred to b.
func better(ma, mb int, a, b Candidate, first uint64) bool {
	if ma != mb {
		return ma > mb
	}
	if a.Score != b.Score {
		return a.Score < b.Score
	}
	return prefix.Weight(first, a.Target.Addr) > prefix.Weight(first, b.Target.Addr)
}

// learn records the prompt on the chosen upstream's index and reports the
// decision.
func (s *PrefixCache) learn(cs []Candidate, i int, keys []uint64, matched int, result PrefixResult) {
	if i < 0 || i >= len(cs) {
		return
	}
	if len(keys) > 0 {
		cs[i].Entry.prefixIndex(s.maxBlocks()).Insert(keys)
	}
	if s.Observer != nil {
		s.Observer.PrefixRouted(matched, len(keys), result)
	}
}

var _ Selector = (*PrefixCache)(nil)
