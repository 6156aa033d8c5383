package upstream

import (
	"math/rand/v2"
	"net/http"
	"time"
)

// Saturation scoring (issue 9 items 3, 4 and 6). The score of an upstream
// is max(waiting / queue_threshold, kv_usage / kv_threshold): 1 is
// saturated. waiting is the effective queue:
//
//	max(scraped waiting + attempts started since that scrape and still in flight,
//	    this gateway's in-flight attempts − scraped running)
//
// The first term spreads a burst between two scrapes instead of herding it
// onto the upstream that looked idle; the second is a floor no scrape can
// lower (our requests that the server is not running are waiting), so a
// frozen "idle" /metrics cannot attract everything either. With the queue
// signal unknown (stale, failed, never scraped, not exposed) the score is
// in-flight / queue_threshold on the gateway's own count alone, and the KV
// term is dropped when KV usage is unknown: unknown is never idle, never
// full (DESIGN §7).

// startAttempt counts an attempt against the current scrape epoch and
// returns the epoch, for endAttempt.
func (e *Entry) startAttempt() uint32 { return uint32(e.since.Add(1) >> 32) }

// endAttempt takes back what startAttempt(epoch) added, if that epoch is
// still the current one (a newer scrape already counts the attempt, or
// its end). Counts never go negative.
func (e *Entry) endAttempt(epoch uint32) {
	for {
		w := e.since.Load()
		if uint32(w>>32) != epoch || uint32(w) == 0 {
			return
		}
		if e.since.CompareAndSwap(w, w-1) {
			return
		}
	}
}

// SinceScrape returns the attempts started on the upstream since its latest
// successful scrape that are still in flight.
func (e *Entry) SinceScrape() int64 { return int64(uint32(e.since.Load())) }

// Score returns the upstream's saturation score for model ("" the whole
// server) at now under s, and whether its queue signal was known; s nil
// scores in-flight counts against DefaultQueueThreshold.
func (e *Entry) Score(now time.Time, s *Saturation, model string) (score float64, known bool) {
	inflight := float64(e.inflight.Load())
	if s == nil {
		return inflight / DefaultQueueThreshold, false
	}
	snap := e.sat.Load()
	if !snap.fresh(now, s.StaleAfter) {
		return inflight / s.QueueThreshold, false
	}
	smp := &snap.scrape.Server
	if model != "" && snap.scrape.Models != nil {
		if m, ok := snap.scrape.Models[model]; ok {
			smp = &m
		}
	}
	rv := smp.Readings()
	r := &rv
	if r.Waiting.Known {
		q := r.Waiting.V + float64(uint32(e.since.Load()))
		if r.Running.Known {
			q = max(q, inflight-r.Running.V)
		}
		score, known = q/s.QueueThreshold, true
	} else {
		score = inflight / s.QueueThreshold
	}
	if r.KVUsage.Known {
		score = max(score, r.KVUsage.V/s.KVThreshold)
	}
	return score, known
}

// rank scores the candidates when the pool or its selector uses scores,
// and with saturation on removes the saturated ones (see keepUnsaturated).
// It works in place and allocates nothing.
func (p *Pool) rank(cs []Candidate, now time.Time, model string) []Candidate {
	if !p.scored || len(cs) == 0 {
		return cs
	}
	model = p.scoreModel(model)
	for i := range cs {
		cs[i].Score, _ = cs[i].Entry.Score(now, p.sat, model)
	}
	if p.sat != nil {
		cs = keepUnsaturated(cs)
	}
	return cs
}

// keepUnsaturated removes the saturated candidates (score ≥ 1) while an
// unsaturated one exists; when every one is saturated it keeps those with
// the lowest score: saturation alone never refuses a request (item 4). It
// filters in place.
func keepUnsaturated(cs []Candidate) []Candidate {
	out := cs[:0]
	least := -1.0
	for _, c := range cs {
		if c.Score < 1 {
			out = append(out, c)
		}
		if least < 0 || c.Score < least {
			least = c.Score
		}
	}
	if len(out) > 0 {
		return out
	}
	for _, c := range cs {
		if c.Score == least {
			out = append(out, c)
		}
	}
	return out
}

// LeastQueue selects the candidate with the lowest saturation score,
// breaking ties uniformly at random: the default policy when saturation is
// configured (lb_policy least_queue). Without saturation signals the
// scores are in-flight counts, and it behaves as LeastConn.
type LeastQueue struct{}

