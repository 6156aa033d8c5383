package proxy

import (
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

// countingRetries grants every retry and counts what it is asked.
type countingRetries struct {
	requests, charged atomic.Int64
}

func (c *countingRetries) Request()       { c.requests.Add(1) }
func (c *countingRetries) TryRetry() bool { c.charged.Add(1); return true }
func (c *countingRetries) Backoff(int, time.Duration, time.Duration) (time.Duration, bool) {
	return 0, true
}

// countingHedging hedges at once and counts what it is asked.
type countingHedging struct {
	requests, charged atomic.Int64
}

func (c *countingHedging) Delay(RequestInfo) (time.Duration, bool) { return time.Millisecond, true }
func (c *countingHedging) Request()                                { c.requests.Add(1) }
func (c *countingHedging) TryHedge() bool                          { c.charged.Add(1); return true }
func (c *countingHedging) Observe(RequestInfo, time.Duration)      {}
func (c *countingHedging) MaxHedges() int                          { return 1 }

// Issue 19: the retry budget is charged only when an upstream will be
// attempted. The first attempt fails with a 503; every later pick finds the
// pool's breakers open. The old order (TryRetry, then pick) charged a retry
// for nothing on every such request, draining the budget that the pool's
// recovery needs.
func TestRetryBudgetNotChargedWithoutAnAttempt(t *testing.T) {
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	})
	rs := &countingRetries{}
	p, _, _ := newTestProxy(t, Config{Retries: rs, MaxAttempts: 3}, up)
	p.cfg.Balancer = balancerFunc(func(req PickRequest) (Upstream, error) {
		if len(req.Tried) > 0 {
			return Upstream{}, &UnavailableError{CircuitOpen: true, Reason: "every breaker is open"}
		}
		return Upstream{Addr: up.addr()}, nil
	})
	p.primary.Balancer = p.cfg.Balancer
	for range 5 {
		p.ServeHTTP(httptest.NewRecorder(), post(`{"model":"m"}`))
	}
	if c := up.calls.Load(); c != 5 {
		t.Fatalf("upstream calls %d, want 5 (one per request)", c)
	}
	if n := rs.charged.Load(); n != 0 {
		t.Fatalf("the budget was charged %d retries with no upstream to attempt, want 0", n)
	}
	if n := rs.requests.Load(); n != 5 {
		t.Fatalf("Request() called %d times for 5 requests", n)
	}
}

// When an upstream is there, the retry is charged once per attempt made.
func TestRetryBudgetChargedOncePerRetry(t *testing.T) {
	bad := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	})
	good := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	rs := &countingRetries{}
	p, _, _ := newTestProxy(t, Config{Retries: rs, MaxAttempts: 3}, bad, good)
	res := p.ServeHTTP(httptest.NewRecorder(), post(`{"model":"m","stream":true}`))
	if res.Outcome != OutcomeSuccess || res.Attempts != 2 {
		t.Fatalf("result %+v, want a success on the second attempt", res)
	}
	if n := rs.charged.Load(); n != 1 {
		t.Fatalf("%d retries charged for one retry made", n)
	}
}

// A hedge that finds no other upstream charges neither the hedge cap nor
// the retry budget.
func TestHedgeNotChargedWithoutAnUpstream(t *testing.T) {
	slow := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(50 * time.Millisecond)
		sseUpstream(chunkA, chunkEnd, done)(w, r)
	})
	rs, hs := &countingRetries{}, &countingHedging{}
	p, _, _ := newTestProxy(t, Config{Retries: rs, Hedging: hs, MaxAttempts: 3}, slow)
	p.cfg.Balancer = balancerFunc(func(req PickRequest) (Upstream, error) {
		if req.Hedge {
			return Upstream{}, &UnavailableError{CircuitOpen: true, Reason: "no closed breaker"}
		}
		return Upstream{Addr: slow.addr(), Closed: true}, nil
	})
	p.primary.Balancer = p.cfg.Balancer
	res := p.ServeHTTP(httptest.NewRecorder(), post(`{"model":"m","stream":true}`))
	if res.Outcome != OutcomeSuccess || res.Hedged {
		t.Fatalf("result %+v, want an unhedged success", res)
	}
	if h, r := hs.charged.Load(), rs.charged.Load(); h != 0 || r != 0 {
		t.Fatalf("hedge cap charged %d, budget %d, with no upstream for the hedge; want 0 and 0", h, r)
	}
}

// Each request is counted once by a budget: the primary fails, the ladder
// takes the request to a fallback pool that shares the primary's budget
// (the same upstreams, another model), which fails too. The budget saw one
// request, not two.
func TestRequestCountedOncePerBudget(t *testing.T) {
	primary := newUpstream(t, failing(503))
	small := newUpstream(t, failing(503))
	rs := &countingRetries{}
	f := Fallback{Model: "llama-8b"}
	f.Retries = rs
	p, _ := fallbackProxy(t, Config{MaxAttempts: 2, Retries: rs}, f, []*upstream{primary}, small)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, post(`{"model":"llama-70b","stream":true}`))
	if res.Fallback != "small" || primary.calls.Load() == 0 || small.calls.Load() == 0 {
		t.Fatalf("result %+v, calls %d/%d: want both pools tried", res, primary.calls.Load(), small.calls.Load())
	}
	if n := rs.requests.Load(); n != 1 {
		t.Fatalf("the shared budget counted %d requests for one client request, want 1", n)
	}
}
