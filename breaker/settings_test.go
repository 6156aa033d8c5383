package breaker_test

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

func TestSettingsDefaults(t *testing.T) {
	got := breaker.Settings{}.WithDefaults()
	want := breaker.Settings{
		ConsecutiveFailures: 3,
		FailuresWindow:      30 * time.Second,
		MinRequests:         20,
		RatioWindow:         30 * time.Second,
		MinOpen:             10 * time.Second,
		OpenFor:             10 * time.Second,
		MaxOpen:             5 * time.Minute,
		HalfOpenProbes:      1,
		RecoverySuccesses:   2,
		ProbeTimeout:        60 * time.Second,
	}
	if got != want {
		t.Fatalf("defaults\n got %+v\nwant %+v", got, want)
	}
	// Set fields are kept.
	s := breaker.Settings{ConsecutiveFailures: -1, MinOpen: -1, OpenFor: time.Second}.WithDefaults()
	if s.ConsecutiveFailures != -1 || s.MinOpen != -1 || s.OpenFor != time.Second {
		t.Fatalf("WithDefaults overwrote set fields: %+v", s)
	}
	if err := (breaker.Settings{}).Validate(); err != nil {
		t.Fatalf("zero settings invalid: %v", err)
	}
}

func TestSettingsValidate(t *testing.T) {
	tests := []struct {
		name string
		s    breaker.Settings
		want string // substring of the error; "" means valid
	}{
		{"all rules", breaker.Settings{ConsecutiveFailures: 5, Failures: 10, FailuresWindow: time.Minute,
			FailureRatio: 0.5, MinRequests: 10, RatioWindow: time.Minute, SlowTTFT: 5 * time.Second, SlowRatio: 0.8}, ""},
		{"consecutive -2", breaker.Settings{ConsecutiveFailures: -2}, "consecutive_failures -2"},
		{"negative failures", breaker.Settings{Failures: -1}, "failures -1"},
		{"ratio above 1", breaker.Settings{FailureRatio: 1.5}, "failure_ratio 1.5"},
		{"ratio NaN", breaker.Settings{FailureRatio: math.NaN()}, "failure_ratio NaN"},
		{"slow ratio without slow_ttft", breaker.Settings{SlowRatio: 0.5}, "needs slow_ttft"},
		{"negative slow_ttft", breaker.Settings{SlowTTFT: -1}, "slow_ttft"},
		{"open_for above max_open", breaker.Settings{OpenFor: 10 * time.Minute}, "open_for 10m0s: must not exceed max_open 5m0s"},
		{"min_open above max_open", breaker.Settings{MinOpen: time.Hour}, "min_open 1h0m0s"},
		{"negative probes", breaker.Settings{HalfOpenProbes: -1}, "half_open_probes -1"},
		{"negative recovery", breaker.Settings{RecoverySuccesses: -1}, "recovery_successes -1"},
		{"negative min requests", breaker.Settings{MinRequests: -1}, "min_requests -1"},
		{"negative windows", breaker.Settings{FailuresWindow: -1, RatioWindow: -1, ProbeTimeout: -1}, "probe timeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.s.Validate()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Validate = %v, want it to mention %q", err, tt.want)
			}
		})
	}
}

// Breakers never run on invalid settings: each invalid field takes its
// default.
func TestInvalidSettingsTakeDefaults(t *testing.T) {
	b := breaker.New("k", breaker.Settings{ConsecutiveFailures: -7, HalfOpenProbes: -1, FailureRatio: 3,
		SlowRatio: 0.5, OpenFor: time.Hour, MaxOpen: time.Minute})
	got := b.Settings()
	if got.ConsecutiveFailures != 3 || got.HalfOpenProbes != 1 || got.FailureRatio != 0 || got.SlowRatio != 0 ||
		got.OpenFor != 10*time.Second || got.MaxOpen != time.Minute {
		t.Fatalf("settings %+v", got)
	}
	if err := got.Validate(); err != nil {
		t.Fatalf("sanitized settings invalid: %v", err)
	}
}

// Validate and the breaker's sanitizing are one rule set: every setting
// Validate refuses runs as settings Validate accepts, and valid settings
// run unchanged.
func TestSanitizedSettingsAlwaysValidate(t *testing.T) {
	for _, s := range []breaker.Settings{
		{ConsecutiveFailures: -2}, {Failures: -1}, {FailuresWindow: -1}, {FailureRatio: math.NaN()},
		{SlowRatio: 2}, {SlowRatio: 0.5}, {SlowRatio: 0.5, SlowTTFT: -time.Second}, {MinRequests: -3},
		{RatioWindow: -1}, {MaxOpen: -1, OpenFor: -1}, {MaxOpen: -1, MinOpen: time.Hour}, {OpenFor: time.Hour},
		{HalfOpenProbes: -1}, {RecoverySuccesses: -1}, {ProbeTimeout: -1},
		{ConsecutiveFailures: 5, SlowTTFT: time.Second, SlowRatio: 0.5, MaxOpen: time.Minute, OpenFor: 30 * time.Second},
	} {
		valid := s.Validate() == nil
		got := breaker.New("k", s).Settings()
		if err := got.Validate(); err != nil {
			t.Errorf("%+v runs as %+v, which Validate refuses: %v", s, got, err)
		}
		if valid && got != s.WithDefaults() {
			t.Errorf("valid %+v runs as %+v", s, got)
		}
	}
}
