package clocktest

import (
	"slices"
	"testing"
	"time"
)

func TestFakeFiresInDeadlineOrderAndResetDropsStaleValues(t *testing.T) {
	c := New(time.Time{})
	var order []int
	c.AfterFunc(2*time.Second, func() { order = append(order, 2) })
	c.AfterFunc(time.Second, func() { order = append(order, 1) })
	tm := c.NewTimer(time.Second)
	if n := c.Advance(3 * time.Second); n != 3 || !slices.Equal(order, []int{1, 2}) {
		t.Fatalf("fired %d, order %v", n, order)
	}
	tm.Reset(time.Second)
	select {
	case <-tm.C():
		t.Fatal("a stale value survived Reset")
	default:
	}
	if tm.Stop() != true || tm.Stop() != false {
		t.Fatal("Stop must report whether the timer was active")
	}
}

func TestFakeReadsEachTimersDeadlineAsItFires(t *testing.T) {
	c := New(time.Time{})
	var seen []time.Duration
	c.AfterFunc(time.Second, func() {
		seen = append(seen, c.Elapsed())
		// A timer armed by a callback fires within the same Advance when
		// it falls due by its end.
		c.AfterFunc(time.Second, func() { seen = append(seen, c.Elapsed()) })
	})
	c.Advance(5 * time.Second)
	if !slices.Equal(seen, []time.Duration{time.Second, 2 * time.Second}) || c.Elapsed() != 5*time.Second {
		t.Fatalf("callbacks saw %v, clock at %v", seen, c.Elapsed())
	}
	c.Set(4 * time.Second) // never backwards
	if c.Elapsed() != 5*time.Second {
		t.Fatalf("Set moved the clock back to %v", c.Elapsed())
	}
}

func TestFakeWaitTimerReturnsOnceTheTimerIsArmed(t *testing.T) {
	c := New(time.Time{})
	go c.NewTimer(7 * time.Second)
	c.WaitTimer(t, 7*time.Second)
	if timers, funcs := c.Armed(); timers != 1 || funcs != 0 {
		t.Fatalf("armed %d timers, %d funcs; want 1, 0", timers, funcs)
	}
}
