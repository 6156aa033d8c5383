package upstream

import (
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/saturation"
)

// Selection by saturation score: the scores
// themselves are the scrapers' (saturation.Scraper.Score); here the pool
// ranks its candidates by them, drops the saturated, and sums them into
// the pool signal.

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
	// Recent failures weigh as attempts in flight do (see Candidate.Load),
	// once saturation has had its say.
	per := 1.0 / saturation.DefaultQueueThreshold
	if p.sat != nil && p.sat.QueueThreshold > 0 {
		per = 1 / p.sat.QueueThreshold
	}
	for i := range cs {
		cs[i].Score += float64(cs[i].failing) * per
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
// saturation rules) is saturated by a known queue signal, as the server
// reported it (Entry.Reported: a burst not yet scraped is no queue). An upstream whose signals are unknown keeps the
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
		s, known := m.e.Reported(now, p.sat)
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
func (p *Pool) SaturationConfig() *saturation.Saturation { return p.sat }
