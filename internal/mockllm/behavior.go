package mockllm

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Defaults for the zero fields of a Behavior.
const (
	DefaultModel         = "mock-llama"
	DefaultTTFT          = 50 * time.Millisecond
	DefaultTokens        = 16
	DefaultTokenInterval = 20 * time.Millisecond
)

// NoDelay, used as a TTFT median or a token interval, asks for no delay at
// all; the zero value of those fields means the default. Any negative
// duration is treated the same way.
const NoDelay time.Duration = -1

// NoTokens, used as Behavior.Tokens, asks for an empty completion (zero
// means DefaultTokens). Any negative count is treated the same way.
const NoTokens = -1

// Request headers that override a replica's Behavior for one request, and
// the response header that names the replica.
const (
	HeaderTTFT          = "X-Mock-TTFT"
	HeaderStraggler     = "X-Mock-Straggler"
	HeaderTokens        = "X-Mock-Tokens"
	HeaderTokenInterval = "X-Mock-Token-Interval"
	HeaderTPS           = "X-Mock-TPS"
	HeaderTokenBytes    = "X-Mock-Token-Bytes"
	HeaderFault         = "X-Mock-Fault"
	// HeaderReplica is set on every response to the replica's address.
	HeaderReplica = "X-Mock-Replica"
)

// Limits on parsed values, so that a fuzzed or mistyped spec cannot ask
// for a day-long sleep loop or gigabytes of output.
const (
	maxDuration   = 24 * time.Hour
	maxCount      = 1_000_000
	maxTokenBytes = 1 << 20
	maxSigma      = 10
)

// Behavior is what a replica does with a completion request. The zero
// value is a healthy replica: 50ms fixed TTFT, 16 tokens 20ms apart, no
// faults.
type Behavior struct {
	// Model is the model name listed by /v1/models and used in responses
	// to requests that name no model (a request's own model is echoed).
	// Default "mock-llama".
	Model string

	// TTFT is the time from the moment a request holds a generation slot
	// to its first token. Zero means DefaultTTFT; a negative median means
	// no delay. Queueing time (FleetConfig.Capacity, FleetConfig.KVBlocks)
	// comes on top.
	TTFT Latency

	// Straggler makes a fraction of requests wait a delay drawn uniformly
	// from [Min, Max] instead of their TTFT. Zero means no stragglers.
	Straggler Straggler

	// Tokens is the number of tokens generated, unless the request's
	// output limit is smaller (max_completion_tokens or max_tokens;
	// Responses' max_output_tokens; Messages' max_tokens): then
	// finish_reason is "length", a Responses stream ends with
	// response.incomplete and a Messages one with stop_reason
	// "max_tokens". Zero means DefaultTokens; negative means none.
	Tokens int

	// TokenInterval is the delay between two tokens. Zero means
	// DefaultTokenInterval; negative means no delay.
	TokenInterval time.Duration

	// TokenBytes pads the content of each token to about this many bytes
	// (with multi-byte UTF-8 filler). Zero means no padding.
	TokenBytes int

	// Fault is the failure injected into completion requests. Zero means
	// none.
	Fault Fault

	// HealthStatus is the status of GET /health. Zero means 200.
	HealthStatus int
}

// Latency is a delay distribution: fixed at Median when Sigma is zero,
// otherwise lognormal with that median and shape Sigma (the standard
// deviation of the underlying normal distribution).
type Latency struct {
	Median time.Duration
	Sigma  float64
}

// Fixed returns a fixed latency; d <= 0 yields NoDelay.
func Fixed(d time.Duration) Latency {
	if d <= 0 {
		return Latency{Median: NoDelay}
	}
	return Latency{Median: d}
}

// LogNormal returns a lognormal latency with the given median and sigma.
func LogNormal(median time.Duration, sigma float64) Latency {
	if median <= 0 {
		return Latency{Median: NoDelay}
	}
	return Latency{Median: median, Sigma: sigma}
}

// IsZero reports whether l is the zero value (meaning "the default").
func (l Latency) IsZero() bool { return l == Latency{} }

