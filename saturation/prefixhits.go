package saturation

// PrefixHitObserver is implemented by an Observer that wants each scraped
// upstream's own prefix-cache hit ratio (shown next to lb_policy
// prefix_cache's guess). The scraper checks for it with a type assertion,
// so Observers without it are unaffected.
type PrefixHitObserver interface {
	// ServerPrefixHitRatio reports the upstream's prefix-cache hit ratio
	// (0–1) after a successful scrape: the share of the prompt tokens it
	// looked up since the previous scrape that it found (vLLM's
	// prefix_cache_hits / prefix_cache_queries counters), else its own
	// hit-rate gauge (SGLang's cache_hit_rate). It is not called when the
	// server exposes neither, nor when it looked nothing up between the
	// two scrapes.
	ServerPrefixHitRatio(upstream string, ratio float64)
}

// ServerPrefixHitRatio returns the hit ratio that the scrape cur reports,
// with prev the scrape before it (zero when none): the counters' increase
// between the two when both expose them and queries grew (a counter that
// went down, a restart, reads cur's own totals), else cur's hit-rate
// gauge; ok is false when neither is known.
func ServerPrefixHitRatio(prev, cur Readings) (ratio float64, ok bool) {
	q, h := cur.PrefixQueries, cur.PrefixHits
	if q.Known && h.Known {
		dq, dh := q.V, h.V
		if prev.PrefixQueries.Known && prev.PrefixHits.Known && q.V >= prev.PrefixQueries.V && h.V >= prev.PrefixHits.V {
			dq, dh = q.V-prev.PrefixQueries.V, h.V-prev.PrefixHits.V
		}
		if dq > 0 {
			return min(max(dh/dq, 0), 1), true
		}
		return 0, false
	}
	if r := cur.PrefixHitRate; r.Known && r.V >= 0 && r.V <= 1 {
		return r.V, true
	}
	return 0, false
}

// reportPrefixHits tells a PrefixHitObserver the server's hit ratio of a
// successful scrape. Called under s.mu.
func (s *Scraper) reportPrefixHits(prev, snap *snapshot) {
	o, ok := s.g.obs.(PrefixHitObserver)
	if !ok || !snap.ok {
		return
	}
	var before Readings // the latest successful scrape before this one
	if prev != nil {
		before = prev.scrape.Server.Readings()
	}
	if r, ok := ServerPrefixHitRatio(before, snap.scrape.Server.Readings()); ok {
		o.ServerPrefixHitRatio(s.addr, r)
	}
}
