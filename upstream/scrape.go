package upstream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/saturation"
)

// scrapeAccept asks for the Prometheus text format: every inference server
// serves it, and it is the format the parser knows best.
const scrapeAccept = "text/plain;version=0.0.4;q=1,*/*;q=0.1"

// maxScrapeBody bounds a /metrics response read (a vLLM server with many
// LoRA adapters exposes a few hundred KB).
const maxScrapeBody = 8 << 20

// satSnapshot is an entry's saturation state after its latest scrape. It is
// replaced whole, so the request path reads it with one atomic load.
type satSnapshot struct {
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
	// cfg is the settings the scrape ran with (staleness for the admin API).
	staleAfter time.Duration
}

// fresh reports whether the snapshot's signals may be used at now.
func (s *satSnapshot) fresh(now time.Time, staleAfter time.Duration) bool {
	return s != nil && s.ok && s.scrape.Server.Fresh(now, staleAfter)
}

// histPoint is one successful scrape's histograms, for recent quantiles.
type histPoint struct {
	at               time.Time
	queueTime, ttft  Histogram
	waiting, kvUsage Value
}

// scrapeState is what only the entry's scrape loop touches: the history of
// histogram points over the window and the trip rules' running counts.
type scrapeState struct {
	points []histPoint
	trip   saturation.TripMonitor
}

// satClaimLocked returns the newest started claim that wants saturation
// signals, nil when none does: scraping runs only for started configs.
func (e *Entry) satClaimLocked() *claim {
	var best *claim
	for _, c := range e.claims {
		if c.sat != nil && c.active.Load() && (best == nil || c.gen > best.gen) {
			best = c
		}
	}
	return best
}

// maybeScrape starts the entry's scrape loop when a started config wants
// saturation signals and no loop runs. Like the probe loop it belongs to
// the entry: one per upstream however many handlers and configs use it,
// kept across reloads, stopped when no started config wants it or the
// entry is destroyed.
func (e *Entry) maybeScrape() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.scraping || e.destroyed || e.satClaimLocked() == nil {
		return
	}
	e.scraping = true
	e.reg.scrapers.Add(1)
	go e.scrapeLoop()
}

// scrapeLoop scrapes at once, then every interval; one scrape is in flight
// at a time.
func (e *Entry) scrapeLoop() {
	defer e.reg.scrapers.Add(-1)
	var st scrapeState
	for {
		e.mu.Lock()
		c := e.satClaimLocked()
		if c == nil || e.destroyed {
			e.scraping = false
			if !e.destroyed && e.sat.Load() != nil {
				// No started config reads the signals any more (turned
				// off, or the app stopped): forget them and their series
				// rather than leave them frozen.
				e.sat.Store(nil)
				e.reg.obs.ScraperGone(e.addr)
			}
			e.mu.Unlock()
			return
		}
		cfg := c.sat
		e.mu.Unlock()

		e.scrapeOnce(cfg, &st)

		t := e.reg.timers.NewTimer(cfg.Interval)
		select {
		case <-e.ctx.Done():
			t.Stop()
			e.mu.Lock()
			e.scraping = false
			e.mu.Unlock()
			return
		case <-t.C():
		}
	}
}

// scrapeOnce fetches and applies one scrape.
func (e *Entry) scrapeOnce(cfg *Saturation, st *scrapeState) {
	start := e.reg.now()
	sc, err := e.fetch(cfg)
	end := e.reg.now()
	if e.ctx.Err() != nil {
		return // released while scraping: say nothing
	}
	e.applyScrape(cfg, st, sc, err, end, end.Sub(start))
}

