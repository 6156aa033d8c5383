package saturation

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// scrapeAccept asks for the Prometheus text format: every inference server
// serves it, and it is the format the parser knows best.
const scrapeAccept = "text/plain;version=0.0.4;q=1,*/*;q=0.1"

// maxScrapeBody bounds a /metrics response read (a vLLM server with many
// LoRA adapters exposes a few hundred KB): 8 MiB.
const maxScrapeBody = 8 << 20

// Observer receives a Scraper's reports for metrics and logs. Calls come
// from the scrape loops, one at a time per upstream, under the scraper's
// lock (so a report never follows ScraperGone); implementations must be
// safe for concurrent use across upstreams and must not call back into the
// Scraper. An Observer that also implements PrefixHitObserver gets the
// server's prefix-cache hit ratios.
type Observer interface {
	// Scraped reports one scrape of the upstream's metrics: how long it
	// took and its error (nil when it succeeded). The pool signal may
	// have changed with it.
	Scraped(upstream string, took time.Duration, err error)
	// SignalUpdated reports a signal after each scrape: its last known
	// value (Known false: never known) and its state, with the state
	// after the previous scrape (SignalFresh before the first), so that
	// a change is logged once, not every scrape.
	SignalUpdated(upstream string, sig Signal, last Value, state, prev SignalState)
	// ScraperGone is called when a scraped upstream is released, or no
	// config reads its signals any more: its saturation series should go.
	ScraperGone(upstream string)
}

// Host is what a Scraper needs from the upstream it scrapes, as its owner
// (package upstream's entry) keeps it.
type Host interface {
	// Inflight returns this gateway's attempts in progress to the
	// upstream: the floor of its effective queue (see Scraper.Score).
	Inflight() int64
	// TripGroups returns the breakers that the saturation rules trip and
	// recover by observation, grouped by the settings whose rules judge
	// them: those of the pools that configured saturation (DESIGN §7),
	// each with its own pool's trip rules; none when no such pool has
	// breakers on (the rules then do not run). Called after each scrape,
	// without the scraper's lock: the breakers' listeners may take the
	// host's.
	TripGroups() []TripGroup
}

// TripGroup is breakers judged by one set of saturation settings.
type TripGroup struct {
	// Key identifies the group from one scrape to the next: the trip
	// rules' running counts are kept per key.
	Key string
	// Config holds the trip rules (Trip; nil: they never trip) and the
	// queue_threshold of the recovery verdict that judge the group; nil
	// is the scrape's own settings.
	Config *Saturation
	// Breakers are the group's breakers.
	Breakers []*breaker.Breaker
}

// Scrapers are the scrapers of one registry: the clock and observer they
// share, and the count of scrape loops running.
type Scrapers struct {
	clock clock.Clock
	obs   Observer
	loops atomic.Int64
}

// NewScrapers returns a group of scrapers on clock (required) reporting to
// obs (nil: nothing is reported).
func NewScrapers(clk clock.Clock, obs Observer) *Scrapers {
	if obs == nil {
		obs = nopObserver{}
	}
	return &Scrapers{clock: clk, obs: obs}
}

// Loops returns the number of scrape loops running.
func (g *Scrapers) Loops() int { return int(g.loops.Load()) }

// New returns the scraper of the upstream at dial address addr ("host:port"
// or a socket path), idle until Configure; its owner stops it with Stop.
func (g *Scrapers) New(addr string, host Host) *Scraper {
	ctx, cancel := context.WithCancel(context.Background())
	return &Scraper{g: g, addr: addr, host: host, ctx: ctx, cancel: cancel}
}

type nopObserver struct{}

func (nopObserver) Scraped(string, time.Duration, error)                          {}
func (nopObserver) SignalUpdated(string, Signal, Value, SignalState, SignalState) {}
func (nopObserver) ScraperGone(string)                                            {}

// Scraper is the saturation state of one upstream server: its /metrics
// scrape loop (one however many handlers and configs read it, kept across
// reloads), the snapshot of its latest scrape, the history of histogram
// points behind recent quantiles, the trip rules' running counts, and the
// count of attempts started since the latest successful scrape. The
// request path reads it without a lock (Score, StartAttempt, EndAttempt).
type Scraper struct {
	g    *Scrapers
	addr string
	host Host
	// ctx is cancelled by Stop: a scrape in flight ends with it.
	ctx    context.Context
	cancel context.CancelFunc

	// since counts the attempts started since the latest successful
	// scrape that are still in flight: the scrape epoch in the high 32
	// bits, the count in the low 32 (see score.go).
	since atomic.Uint64
	// snap is the latest scrape's snapshot, nil before the first.
	snap atomic.Pointer[snapshot]

	// applyMu serialises Apply: the history and the trip rules' counts.
	applyMu sync.Mutex
	hist    history

	mu sync.Mutex // guards what follows, and every Observer report
	// cfg is the settings of the next scrape; nil: the loop stops.
	cfg     *Saturation
	running bool // a loop runs
	stopped bool // Stop was called
}

