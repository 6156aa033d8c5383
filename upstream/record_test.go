package upstream

import (
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// A pick made in panic takes no breaker permit; its outcome is still the
// upstream's evidence, recorded once.
func TestOutcomeInPanicIsTheUpstreamsEvidence(t *testing.T) {
	reg, p, addrs, _ := ejectionPool(t, 3, Ejection{})
	mustPick(t, p, "").Done(nil)
	breakerOf(t, reg, addrs[0], "").ForceOpen(0, "hard")
	breakerOf(t, reg, addrs[1], "").Eject("outlier", 0.5)
	e, _ := reg.Entry(addrs[1])
	var up proxy.Upstream
	for range 100 {
		up = mustPick(t, p, "", addrs[2])
		if up.Addr == addrs[1] {
			break
		}
		up.Done(nil)
	}
	if up.Addr != addrs[1] || !p.Status().Panic {
		t.Fatalf("picked %s, status %+v: want the ejected upstream routed over in panic", up.Addr, p.Status())
	}
	fail(up)
	if got := e.Recent(); got.Requests != 1 || got.Failures != 1 {
		t.Fatalf("evidence of %s after a failure in panic: %+v, want 1 request, 1 failure", addrs[1], got)
	}
	up = mustPick(t, p, "", addrs[2])
	up.Done(&proxy.AttemptReport{Upstream: up.Addr, Outcome: proxy.AttemptConnectError})
	if got := e.Recent(); got.Requests != 2 || got.Failures != 2 || got.Down != 1 {
		t.Fatalf("evidence of %s after a refused connection in panic: %+v, want 2 requests, 2 failures, 1 down", addrs[1], got)
	}
}

// Three replicas at 20 requests/s under least_conn: one held open on hard
// evidence (it refuses connections), one that starts resetting every new
// connection while the long streams it took before end well, one healthy.
// The resetting one is held on hard evidence after its first refusals and
// receives only its probes after that; at least 95% is served.
func TestResettingReplicaWithLongStreamsDrawsNoTraffic(t *testing.T) {
	const (
		rate   = 20
		resets = 10 * time.Second // replica 1 resets new connections from here
		stream = 20 * time.Second // streams started before resets last this long
		end    = 40 * time.Second
	)
	clk := clocktest.New(simT0)
	reg := NewRegistry(nil)
	reg.UseClock(clk)
	addrs := []string{"10.29.7.1:8000", "10.29.7.2:8000", "10.29.7.3:8000"}
	index := map[string]int{addrs[0]: 0, addrs[1]: 1, addrs[2]: 2}
	p := startPool(t, reg, Config{Key: "resetting", Static: targets(addrs...), Breaker: &breaker.Settings{}, Selector: LeastConn{}})
	retries := p.Retries()
	peek := retries.(proxy.RetryPeeker)
	type held struct {
		up  proxy.Upstream
		end time.Duration
	}
	var streams []held
	served, requests, onResetting := 0, 0, 0
	hardSeen := false
	for now := time.Duration(0); now < end; now += time.Second / rate {
		clk.Set(now)
		kept := streams[:0]
		for _, h := range streams {
			if h.end <= now {
				finish(h.up, proxy.AttemptSuccess)
				continue
			}
			kept = append(kept, h)
		}
		streams = kept
		retries.Request()
		ok := false
		var tried []string
		up, err := pickModel(p, "", tried...)
		for attempt := 1; err == nil; attempt++ {
			i := index[up.Addr]
			tried = append(tried, up.Addr)
			if i == 1 && now >= resets {
				onResetting++
			}
			switch {
			case i == 0, i == 1 && now >= resets:
				up.Done(&proxy.AttemptReport{Upstream: up.Addr, Outcome: proxy.AttemptConnectError})
			case now < resets:
				up.Committed(100 * time.Millisecond)
				streams = append(streams, held{up, now + stream})
				ok = true
			default:
				up.Committed(100 * time.Millisecond)
				finish(up, proxy.AttemptSuccess)
				ok = true
			}
			if ok || attempt >= simMaxAttempts || !peek.RetryAvailable() {
				break
			}
			if up, err = pickModel(p, "", tried...); err != nil {
				break
			}
			if !retries.TryRetry() {
				up.Done(nil)
				break
			}
		}
		if b := breakerOf(t, reg, addrs[1], ""); b.Evidence() == breaker.Hard {
			hardSeen = true
		}
		if now >= resets {
			requests++
			if ok {
				served++
			}
		}
	}
	b := breakerOf(t, reg, addrs[1], "")
	share := float64(served) / float64(requests)
	t.Logf("served %d of %d (%.1f%%) after %v; %d attempts on the resetting replica; its breaker %s (%s), %d re-opens",
		served, requests, 100*share, resets, onResetting, b.State(), b.Evidence(), b.Snapshot().Reopens)
	if !hardSeen {
		t.Errorf("the resetting replica was never held on hard evidence: %+v", b.Snapshot())
	}
	if share < 0.95 {
		t.Errorf("served %.1f%%, want ≥ 95%%", 100*share)
	}
	// Discovery (ConsecutiveFailures, 3) and a probe per half-open: the
	// cooldown starts at 10 s and doubles, so 2 in the 30 s.
	if onResetting > 3+2 {
		t.Errorf("the resetting replica took %d attempts, want ≤ 3 to discover it and 2 probes", onResetting)
	}
}

// A probe answered 429 with Retry-After re-opens the breaker for what the
// upstream asked, not for a doubled cooldown.
func TestProbeAnsweredWithRetryAfterReopensForThatLong(t *testing.T) {
	reg, p, addrs, clk := ejectionPool(t, 3, Ejection{})
	// The rest of the pool serves: a failed probe is no failure like its
	// pool's (PeerRatio 0), so it would re-open with the grown cooldown.
	serveOn(t, p, addrs, addrs[1], 20, never)
	serveOn(t, p, addrs, addrs[2], 20, never)
	for range 3 {
		up := mustPick(t, p, "", addrs[1], addrs[2])
		up.Done(&proxy.AttemptReport{Upstream: up.Addr, Outcome: proxy.AttemptConnectError})
	}
	b := breakerOf(t, reg, addrs[0], "")
	if b.State() != breaker.Open {
		t.Fatalf("after 3 refused connections: %+v", b.Snapshot())
	}
	clk.Advance(b.Snapshot().OpenUntil.Sub(clk.Now()))
	up := mustPick(t, p, "", addrs[1], addrs[2])
	if up.Addr != addrs[0] || b.State() != breaker.HalfOpen {
		t.Fatalf("picked %s in %s, want the probe of %s", up.Addr, b.State(), addrs[0])
	}
	up.Done(&proxy.AttemptReport{Upstream: up.Addr, Outcome: proxy.AttemptHTTP429, Status: 429, RetryAfter: 2 * time.Second})
	s := b.Snapshot()
	if want := clk.Now().Add(2 * time.Second); s.State != breaker.Open || !s.OpenUntil.Equal(want) || s.Reopens != 0 {
		t.Fatalf("after the probe's Retry-After 2s: %s until %v (%v from now), %d re-opens; want open for 2s, no re-open",
			s.State, s.OpenUntil, s.OpenUntil.Sub(clk.Now()), s.Reopens)
	}
}
