package hedge

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// DefaultFallback is the delay of a percentile policy without Fallback or
// Max while its tracker has fewer than MinSamples observations: hedge late
// rather than early until the fleet's latency is known.
const DefaultFallback = time.Second

// MinPercentile is the lowest percentile a policy accepts (0.5, the median):
// a lower one would back up most requests and only the rate cap would stop it.
const MinPercentile = 0.5

// DelayPolicy says how long an attempt may go without its first event before
// a backup attempt starts (`after …` in the Caddyfile's hedge block).
//
// Exactly one of Fixed and Percentile is set:
//
//   - Fixed: a constant delay (`after 300ms`);
//   - Percentile: that quantile of the recent TTFTs of the pool and model
//     (`after p95`, Percentile 0.95), the choice of Dean and Barroso, "The
//     Tail at Scale", CACM 2013, who hedge at p95 for a few percent more
//     requests; clamped to [Min, Max] (`after p95 min 100ms max 2s`).
//
// While the tracker has too few observations (see LatencyTracker.Quantile) a
// percentile policy uses Fallback, or Max when Fallback is 0, or
// DefaultFallback when both are 0; the result is clamped to [Min, Max] too.
//
// The zero value is not valid (Validate reports it); build policies with
// ParseAfter or check them with Validate.
type DelayPolicy struct {
	// Fixed is the delay of a fixed policy; 0 for a percentile policy.
	Fixed time.Duration `json:"fixed,omitempty"`
	// Percentile is the quantile of recent TTFT, in [MinPercentile, 1)
	// (0.95 for p95); 0 for a fixed policy.
	Percentile float64 `json:"percentile,omitempty"`
	// Min is the lowest delay of a percentile policy; 0 means no floor.
	Min time.Duration `json:"min,omitempty"`
	// Max is the highest delay of a percentile policy; 0 means no ceiling.
	Max time.Duration `json:"max,omitempty"`
	// Fallback is the delay of a percentile policy without enough samples;
	// 0 means Max, or DefaultFallback when Max is 0 too.
	Fallback time.Duration `json:"fallback,omitempty"`
}

// Delay returns the hedge delay now: Fixed, or the Percentile of t's
// observations clamped to [Min, Max], or the fallback when t is nil or has
// too few observations. It allocates nothing.
func (p DelayPolicy) Delay(t *LatencyTracker) time.Duration {
	d, _ := p.DelayFrom(t)
	return d
}

// DelayFrom is Delay that also says whether the delay came from t's
// observations (false: Fixed, or the fallback).
func (p DelayPolicy) DelayFrom(t *LatencyTracker) (time.Duration, bool) {
	if p.Percentile == 0 {
		return p.Fixed, false
	}
	d, ok := time.Duration(0), false
	if t != nil {
		d, ok = t.Quantile(p.Percentile)
	}
	if !ok {
		d = p.fallback()
	}
	if d < p.Min {
		d = p.Min
	}
	if p.Max > 0 && d > p.Max {
		d = p.Max
	}
	return d, ok
}

func (p DelayPolicy) fallback() time.Duration {
	switch {
	case p.Fallback > 0:
		return p.Fallback
	case p.Max > 0:
		return p.Max
	}
	return DefaultFallback
}

// ErrInvalidPolicy is wrapped by every error of Validate and ParseAfter.
var ErrInvalidPolicy = errors.New("invalid hedge delay")

// Validate reports what is wrong with p, if anything: exactly one of Fixed
// (> 0) and Percentile (in [MinPercentile, 1)); Min, Max and Fallback only
// with a percentile, not negative, Min ≤ Max, Fallback within [Min, Max].
func (p DelayPolicy) Validate() error {
	if msg := p.problem(); msg != "" {
		return fmt.Errorf("%w: %s", ErrInvalidPolicy, msg)
	}
	return nil
}

// problem says what is wrong with p, or "".
func (p DelayPolicy) problem() string {
	f := fmt.Sprintf
	switch {
	case p.Fixed == 0 && p.Percentile == 0:
		return "neither a fixed delay nor a percentile"
	case p.Fixed != 0 && p.Percentile != 0:
		return f("both a fixed delay (%v) and a percentile (p%s)", p.Fixed, formatPercentile(p.Percentile))
	case p.Fixed < 0:
		return f("fixed delay %v is negative", p.Fixed)
	case p.Fixed > 0:
		if p.Min != 0 || p.Max != 0 || p.Fallback != 0 {
			return f("min, max and fallback apply to a percentile delay, not to a fixed one (%v)", p.Fixed)
		}
		return ""
	case !(p.Percentile >= MinPercentile && p.Percentile < 1):
		return f("percentile p%s is outside [p%s, p100)", formatPercentile(p.Percentile), formatPercentile(MinPercentile))
	case p.Min < 0:
		return f("min %v is negative", p.Min)
	case p.Max < 0:
		return f("max %v is negative", p.Max)
	case p.Fallback < 0:
		return f("fallback %v is negative", p.Fallback)
	case p.Max > 0 && p.Min > p.Max:
		return f("min %v is above max %v", p.Min, p.Max)
	case p.Fallback > 0 && p.Fallback < p.Min:
		return f("fallback %v is below min %v", p.Fallback, p.Min)
	case p.Fallback > 0 && p.Max > 0 && p.Fallback > p.Max:
		return f("fallback %v is above max %v", p.Fallback, p.Max)
	}
	return ""
}

