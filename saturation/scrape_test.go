package saturation

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// eventLog is an Observer that keeps its reports in order.
type eventLog struct {
	mu     sync.Mutex
	events []string
}

func (o *eventLog) add(format string, args ...any) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.events = append(o.events, fmt.Sprintf(format, args...))
}

func (o *eventLog) Scraped(addr string, _ time.Duration, err error) {
	if err != nil {
		o.add("scraped %s: %v", addr, err)
		return
	}
	o.add("scraped %s", addr)
}

func (o *eventLog) SignalUpdated(string, Signal, Value, SignalState, SignalState) {}

func (o *eventLog) ScraperGone(addr string) { o.add("gone %s", addr) }

func (o *eventLog) all() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]string(nil), o.events...)
}

// fakeHost is an upstream with a fixed in-flight count and trip breakers.
type fakeHost struct {
	inflight atomic.Int64
	breakers []*breaker.Breaker
}

func (h *fakeHost) Inflight() int64 { return h.inflight.Load() }
func (h *fakeHost) TripGroups() []TripGroup {
	return []TripGroup{{Key: "", Breakers: h.breakers}}
}

// metricsTransport answers every scrape with body, or, while hang is set,
// holds it until its context ends; it counts the scrapes and those in
// flight.
type metricsTransport struct {
	body              string
	hang              atomic.Bool
	scrapes, inflight atomic.Int64
}

func (m *metricsTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	m.scrapes.Add(1)
	if m.hang.Load() {
		m.inflight.Add(1)
		defer m.inflight.Add(-1)
		<-r.Context().Done()
		return nil, r.Context().Err()
	}
	return &http.Response{StatusCode: http.StatusOK, Header: http.Header{"Content-Type": {"text/plain; version=0.0.4"}},
		Body: io.NopCloser(strings.NewReader(m.body))}, nil
}

const busyBody = `# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 8
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.5
`

// newTestScraper returns a scraper of 10.0.0.1:8000 on a fake clock, with
// settings on tr (defaults applied; Interval and Timeout as given).
func newTestScraper(t *testing.T, tr http.RoundTripper, interval, timeout time.Duration) (*Scraper, *Scrapers, *clocktest.Fake, *eventLog, *Saturation) {
	t.Helper()
	clk, obs := clocktest.New(time.Time{}), &eventLog{}
	g := NewScrapers(clk, obs)
	s := g.New("10.0.0.1:8000", &fakeHost{})
	t.Cleanup(func() {
		s.Stop()
		clocktest.Settle(t, "the loop ends after Stop", func() bool { return g.Loops() == 0 })
	})
	cfg := Saturation{Transport: tr, Interval: interval, Timeout: timeout}.Defaults()
	return s, g, clk, obs, &cfg
}

// TestScrapeTimesOutOnTheScrapersClock: a /metrics that never answers
// fails at the scrape's timeout as the injected clock counts it (an hour:
// a timeout on real time would never fire within the test), not before;
// the loop then waits for its next tick, and the snapshot says why.
func TestScrapeTimesOutOnTheScrapersClock(t *testing.T) {
	tr := &metricsTransport{body: busyBody}
	tr.hang.Store(true)
	s, _, clk, obs, cfg := newTestScraper(t, tr, 2*time.Hour, time.Hour)
	s.Configure(cfg)
	clocktest.Settle(t, "the scrape hangs with its timeout armed", func() bool {
		_, timeouts := clk.Armed()
		return tr.inflight.Load() == 1 && timeouts == 1
	})
	clk.Advance(time.Hour - time.Millisecond)
	if got, pub := obs.all(), scraped(s); len(got) != 0 || pub || tr.inflight.Load() != 1 {
		t.Fatalf("1ms before the timeout: reports %q, snapshot %v, %d in flight; want none, none, 1", got, pub, tr.inflight.Load())
	}
	clk.Advance(time.Millisecond)
	clocktest.Settle(t, "the scrape fails and the loop waits for its next tick", func() bool {
		tickers, _ := clk.Armed()
		return tickers == 1 && tr.inflight.Load() == 0
	})
	want := "scraped 10.0.0.1:8000: GET /metrics: no response within 1h0m0s: context deadline exceeded"
	if got := obs.all(); len(got) != 1 || got[0] != want {
		t.Fatalf("reports %q, want [%q]", got, want)
	}
	v, ok := s.View(clk.Now(), cfg)
	if !ok || v.ScrapedAt != nil || v.ScoreKnown || !strings.Contains(v.LastError, "no response within 1h0m0s") {
		t.Fatalf("view %+v (ok %v), want never scraped, score unknown, the timeout as last error", v, ok)
	}
	// The next tick scrapes again, and times out again.
	clk.Advance(2 * time.Hour)
	clocktest.Settle(t, "the second scrape hangs", func() bool { return tr.inflight.Load() == 1 })
	clk.Advance(time.Hour)
	clocktest.Settle(t, "the second scrape fails", func() bool { return len(obs.all()) == 2 })
	if n := tr.scrapes.Load(); n != 2 {
		t.Fatalf("%d scrapes in two intervals, want 2", n)
	}
}

