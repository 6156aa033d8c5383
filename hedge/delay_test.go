package hedge_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/hedge"
)

const ms = time.Millisecond

// trackerWith returns a tracker holding n observations of each duration.
func trackerWith(n int, ds ...time.Duration) *hedge.LatencyTracker {
	tr := hedge.NewLatencyTracker(time.Minute, newClock())
	for _, d := range ds {
		for range n {
			tr.Observe(d)
		}
	}
	return tr
}

func TestDelay(t *testing.T) {
	// 90 fast, 10 slow: the p95 is the slow value.
	tail := trackerWith(10, 1500*ms)
	for range 9 {
		for range 10 {
			tail.Observe(100 * ms)
		}
	}
	empty := trackerWith(0)
	p95 := hedge.DelayPolicy{Percentile: 0.95}
	for _, c := range []struct {
		name       string
		p          hedge.DelayPolicy
		tr         *hedge.LatencyTracker
		want       time.Duration
		fromTTFTs  bool
		approxOnly bool // the value is a histogram estimate
	}{
		{"fixed", hedge.DelayPolicy{Fixed: 300 * ms}, tail, 300 * ms, false, false},
		{"fixed without tracker", hedge.DelayPolicy{Fixed: 300 * ms}, nil, 300 * ms, false, false},
		{"percentile", p95, tail, 1500 * ms, true, true},
		{"median", hedge.DelayPolicy{Percentile: 0.5}, tail, 100 * ms, true, true},
		{"percentile within bounds", hedge.DelayPolicy{Percentile: 0.95, Min: 100 * ms, Max: 2 * time.Second}, tail, 1500 * ms, true, true},
		{"clamped to max", hedge.DelayPolicy{Percentile: 0.95, Max: time.Second}, tail, time.Second, true, false},
		{"clamped to min", hedge.DelayPolicy{Percentile: 0.5, Min: 250 * ms}, tail, 250 * ms, true, false},
		{"fallback: max", hedge.DelayPolicy{Percentile: 0.95, Min: 100 * ms, Max: 2 * time.Second}, empty, 2 * time.Second, false, false},
		{"fallback: fallback", hedge.DelayPolicy{Percentile: 0.95, Max: 2 * time.Second, Fallback: 700 * ms}, empty, 700 * ms, false, false},
		{"fallback: default", p95, empty, hedge.DefaultFallback, false, false},
		{"fallback: default clamped to min", hedge.DelayPolicy{Percentile: 0.95, Min: 3 * time.Second}, empty, 3 * time.Second, false, false},
		{"fallback without tracker", hedge.DelayPolicy{Percentile: 0.95, Max: 2 * time.Second}, nil, 2 * time.Second, false, false},
		{"fallback with too few samples", hedge.DelayPolicy{Percentile: 0.95, Max: 2 * time.Second}, trackerWith(19, 100*ms), 2 * time.Second, false, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, from := c.p.DelayFrom(c.tr)
			if from != c.fromTTFTs {
				t.Errorf("DelayFrom: from TTFTs = %v, want %v", from, c.fromTTFTs)
			}
			if d := c.p.Delay(c.tr); d != got {
				t.Errorf("Delay = %v, DelayFrom = %v", d, got)
			}
			if c.approxOnly && relErr(got, c.want) > tolerance || !c.approxOnly && got != c.want {
				t.Errorf("Delay = %v, want %v", got, c.want)
			}
		})
	}
}

func TestDelayFollowsTheTracker(t *testing.T) {
	clk := newClock()
	tr := hedge.NewLatencyTracker(time.Minute, clk)
	p, err := hedge.ParseAfter([]string{"p95", "min", "100ms", "max", "2s"})
	if err != nil {
		t.Fatal(err)
	}
	if d := p.Delay(tr); d != 2*time.Second {
		t.Fatalf("cold start: Delay = %v, want max 2s", d)
	}
	for range 100 {
		tr.Observe(400 * ms)
	}
	if d := p.Delay(tr); relErr(d, 400*ms) > tolerance {
		t.Fatalf("Delay = %v, want about 400ms", d)
	}
	for range 4000 { // the 400ms observations fall under 5%
		tr.Observe(30 * ms)
	}
	if d := p.Delay(tr); d != 100*ms {
		t.Fatalf("Delay = %v, want min 100ms", d)
	}
}

