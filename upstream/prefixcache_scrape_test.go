package upstream

import (
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/saturation"
)

// prefixHitLog is a fakeObserver that keeps the server hit ratios.
type prefixHitLog struct {
	*fakeObserver
	ratios map[string][]float64
}

func (o *prefixHitLog) ServerPrefixHitRatio(addr string, r float64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.ratios[addr] = append(o.ratios[addr], r)
}

func TestScraperReportsTheServersPrefixHitRatio(t *testing.T) {
	obs := &prefixHitLog{fakeObserver: newFakeObserver(), ratios: map[string][]float64{}}
	reg := NewRegistry(obs)
	p := satPool(t, reg, &PrefixCache{}, nil, "10.0.22.1:8000")
	f := newFeeder(t, p, "10.0.22.1:8000")
	f.scrape(time.Second, saturation.Readings{PrefixQueries: saturation.Known(100), PrefixHits: saturation.Known(50)})
	f.scrape(time.Second, saturation.Readings{PrefixQueries: saturation.Known(200), PrefixHits: saturation.Known(140)})
	f.fail(time.Second)
	f.scrape(time.Second, saturation.Readings{PrefixQueries: saturation.Known(200), PrefixHits: saturation.Known(140)}) // idle
	obs.mu.Lock()
	defer obs.mu.Unlock()
	if got := obs.ratios["10.0.22.1:8000"]; len(got) != 2 || got[0] != 0.5 || got[1] < 0.9-1e-9 || got[1] > 0.9+1e-9 {
		t.Fatalf("reported ratios %v, want [0.5 0.9] (none for a failed scrape or an idle interval)", got)
	}
}