func scraped(s *Scraper) bool {
	published, _ := s.Scraped()
	return published
}

// TestScrapeLoopEndsWhenNoConfigReadsIt: Configure(nil) ends the loop at
// its next tick, forgets the snapshot and reports the series gone once;
// Configure again starts a new loop, which scrapes at once.
func TestScrapeLoopEndsWhenNoConfigReadsIt(t *testing.T) {
	tr := &metricsTransport{body: busyBody}
	s, g, clk, obs, cfg := newTestScraper(t, tr, time.Second, 500*time.Millisecond)
	if g.Loops() != 0 || tr.scrapes.Load() != 0 {
		t.Fatalf("an unconfigured scraper runs %d loops, scraped %d times", g.Loops(), tr.scrapes.Load())
	}
	s.Configure(cfg)
	clocktest.Settle(t, "the first scrape is done", func() bool { tickers, _ := clk.Armed(); return tickers == 1 })
	if pub, ok := s.Scraped(); !pub || !ok {
		t.Fatalf("after the first scrape: snapshot %v, ok %v", pub, ok)
	}
	if sc, known := s.Score(clk.Now(), cfg, ""); !known || sc != 0.625 {
		t.Fatalf("score %v known %v, want 0.625 (KV 0.5 / 0.8) known", sc, known)
	}
	s.Configure(cfg) // a second config reading it: still one loop
	if n := g.Loops(); n != 1 {
		t.Fatalf("%d loops, want 1", n)
	}
	s.Configure(nil)
	clk.Advance(time.Second) // the loop wakes and sees no config
	clocktest.Settle(t, "the loop ends", func() bool { return g.Loops() == 0 })
	if pub := scraped(s); pub || tr.scrapes.Load() != 1 {
		t.Fatalf("after the loop ended: snapshot %v, %d scrapes; want none, 1", pub, tr.scrapes.Load())
	}
	if got := strings.Join(obs.all(), "; "); got != "scraped 10.0.0.1:8000; gone 10.0.0.1:8000" {
		t.Fatalf("reports %q", got)
	}
	s.Configure(cfg)
	clocktest.Settle(t, "a new loop scrapes", func() bool { tickers, _ := clk.Armed(); return tickers == 1 && scraped(s) })
	if n, loops := tr.scrapes.Load(), g.Loops(); n != 2 || loops != 1 {
		t.Fatalf("%d scrapes, %d loops after configuring again; want 2, 1", n, loops)
	}
}

