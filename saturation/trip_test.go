package saturation

import (
	"strings"
	"testing"
	"time"
)

func TestTripMonitorHoldsForItsDuration(t *testing.T) {
	rules := &TripRules{QueueWaitP99: 5 * time.Second, QueueWaitFor: 30 * time.Second, KVUsage: 0.92, KVFor: 60 * time.Second}
	var m TripMonitor
	t0 := time.Unix(1000, 0)
	above := TripInput{OK: true, QueueWait: Known(7), QueueWaitOver: Overness{Known: true, Over: true}}
	for i := 0; i < 30; i++ {
		if _, trip := m.Update(t0.Add(time.Duration(i)*time.Second), rules, above); trip {
			t.Fatalf("tripped after %ds of a 30s rule", i)
		}
	}
	reason, trip := m.Update(t0.Add(30*time.Second), rules, above)
	if !trip || !strings.Contains(reason, "queue wait p99 7s above 5s for 30s") {
		t.Fatalf("at 30s: trip=%v reason=%q", trip, reason)
	}
	// Unknown restarts the count; unknown never trips.
	m = TripMonitor{}
	m.Update(t0, rules, above)
	m.Update(t0.Add(20*time.Second), rules, TripInput{OK: true})
	if _, trip := m.Update(t0.Add(40*time.Second), rules, above); trip {
		t.Fatal("tripped across an unknown reading")
	}
	for i := 0; i <= 120; i++ {
		if _, trip := m.Update(t0.Add(time.Duration(i)*time.Second), rules, TripInput{OK: false, QueueWait: Known(100), QueueWaitOver: Overness{true, true}, KV: Known(1)}); trip {
			t.Fatal("a failed scrape tripped the breaker")
		}
	}
	// KV has its own duration.
	m = TripMonitor{}
	kv := TripInput{OK: true, KV: Known(0.95)}
	if _, trip := m.Update(t0, rules, kv); trip {
		t.Fatal("kv tripped at once")
	}
	if _, trip := m.Update(t0.Add(59*time.Second), rules, kv); trip {
		t.Fatal("kv tripped before 60s")
	}
	if r, trip := m.Update(t0.Add(60*time.Second), rules, kv); !trip || !strings.Contains(r, "KV-cache usage 0.95 above 0.92") {
		t.Fatalf("kv at 60s: trip=%v %q", trip, r)
	}
}
