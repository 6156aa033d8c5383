// Package registry is the one reference mechanism for state that outlives a
// request and survives config reloads (DESIGN §6): upstream entries, pool
// state (retry budgets, hedge caps, TTFT trackers), and next the tenants.
//
// A Table holds values by a key that does not change across reloads (a dial
// address, a pool's identity). A config takes references through its own
// Claims while it provisions and drops them all with one Release in its
// Cleanup; a reload's new config takes its references before the old one
// releases its own, so a value whose key both use is never destroyed in
// between. The last release destroys the value.
//
// It imports neither Caddy nor net/http, so the packages below the Caddy
// glue can use it.
package registry

import (
	"errors"
	"slices"
	"sort"
	"sync"
)

// ErrReleased is returned by Acquire on Claims that were already released:
// a request still running on a replaced config takes no new references,
// since nobody would release them.
var ErrReleased = errors.New("registry: claims already released")

// Table holds values of type V by key, each with a reference count. It is
// safe for concurrent use. The zero value is not usable: use NewTable.
type Table[V any] struct {
	mu      sync.Mutex
	m       map[string]*slot[V]
	destroy func(key string, v V)
}

type slot[V any] struct {
	v    V
	refs int
}

// NewTable returns an empty table. destroy, when not nil, is called with the
// table's lock released when the last reference to a value is dropped.
func NewTable[V any](destroy func(key string, v V)) *Table[V] {
	return &Table[V]{m: make(map[string]*slot[V]), destroy: destroy}
}

// Acquire returns the value under key, building it with build when absent,
// and records a reference to it in c. Claims hold at most one reference per
// (table, key): acquiring again through the same Claims returns the value
// without counting twice. onRelease, when not nil, runs when c drops this
// reference, before the count goes down. It returns build's error, or
// ErrReleased (and the current value, if there is one) when c was released.
func (t *Table[V]) Acquire(c *Claims, key string, build func() (V, error), onRelease func(V)) (V, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.released {
		v, _ := t.Peek(key)
		return v, ErrReleased
	}
	ck := claimKey{table: t, key: key}
	t.mu.Lock()
	if s, ok := t.m[key]; ok {
		if _, held := c.held[ck]; !held {
			s.refs++
			c.add(ck, t.releaser(key, s.v, onRelease))
		}
		t.mu.Unlock()
		return s.v, nil
	}
	v, err := build()
	if err != nil {
		t.mu.Unlock()
		var zero V
		return zero, err
	}
	t.m[key] = &slot[V]{v: v, refs: 1}
	t.mu.Unlock()
	c.add(ck, t.releaser(key, v, onRelease))
	return v, nil
}

func (t *Table[V]) releaser(key string, v V, onRelease func(V)) func() {
	return func() {
		if onRelease != nil {
			onRelease(v)
		}
		t.release(key)
	}
}

// Peek returns the value under key without taking a reference.
func (t *Table[V]) Peek(key string) (V, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if s, ok := t.m[key]; ok {
		return s.v, true
	}
	var zero V
	return zero, false
}

// Refs returns the number of references to the value under key, 0 if absent.
func (t *Table[V]) Refs(key string) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	if s, ok := t.m[key]; ok {
		return s.refs
	}
	return 0
}

// Len returns the number of values held.
func (t *Table[V]) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.m)
}

// Snapshot returns the keys and values held now, sorted by key.
func (t *Table[V]) Snapshot() (keys []string, values []V) {
	t.mu.Lock()
	keys = make([]string, 0, len(t.m))
	for k := range t.m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	values = make([]V, len(keys))
	for i, k := range keys {
		values[i] = t.m[k].v
	}
	t.mu.Unlock()
	return keys, values
}

// release drops one reference to key and destroys the value on the last.
func (t *Table[V]) release(key string) {
	t.mu.Lock()
	s, ok := t.m[key]
	if !ok {
		t.mu.Unlock()
		return
	}
	s.refs--
	if s.refs > 0 {
		t.mu.Unlock()
		return
	}
	delete(t.m, key)
	t.mu.Unlock()
	if t.destroy != nil {
		t.destroy(key, s.v)
	}
}

// claimKey names one reference held by Claims.
type claimKey struct {
	table any
	key   string
}

// Claims is the set of references one config holds, across every table.
// Safe for concurrent use; the zero value is ready.
type Claims struct {
	mu       sync.Mutex
	held     map[claimKey]func()
	order    []claimKey
	released bool
}

func (c *Claims) add(k claimKey, release func()) {
	if c.held == nil {
		c.held = make(map[claimKey]func())
	}
	c.held[k] = release
	c.order = append(c.order, k)
}

// Drop releases the reference that c holds to key in t, if any (a dynamic
// upstream that its source stopped returning).
func Drop[V any](c *Claims, t *Table[V], key string) {
	c.mu.Lock()
	k := claimKey{table: t, key: key}
	rel, ok := c.held[k]
	if ok {
		delete(c.held, k)
		if len(c.order) > 2*len(c.held)+16 {
			c.compactLocked()
		}
	}
	c.mu.Unlock()
	if ok {
		rel()
	}
}

// compactLocked rewrites the release order with only the keys still held,
// each at its newest position, so that keys dropped one by one (dynamic
// upstreams that churn) are not remembered for the config's lifetime.
func (c *Claims) compactLocked() {
	seen := make(map[claimKey]bool, len(c.held))
	out := make([]claimKey, 0, len(c.held))
	for i := len(c.order) - 1; i >= 0; i-- {
		k := c.order[i]
		if _, held := c.held[k]; held && !seen[k] {
			seen[k] = true
			out = append(out, k)
		}
	}
	slices.Reverse(out)
	c.order = out
}

// Release drops every reference, newest first. Later calls do nothing, and
// later Acquire calls through c fail with ErrReleased.
func (c *Claims) Release() {
	c.mu.Lock()
	if c.released {
		c.mu.Unlock()
		return
	}
	c.released = true
	var rels []func()
	for i := len(c.order) - 1; i >= 0; i-- {
		if rel, ok := c.held[c.order[i]]; ok {
			rels = append(rels, rel)
			delete(c.held, c.order[i])
		}
	}
	c.order = nil
	c.mu.Unlock()
	for _, rel := range rels {
		rel()
	}
}

// Released reports whether Release was called.
func (c *Claims) Released() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.released
}