// Select implements Selector.
func (LeastQueue) Select(cs []Candidate, _ *http.Request, _ http.ResponseWriter) int {
	best, ties := -1, 0
	least := 0.0
	for i, c := range cs {
		if best == -1 || c.Score < least {
			best, least, ties = i, c.Score, 1
			continue
		}
		if c.Score == least {
			ties++
			if rand.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best
}

// wantsScores is implemented by selectors that read Candidate.Score.
func (LeastQueue) wantsScores() {}

var _ Selector = LeastQueue{}

// Saturated reports the pool signal (item 6): saturation is configured and
// every healthy upstream (breaker closed, or breakers off, or opened by the
// saturation rules) is saturated by a known queue signal. An upstream whose signals are unknown keeps the
// pool unsaturated (a failed /metrics must not shed a healthy pool), and a
// pool with no healthy upstream is unavailable, not saturated.
func (p *Pool) Saturated() bool {
	if p.sat == nil {
		return false
	}
	now := p.reg.now()
	healthy, saturated := 0, true
	check := func(m *member) bool {
		if !p.healthy(m) && !p.saturationTripped(m) {
			return true
		}
		healthy++
		s, known := m.e.Score(now, p.sat, "")
		if !known || s < 1 {
			saturated = false
			return false
		}
		return true
	}
	for _, m := range p.static {
		if !check(m) {
			return false
		}
	}
	p.dynamic.Range(func(_, v any) bool { return check(v.(*member)) })
	return saturated && healthy > 0
}

// saturationTripped reports whether m's breaker is open by the saturation
// rules: it still counts for the pool signal (it is saturated, not down).
func (p *Pool) saturationTripped(m *member) bool {
	b := m.e.lookupFor(p.claim, "")
	return b != nil && b.Observed()
}

// scoreModel is the model whose series score a request: its own under
// scope model, else the whole server's.
func (p *Pool) scoreModel(model string) string {
	if !p.cfg.ScopeModel {
		return ""
	}
	return model
}

// SaturationConfig returns the pool's saturation settings (defaults
// applied), nil when saturation is off.
func (p *Pool) SaturationConfig() *Saturation { return p.sat }

// SignalView is one signal of an upstream for the admin API.
type SignalView struct {
	// Signal is its name (queue_depth, running, kv_usage, queue_time, ttft).
	Signal Signal `json:"signal"`
	// Value is the last known value (queue_time: recent p99 in seconds,
	// ttft: recent p95 in seconds); absent when never known.
	Value *float64 `json:"value,omitempty"`
	// State is fresh, stale or missing.
	State SignalState `json:"state"`
}

// SaturationView is an upstream's saturation snapshot for the admin API.
type SaturationView struct {
	// Upstream is the dial address.
	Upstream string `json:"upstream"`
	// ScrapedAt is when the latest successful scrape was read; absent
	// when none has succeeded.
	ScrapedAt *time.Time `json:"scraped_at,omitempty"`
	// AgeSeconds is the age of that scrape in seconds (-1: none yet).
	AgeSeconds float64 `json:"age_seconds"`
	// LastError is the latest scrape's error, "" when it succeeded.
	LastError string `json:"last_error,omitempty"`
	// ScrapeSeconds is how long the latest scrape took.
	ScrapeSeconds float64 `json:"scrape_seconds"`
	// Score is the whole-server saturation score now (1 is saturated),
	// and ScoreKnown whether its queue signal was known.
	Score      float64 `json:"score"`
	ScoreKnown bool    `json:"score_known"`
	// Inflight is this gateway's attempts in progress to the upstream;
	// SinceScrape those of them started since the latest scrape.
	Inflight    int64 `json:"inflight"`
	SinceScrape int64 `json:"since_scrape"`
	// Signals are the five signals in order.
	Signals []SignalView `json:"signals"`
}

// Saturation returns the upstream's saturation snapshot at now under s (its
// thresholds and staleness); ok is false when it has never been scraped.
func (e *Entry) Saturation(now time.Time, s *Saturation) (v SaturationView, ok bool) {
	snap := e.sat.Load()
	if snap == nil {
		return SaturationView{}, false
	}
	if s == nil {
		def := Saturation{StaleAfter: snap.staleAfter}.Defaults()
		s = &def
	}
	v = SaturationView{Upstream: e.addr, AgeSeconds: -1, LastError: snap.err, ScrapeSeconds: snap.took.Seconds(),
		Inflight: e.Inflight(), SinceScrape: e.SinceScrape()}
	if at := snap.scrape.Server.At(); !at.IsZero() {
		v.ScrapedAt = &at
		v.AgeSeconds = snap.scrape.Server.Age(now).Seconds()
	}
	v.Score, v.ScoreKnown = e.Score(now, s, "")
	stale := !snap.fresh(now, s.StaleAfter)
	for i, sig := range Signals {
		sv := SignalView{Signal: sig, State: snap.states[i]}
		if stale && sv.State == SignalFresh {
			sv.State = SignalStale
		}
		if snap.values[i].Known {
			x := snap.values[i].V
			sv.Value = &x
		}
		v.Signals = append(v.Signals, sv)
	}
	return v, true
}

// Saturation returns the snapshots of every scraped upstream, by address.
func (r *Registry) Saturation(now time.Time) []SaturationView {
	var out []SaturationView
	for _, e := range r.Entries() {
		var s *Saturation
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
