package upstream

import (
	"time"

	"github.com/llmproxy/caddy-llm-proxy/saturation"
)

// The entry's side of its saturation.Scraper: which config's settings it
// scrapes with, which breakers its trips reach (DESIGN §7: a verdict
// steers only the pools that configured saturation), the attempts it
// counts, and the registry's clock.

// satClaimLocked returns the newest started claim that wants saturation
// signals, nil when none does: scraping runs only for started configs.
func (e *Entry) satClaimLocked() *claim {
	var best *claim
	for _, c := range e.claims {
		if c.sat != nil && c.active.Load() && (best == nil || c.newerThan(best)) {
			best = c
		}
	}
	return best
}

// configureScraperLocked hands the scraper the settings of the newest
// started config that reads saturation signals (nil when none does: the
// loop stops at its next tick). Like the probe loop the scrape loop
// belongs to the entry: one per upstream however many handlers and
// configs use it, kept across reloads. Called under e.mu, so that the
// scraper gets the claims' changes in order.
func (e *Entry) configureScraperLocked() {
	var cfg *saturation.Saturation
	if c := e.satClaimLocked(); c != nil && !e.destroyed {
		cfg = c.sat
	}
	e.scraper.Configure(cfg)
}

// scrapeHost is an entry as its scraper sees it.
type scrapeHost struct{ e *Entry }

// Inflight implements saturation.Host.
func (h scrapeHost) Inflight() int64 { return h.e.inflight.Load() }

// TripGroups implements saturation.Host: the entry's breakers whose
// handler reads saturation signals (the server's queue is every model's
// queue), one group per policy, judged by that policy's trip rules; a
// handler without a saturation block is never refused for it, and one
// pool's trip rules never trip another's breakers.
func (h scrapeHost) TripGroups() []saturation.TripGroup {
	byPol := map[string]*saturation.TripGroup{}
	var keys []string
	for _, v := range h.e.verdictList() {
		if v.c.sat == nil {
			continue
		}
		g := byPol[v.c.fp]
		if g == nil {
			g = &saturation.TripGroup{Key: v.c.fp, Config: v.c.sat}
			byPol[v.c.fp] = g
			keys = append(keys, v.c.fp)
		}
		g.Breakers = append(g.Breakers, v.b)
	}
	out := make([]saturation.TripGroup, 0, len(keys))
	for _, k := range keys {
		out = append(out, *byPol[k])
	}
	return out
}

// startAttempt counts an attempt against the current scrape epoch and
// returns the epoch, for endAttempt.
func (e *Entry) startAttempt() uint32 { return e.scraper.StartAttempt() }

// endAttempt takes back what startAttempt(epoch) added (see
// saturation.Scraper.EndAttempt).
func (e *Entry) endAttempt(epoch uint32) { e.scraper.EndAttempt(epoch) }

// SinceScrape returns the attempts started on the upstream since its latest
// successful scrape that are still in flight.
func (e *Entry) SinceScrape() int64 { return e.scraper.SinceScrape() }

// Score returns the upstream's saturation score for model ("" the whole
// server) at now under s, and whether its queue signal was known; s nil
// scores in-flight counts against saturation.DefaultQueueThreshold (see
// saturation.Scraper.Score).
func (e *Entry) Score(now time.Time, s *saturation.Saturation, model string) (score float64, known bool) {
	return e.scraper.Score(now, s, model)
}

// Reported returns the score the upstream's own latest scrape gives under
// s, without estimates of attempts since (saturation.Scraper.Reported):
// the pool signal's input.
func (e *Entry) Reported(now time.Time, s *saturation.Saturation) (score float64, known bool) {
	return e.scraper.Reported(now, s)
}

// Saturation returns the upstream's saturation snapshot at now under s (its
// thresholds and staleness; nil: the defaults); ok is false when it has
// never been scraped.
func (e *Entry) Saturation(now time.Time, s *saturation.Saturation) (v saturation.View, ok bool) {
	return e.scraper.View(now, s)
}

// Saturation returns the snapshots of every scraped upstream, by address,
// each under the settings of the newest started config that reads it.
func (r *Registry) Saturation(now time.Time) []saturation.View {
	var out []saturation.View
	for _, e := range r.Entries() {
		var s *saturation.Saturation
		e.mu.Lock()
		if c := e.satClaimLocked(); c != nil {
			s = c.sat
		}
		e.mu.Unlock()
		if v, ok := e.Saturation(now, s); ok {
			out = append(out, v)
		}
	}
	return out
}

// ScrapeLoops returns the number of scrape loops running.
func (r *Registry) ScrapeLoops() int { return r.scrapers.Loops() }
