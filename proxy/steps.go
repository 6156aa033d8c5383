package proxy

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// stepWorkerIdle is how long a step worker waits for the next request
// before it exits.
const stepWorkerIdle = 5 * time.Second

// stepPool runs requests' steps up to commit (exchange.run) off the
// handler's goroutine (ServeHTTP says why), on workers that outlive a
// request. A fresh goroutine would grow its stack two or three times on
// the way (the round trip, a pick, logging), each growth a copy of the
// whole stack: at 100 concurrent streams those copies were 4% of the
// gateway's CPU and +1 to +4 ms of added time to first token (S3). A
// worker keeps the stack it grew for the next request and is free again at
// commit, so a proxy has about as many workers as requests waiting for
// their first event, not as many as streams it holds. A worker idle for
// stepWorkerIdle exits, and Close lets every idle one go. The workers hold
// nothing of a request once run returns.
type stepPool struct {
	clock clock.Clock
	// jobs is unbuffered: a send succeeds only into a waiting worker.
	jobs chan *exchange
	stop chan struct{}
	once sync.Once
	// live counts the workers running or waiting.
	live atomic.Int32
}

func newStepPool(clk clock.Clock) *stepPool {
	return &stepPool{clock: clk, jobs: make(chan *exchange), stop: make(chan struct{})}
}

// run runs x.run on a waiting worker, or on a new one when none waits.
func (s *stepPool) run(x *exchange) {
	select {
	case s.jobs <- x:
	default:
		s.live.Add(1)
		go s.work(x)
	}
}

func (s *stepPool) work(x *exchange) {
	defer s.live.Add(-1)
	idle := s.clock.NewTimer(stepWorkerIdle)
	defer idle.Stop()
	for {
		x.run()
		x = nil
		idle.Reset(stepWorkerIdle)
		select {
		case x = <-s.jobs:
		case <-idle.C():
			return
		case <-s.stop:
			return
		}
	}
}

// close lets every waiting worker exit; a request served after it still
// runs, on a worker that exits when the request is through its steps.
func (s *stepPool) close() { s.once.Do(func() { close(s.stop) }) }