// TestStopEndsAScrapeInFlightAndReportsNothingAfter: Stop cancels the
// scrape in flight; the series are reported gone once, and nothing of the
// cancelled scrape is reported after.
func TestStopEndsAScrapeInFlightAndReportsNothingAfter(t *testing.T) {
	tr := &metricsTransport{body: busyBody}
	clk, obs := clocktest.New(time.Time{}), &eventLog{}
	g := NewScrapers(clk, obs)
	s := g.New("10.0.0.1:8000", &fakeHost{})
	cfg := Saturation{Transport: tr}.Defaults()
	s.Configure(&cfg)
	clocktest.Settle(t, "the first scrape is done", func() bool { tickers, _ := clk.Armed(); return tickers == 1 })
	tr.hang.Store(true)
	clk.Advance(cfg.Interval)
	clocktest.Settle(t, "the second scrape hangs", func() bool { return tr.inflight.Load() == 1 })
	s.Stop()
	clocktest.Settle(t, "the loop ends", func() bool { return g.Loops() == 0 && tr.inflight.Load() == 0 })
	s.Configure(&cfg) // a stopped scraper never starts again
	if got := strings.Join(obs.all(), "; "); got != "scraped 10.0.0.1:8000; gone 10.0.0.1:8000" || g.Loops() != 0 {
		t.Fatalf("reports %q, %d loops; want one scrape, gone, no loop", got, g.Loops())
	}
	s.Apply(&cfg, Scrape{}, nil, clk.Now(), 0)
	if n := len(obs.all()); n != 2 {
		t.Fatalf("Apply after Stop reported %q", obs.all()[2:])
	}
}

// TestSaturationTripReachesOnlyTheHostsBreakers: the rules trip the
// breakers the host names (the pools that configured saturation), no
// other; with none named they trip nothing.
func TestSaturationTripReachesOnlyTheHostsBreakers(t *testing.T) {
	clk := clocktest.New(time.Time{})
	g := NewScrapers(clk, nil)
	reads, other := breaker.New("reads", breaker.Settings{}, breaker.WithClock(clk)), breaker.New("other", breaker.Settings{}, breaker.WithClock(clk))
	s := g.New("10.0.0.1:8000", &fakeHost{breakers: []*breaker.Breaker{reads}})
	none := g.New("10.0.0.2:8000", &fakeHost{})
	cfg := Saturation{Transport: &metricsTransport{}, Trip: &TripRules{KVUsage: 0.9, KVFor: 2 * time.Second}}.Defaults()
	full := Readings{Waiting: Known(0), Running: Known(8), KVUsage: Known(0.97)}
	for range 3 {
		clk.Advance(time.Second)
		now := clk.Now()
		s.Apply(&cfg, Scrape{Server: NewSample(now, full)}, nil, now, 0)
		none.Apply(&cfg, Scrape{Server: NewSample(now, full)}, nil, now, 0)
	}
	if reads.State() != breaker.Open || !reads.Observed() {
		t.Fatalf("host's breaker %v observed=%v after KV 0.97 for 2s, want open by observation", reads.State(), reads.Observed())
	}
	if other.State() != breaker.Closed {
		t.Fatalf("a breaker the host did not name is %v, want closed", other.State())
	}
	if sc, known := none.Score(clk.Now(), &cfg, ""); !known || sc != 0.97/0.8 {
		t.Fatalf("the scraper without breakers scored %v known %v, want %v known", sc, known, 0.97/0.8)
	}
}

// TestSinceScrapeConcurrentNeverNegative: attempts starting and ending
// while successful scrapes reset the epoch never drive the count below
// zero (it would read as about 4 billion), and it is 0 when all ended.
func TestSinceScrapeConcurrentNeverNegative(t *testing.T) {
	s := NewScrapers(clocktest.New(time.Time{}), nil).New("10.0.0.1:8000", &fakeHost{})
	var wg, resetter sync.WaitGroup
	var stop atomic.Bool
	var resets atomic.Int64
	resetter.Go(func() {
		for !stop.Load() {
			s.epochReset(true)
			resets.Add(1)
		}
	})
	for range 4 {
		wg.Go(func() {
			for range 2000 {
				epoch := s.StartAttempt()
				if n := int32(uint32(s.since.Load())); n < 0 || n > 4 {
					t.Errorf("since count %d with at most 4 attempts in flight", n)
				}
				s.EndAttempt(epoch)
			}
		})
	}
	wg.Wait() // the workers' 8000 attempts, with scrapes resetting the epoch throughout
	stop.Store(true)
	resetter.Wait()
	if resets.Load() == 0 {
		t.Fatal("no epoch reset ran alongside the attempts")
	}
	if n := s.SinceScrape(); n != 0 {
		t.Fatalf("since scrape = %d with nothing in flight, want 0", n)
	}
}