// String formats l as ParseLatency accepts it: "200ms",
// "lognormal:150ms:0.5", "0" for no delay, "" for the zero value.
func (l Latency) String() string {
	switch {
	case l.IsZero():
		return ""
	case l.Median <= 0:
		return "0"
	case l.Sigma == 0:
		return l.Median.String()
	}
	return "lognormal:" + l.Median.String() + ":" + strconv.FormatFloat(l.Sigma, 'g', -1, 64)
}

// ParseLatency parses "200ms" (fixed), "0" (no delay) or
// "lognormal:MEDIAN:SIGMA".
func ParseLatency(s string) (Latency, error) {
	s = strings.TrimSpace(s)
	if rest, ok := strings.CutPrefix(s, "lognormal:"); ok {
		m, sig, ok := strings.Cut(rest, ":")
		if !ok {
			return Latency{}, fmt.Errorf("latency %q: want lognormal:MEDIAN:SIGMA", s)
		}
		median, err := parseDuration(m)
		if err != nil {
			return Latency{}, fmt.Errorf("latency %q: median: %w", s, err)
		}
		sigma, err := strconv.ParseFloat(strings.TrimSpace(sig), 64)
		if err != nil || math.IsNaN(sigma) || sigma < 0 || sigma > maxSigma {
			return Latency{}, fmt.Errorf("latency %q: sigma must be a number in [0, %d]", s, maxSigma)
		}
		return LogNormal(median, sigma), nil
	}
	d, err := parseDuration(s)
	if err != nil {
		return Latency{}, fmt.Errorf("latency %q: %w", s, err)
	}
	return Fixed(d), nil
}

// sample draws a delay; the zero Latency yields def.
func (l Latency) sample(rng *rand.Rand, def time.Duration) time.Duration {
	switch {
	case l.IsZero():
		return def
	case l.Median <= 0:
		return 0
	case l.Sigma == 0:
		return l.Median
	}
	v := float64(l.Median) * math.Exp(l.Sigma*rng.NormFloat64())
	if v > float64(maxDuration) {
		return maxDuration
	}
	return time.Duration(v)
}

// Straggler sends a Fraction of requests a delay drawn uniformly from
// [Min, Max] in place of their TTFT.
type Straggler struct {
	Fraction float64
	Min, Max time.Duration
}

// String formats s as ParseStraggler accepts it: "0.05:2s-5s", "0.05:2s",
// or "" for none.
func (s Straggler) String() string {
	if s == (Straggler{}) {
		return ""
	}
	f := strconv.FormatFloat(s.Fraction, 'g', -1, 64)
	if s.Min == s.Max {
		return f + ":" + s.Min.String()
	}
	return f + ":" + s.Min.String() + "-" + s.Max.String()
}

// ParseStraggler parses "FRACTION:DELAY" or "FRACTION:MIN-MAX", e.g.
// "0.05:2s-5s"; "none" or a zero fraction means no stragglers.
func ParseStraggler(s string) (Straggler, error) {
	s = strings.TrimSpace(s)
	if s == "" || s == "none" {
		return Straggler{}, nil
	}
	fs, rs, ok := strings.Cut(s, ":")
	if !ok {
		return Straggler{}, fmt.Errorf("straggler %q: want FRACTION:MIN-MAX", s)
	}
	frac, err := parseFraction(fs)
	if err != nil {
		return Straggler{}, fmt.Errorf("straggler %q: %w", s, err)
	}
	lo, hi, isRange := strings.Cut(rs, "-")
	min, err := parseDuration(lo)
	if err != nil {
		return Straggler{}, fmt.Errorf("straggler %q: %w", s, err)
	}
	max := min
	if isRange {
		if max, err = parseDuration(hi); err != nil {
			return Straggler{}, fmt.Errorf("straggler %q: %w", s, err)
		}
	}
	if max < min {
		return Straggler{}, fmt.Errorf("straggler %q: max below min", s)
	}
	if frac == 0 {
		return Straggler{}, nil
	}
	return Straggler{Fraction: frac, Min: min, Max: max}, nil
}

// knobs lists the spec keys in the order Behavior.String writes them.
var knobs = []string{"model", "ttft", "straggler", "tokens", "token_interval", "token_bytes", "fault", "health_status"}

