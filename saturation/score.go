package saturation

import "time"

// Saturation scoring. The score of an upstream
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

// StartAttempt counts an attempt to the upstream against the current
// scrape epoch and returns the epoch, for EndAttempt. It allocates nothing.
func (s *Scraper) StartAttempt() uint32 { return uint32(s.since.Add(1) >> 32) }

// EndAttempt takes back what StartAttempt(epoch) added, if that epoch is
// still the current one (a newer scrape already counts the attempt, or
// its end). Counts never go negative.
func (s *Scraper) EndAttempt(epoch uint32) {
	for {
		w := s.since.Load()
		if uint32(w>>32) != epoch || uint32(w) == 0 {
			return
		}
		if s.since.CompareAndSwap(w, w-1) {
			return
		}
	}
}

// epochReset starts a new count of attempts since the scrape (success) or
// keeps counting against the last good one (failure).
func (s *Scraper) epochReset(success bool) {
	if !success {
		return
	}
	for {
		w := s.since.Load()
		if s.since.CompareAndSwap(w, (w>>32+1)<<32) {
			return
		}
	}
}

// SinceScrape returns the attempts started on the upstream since its latest
// successful scrape that are still in flight.
func (s *Scraper) SinceScrape() int64 { return int64(uint32(s.since.Load())) }

// Score returns the upstream's saturation score for model ("" the whole
// server, or a model the scrape has no series of) at now under cfg, and
// whether its queue signal was known; cfg nil scores the host's in-flight
// count against DefaultQueueThreshold. 1 is saturated. It allocates
// nothing.
func (s *Scraper) Score(now time.Time, cfg *Saturation, model string) (score float64, known bool) {
	inflight := float64(s.host.Inflight())
	if cfg == nil {
		return inflight / DefaultQueueThreshold, false
	}
	snap := s.snap.Load()
	if !snap.fresh(now, cfg.StaleAfter) {
		return inflight / cfg.QueueThreshold, false
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
		q := r.Waiting.V + float64(uint32(s.since.Load()))
		if r.Running.Known {
			q = max(q, inflight-r.Running.V)
		}
		score, known = q/cfg.QueueThreshold, true
	} else {
		score = inflight / cfg.QueueThreshold
	}
	if r.KVUsage.Known {
		score = max(score, r.KVUsage.V/cfg.KVThreshold)
	}
	return score, known
}

// Reported returns the upstream's saturation score at now under cfg from
// what the server itself reported in its latest fresh scrape, with none of
// Score's estimates of this gateway's attempts since that scrape:
// max(waiting / queue_threshold, kv_usage / kv_threshold), and whether the
// queue signal was known. It is the pool signal's input (admission
// queues or sheds on it): Score's estimates steer selection, where
// spreading a burst costs nothing, but a gate that read them would admit a
// burst from idle at the scraped running batch plus queue_threshold per
// scrape, in front of servers that queue nothing. cfg nil or
// a stale scrape: unknown (0, false). It allocates nothing.
func (s *Scraper) Reported(now time.Time, cfg *Saturation) (score float64, known bool) {
	if cfg == nil {
		return 0, false
	}
	snap := s.snap.Load()
	if !snap.fresh(now, cfg.StaleAfter) {
		return 0, false
	}
	r := snap.scrape.Server.Readings()
	if r.Waiting.Known {
		score, known = r.Waiting.V/cfg.QueueThreshold, true
	}
	if r.KVUsage.Known {
		score = max(score, r.KVUsage.V/cfg.KVThreshold)
	}
	return score, known
}

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

// View is an upstream's saturation snapshot for the admin API
// (GET /llm_proxy/saturation).
type View struct {
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

// View returns the upstream's saturation snapshot at now under cfg (its
// thresholds and staleness; nil: the defaults with the staleness of the
// latest scrape); ok is false when no scrape was ever published.
func (s *Scraper) View(now time.Time, cfg *Saturation) (v View, ok bool) {
	snap := s.snap.Load()
	if snap == nil {
		return View{}, false
	}
	if cfg == nil {
		def := Saturation{StaleAfter: snap.staleAfter}.Defaults()
		cfg = &def
	}
	v = View{Upstream: s.addr, AgeSeconds: -1, LastError: snap.err, ScrapeSeconds: snap.took.Seconds(),
		Inflight: s.host.Inflight(), SinceScrape: s.SinceScrape()}
	if at := snap.scrape.Server.At(); !at.IsZero() {
		v.ScrapedAt = &at
		v.AgeSeconds = snap.scrape.Server.Age(now).Seconds()
	}
	v.Score, v.ScoreKnown = s.Score(now, cfg, "")
	stale := !snap.fresh(now, cfg.StaleAfter)
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