func TestParseAfter(t *testing.T) {
	for _, c := range []struct {
		args string
		want hedge.DelayPolicy
	}{
		{"300ms", hedge.DelayPolicy{Fixed: 300 * ms}},
		{"1.5s", hedge.DelayPolicy{Fixed: 1500 * ms}},
		{"1m", hedge.DelayPolicy{Fixed: time.Minute}},
		{"+250ms", hedge.DelayPolicy{Fixed: 250 * ms}},
		{"p095", hedge.DelayPolicy{Percentile: 0.95}},
		{"p95", hedge.DelayPolicy{Percentile: 0.95}},
		{"p50", hedge.DelayPolicy{Percentile: 0.5}},
		{"p99.9", hedge.DelayPolicy{Percentile: 0.999}},
		{"p99.999", hedge.DelayPolicy{Percentile: 0.99999}},
		{"p95 min 100ms max 2s", hedge.DelayPolicy{Percentile: 0.95, Min: 100 * ms, Max: 2 * time.Second}},
		{"p95 max 2s min 100ms", hedge.DelayPolicy{Percentile: 0.95, Min: 100 * ms, Max: 2 * time.Second}},
		{"p95 min 2s max 2s", hedge.DelayPolicy{Percentile: 0.95, Min: 2 * time.Second, Max: 2 * time.Second}},
		{"p90 max 1s", hedge.DelayPolicy{Percentile: 0.9, Max: time.Second}},
		{"p90 min 50ms", hedge.DelayPolicy{Percentile: 0.9, Min: 50 * ms}},
		{"p95 fallback 500ms", hedge.DelayPolicy{Percentile: 0.95, Fallback: 500 * ms}},
		{"p95 min 100ms max 2s fallback 1s", hedge.DelayPolicy{Percentile: 0.95, Min: 100 * ms, Max: 2 * time.Second, Fallback: time.Second}},
	} {
		got, err := hedge.ParseAfter(strings.Fields(c.args))
		if err != nil || got != c.want {
			t.Errorf("ParseAfter(%s) = %+v, %v; want %+v", c.args, got, err, c.want)
			continue
		}
		if err := got.Validate(); err != nil {
			t.Errorf("ParseAfter(%s): Validate: %v", c.args, err)
		}
		if back, err := hedge.ParseAfter(strings.Fields(got.String())); err != nil || back != got {
			t.Errorf("ParseAfter(%s).String() = %q reads back as %+v, %v", c.args, got.String(), back, err)
		}
	}
}

