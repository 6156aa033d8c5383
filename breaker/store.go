package breaker

import (
	"sync"
	"time"
)

// Store holds the part of a breaker's state that is shared beyond one
// Breaker value: the open set, "key K is open until T, because R". fleet/
// implements it on Redis so that a fleet of gateways learns of an outage
// from whichever instance tripped first, instead of each rediscovering it by
// waiting (DESIGN §1); MemoryStore is the in-process one.
//
// The seam is deliberately narrow. A breaker calls its store only on slow
// paths, all under the breaker's lock: PutOpen when it opens (and on
// ExtendOpen, ForceOpen, TripObserved), ClearOpen when it closes (and on ForceClose,
// Reset), OpenUntil when the breaker is created and
// when it records a failure while closed, where a store that knows the key
// is open opens the local breaker at once, after one failure rather than
// after its own trip rules fire. Implementations must therefore answer from
// memory and never block (a Redis store serves OpenUntil from a local copy
// kept current by subscription, and writes asynchronously); they must be
// safe for concurrent use.
//
// A plain Store shares verdicts only: each breaker's trip rules count its
// own calls, so every gateway of a fleet discovers an outage by its own
// failures, and the number of requests that discover it grows with the
// fleet (docs/benchmarks.md, the outage discovery simulation). A Store that
// is also a Fleet shares the counts as well (DESIGN §9): the
// breaker reports each closed-state failure, and the success that ends a
// fleet run, and the fleet decides and pushes its verdicts back (Adopt,
// AdoptClose). In fleet mode a trip by the breaker's own rules stays local
// and is not PutOpen; Fleet has the table of what is published.
//
// The rolling-window counters themselves stay in the breaker: they are
// updated on every call, and the closed-state success path must stay
// lock-free and allocation-free (≤ 100 ns), which rules out a map lookup,
// an interface call per event or a round trip. A Fleet gets a success only
// while its flag says the fleet's run may be non-zero (one atomic load
// otherwise). Permits and probe slots are not in the store either: each
// gateway probes for itself, with jittered cooldowns so that a fleet does
// not probe in step (fleet/'s probe lease narrows that to one prober).
type Store interface {
	// PutOpen records that key is open until `until` (zero: until an
	// operator closes it) for the given reason.
	PutOpen(key string, until time.Time, reason string)
	// ClearOpen records that key closed. It is advisory: a shared store
	// may keep an entry that another gateway extended meanwhile.
	ClearOpen(key string)
	// OpenUntil reports whether key is open at now, until when (zero:
	// until closed by an operator) and why.
	OpenUntil(key string, now time.Time) (until time.Time, reason string, open bool)
}

// MemoryStore is an in-process Store: a map of open entries. Breakers that
// share it keep a key's open state when one breaker of that key is dropped
// and a new one is built (an upstream dropped and re-added by a reload). The
// zero value is not usable; use NewMemoryStore.
type MemoryStore struct {
	mu   sync.Mutex
	open map[string]openEntry
}

type openEntry struct {
	until  time.Time
	reason string
}

// NewMemoryStore returns an empty MemoryStore.
func NewMemoryStore() *MemoryStore { return &MemoryStore{open: make(map[string]openEntry)} }

// PutOpen implements Store.
func (m *MemoryStore) PutOpen(key string, until time.Time, reason string) {
	m.mu.Lock()
	m.open[key] = openEntry{until: until, reason: reason}
	m.mu.Unlock()
}

// ClearOpen implements Store.
func (m *MemoryStore) ClearOpen(key string) {
	m.mu.Lock()
	delete(m.open, key)
	m.mu.Unlock()
}

// OpenUntil implements Store. Expired entries are dropped when read.
func (m *MemoryStore) OpenUntil(key string, now time.Time) (time.Time, string, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.open[key]
	if !ok {
		return time.Time{}, "", false
	}
	if !e.until.IsZero() && !e.until.After(now) {
		delete(m.open, key)
		return time.Time{}, "", false
	}
	return e.until, e.reason, true
}

var _ Store = (*MemoryStore)(nil)