// snapshot is a scraper's state after its latest scrape. It is replaced
// whole, so the request path reads it with one atomic load.
type snapshot struct {
	// scrape is the latest successful scrape (zero: none yet).
	scrape Scrape
	// ok is whether the latest scrape succeeded: after a failed one every
	// signal is unknown until the next success (DESIGN §7).
	ok bool
	// err is the latest scrape's error, "" when it succeeded.
	err string
	// tried is when the latest scrape ended; took how long it took.
	tried time.Time
	took  time.Duration
	// values are the last known value of each signal (queue time: recent
	// p99, TTFT: recent p95, in seconds), states their state.
	values [len(Signals)]Value
	states [len(Signals)]SignalState
	// staleAfter is the staleness the scrape ran with (for the admin API).
	staleAfter time.Duration
}

// fresh reports whether the snapshot's signals may be used at now.
func (s *snapshot) fresh(now time.Time, staleAfter time.Duration) bool {
	return s != nil && s.ok && s.scrape.Server.Fresh(now, staleAfter)
}

// histPoint is one successful scrape's histograms, for recent quantiles.
type histPoint struct {
	at               time.Time
	queueTime, ttft  Histogram
	waiting, kvUsage Value
}

// history is what only Apply touches: the histogram points over the
// window and the trip rules' running counts.
type history struct {
	points []histPoint
	// trips are the running counts of each TripGroup's rules, by key.
	trips map[string]*TripMonitor
}

// Addr returns the upstream's dial address.
func (s *Scraper) Addr() string { return s.addr }

// Configure sets the settings of the upstream's next scrapes (defaults
// applied; nil: no started config reads its signals). Non-nil starts the
// loop if none runs: it scrapes at once, then every Interval. With nil the
// loop ends at its next tick, forgetting the snapshot and reporting
// ScraperGone, rather than leave the signals frozen. The owner calls it
// whenever the configs reading the upstream change, in order (under its
// own lock): the loop reads the latest settings at each tick.
func (s *Scraper) Configure(cfg *Saturation) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cfg = cfg
	if cfg == nil || s.running || s.stopped {
		return
	}
	s.running = true
	s.g.loops.Add(1)
	go s.loop()
}

// Stop ends the scraper for good (its upstream is released): the loop
// stops, a scrape in flight is cancelled and says nothing, and the
// saturation series are reported gone if a scrape was published.
func (s *Scraper) Stop() {
	s.mu.Lock()
	if !s.stopped {
		s.stopped, s.cfg = true, nil
		if s.snap.Load() != nil {
			s.g.obs.ScraperGone(s.addr)
		}
	}
	s.mu.Unlock()
	s.cancel()
}

// Scraped reports whether a scrape was published (the snapshot exists),
// and whether the latest one succeeded. It waits for the reports of a
// scrape being published (they go out under the same lock), so that a
// caller who saw it published sees its reports too.
func (s *Scraper) Scraped() (published, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	snap := s.snap.Load()
	return snap != nil, snap != nil && snap.ok
}

// loop scrapes at once, then every interval; one scrape is in flight at a
// time.
func (s *Scraper) loop() {
	defer s.g.loops.Add(-1)
	for {
		s.mu.Lock()
		cfg := s.cfg
		if cfg == nil {
			s.running = false
			if !s.stopped && s.snap.Load() != nil {
				// No started config reads the signals any more (turned
				// off, or the app stopped): forget them and their series
				// rather than leave them frozen.
				s.snap.Store(nil)
				s.g.obs.ScraperGone(s.addr)
			}
			s.mu.Unlock()
			return
		}
		s.mu.Unlock()

		s.scrapeOnce(cfg)

		t := s.g.clock.NewTimer(cfg.Interval)
		select {
		case <-s.ctx.Done():
			t.Stop()
			s.mu.Lock()
			s.running = false
			s.mu.Unlock()
			return
		case <-t.C():
		}
	}
}

// scrapeOnce fetches and applies one scrape.
func (s *Scraper) scrapeOnce(cfg *Saturation) {
	start := s.g.clock.Now()
	sc, err := s.fetch(cfg)
	end := s.g.clock.Now()
	if s.ctx.Err() != nil {
		return // stopped while scraping: say nothing
	}
	s.Apply(cfg, sc, err, end, end.Sub(start))
}

// errScrapeTimeout is the cause of a scrape's cancellation at its timeout.
var errScrapeTimeout = errors.New("scrape timeout")