// headerKnobs maps the per-request headers to spec keys; X-Mock-TPS comes
// after X-Mock-Token-Interval so that it wins when both are sent.
var headerKnobs = []struct{ header, key string }{
	{HeaderTTFT, "ttft"},
	{HeaderStraggler, "straggler"},
	{HeaderTokens, "tokens"},
	{HeaderTokenInterval, "token_interval"},
	{HeaderTPS, "tps"},
	{HeaderTokenBytes, "token_bytes"},
	{HeaderFault, "fault"},
}

// With returns b with one knob set from its text form. Keys (case and
// "-"/"_" insensitive, an "x-mock-" prefix allowed): model, ttft,
// straggler, tokens, token_interval, tps, token_bytes, fault,
// health_status.
func (b Behavior) With(key, value string) (Behavior, error) {
	k := strings.ReplaceAll(strings.ToLower(strings.TrimSpace(key)), "-", "_")
	k = strings.TrimPrefix(k, "x_mock_")
	value = strings.TrimSpace(value)
	var err error
	switch k {
	case "model":
		if value == "" || strings.ContainsAny(value, ";\r\n") {
			return b, fmt.Errorf("model %q: must be non-empty, without ';' or newlines", value)
		}
		b.Model = value
	case "ttft":
		b.TTFT, err = ParseLatency(value)
	case "straggler":
		b.Straggler, err = ParseStraggler(value)
	case "tokens":
		var n int
		if n, err = parseCount(value, maxCount); err == nil {
			b.Tokens = n
			if n == 0 {
				b.Tokens = NoTokens
			}
		}
	case "token_interval":
		var d time.Duration
		if d, err = parseDuration(value); err == nil {
			b.TokenInterval = d
			if d == 0 {
				b.TokenInterval = NoDelay
			}
		}
	case "tps":
		tps, perr := strconv.ParseFloat(value, 64)
		if perr != nil || math.IsNaN(tps) || math.IsInf(tps, 0) || tps <= 0 {
			return b, fmt.Errorf("tps %q: want a positive number", value)
		}
		d := time.Duration(float64(time.Second) / tps)
		switch {
		case d > maxDuration:
			d = maxDuration
		case d <= 0:
			d = NoDelay
		}
		b.TokenInterval = d
	case "token_bytes":
		b.TokenBytes, err = parseCount(value, maxTokenBytes)
	case "fault":
		b.Fault, err = ParseFault(value)
	case "health_status":
		var n int
		if n, err = parseCount(value, 599); err == nil && n != 0 && n < 100 {
			err = fmt.Errorf("health_status %d: want an HTTP status", n)
		}
		if err == nil {
			b.HealthStatus = n
		}
	default:
		return b, fmt.Errorf("unknown behavior key %q", key)
	}
	return b, err
}

// WithHeaders returns b overridden by the X-Mock-* headers in h. Absent or
// empty headers leave the corresponding knob alone.
func (b Behavior) WithHeaders(h http.Header) (Behavior, error) {
	for _, hk := range headerKnobs {
		v := h.Get(hk.header)
		if v == "" {
			continue
		}
		var err error
		if b, err = b.With(hk.key, v); err != nil {
			return b, fmt.Errorf("header %s: %w", hk.header, err)
		}
	}
	return b, nil
}

// Headers returns the X-Mock-* request headers that ask a replica for the
// non-zero knobs of b (Model and HealthStatus have no header).
func (b Behavior) Headers() http.Header {
	h := http.Header{}
	set := func(name, v string) {
		if v != "" {
			h.Set(name, v)
		}
	}
	set(HeaderTTFT, b.TTFT.String())
	set(HeaderStraggler, b.Straggler.String())
	set(HeaderTokens, b.knob("tokens"))
	set(HeaderTokenInterval, b.knob("token_interval"))
	set(HeaderTokenBytes, b.knob("token_bytes"))
	set(HeaderFault, b.Fault.String())
	return h
}

