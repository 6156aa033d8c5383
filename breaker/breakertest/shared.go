// Package breakertest holds test and simulation helpers for package
// breaker: SharedMemory, an in-process fleet of breakers. It is not part of
// the gateway's production code: only tests import it (as net/http/httptest).
package breakertest

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// SharedMemory is an in-process breaker.Fleet: the fleet-shared state of several
// simulated gateways in one process, for tests and simulations. Each
// gateway has its own view (Instance) whose id is the reporter id of its
// failures; its breakers are built WithStore of that view. Everything is
// synchronous: a failure that fires the fleet's rule has pushed the
// verdict to every joined breaker of the key by the time the reporting
// breaker's Done returns, so a simulation on a fake clock is
// deterministic.
//
// Per key it keeps the fleet's consecutive count with the distinct
// reporters of that run, the failures within FailuresWindow with their
// reporters, and the open entry (as MemoryStore does). The fleet opens a
// key when its counts reach a rule of the reporting breaker's settings,
// ConsecutiveFailures or Failures within FailuresWindow, with failures
// from at least minReporters distinct gateways: until now+OpenFor (no
// jitter, no MinOpen), calling Adopt on every joined breaker of the key in
// every gateway, and starting its counts afresh. A success resets the
// consecutive run and its reporters (not the window: the Failures rule
// counts whatever the successes in between). The ratio rules stay local
// here (fleet's Redis store decides them on the fleet's sums, read from
// the breakers' windows with RatioCounts).
//
// Recovery and re-opens are the fleet's too: the half-open probe successes
// of every gateway's breakers of a key (ProbeSuccess) count toward one
// RecoverySuccesses, and when they reach it the key closes fleet-wide
// (AdoptClose on every joined breaker, the reporter's included); a failed
// probe (Reopen) starts that count afresh and records the fleet's re-open
// count (Reopens), which a gateway that re-opens the key later grows its
// cooldown from; a close sets both to zero.
//
// PutOpen and ClearOpen by one gateway (a probe failure re-opening, a
// recovery, Retry-After, an observed trip, an operator) record the entry
// and push Adopt, or AdoptClose when the fleet had opened the key since
// its last close, to every other gateway's breakers of the key; both start
// the counts afresh. Pushes are
// delivered after the store's lock is released, in order, by one goroutine
// at a time (a push made while another goroutine delivers is left to it),
// so a listener may call back into breakers and the store.
//
// The zero value is not usable; use NewSharedMemory. Safe for concurrent
// use.
type SharedMemory struct {
	clock        clock.Reader
	minReporters int

	mu     sync.Mutex
	keys   map[string]*sharedKey
	outbox []sharedPush

	// pushing is held by the goroutine delivering the outbox (TryLock
	// only, so nothing waits on it).
	pushing sync.Mutex
}

// sharedKey is one key's fleet state.
type sharedKey struct {
	open   bool
	until  time.Time // zero: until closed
	reason string
	// verdict is set from an open until the next ClearOpen, even once the
	// entry expired: breakers that adopted it may still be open or
	// half-open, and a gateway's recovery closes them.
	verdict bool

	// recovered is the fleet's probe successes since the key last
	// opened; reopens its re-opens since it last closed.
	recovered, reopens int

	consec int
	run    map[string]struct{} // reporters of the consecutive run
	fails  []sharedFailure     // within window, oldest first
	window time.Duration       // FailuresWindow of the latest failure

	members []*sharedMember // in order of first Join, for deterministic pushes
}

type sharedFailure struct {
	at       time.Time
	reporter string
}

// sharedMember is one gateway's breakers of a key.
type sharedMember struct {
	id       string
	dirty    atomic.Bool
	breakers []*breaker.Breaker
}

type sharedPush struct {
	b      *breaker.Breaker
	open   bool
	until  time.Time
	reason string
}

// NewSharedMemory returns an empty SharedMemory that reads time from clock
// (nil: clock.Real) and opens a key fleet-wide only on failures from at
// least minReporters distinct gateways (the fleet's min_reporters; below 1
// means 1).
func NewSharedMemory(clk clock.Reader, minReporters int) *SharedMemory {
	if clk == nil {
		clk = clock.Real
	}
	return &SharedMemory{clock: clk, minReporters: max(minReporters, 1), keys: make(map[string]*sharedKey)}
}

// Instance returns gateway id's view of the fleet, the breaker.Fleet its breakers
// are built with. Views with the same id are the same gateway.
func (sm *SharedMemory) Instance(id string) *SharedInstance {
	return &SharedInstance{sm: sm, id: id}
}

// SharedCounts are a key's fleet counts in a SharedMemory (Counts).
type SharedCounts struct {
	// Consecutive is the fleet's run of failures since the last success.
	Consecutive int
	// Reporters is the number of distinct gateways in that run.
	Reporters int
	// InWindow is the number of failures within FailuresWindow.
	InWindow int
	// Joined is the number of breakers joined, over every gateway.
	Joined int
	// Recovered is the number of probe successes since the key last
	// opened or re-opened, over every gateway.
	Recovered int
	// Reopens is the fleet's re-open count since the key last closed.
	Reopens int
}

