package breaker_test

import (
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// t0 is the fake clock's start.
var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// newClock returns a fake clock at t0.
func newClock() *clocktest.Fake { return clocktest.New(t0) }

// noJitter makes cooldowns exact.
var noJitter = breaker.WithRand(func() float64 { return 0 })

// recorder collects transitions.
type recorder struct {
	mu sync.Mutex
	ts []breaker.Transition
}

func (r *recorder) listen(t breaker.Transition) {
	r.mu.Lock()
	r.ts = append(r.ts, t)
	r.mu.Unlock()
}

func (r *recorder) all() []breaker.Transition {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]breaker.Transition(nil), r.ts...)
}

type fixture struct {
	t   *testing.T
	b   *breaker.Breaker
	clk *clocktest.Fake
	rec *recorder
}

func newFixture(t *testing.T, s breaker.Settings, opts ...breaker.Option) *fixture {
	t.Helper()
	f := &fixture{t: t, clk: newClock(), rec: new(recorder)}
	opts = append([]breaker.Option{breaker.WithClock(f.clk), noJitter, breaker.WithListener(f.rec.listen)}, opts...)
	f.b = breaker.New("up1", s, opts...)
	return f
}

// call runs one call through Allow/Done; it reports whether it was allowed.
func (f *fixture) call(o breaker.Outcome, ttft time.Duration) bool {
	p, ok := f.b.Allow()
	if ok {
		p.Done(o, ttft, o.String())
	}
	return ok
}

func (f *fixture) fail(n int) {
	f.t.Helper()
	for range n {
		if !f.call(breaker.Failure, 0) {
			f.t.Fatalf("Allow refused in %s", f.b.State())
		}
	}
}

// down runs n calls that end Down (connection refused): hard evidence,
// which a Fleet is told of whatever the successes before.
func (f *fixture) down(n int) {
	f.t.Helper()
	for range n {
		if !f.call(breaker.Down, 0) {
			f.t.Fatalf("Allow refused in %s", f.b.State())
		}
	}
}

func (f *fixture) succeed(n int) {
	f.t.Helper()
	for range n {
		if !f.call(breaker.Success, 0) {
			f.t.Fatalf("Allow refused in %s", f.b.State())
		}
	}
}

func (f *fixture) wantState(want breaker.State) {
	f.t.Helper()
	if got := f.b.State(); got != want {
		f.t.Fatalf("state = %s, want %s (snapshot %+v)", got, want, f.b.Snapshot())
	}
}

// openFor returns how long from now the breaker stays open.
func (f *fixture) openFor() time.Duration {
	f.t.Helper()
	s := f.b.Snapshot()
	if s.State != breaker.Open {
		f.t.Fatalf("state = %s, want open", s.State)
	}
	return s.OpenUntil.Sub(f.clk.Now())
}

// probe takes a probe permit, failing the test if refused.
func (f *fixture) probe() breaker.Permit {
	f.t.Helper()
	p, ok := f.b.Allow()
	if !ok || !p.Probe() {
		f.t.Fatalf("Allow = probe %v, ok %v; want a probe permit (state %s)", p.Probe(), ok, f.b.State())
	}
	return p
}
