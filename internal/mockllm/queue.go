package mockllm

import (
	"sync"
	"time"
)

// Defaults of a replica's KV cache (FleetConfig.KVBlocks,
// FleetConfig.KVBlockTokens).
const (
	// DefaultKVBlocks is the number of KV-cache blocks of a replica:
	// 2048 blocks of 16 tokens hold 32768 tokens, eight requests of the
	// 4096-token context /v1/models advertises.
	DefaultKVBlocks = 2048
	// DefaultKVBlockTokens is the number of tokens per KV-cache block,
	// vLLM's default block size.
	DefaultKVBlockTokens = 16
)

// scheduler admits requests to generation as vLLM's scheduler does: a
// request runs when a capacity slot is free and the KV cache has enough
// free blocks for its prompt; otherwise it waits, in FIFO order (the first
// waiter that does not fit holds back those behind it). A running request
// holds ceil((prompt + generated tokens) / block size) blocks, growing as
// it generates; a waiting one holds none. The mock never preempts: growth
// past the cache is granted (usage reads 1) and nothing more is scheduled
// until blocks are freed. A prompt larger than the whole cache is
// scheduled when nothing else runs.
type scheduler struct {
	blockTokens int // tokens per block, fixed

	mu       sync.Mutex
	capacity int // concurrent generations; 0 = unlimited
	blocks   int // KV-cache size in blocks
	used     int // blocks held by running requests; may exceed blocks
	running  int
	waiters  []*schedReq
}

// schedReq is one request's place in the scheduler, from enqueue to
// release.
type schedReq struct {
	prompt int           // prompt tokens
	queued time.Time     // when it was enqueued
	ready  chan struct{} // closed when it is scheduled; nil if it was at once

	// Set under scheduler.mu when the request is scheduled; read by its
	// owner after ready is closed (or at once).
	granted bool
	waited  time.Duration // time spent waiting, 0 when scheduled at once
	held    int           // KV blocks held
}

func newScheduler(capacity, blocks, blockTokens int) *scheduler {
	if blocks <= 0 {
		blocks = DefaultKVBlocks
	}
	if blockTokens <= 0 {
		blockTokens = DefaultKVBlockTokens
	}
	return &scheduler{capacity: max(capacity, 0), blocks: blocks, blockTokens: blockTokens}
}

// blocksFor is the number of blocks that hold n tokens.
func (q *scheduler) blocksFor(n int) int {
	return (max(n, 0) + q.blockTokens - 1) / q.blockTokens
}

// enqueue adds a request with the given number of prompt tokens. It is
// scheduled at once (granted, ready nil) when it fits and nobody waits;
// otherwise ready closes when it is scheduled.
func (q *scheduler) enqueue(prompt int) *schedReq {
	s := &schedReq{prompt: prompt, queued: time.Now()}
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.waiters) == 0 && q.fitsLocked(s) {
		q.scheduleLocked(s)
		return s
	}
	s.ready = make(chan struct{})
	q.waiters = append(q.waiters, s)
	return s
}

// abandon withdraws a waiting request that gave up; one scheduled in the
// meantime is released.
func (q *scheduler) abandon(s *schedReq) {
	q.mu.Lock()
	if s.granted {
		q.mu.Unlock()
		q.release(s)
		return
	}
	for i, x := range q.waiters {
		if x == s {
			q.waiters = append(q.waiters[:i], q.waiters[i+1:]...)
			break
		}
	}
	// The head may have been what held the others back.
	q.grantLocked()
	q.mu.Unlock()
}

// grow records that a running request now has tokens tokens (prompt plus
// generated) in the KV cache. Blocks are only ever added.
func (q *scheduler) grow(s *schedReq, tokens int) {
	n := q.blocksFor(tokens)
	if n <= s.held {
		return
	}
	q.mu.Lock()
	q.used += n - s.held
	s.held = n
	q.mu.Unlock()
}

// release ends a scheduled request: its slot and blocks are freed and the
// waiters that now fit are scheduled.
func (q *scheduler) release(s *schedReq) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.running--
	q.used -= s.held
	s.held = 0
	q.grantLocked()
}

// setCapacity changes the capacity (0 = unlimited) and schedules waiters
// that now fit.
func (q *scheduler) setCapacity(n int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.capacity = max(n, 0)
	q.grantLocked()
}

// setBlocks changes the KV-cache size (n <= 0 means DefaultKVBlocks) and
// schedules waiters that now fit. Blocks already held stay held.
func (q *scheduler) setBlocks(n int) {
	if n <= 0 {
		n = DefaultKVBlocks
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	q.blocks = n
	q.grantLocked()
}

// fitsLocked reports whether s can be scheduled now.
func (q *scheduler) fitsLocked(s *schedReq) bool {
	if q.capacity != 0 && q.running >= q.capacity {
		return false
	}
	return q.running == 0 || q.blocksFor(s.prompt) <= q.blocks-q.used
}

func (q *scheduler) scheduleLocked(s *schedReq) {
	s.granted = true
	s.held = q.blocksFor(s.prompt)
	if s.ready != nil {
		s.waited = time.Since(s.queued)
	}
	q.running++
	q.used += s.held
}

func (q *scheduler) grantLocked() {
	for len(q.waiters) > 0 && q.fitsLocked(q.waiters[0]) {
		s := q.waiters[0]
		q.waiters = q.waiters[1:]
		q.scheduleLocked(s)
		close(s.ready)
	}
}

// schedLoad is a snapshot of the scheduler.
type schedLoad struct {
	running, waiting, capacity int
	blocks, used               int
}

// kvUsage is the fraction of KV-cache blocks in use, 0 to 1.
func (l schedLoad) kvUsage() float64 {
	return min(1, float64(l.used)/float64(l.blocks))
}

func (q *scheduler) load() schedLoad {
	q.mu.Lock()
	defer q.mu.Unlock()
	return schedLoad{running: q.running, waiting: len(q.waiters), capacity: q.capacity, blocks: q.blocks, used: q.used}
}
