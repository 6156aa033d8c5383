package hedge_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/hedge"
)

// FuzzParseAfter feeds ParseAfter the fields of arbitrary text. The seed
// corpus is in testdata/fuzz/FuzzParseAfter; run more with
//
//	go test -run '^$' -fuzz FuzzParseAfter -fuzztime 30s ./hedge/
//
// Properties: no panic; an error wraps ErrInvalidPolicy and comes with the
// zero policy; a policy parsed is valid, reads back from its String, and
// gives delays within [Min, Max] with or without observations.
func FuzzParseAfter(f *testing.F) {
	for _, s := range []string{"300ms", "p95", "p95 min 100ms max 2s", "p99.9 fallback 1s", "p95 max 2s min 3s", ""} {
		f.Add(s)
	}
	full := trackerWith(20, 10*time.Millisecond, 300*time.Millisecond, 5*time.Second)
	empty := trackerWith(0)
	f.Fuzz(func(t *testing.T, s string) {
		p, err := hedge.ParseAfter(strings.Fields(s))
		if err != nil {
			if !errors.Is(err, hedge.ErrInvalidPolicy) {
				t.Fatalf("ParseAfter(%q) error %v does not wrap ErrInvalidPolicy", s, err)
			}
			if p != (hedge.DelayPolicy{}) {
				t.Fatalf("ParseAfter(%q) returned %+v with its error", s, p)
			}
			return
		}
		if err := p.Validate(); err != nil {
			t.Fatalf("ParseAfter(%q) = %+v, invalid: %v", s, p, err)
		}
		back, err := hedge.ParseAfter(strings.Fields(p.String()))
		if err != nil || back != p {
			t.Fatalf("ParseAfter(%q) = %+v; its String %q reads back as %+v, %v", s, p, p.String(), back, err)
		}
		for _, tr := range []*hedge.LatencyTracker{full, empty, nil} {
			d := p.Delay(tr)
			if d <= 0 || d < p.Min || p.Max > 0 && d > p.Max {
				t.Fatalf("%+v: Delay = %v, outside (0, max] or below min", p, d)
			}
		}
	})
}
