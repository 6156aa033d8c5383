package breaker

import (
	"slices"
	"strings"
	"sync"
)

// Registry holds breakers by key, for the gateway: one per upstream (or
// upstream and model). The caddymodule keeps a Registry in a package-level
// pool so that breakers survive config reloads (DESIGN §5). Safe for
// concurrent use.
type Registry struct {
	opts []Option
	mu   sync.RWMutex
	m    map[string]*Breaker
}

// NewRegistry returns an empty registry whose breakers are built with opts
// (a shared clock, listener and store: the listener tells breakers apart by
// Transition.Key).
func NewRegistry(opts ...Option) *Registry {
	return &Registry{opts: slices.Clone(opts), m: make(map[string]*Breaker)}
}

// Get returns the breaker for key, creating it with s if absent. An existing
// breaker whose settings differ from s gets them (SetSettings), so that a
// reload's new thresholds apply to the state it already has.
func (r *Registry) Get(key string, s Settings) *Breaker {
	r.mu.RLock()
	b, ok := r.m[key]
	r.mu.RUnlock()
	if !ok {
		r.mu.Lock()
		if b, ok = r.m[key]; !ok {
			b = New(key, s, r.opts...)
			r.m[key] = b
		}
		r.mu.Unlock()
		if !ok {
			return b
		}
	}
	if b.cfg.Load().raw != s {
		b.SetSettings(s)
	}
	return b
}

// Lookup returns the breaker for key, if there is one.
func (r *Registry) Lookup(key string) (*Breaker, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	b, ok := r.m[key]
	return b, ok
}

// All returns every breaker, sorted by key.
func (r *Registry) All() []*Breaker {
	r.mu.RLock()
	all := make([]*Breaker, 0, len(r.m))
	for _, b := range r.m {
		all = append(all, b)
	}
	r.mu.RUnlock()
	slices.SortFunc(all, func(a, b *Breaker) int { return strings.Compare(a.key, b.key) })
	return all
}

// Delete forgets the breaker for key (an upstream removed from every
// config). Holders of the *Breaker may keep using it.
func (r *Registry) Delete(key string) {
	r.mu.Lock()
	delete(r.m, key)
	r.mu.Unlock()
}
