package budget

import (
	"strconv"
	"strings"
	"time"
)

// MaxRetryAfter is the longest Retry-After honoured. Longer values are
// clamped to it: an upstream that asks for a day off is treated as asking
// for an hour, after which probing decides.
const MaxRetryAfter = time.Hour

// ParseRetryAfter parses a Retry-After header value (RFC 9110 §10.2.3):
// delta-seconds ("120") or an HTTP-date, relative to now. It returns the
// wait, clamped to [0, MaxRetryAfter], and ok=false for an empty, negative,
// non-numeric or unparseable value (junk is ignored, never trusted). A
// fractional number of seconds ("1.5", which some servers send) is accepted
// and rounded up to whole milliseconds.
func ParseRetryAfter(v string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	if c := v[0]; c >= '0' && c <= '9' {
		secs, err := strconv.ParseFloat(v, 64)
		if err != nil || secs < 0 || secs != secs {
			return 0, false
		}
		if secs >= MaxRetryAfter.Seconds() {
			return MaxRetryAfter, true
		}
		return time.Duration(secs*1000+0.999999) * time.Millisecond, true
	}
	t, err := time.Parse(time.RFC1123, v) // IMF-fixdate
	if err != nil {
		if t, err = time.Parse(time.RFC850, v); err != nil {
			if t, err = time.Parse(time.ANSIC, v); err != nil {
				return 0, false
			}
		}
	}
	d := t.Sub(now)
	switch {
	case d < 0:
		return 0, true
	case d > MaxRetryAfter:
		return MaxRetryAfter, true
	}
	return d, true
}
