package upstream

import (
	"sort"
	"sync"
	"sync/atomic"
)

// Bounds of ModelNames (the model name comes from clients).
const (
	// DefaultMaxModels is how many model names that an upstream has served
	// become metric labels; the rest are "other".
	DefaultMaxModels = 64
	// DefaultMaxUnservedModels is how many names no upstream has served yet
	// get breakers of their own under scope model; the rest share "other".
	DefaultMaxUnservedModels = 256
)

// ModelNames bounds the model names that become metric labels, breaker keys
// and TTFT tracker keys: a client can send any name, so a name counts only
// once an upstream served it successfully (Learn), and only so many of them.
// Safe for concurrent use.
type ModelNames struct {
	served      sync.Map
	nServed     atomic.Int64
	maxServed   int64
	unserved    sync.Map
	nUnserved   atomic.Int64
	maxUnserved int64
}

// NewModelNames returns a set that learns up to maxServed served names and
// gives breakers to up to maxUnserved names not served yet.
func NewModelNames(maxServed, maxUnserved int) *ModelNames {
	return &ModelNames{maxServed: int64(maxServed), maxUnserved: int64(maxUnserved)}
}

// Learn accepts a model name that an upstream served successfully, while
// fewer than the bound are known.
func (m *ModelNames) Learn(model string) {
	if model == "" {
		return
	}
	if _, ok := m.served.Load(model); ok {
		return
	}
	if !reserve(&m.nServed, m.maxServed) {
		return
	}
	if _, loaded := m.served.LoadOrStore(model, struct{}{}); loaded {
		m.nServed.Add(-1)
	}
}

// Label returns the label value for a model: the name once learned,
// "other" before, "unknown" for none.
func (m *ModelNames) Label(model string) string {
	if model == "" {
		return "unknown"
	}
	if _, ok := m.served.Load(model); ok {
		return model
	}
	return "other"
}

// BreakerKey returns the model part of a scope-model breaker key: the name
// itself when served, or while fewer than the bound of unserved names were
// seen; else "other". "unknown" for none.
func (m *ModelNames) BreakerKey(model string) string {
	if model == "" {
		return "unknown"
	}
	if m.Label(model) == model {
		return model
	}
	if _, ok := m.unserved.Load(model); ok {
		return model
	}
	if !reserve(&m.nUnserved, m.maxUnserved) {
		return "other"
	}
	if _, loaded := m.unserved.LoadOrStore(model, struct{}{}); loaded {
		m.nUnserved.Add(-1)
	}
	return model
}

// reserve takes one of max places in n.
func reserve(n *atomic.Int64, max int64) bool {
	if n.Add(1) > max {
		n.Add(-1)
		return false
	}
	return true
}

func sortViews(v []BreakerView) {
	sort.SliceStable(v, func(i, j int) bool {
		if v[i].Key != v[j].Key {
			return v[i].Key < v[j].Key
		}
		return v[i].Handler < v[j].Handler
	})
}
