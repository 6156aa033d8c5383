package upstream

import (
	"fmt"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// newLoopClock returns the fake clock of the probe and scrape loops'
// tests. It starts at the wall clock's time (so that helpers mixing it
// with time.Now stay within staleness bounds); only Advance moves it.
// Tests synchronise on the timers armed (awaitArmed): a loop arms its next
// timer once its probe or scrape is done, so no test sleeps.
func newLoopClock() *clocktest.Fake { return clocktest.New(time.Now()) }

// armed returns the number of timers waiting to fire.
func armed(c *clocktest.Fake) int {
	timers, funcs := c.Armed()
	return timers + funcs
}

// tickers returns the number of NewTimer timers waiting to fire: a probe
// or scrape loop waiting for its next tick holds one; a probe or scrape
// in flight holds none, only its timeout (an AfterFunc timer).
func tickers(c *clocktest.Fake) int {
	timers, _ := c.Armed()
	return timers
}

// awaitTickers waits until n NewTimer timers are armed (n scrape loops
// have scraped and wait for their next tick), failing the test after 5s
// of real time.
func awaitTickers(t testing.TB, c *clocktest.Fake, n int) {
	t.Helper()
	clocktest.Settle(t, "scrape loops waiting for their next tick", func() bool { return tickers(c) >= n })
}

// awaitArmed waits until n timers are armed, failing the test after 5s of
// real time.
func awaitArmed(t testing.TB, c *clocktest.Fake, n int) {
	t.Helper()
	clocktest.Settle(t, fmt.Sprintf("%d timers armed", n), func() bool { return armed(c) >= n })
}

// awaitIdle waits until the probe loops of reg are idle: one NewTimer
// timer armed (the loop waits for its next tick, its probe done; a probe
// in flight holds only its timeout, an AfterFunc timer) or no loop
// running.
func awaitIdle(t testing.TB, c *clocktest.Fake, reg *Registry) {
	t.Helper()
	clocktest.Settle(t, "the probe loop neither armed its timer nor stopped", func() bool { return tickers(c) >= 1 || reg.ProbeLoops() == 0 })
}

// step advances the clock by d (the loop's tick fires) and waits until the
// probe loops are idle again.
func step(t testing.TB, c *clocktest.Fake, reg *Registry, d time.Duration) {
	t.Helper()
	awaitIdle(t, c, reg)
	c.Advance(d)
	awaitIdle(t, c, reg)
}