// Counts returns key's fleet counts.
func (sm *SharedMemory) Counts(key string) SharedCounts {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	k, ok := sm.keys[key]
	if !ok {
		return SharedCounts{}
	}
	k.pruneLocked(sm.clock.Now())
	c := SharedCounts{Consecutive: k.consec, Reporters: len(k.run), InWindow: len(k.fails),
		Recovered: k.recovered, Reopens: k.reopens}
	for _, m := range k.members {
		c.Joined += len(m.breakers)
	}
	return c
}

func (sm *SharedMemory) keyLocked(key string) *sharedKey {
	k, ok := sm.keys[key]
	if !ok {
		k = &sharedKey{run: make(map[string]struct{})}
		sm.keys[key] = k
	}
	return k
}

// openAtLocked reports whether the key is open at now, dropping an expired
// entry.
func (k *sharedKey) openAtLocked(now time.Time) bool {
	if k.open && !k.until.IsZero() && !k.until.After(now) {
		k.open, k.until, k.reason = false, time.Time{}, ""
	}
	return k.open
}

func (k *sharedKey) pruneLocked(now time.Time) {
	i := 0
	for i < len(k.fails) && !k.fails[i].at.After(now.Add(-k.window)) {
		i++
	}
	k.fails = k.fails[i:]
}

// resetLocked starts the counts afresh and clears every gateway's flag.
func (k *sharedKey) resetLocked() {
	k.consec = 0
	clear(k.run)
	k.fails = nil
	k.setDirtyLocked(false)
}

func (k *sharedKey) setDirtyLocked(v bool) {
	for _, m := range k.members {
		m.dirty.Store(v)
	}
}

// ruleLocked returns why the fleet's counts open the key under s, or "".
func (k *sharedKey) ruleLocked(s breaker.Settings, minReporters int) string {
	if s.ConsecutiveFailures > 0 && k.consec >= s.ConsecutiveFailures && len(k.run) >= minReporters {
		return fmt.Sprintf("%d consecutive failures from %s", k.consec, gateways(len(k.run)))
	}
	if s.Failures > 0 && len(k.fails) >= s.Failures {
		seen := make(map[string]struct{}, minReporters)
		for _, f := range k.fails {
			seen[f.reporter] = struct{}{}
		}
		if len(seen) >= minReporters {
			return fmt.Sprintf("%d failures within %s from %s", len(k.fails), k.window, gateways(len(seen)))
		}
	}
	return ""
}

func gateways(n int) string {
	if n == 1 {
		return "1 gateway"
	}
	return fmt.Sprintf("%d gateways", n)
}

// pushLocked queues a verdict for every breaker of the key, except those of
// gateway `from` unless all.
func (sm *SharedMemory) pushLocked(k *sharedKey, from string, all, open bool, until time.Time, reason string) {
	for _, m := range k.members {
		if !all && m.id == from {
			continue
		}
		for _, b := range m.breakers {
			sm.outbox = append(sm.outbox, sharedPush{b: b, open: open, until: until, reason: reason})
		}
	}
}

// flush delivers the outbox, one goroutine at a time, without any lock
// held (Adopt and AdoptClose never wait for a breaker's lock either).
func (sm *SharedMemory) flush() {
	for {
		if !sm.pushing.TryLock() {
			return
		}
		for {
			sm.mu.Lock()
			q := sm.outbox
			sm.outbox = nil
			sm.mu.Unlock()
			if len(q) == 0 {
				break
			}
			for _, p := range q {
				if p.open {
					p.b.Adopt(p.until, p.reason)
				} else {
					p.b.AdoptClose(p.reason)
				}
			}
		}
		sm.pushing.Unlock()
		sm.mu.Lock()
		more := len(sm.outbox) > 0
		sm.mu.Unlock()
		if !more {
			return
		}
	}
}

// SharedInstance is one gateway's view of a SharedMemory: a breaker.Fleet whose
// failures are reported under its id.
type SharedInstance struct {
	sm *SharedMemory
	id string
}

// ID returns the gateway's id.
func (v *SharedInstance) ID() string { return v.id }

// Join implements breaker.Fleet.
func (v *SharedInstance) Join(key string, b *breaker.Breaker) *atomic.Bool {
	sm := v.sm
	sm.mu.Lock()
	defer sm.mu.Unlock()
	k := sm.keyLocked(key)
	i := slices.IndexFunc(k.members, func(m *sharedMember) bool { return m.id == v.id })
	if i < 0 {
		m := &sharedMember{id: v.id}
		m.dirty.Store(k.consec > 0)
		k.members = append(k.members, m)
		i = len(k.members) - 1
	}
	m := k.members[i]
	if !slices.Contains(m.breakers, b) {
		m.breakers = append(m.breakers, b)
	}
	return &m.dirty
}

// Leave implements breaker.Fleet.
func (v *SharedInstance) Leave(key string, b *breaker.Breaker) {
	sm := v.sm
	sm.mu.Lock()
	defer sm.mu.Unlock()
	k, ok := sm.keys[key]
	if !ok {
		return
	}
	for _, m := range k.members {
		if m.id == v.id {
			m.breakers = slices.DeleteFunc(m.breakers, func(x *breaker.Breaker) bool { return x == b })
		}
	}
}