func TestParseAfterErrors(t *testing.T) {
	for _, c := range []struct{ args, err string }{
		{"", "after: missing delay: want a duration (after 300ms) or a percentile (after p95)"},
		{"300", `after 300: "300" is neither a duration (300ms) nor a percentile (p95): time: missing unit in duration "300"`},
		{"soon", `after soon: "soon" is neither a duration`},
		{"P95", `"P95" is neither a duration`},
		{"0s", "after 0s: delay 0s must be positive"},
		{"-1s", "after -1s: delay -1s must be positive"},
		{"300ms min 100ms", `after 300ms min 100ms: unexpected "min": min, max and fallback apply to a percentile delay`},
		{"300ms 2s", `unexpected "2s"`},
		{"p", `after p: percentile "p": want p followed by a number, as in p95 or p99.9`},
		{"p-5", `percentile "p-5": want p followed by a number`},
		{"p95%", `percentile "p95%": want p followed by a number`},
		{"p9.5.1", `percentile "p9.5.1": want p followed by a number`},
		{"p.5", `percentile "p.5": want p followed by a number`},
		{"p95.", `percentile "p95.": want p followed by a number`},
		{"p1e2", `percentile "p1e2": want p followed by a number`},
		{"pNaN", `percentile "pNaN": want p followed by a number`},
		{"p99.9999", `percentile "p99.9999": at most 3 decimals`},
		{"p100", `percentile "p100": must be at least p50 and below p100`},
		{"p49.9", `percentile "p49.9": must be at least p50 and below p100`},
		{"p0", `percentile "p0": must be at least p50`},
		{"p95 min", "after p95 min: min: missing duration"},
		{"p95 max 2s min", "min: missing duration"},
		{"p95 min fast", `after p95 min fast: min: time: invalid duration "fast"`},
		{"p95 max 2", `max: time: missing unit in duration "2"`},
		{"p95 min 0s", "min 0s must be positive"},
		{"p95 max -2s", "max -2s must be positive"},
		{"p95 fallback 0ms", "fallback 0s must be positive"},
		{"p95 min 1s min 2s", "after p95 min 1s min 2s: min given twice"},
		{"p95 max 1s max 1s", "max given twice"},
		{"p95 upto 2s", `after p95 upto 2s: unknown argument "upto": want min, max or fallback`},
		{"p95 2s", `unknown argument "2s"`},
		{"p95 min 3s max 2s", "after p95 min 3s max 2s: min 3s is above max 2s"},
		{"p95 max 2s fallback 5s", "fallback 5s is above max 2s"},
		{"p95 min 100ms fallback 50ms", "fallback 50ms is below min 100ms"},
	} {
		p, err := hedge.ParseAfter(strings.Fields(c.args))
		if err == nil {
			t.Errorf("ParseAfter(%s) = %+v, want an error", c.args, p)
			continue
		}
		if !errors.Is(err, hedge.ErrInvalidPolicy) {
			t.Errorf("ParseAfter(%s): %v does not wrap ErrInvalidPolicy", c.args, err)
		}
		if !strings.Contains(err.Error(), c.err) {
			t.Errorf("ParseAfter(%s) error = %q, want it to contain %q", c.args, err, c.err)
		}
		if p != (hedge.DelayPolicy{}) {
			t.Errorf("ParseAfter(%s) returned %+v with its error", c.args, p)
		}
	}
}

func TestValidate(t *testing.T) {
	for _, c := range []struct {
		p   hedge.DelayPolicy
		err string // "" for valid
	}{
		{hedge.DelayPolicy{Fixed: time.Second}, ""},
		{hedge.DelayPolicy{Percentile: 0.95, Min: ms, Max: time.Second, Fallback: time.Second}, ""},
		{hedge.DelayPolicy{}, "neither a fixed delay nor a percentile"},
		{hedge.DelayPolicy{Fixed: time.Second, Percentile: 0.95}, "both a fixed delay (1s) and a percentile (p95)"},
		{hedge.DelayPolicy{Fixed: -time.Second}, "fixed delay -1s is negative"},
		{hedge.DelayPolicy{Fixed: time.Second, Max: 2 * time.Second}, "min, max and fallback apply to a percentile delay"},
		{hedge.DelayPolicy{Percentile: 95}, "percentile p9500 is outside [p50, p100)"},
		{hedge.DelayPolicy{Percentile: 1}, "percentile p100 is outside"},
		{hedge.DelayPolicy{Percentile: 0.2}, "percentile p20 is outside"},
		{hedge.DelayPolicy{Percentile: -0.95}, "percentile p-95 is outside"},
		{hedge.DelayPolicy{Percentile: 0.95, Min: -ms}, "min -1ms is negative"},
		{hedge.DelayPolicy{Percentile: 0.95, Max: -ms}, "max -1ms is negative"},
		{hedge.DelayPolicy{Percentile: 0.95, Fallback: -ms}, "fallback -1ms is negative"},
		{hedge.DelayPolicy{Percentile: 0.95, Min: time.Second, Max: ms}, "min 1s is above max 1ms"},
	} {
		err := c.p.Validate()
		switch {
		case c.err == "" && err != nil:
			t.Errorf("%+v: Validate() = %v", c.p, err)
		case c.err != "" && (err == nil || !errors.Is(err, hedge.ErrInvalidPolicy) || !strings.Contains(err.Error(), c.err)):
			t.Errorf("%+v: Validate() = %v, want %q", c.p, err, c.err)
		}
	}
}
