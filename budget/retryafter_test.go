package budget

import (
	"testing"
	"time"
)

func TestParseRetryAfter(t *testing.T) {
	now := time.Date(2026, 11, 30, 6, 0, 0, 0, time.UTC)
	cases := []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"2", 2 * time.Second, true},
		{" 30 ", 30 * time.Second, true},
		{"0", 0, true},
		{"1.5", 1500 * time.Millisecond, true},
		{"86400", MaxRetryAfter, true},
		{"99999999999999999999999", MaxRetryAfter, true},
		{"Mon, 30 Nov 2026 06:00:10 GMT", 10 * time.Second, true},
		{"Monday, 30-Nov-26 06:00:10 GMT", 10 * time.Second, true},
		{"Mon Nov 30 06:00:10 2026", 10 * time.Second, true},
		{"Mon, 30 Nov 2026 05:59:00 GMT", 0, true},
		{"Tue, 01 Dec 2026 06:00:00 GMT", MaxRetryAfter, true},
		{"", 0, false},
		{"-1", 0, false},
		{"soon", 0, false},
		{"1e400", 0, false},
		{"NaN", 0, false},
		{"2s", 0, false},
	}
	for _, tc := range cases {
		got, ok := ParseRetryAfter(tc.in, now)
		if got != tc.want || ok != tc.ok {
			t.Errorf("ParseRetryAfter(%q) = %v, %v; want %v, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
}

func FuzzParseRetryAfter(f *testing.F) {
	for _, s := range []string{"2", "1.5", "Mon, 30 Nov 2026 06:00:10 GMT", "-1", "junk", "1e400", ""} {
		f.Add(s)
	}
	now := time.Date(2026, 11, 30, 6, 0, 0, 0, time.UTC)
	f.Fuzz(func(t *testing.T, s string) {
		d, ok := ParseRetryAfter(s, now)
		if d < 0 || d > MaxRetryAfter || (!ok && d != 0) {
			t.Fatalf("ParseRetryAfter(%q) = %v, %v", s, d, ok)
		}
	})
}
