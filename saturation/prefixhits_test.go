package saturation

import (
	"strings"
	"testing"
	"time"
)

func TestServerPrefixHitRatioFromCountersOrGauge(t *testing.T) {
	vllm := func(q, h float64) Readings {
		return Readings{PrefixQueries: Known(q), PrefixHits: Known(h)}
	}
	for _, tc := range []struct {
		name      string
		prev, cur Readings
		want      float64
		ok        bool
	}{
		{"first scrape: totals", Readings{}, vllm(100, 25), 0.25, true},
		{"increase between scrapes", vllm(100, 25), vllm(300, 205), 0.9, true},
		{"nothing looked up", vllm(100, 25), vllm(100, 25), 0, false},
		{"restart: totals", vllm(1000, 900), vllm(40, 10), 0.25, true},
		{"sglang gauge", Readings{}, Readings{PrefixHitRate: Known(0.7)}, 0.7, true},
		{"gauge out of range", Readings{}, Readings{PrefixHitRate: Known(7)}, 0, false},
		{"none", Readings{}, Readings{Waiting: Known(3)}, 0, false},
	} {
		got, ok := ServerPrefixHitRatio(tc.prev, tc.cur)
		if ok != tc.ok || (ok && (got < tc.want-1e-9 || got > tc.want+1e-9)) {
			t.Errorf("%s: got %v, %v; want %v, %v", tc.name, got, ok, tc.want, tc.ok)
		}
	}
}

func TestParseReadsPrefixCacheMetrics(t *testing.T) {
	const vllmBody = `# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 640
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 480
`
	s, err := ParseSignals(strings.NewReader(vllmBody), "", VLLMSignals, "", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if r := s.Readings(); r.PrefixQueries != Known(640) || r.PrefixHits != Known(480) {
		t.Fatalf("vLLM prefix counters read %+v, %+v", r.PrefixQueries, r.PrefixHits)
	}
	const sglangBody = `# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m"} 0.5
sglang:cache_hit_rate{model_name="n"} 0.7
`
	s, err = ParseSignals(strings.NewReader(sglangBody), "", SGLangSignals, "", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if r := s.Readings().PrefixHitRate; !r.Known || r.V < 0.6-1e-9 || r.V > 0.6+1e-9 {
		t.Fatalf("SGLang cache_hit_rate read %+v, want the mean 0.6", r)
	}
}