// fetch GETs the metrics path within the timeout (on the scraper's clock)
// and parses the body.
func (s *Scraper) fetch(cfg *Saturation) (Scrape, error) {
	ctx, cancel := context.WithCancelCause(s.ctx)
	defer cancel(nil)
	t := s.g.clock.AfterFunc(cfg.Timeout, func() { cancel(errScrapeTimeout) })
	defer t.Stop()
	if cfg.Dial != nil {
		ctx = cfg.Dial(ctx, s.addr)
	}
	timedOut := func(err error) error {
		if errors.Is(context.Cause(ctx), errScrapeTimeout) {
			return fmt.Errorf("GET %s: no response within %v: %w", cfg.MetricsPath, cfg.Timeout, context.DeadlineExceeded)
		}
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+s.addr+cfg.MetricsPath, nil)
	if err != nil {
		return Scrape{}, err
	}
	req.URL.Scheme = "" // the transport sets http or https
	req.Header.Set("Accept", scrapeAccept)
	req.Header.Set("User-Agent", "caddy-llm-proxy-scraper")
	resp, err := cfg.Transport.RoundTrip(req)
	if err != nil {
		return Scrape{}, timedOut(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return Scrape{}, fmt.Errorf("GET %s: status %d", cfg.MetricsPath, resp.StatusCode)
	}
	body := &limitedReader{r: resp.Body, n: maxScrapeBody}
	sc, err := ParseScrape(body, resp.Header.Get("Content-Type"), cfg.Names, s.g.clock.Now())
	if body.over {
		return Scrape{}, fmt.Errorf("GET %s: body larger than %d bytes", cfg.MetricsPath, maxScrapeBody)
	}
	if err != nil {
		if ctx.Err() != nil {
			return Scrape{}, timedOut(fmt.Errorf("GET %s: %w", cfg.MetricsPath, ctx.Err()))
		}
		return Scrape{}, err
	}
	// Stamp the sample when the body was read, so staleness counts from
	// the newest moment the values can describe.
	sc.Stamp(s.g.clock.Now())
	return sc, nil
}

// limitedReader reads at most n bytes and records whether there was more.
type limitedReader struct {
	r    io.Reader
	n    int64
	over bool
}

var errScrapeTooLarge = errors.New("metrics body too large")

func (l *limitedReader) Read(p []byte) (int, error) {
	if l.n <= 0 {
		var one [1]byte
		if n, _ := l.r.Read(one[:]); n > 0 {
			l.over = true
			return 0, errScrapeTooLarge
		}
		return 0, io.EOF
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	n, err := l.r.Read(p)
	l.n -= int64(n)
	return n, err
}

// Apply publishes one scrape's outcome as the loop does after each fetch:
// sc is the parsed scrape when err is nil, else err is why it failed; now
// is when it ended and took how long it took; cfg is the settings it ran
// with (defaults applied). It stores the new snapshot (the count of
// attempts started since the scrape restarts on success), reports the
// signals' values and states and the scrape to the Observer, and runs the
// saturation breaker on the host's TripGroups, each with its own trip rules.
// Callers that fetch scrapes their own way (simulations, tests) feed them
// here; it is safe for concurrent use, and does nothing once stopped.
func (s *Scraper) Apply(cfg *Saturation, sc Scrape, err error, now time.Time, took time.Duration) {
	s.applyMu.Lock()
	defer s.applyMu.Unlock()
	st := &s.hist
	prev := s.snap.Load()
	snap := &snapshot{tried: now, took: took, staleAfter: cfg.StaleAfter}
	if prev != nil {
		snap.scrape, snap.values = prev.scrape, prev.values
	} else {
		for i := range snap.states {
			snap.states[i] = SignalFresh // so that a first missing signal is reported once
		}
	}
	var prevStates [len(Signals)]SignalState
	if prev != nil {
		prevStates = prev.states
	}
	var cur, last histPoint
	var haveLast bool
	if err == nil {
		snap.scrape, snap.ok = sc, true
		r := sc.Server.Readings()
		cur = histPoint{at: now, queueTime: r.QueueTime, ttft: r.TTFT, waiting: r.Waiting, kvUsage: r.KVUsage}
		if n := len(st.points); n > 0 {
			last, haveLast = st.points[n-1], true
		}
		st.points = append(st.points, cur)
		// Keep the newest point at or before now − window as the base,
		// and everything after it.
		cut := 0
		for i, p := range st.points {
			if !p.at.After(now.Add(-cfg.Window)) {
				cut = i
			}
		}
		st.points = st.points[cut:]
	} else {
		snap.err = err.Error()
	}
	qw, ttft := Value{}, Value{}
	if snap.ok && len(st.points) > 1 {
		base := st.points[0]
		qw = QuantileBetween(base.queueTime, cur.queueTime, 0.99)
		ttft = QuantileBetween(base.ttft, cur.ttft, 0.95)
	}
	r := snap.scrape.Server.Readings()
	known := [len(Signals)]Value{r.Waiting, r.Running, r.KVUsage, qw, ttft}
	present := [len(Signals)]bool{r.Waiting.Known, r.Running.Known, r.KVUsage.Known, r.QueueTime.Known(), r.TTFT.Known()}
	for i := range known {
		switch {
		case !snap.ok:
			snap.states[i] = SignalStale
		case !present[i]:
			snap.states[i] = SignalMissing
		default:
			snap.states[i] = SignalFresh
		}
		if known[i].Known {
			snap.values[i] = known[i]
		}
	}
	// Published and reported under the scraper's lock, so that a Stop
	// (which reports ScraperGone under it too) cannot slip in between and
	// have this scrape's series re-created after they were deleted.
	s.mu.Lock()
	if s.stopped {
		s.mu.Unlock()
		return
	}
	s.epochReset(err == nil)
	s.snap.Store(snap)
	for i, sig := range Signals {
		from := prevStates[i]
		if prev == nil {
			from = SignalFresh
		}
		s.g.obs.SignalUpdated(s.addr, sig, snap.values[i], snap.states[i], from)
	}
	s.g.obs.Scraped(s.addr, took, err)
	s.reportPrefixHits(prev, snap) // prefixhits.go
	s.mu.Unlock()

	// The input of one group's trip rules: which quantiles are over
	// depends on its thresholds.
	input := func(t *TripRules) TripInput {
		in := TripInput{OK: snap.ok, QueueWait: qw, TTFT: ttft}
		if snap.ok {
			in.KV, in.Waiting = r.KVUsage, r.Waiting
			if len(st.points) > 1 {
				base := st.points[0]
				in.QueueWaitOver = Over(base.queueTime, cur.queueTime, 0.99, t.QueueWaitP99)
				in.TTFTOver = Over(base.ttft, cur.ttft, 0.95, t.TTFTP95)
			}
			if haveLast {
				in.IntervalQueueWaitOver = Over(last.queueTime, cur.queueTime, 0.99, t.QueueWaitP99)
				in.IntervalTTFTOver = Over(last.ttft, cur.ttft, 0.95, t.TTFTP95)
			}
		}
		return in
	}
	s.judge(cfg, now, input)
}

// judge runs the saturation breaker over each of the host's TripGroups,
// with the group's own trip rules and running counts: a rule held for its
// duration trips every breaker of the group (the server's queue is every
// model's queue; a pool without saturation is never refused for it, its
// breakers are in no group, and a pool's rules never trip another pool's
// breakers); breakers it tripped are fed this scrape's verdict (recovery
// by observation). Called under applyMu.
func (s *Scraper) judge(cfg *Saturation, now time.Time, input func(*TripRules) TripInput) {
	groups := s.host.TripGroups()
	st := &s.hist
	seen := make(map[string]bool, len(groups))
	restart := false
	for _, g := range groups {
		gcfg := g.Config
		if gcfg == nil {
			gcfg = cfg
		}
		if gcfg.Trip == nil || len(g.Breakers) == 0 {
			continue
		}
		seen[g.Key] = true
		if st.trips == nil {
			st.trips = map[string]*TripMonitor{}
		}
		mon := st.trips[g.Key]
		if mon == nil {
			mon = new(TripMonitor)
			st.trips[g.Key] = mon
		}
		in := input(gcfg.Trip)
		recovering := false
		for _, b := range g.Breakers {
			recovering = recovering || b.Observed()
		}
		if recovering {
			// Tripped: recovery is judged scrape by scrape (Verdict), and
			// the trip rules wait until it is closed again.
			mon.Reset()
		} else if reason, trip := mon.Update(now, gcfg.Trip, in); trip {
			for _, b := range g.Breakers {
				b.TripObserved(reason) // an already open breaker keeps its own reason
			}
			// The window restarts: what recovery and the next trip judge
			// is what happens from now on, not the waits that tripped it.
			restart = true
			continue
		}
		verdict, why := Verdict(gcfg, in)
		for _, b := range g.Breakers {
			if b.Observed() {
				b.Observe(verdict, why)
				// Closed by observation: the waits from before the drain
				// must not trip it again once they are "recent" for
				// another window.
				restart = restart || b.State() == breaker.Closed
			}
		}
	}
	for k := range st.trips {
		if !seen[k] {
			delete(st.trips, k) // a group no config has any more
		}
	}
	if restart {
		st.restartWindow()
	}
}

// restartWindow keeps only the latest point as the base of recent
// quantiles and forgets the trip rules' running counts.
func (st *history) restartWindow() {
	if n := len(st.points); n > 1 {
		st.points = append(st.points[:0], st.points[n-1])
	}
	for _, m := range st.trips {
		m.Reset()
	}
}
