package mockllm

import "sync"

// slotQueue bounds concurrent generations; requests beyond the capacity
// wait in FIFO order, like vLLM's scheduler waiting queue.
type slotQueue struct {
	mu       sync.Mutex
	capacity int // 0 = unlimited
	running  int
	waiters  []*slotWaiter
}

// slotWaiter is a request waiting for a slot; ready is closed when the
// slot has been handed to it.
type slotWaiter struct {
	ready   chan struct{}
	granted bool
}

// enqueue takes a slot at once when one is free and nobody waits, and
// returns nil; otherwise it returns a waiter whose ready channel closes
// when the slot is granted.
func (q *slotQueue) enqueue() *slotWaiter {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.waiters) == 0 && (q.capacity == 0 || q.running < q.capacity) {
		q.running++
		return nil
	}
	w := &slotWaiter{ready: make(chan struct{})}
	q.waiters = append(q.waiters, w)
	return w
}

// abandon withdraws a waiter that gave up; a slot granted in the meantime
// is released.
func (q *slotQueue) abandon(w *slotWaiter) {
	q.mu.Lock()
	if w.granted {
		q.mu.Unlock()
		q.release()
		return
	}
	for i, x := range q.waiters {
		if x == w {
			q.waiters = append(q.waiters[:i], q.waiters[i+1:]...)
			break
		}
	}
	q.mu.Unlock()
}

// release gives a slot back, handing it to the first waiter if any.
func (q *slotQueue) release() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.running--
	q.grantLocked()
}

// setCapacity changes the capacity (0 = unlimited) and wakes waiters that
// now fit.
func (q *slotQueue) setCapacity(n int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.capacity = max(n, 0)
	q.grantLocked()
}

func (q *slotQueue) grantLocked() {
	for len(q.waiters) > 0 && (q.capacity == 0 || q.running < q.capacity) {
		w := q.waiters[0]
		q.waiters = q.waiters[1:]
		w.granted = true
		q.running++
		close(w.ready)
	}
}

// load returns the running and waiting counts and the capacity.
func (q *slotQueue) load() (running, waiting, capacity int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.running, len(q.waiters), q.capacity
}
