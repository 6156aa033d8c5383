package saturation

import (
	"testing"
	"time"
)

func TestSaturationConfigDefaultsAndErrors(t *testing.T) {
	s := Saturation{}.Defaults()
	if s.MetricsPath != "/metrics" || s.Interval != time.Second || s.Timeout != 500*time.Millisecond || s.StaleAfter != 3*time.Second ||
		s.QueueThreshold != 5 || s.KVThreshold != 0.8 || s.Window != 30*time.Second || s.Names.KVUsage[0] != "vllm:kv_cache_usage_perc" {
		t.Fatalf("defaults = %+v", s)
	}
	if err := s.Validate(); err != nil {
		t.Fatal(err)
	}
	if tr := (Saturation{Trip: &TripRules{QueueWaitP99: time.Second}}).Defaults().Trip; tr.QueueWaitFor != 30*time.Second || tr.KVUsage != 0 {
		t.Fatalf("trip defaults = %+v", tr)
	}
	for _, bad := range []Saturation{
		{Interval: time.Second, StaleAfter: 1500 * time.Millisecond},
		{Interval: time.Second, Timeout: 2 * time.Second},
		{MetricsPath: "metrics"},
		{KVThreshold: 1.5},
		{Interval: time.Second, Window: time.Second},
	} {
		if err := bad.Defaults().Validate(); err == nil {
			t.Errorf("%+v: no error", bad)
		}
	}
}
