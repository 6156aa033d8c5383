package admission

import (
	"sort"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// waiter is a request waiting in a Gate's queue. Its fields after done are
// written under the gate's lock before done is closed, and read by the
// waiting goroutine after.
type waiter struct {
	tenant   string
	tier     string
	prio     int
	seq      uint64 // arrival order
	enq      time.Time
	deadline time.Time
	timeout  time.Duration
	timer    clock.Timer

	decided bool     // admitted, refused or gone: out of the queue
	refusal *Refusal // nil when admitted
	done    chan struct{}
}

// queue is a Gate's waiting requests, ordered by priority (higher first),
// then arrival. Its bound is a few hundred at most (GateConfig.Queue), so a
// sorted slice is both the simplest and the fastest shape.
type queue []*waiter

// before reports whether a is served before b.
func before(a, b *waiter) bool {
	if a.prio != b.prio {
		return a.prio > b.prio
	}
	return a.seq < b.seq
}

// insert adds w at its place.
func (q *queue) insert(w *waiter) {
	i := sort.Search(len(*q), func(i int) bool { return before(w, (*q)[i]) })
	*q = append(*q, nil)
	copy((*q)[i+1:], (*q)[i:])
	(*q)[i] = w
}

// remove takes w out, reporting whether it was there.
func (q *queue) remove(w *waiter) bool {
	for i, x := range *q {
		if x == w {
			copy((*q)[i:], (*q)[i+1:])
			(*q)[len(*q)-1] = nil
			*q = (*q)[:len(*q)-1]
			return true
		}
	}
	return false
}

// victim returns the request a arrival of priority prio displaces from a
// full queue: the newest of the lowest tier, if that tier is lower; nil
// otherwise.
func (q queue) victim(prio int) *waiter {
	if len(q) == 0 {
		return nil
	}
	if last := q[len(q)-1]; last.prio < prio {
		return last
	}
	return nil
}