// fetch GETs the metrics path within the timeout and parses the body.
func (e *Entry) fetch(cfg *Saturation) (Scrape, error) {
	ctx, cancel := context.WithTimeout(e.ctx, cfg.Timeout)
	defer cancel()
	if cfg.Dial != nil {
		ctx = cfg.Dial(ctx, e.addr)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+e.addr+cfg.MetricsPath, nil)
	if err != nil {
		return Scrape{}, err
	}
	req.URL.Scheme = "" // the transport sets http or https
	req.Header.Set("Accept", scrapeAccept)
	req.Header.Set("User-Agent", "caddy-llm-proxy-scraper")
	resp, err := cfg.Transport.RoundTrip(req)
	if err != nil {
		return Scrape{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return Scrape{}, fmt.Errorf("GET %s: status %d", cfg.MetricsPath, resp.StatusCode)
	}
	body := &limitedReader{r: resp.Body, n: maxScrapeBody}
	sc, err := ParseScrape(body, resp.Header.Get("Content-Type"), cfg.Names, e.reg.now())
	if body.over {
		return Scrape{}, fmt.Errorf("GET %s: body larger than %d bytes", cfg.MetricsPath, maxScrapeBody)
	}
	if err != nil {
		if ctx.Err() != nil {
			return Scrape{}, fmt.Errorf("GET %s: %w", cfg.MetricsPath, ctx.Err())
		}
		return Scrape{}, err
	}
	// Stamp the sample when the body was read, so staleness counts from
	// the newest moment the values can describe.
	now := e.reg.now()
	sc.Stamp(now)
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

// applyScrape publishes a scrape's outcome: the new snapshot (the count of
// attempts started since the scrape restarts on success), the signals'
// values and states, and the saturation breaker's verdict.
func (e *Entry) applyScrape(cfg *Saturation, st *scrapeState, sc Scrape, err error, now time.Time, took time.Duration) {
	prev := e.sat.Load()
	snap := &satSnapshot{tried: now, took: took, staleAfter: cfg.StaleAfter}
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
	// Published and reported under the entry's lock, so that a release
	// (destroy reports ScraperGone under it too) cannot slip in between
	// and have this scrape's series re-created after they were deleted.
	e.mu.Lock()
	if e.destroyed {
		e.mu.Unlock()
		return
	}
	e.epochReset(err == nil)
	e.sat.Store(snap)
	for i, sig := range Signals {
		from := prevStates[i]
		if prev == nil {
			from = SignalFresh
		}
		e.reg.obs.SignalUpdated(e.addr, sig, snap.values[i], snap.states[i], from)
	}
	e.reg.obs.Scraped(e.addr, took, err)
	e.reportPrefixHits(prev, snap) // prefixcache_scrape.go
	e.mu.Unlock()

	if t := cfg.Trip; t != nil {
		sn := saturation.TripInput{OK: snap.ok, QueueWait: qw, TTFT: ttft}
		if snap.ok {
			sn.KV, sn.Waiting = r.KVUsage, r.Waiting
			if len(st.points) > 1 {
				base := st.points[0]
				sn.QueueWaitOver = saturation.Over(base.queueTime, cur.queueTime, 0.99, t.QueueWaitP99)
				sn.TTFTOver = saturation.Over(base.ttft, cur.ttft, 0.95, t.TTFTP95)
			}
			if haveLast {
				sn.IntervalQueueWaitOver = saturation.Over(last.queueTime, cur.queueTime, 0.99, t.QueueWaitP99)
				sn.IntervalTTFTOver = saturation.Over(last.ttft, cur.ttft, 0.95, t.TTFTP95)
			}
		}
		e.judge(cfg, st, now, sn)
	}
}

// epochReset starts a new count of attempts since the scrape (success) or
// keeps counting against the last good one (failure).
func (e *Entry) epochReset(success bool) {
	if !success {
		return
	}
	for {
		w := e.since.Load()
		if e.since.CompareAndSwap(w, (w>>32+1)<<32) {
			return
		}
	}
}

// judge runs the saturation breaker: a rule held for its duration trips
// every breaker of the entry whose policy reads saturation signals (the
// server's queue is every model's queue; a handler without a saturation
// block is never refused for it); breakers it tripped are fed this
// scrape's verdict (recovery by observation).
func (e *Entry) judge(cfg *Saturation, st *scrapeState, now time.Time, s saturation.TripInput) {
	var bs []*breaker.Breaker
	for k, b := range e.breakerMap() {
		if e.satPolicy(k.pol) {
			bs = append(bs, b)
		}
	}
	if len(bs) == 0 {
		return
	}
	recovering := false
	for _, b := range bs {
		recovering = recovering || b.Observed()
	}
	if recovering {
		// Tripped: recovery is judged scrape by scrape (saturation.Verdict), and
		// the trip rules wait until it is closed again.
		st.trip.Reset()
	} else if reason, trip := st.trip.Update(now, cfg.Trip, s); trip {
		for _, b := range bs {
			b.TripObserved(reason) // an already open breaker keeps its own reason
		}
		// The window restarts: what recovery and the next trip judge is
		// what happens from now on, not the waits that tripped it.
		st.restartWindow()
		return
	}
	verdict, why := saturation.Verdict(cfg, s)
	closed := false
	for _, b := range bs {
		if b.Observed() {
			b.Observe(verdict, why)
			closed = closed || b.State() == breaker.Closed
		}
	}
	if closed {
		// Closed by observation: the waits from before the drain must
		// not trip it again once they are "recent" for another window.
		st.restartWindow()
	}
}

// restartWindow keeps only the latest point as the base of recent
// quantiles and forgets the trip rules' running counts.
func (st *scrapeState) restartWindow() {
	if n := len(st.points); n > 1 {
		st.points = append(st.points[:0], st.points[n-1])
	}
	st.trip.Reset()
}

// ScrapeLoops returns the number of scrape loops running.
func (r *Registry) ScrapeLoops() int { return int(r.scrapers.Load()) }