// knob returns the text form of one non-zero knob, or "".
func (b Behavior) knob(key string) string {
	switch key {
	case "model":
		return b.Model
	case "ttft":
		return b.TTFT.String()
	case "straggler":
		return b.Straggler.String()
	case "tokens":
		if b.Tokens != 0 {
			return strconv.Itoa(max(b.Tokens, 0))
		}
	case "token_interval":
		if b.TokenInterval != 0 {
			return max(b.TokenInterval, 0).String()
		}
	case "token_bytes":
		if b.TokenBytes > 0 {
			return strconv.Itoa(b.TokenBytes)
		}
	case "fault":
		return b.Fault.String()
	case "health_status":
		if b.HealthStatus != 0 {
			return strconv.Itoa(b.HealthStatus)
		}
	}
	return ""
}

// String formats b as a spec that ParseBehavior accepts, listing only the
// knobs that differ from the defaults, e.g.
// "ttft=lognormal:150ms:0.5; tokens=32; fault=status=503,every=3".
func (b Behavior) String() string {
	var parts []string
	for _, k := range knobs {
		if v := b.knob(k); v != "" {
			parts = append(parts, k+"="+v)
		}
	}
	return strings.Join(parts, "; ")
}

// ParseBehavior parses a spec of "key=value" items separated by ';' (see
// Behavior.With for the keys). The empty spec and "none" yield the zero
// Behavior.
func ParseBehavior(spec string) (Behavior, error) {
	var b Behavior
	spec = strings.TrimSpace(spec)
	if spec == "none" {
		return b, nil
	}
	for item := range strings.SplitSeq(spec, ";") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		k, v, ok := strings.Cut(item, "=")
		if !ok {
			return Behavior{}, fmt.Errorf("behavior item %q: want key=value", item)
		}
		var err error
		if b, err = b.With(k, v); err != nil {
			return Behavior{}, err
		}
	}
	return b, nil
}

// MarshalText implements encoding.TextMarshaler with Behavior.String.
func (b Behavior) MarshalText() ([]byte, error) { return []byte(b.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler with ParseBehavior.
func (b *Behavior) UnmarshalText(text []byte) error {
	nb, err := ParseBehavior(string(text))
	if err != nil {
		return err
	}
	*b = nb
	return nil
}

// Validate reports values that the parsers would refuse: negative or
// oversized sizes, fractions outside [0, 1], an invalid Fault.
func (b Behavior) Validate() error {
	var errs []error
	if strings.ContainsAny(b.Model, ";\r\n") {
		errs = append(errs, fmt.Errorf("model %q: contains ';' or a newline", b.Model))
	}
	if b.TTFT.Sigma < 0 || b.TTFT.Sigma > maxSigma || math.IsNaN(b.TTFT.Sigma) {
		errs = append(errs, fmt.Errorf("ttft sigma %v: want [0, %d]", b.TTFT.Sigma, maxSigma))
	}
	s := b.Straggler
	if s.Fraction < 0 || s.Fraction > 1 || math.IsNaN(s.Fraction) || s.Min < 0 || s.Max < s.Min {
		errs = append(errs, fmt.Errorf("straggler %s: want a fraction in [0, 1] and 0 <= min <= max", s))
	}
	if b.TokenBytes < 0 || b.TokenBytes > maxTokenBytes {
		errs = append(errs, fmt.Errorf("token_bytes %d: want [0, %d]", b.TokenBytes, maxTokenBytes))
	}
	if b.HealthStatus != 0 && (b.HealthStatus < 100 || b.HealthStatus > 599) {
		errs = append(errs, fmt.Errorf("health_status %d: want an HTTP status", b.HealthStatus))
	}
	if err := b.Fault.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// parseDuration parses a non-negative Go duration up to maxDuration; a
// bare "0" is allowed.
func parseDuration(s string) (time.Duration, error) {
	s = strings.TrimSpace(s)
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, err
	}
	if d < 0 || d > maxDuration {
		return 0, fmt.Errorf("duration %s: want [0, %s]", d, maxDuration)
	}
	return d, nil
}

// parseCount parses a decimal integer in [0, limit].
func parseCount(s string, limit int) (int, error) {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil || n < 0 || n > limit {
		return 0, fmt.Errorf("%q: want an integer in [0, %d]", s, limit)
	}
	return n, nil
}

// parseFraction parses a number in [0, 1].
func parseFraction(s string) (float64, error) {
	f, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil || math.IsNaN(f) || f < 0 || f > 1 {
		return 0, fmt.Errorf("fraction %q: want a number in [0, 1]", s)
	}
	return f, nil
}
