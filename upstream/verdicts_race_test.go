package upstream

import (
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/breaker/breakertest"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// Requests, reloads (settings and scope changing), drains, the admin
// API's listing and breaker-store changes run at once: every outcome
// reaches breakers being built, carried over, rebuilt for a new store and
// dropped (Entry.hear, activate, dropClaim, useStore, destroy). Run with
// -race; at the end no entry is left.
func TestReloadsDrainsAndStoreChangesUnderTraffic(t *testing.T) {
	sm := breakertest.NewSharedMemory(nil, 1)
	reg := NewRegistry(nil)
	clk := newLoopClock()
	reg.UseClock(clk)
	reg.Models.Learn("m")
	const a, b = "10.29.4.1:8000", "10.29.4.2:8000"
	s := func(n int) *breaker.Settings {
		return &breaker.Settings{ConsecutiveFailures: n, OpenFor: 5 * time.Millisecond, MinOpen: -1}
	}
	cfgs := func(i int) []Config {
		return []Config{
			{Key: a + "," + b, Handler: "X", Static: targets(a, b), Breaker: s(2 + i%2), ScopeModel: i%3 == 0},
			{Key: a, Handler: "Y", Static: targets(a), Breaker: s(3)},
		}
	}
	var cur atomic.Pointer[[]*Pool]
	pools := reloadAll(t, reg, nil, cfgs(0)...)
	cur.Store(&pools)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			outs := []proxy.AttemptOutcome{proxy.AttemptSuccess, proxy.AttemptConnectError, proxy.AttemptHTTP5xx}
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				ps := *cur.Load()
				up, err := pickModel(ps[(i+w)%len(ps)], "m")
				if err != nil {
					continue
				}
				if i%7 == 0 {
					up.Done(&proxy.AttemptReport{Upstream: up.Addr, Outcome: proxy.AttemptHTTP429, Status: 429, RetryAfter: time.Millisecond})
					continue
				}
				finish(up, outs[i%3])
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			e, ok := reg.Entry(a)
			if ok {
				if i%2 == 0 {
					e.Drain(time.Millisecond, "x")
				} else {
					e.Undrain(i%4 == 1, "y")
				}
			}
			_ = reg.Breakers()
			runtime.Gosched()
		}
	}()
	for i := 1; i < 200; i++ {
		ps := *cur.Load()
		var next []*Pool
		gen := reg.NextGeneration()
		for _, c := range cfgs(i) {
			c.Generation = gen
			p, err := reg.NewPool(c)
			if err != nil {
				t.Fatal(err)
			}
			next = append(next, p)
		}
		for _, p := range next {
			p.Activate()
		}
		cur.Store(&next)
		clk.Advance(3 * time.Millisecond)
		if i%10 == 0 {
			if i%20 == 0 {
				reg.SetBreakerStore(sm.Instance("gw0"))
			} else {
				reg.SetBreakerStore(nil)
			}
		}
		for _, p := range ps {
			p.Deactivate()
			p.Release()
		}
	}
	close(stop)
	wg.Wait()
	for _, p := range *cur.Load() {
		p.Deactivate()
		p.Release()
	}
	if n := len(reg.Entries()); n != 0 {
		t.Errorf("%d entries left", n)
	}
}