// String returns the policy in the Caddyfile's form, the arguments of
// `after` ("300ms", "p95 min 100ms max 2s"), which ParseAfter reads back.
func (p DelayPolicy) String() string {
	if p.Percentile == 0 {
		return p.Fixed.String()
	}
	s := "p" + formatPercentile(p.Percentile)
	if p.Min != 0 {
		s += " min " + p.Min.String()
	}
	if p.Max != 0 {
		s += " max " + p.Max.String()
	}
	if p.Fallback != 0 {
		s += " fallback " + p.Fallback.String()
	}
	return s
}

// formatPercentile returns 100q with at most 10 significant digits, so that
// 0.999 reads "99.9".
func formatPercentile(q float64) string {
	return strconv.FormatFloat(q*100, 'g', 10, 64)
}

// ParseAfter parses the arguments of the hedge block's `after` subdirective:
//
//	after <duration>
//	after p<NN> [min <duration>] [max <duration>] [fallback <duration>]
//
// A duration is Go's (time.ParseDuration: "300ms", "1.5s") and positive. NN
// is a percentile from 50 up to, not including, 100, with at most 3 decimals
// ("p95", "p99.9"). min, max and fallback may come in
// any order, each at most once. Errors wrap ErrInvalidPolicy and name the
// offending argument.
func ParseAfter(args []string) (DelayPolicy, error) {
	var p DelayPolicy
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: after %s: "+format, append([]any{ErrInvalidPolicy, strings.Join(args, " ")}, a...)...)
	}
	if len(args) == 0 {
		return DelayPolicy{}, fmt.Errorf("%w: after: missing delay: want a duration (after 300ms) or a percentile (after p95)", ErrInvalidPolicy)
	}
	first := args[0]
	if !strings.HasPrefix(first, "p") {
		d, err := time.ParseDuration(first)
		if err != nil {
			return DelayPolicy{}, bad("%q is neither a duration (300ms) nor a percentile (p95): %w", first, err)
		}
		if d <= 0 {
			return DelayPolicy{}, bad("delay %v must be positive", d)
		}
		if len(args) > 1 {
			return DelayPolicy{}, bad("unexpected %q: min, max and fallback apply to a percentile delay (after p95 min 100ms max 2s)", args[1])
		}
		p.Fixed = d
		return p, nil
	}
	q, err := parsePercentile(first[1:])
	if err != nil {
		return DelayPolicy{}, bad("percentile %q: %w", first, err)
	}
	p.Percentile = q
	for i := 1; i < len(args); i += 2 {
		key := args[i]
		var dst *time.Duration
		switch key {
		case "min":
			dst = &p.Min
		case "max":
			dst = &p.Max
		case "fallback":
			dst = &p.Fallback
		default:
			return DelayPolicy{}, bad("unknown argument %q: want min, max or fallback", key)
		}
		if *dst != 0 {
			return DelayPolicy{}, bad("%s given twice", key)
		}
		if i+1 >= len(args) {
			return DelayPolicy{}, bad("%s: missing duration", key)
		}
		d, err := time.ParseDuration(args[i+1])
		if err != nil {
			return DelayPolicy{}, bad("%s: %w", key, err)
		}
		if d <= 0 {
			return DelayPolicy{}, bad("%s %v must be positive", key, d)
		}
		*dst = d
	}
	if msg := p.problem(); msg != "" {
		return DelayPolicy{}, bad("%s", msg)
	}
	return p, nil
}

// parsePercentile parses "95" or "99.9" (digits, optionally a dot and at
// most 3 more digits) into 0.95 or 0.999; it must be in [50, 100).
func parsePercentile(s string) (float64, error) {
	intPart, frac, dot := strings.Cut(s, ".")
	if !allDigits(intPart) || len(intPart) > 6 || dot && !allDigits(frac) {
		return 0, errors.New("want p followed by a number, as in p95 or p99.9")
	}
	if len(frac) > 3 {
		return 0, errors.New("at most 3 decimals, as in p99.999")
	}
	// In thousandths of a percent, so that the division below rounds once
	// and p99.9 gives exactly the float64 nearest 0.999.
	n, _ := strconv.Atoi(intPart + (frac + "000")[:3]) // at most 9 digits
	if n < int(MinPercentile*100_000) || n >= 100_000 {
		return 0, fmt.Errorf("must be at least p%s and below p100", formatPercentile(MinPercentile))
	}
	return float64(n) / 100_000, nil
}

// allDigits reports whether s is a non-empty run of ASCII digits.
func allDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return s != ""
}