// Failure implements breaker.Fleet. A failure while the key is open fleet-wide is
// not counted: the fleet has decided, and the reporting breaker adopts the
// open entry (OpenUntil) as with any Store.
func (v *SharedInstance) Failure(key string, s breaker.Settings, at time.Time, reason string) {
	sm := v.sm
	sm.mu.Lock()
	now := sm.clock.Now()
	k := sm.keyLocked(key)
	if k.openAtLocked(now) {
		sm.mu.Unlock()
		return
	}
	k.consec++
	k.run[v.id] = struct{}{}
	k.window = s.FailuresWindow
	k.fails = append(k.fails, sharedFailure{at: at, reporter: v.id})
	k.pruneLocked(now)
	k.setDirtyLocked(true)
	if why := k.ruleLocked(s, sm.minReporters); why != "" {
		k.open, k.verdict, k.until = true, true, now.Add(s.OpenFor)
		k.reason = "fleet: " + why + "; last: " + reason + " (" + v.id + ")"
		k.recovered, k.reopens = 0, 0
		k.resetLocked()
		sm.pushLocked(k, v.id, true, true, k.until, k.reason)
	}
	sm.mu.Unlock()
	sm.flush()
}

// Success implements breaker.Fleet.
func (v *SharedInstance) Success(key string) {
	sm := v.sm
	sm.mu.Lock()
	if k, ok := sm.keys[key]; ok {
		k.consec = 0
		clear(k.run)
		k.setDirtyLocked(false)
	}
	sm.mu.Unlock()
}

// PutOpen implements Store: it records the entry and pushes it to the
// other gateways' breakers. The fleet's re-open count stays.
func (v *SharedInstance) PutOpen(key string, until time.Time, reason string) {
	v.putOpen(key, until, reason, -1)
}

// Reopen implements breaker.Fleet: PutOpen with the fleet's re-open count.
func (v *SharedInstance) Reopen(key string, until time.Time, reason string, reopens int) {
	v.putOpen(key, until, reason, max(reopens, 0))
}

// putOpen is PutOpen and Reopen; reopens < 0 keeps the count.
func (v *SharedInstance) putOpen(key string, until time.Time, reason string, reopens int) {
	sm := v.sm
	sm.mu.Lock()
	k := sm.keyLocked(key)
	k.open, k.verdict, k.until, k.reason = true, true, until, reason
	k.recovered = 0
	if reopens >= 0 {
		k.reopens = reopens
	}
	k.resetLocked()
	sm.pushLocked(k, v.id, false, true, until, reason)
	sm.mu.Unlock()
	sm.flush()
}

// ClearOpen implements Store: it drops the entry and, if the fleet had
// opened the key since the last close (the entry may have expired while
// breakers that adopted it still wait or probe), closes the other
// gateways' breakers.
func (v *SharedInstance) ClearOpen(key string) {
	sm := v.sm
	sm.mu.Lock()
	k := sm.keyLocked(key)
	if k.verdict {
		sm.pushLocked(k, v.id, false, false, time.Time{}, "closed in fleet by "+v.id)
	}
	k.open, k.verdict, k.until, k.reason = false, false, time.Time{}, ""
	k.recovered, k.reopens = 0, 0
	k.resetLocked()
	sm.mu.Unlock()
	sm.flush()
}

// ProbeSuccess implements breaker.Fleet: it counts the success while the fleet has
// the key open (since its last close), and closes the key fleet-wide when
// the count reaches s.RecoverySuccesses.
func (v *SharedInstance) ProbeSuccess(key string, s breaker.Settings) {
	sm := v.sm
	sm.mu.Lock()
	k, ok := sm.keys[key]
	if !ok || !k.verdict {
		sm.mu.Unlock()
		return
	}
	k.recovered++
	if k.recovered >= max(s.RecoverySuccesses, 1) {
		sm.pushLocked(k, v.id, true, false, time.Time{},
			fmt.Sprintf("closed in fleet by %s: %d probe successes", v.id, k.recovered))
		k.open, k.verdict, k.until, k.reason = false, false, time.Time{}, ""
		k.recovered, k.reopens = 0, 0
		k.resetLocked()
	}
	sm.mu.Unlock()
	sm.flush()
}

// Reopens implements breaker.Fleet.
func (v *SharedInstance) Reopens(key string) int {
	sm := v.sm
	sm.mu.Lock()
	defer sm.mu.Unlock()
	if k, ok := sm.keys[key]; ok {
		return k.reopens
	}
	return 0
}

// OpenUntil implements Store. Expired entries are dropped when read.
func (v *SharedInstance) OpenUntil(key string, now time.Time) (time.Time, string, bool) {
	sm := v.sm
	sm.mu.Lock()
	defer sm.mu.Unlock()
	k, ok := sm.keys[key]
	if !ok || !k.openAtLocked(now) {
		return time.Time{}, "", false
	}
	return k.until, k.reason, true
}

var _ breaker.Fleet = (*SharedInstance)(nil)
