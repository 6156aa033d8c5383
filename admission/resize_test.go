package admission

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"
)

// TestResizeMovesTheReservation resizes a ticket on the controller's own
// state and on LocalLimits the same way: shrinking gives tokens back to the
// window at once, growing is refused when it would pass the tpm, and
// settlement replaces whatever is reserved by then.
func TestResizeMovesTheReservation(t *testing.T) {
	for _, store := range []bool{false, true} {
		cfg := oneTier(Tier{Name: "t", TPM: 2000})
		c, clk, _ := newCtl(t, cfg)
		var ll *LocalLimits
		if store {
			ll = NewLocalLimits(clk)
			c.SetLimitStore(ll)
		}
		tokens := func() int {
			if store {
				_, _, toks := ll.Counts("a")
				return int(toks)
			}
			return view(c, "a").TokensInWindow
		}
		tk, r := c.Reserve(Request{Tenant: "a", PromptTokens: 100, MaxTokens: 1500})
		if r != nil {
			t.Fatal(r)
		}
		if got := tokens(); got != 1600 {
			t.Fatalf("store %v: reserved %d, want 1600", store, got)
		}
		if r := tk.Resize(300, 1); r != nil {
			t.Fatalf("store %v: shrink refused: %v", store, r)
		}
		if got := tokens(); got != 400 || tk.Reserved() != 400 {
			t.Fatalf("store %v: after shrink %d in window, ticket %d; want 400", store, got, tk.Reserved())
		}
		// Another request takes 1000: growing back to 1600 would pass 2000.
		other, r := c.Reserve(Request{Tenant: "a", MaxTokens: 1000})
		if r != nil {
			t.Fatal(r)
		}
		if r := tk.Resize(1500, 1); r == nil || r.Code != CodeTenantTPM {
			t.Fatalf("store %v: grow past tpm = %v, want a tenant_tpm refusal", store, r)
		}
		if got := tokens(); got != 1400 {
			t.Fatalf("store %v: a refused grow changed the window: %d", store, got)
		}
		if r := tk.Resize(500, 2); r != nil { // 100 + 2×500 = 1100, 2100 > 2000
			if got := tokens(); got != 1400 {
				t.Fatalf("store %v: refused n=2 grow changed the window: %d", store, got)
			}
		} else {
			t.Fatalf("store %v: n=2 grow to 1100 accepted past the tpm", store)
		}
		if r := tk.Resize(800, 1); r != nil { // 900 + 1000 fits
			t.Fatalf("store %v: fitting grow refused: %v", store, r)
		}
		clk.Advance(90 * time.Second) // the reservations' slot left the window
		if r := tk.Resize(200, 1); r != nil {
			t.Fatal(r)
		}
		if got := tokens(); got != 300 {
			t.Fatalf("store %v: a reservation resized after its slot left is counted anew: %d, want 300", store, got)
		}
		tk.Settle(Usage{PromptTokens: 100, CompletionTokens: 50}, 0)
		other.Cancel()
		if got := tokens(); got != 150 {
			t.Fatalf("store %v: after settlement %d, want 150", store, got)
		}
		if r := tk.Resize(10, 1); r != nil {
			t.Fatal("a settled ticket has nothing to resize")
		}
		if got := tokens(); got != 150 {
			t.Fatalf("store %v: resizing a settled ticket changed the window: %d", store, got)
		}
	}
}

func TestTryAcquireSlotNeverQueues(t *testing.T) {
	c, clk, obs := newCtl(t, oneTier(Tier{Name: "t"}))
	var capacity atomic.Int64
	capacity.Store(1)
	g := NewGate(GateConfig{Capacity: func() int { return int(capacity.Load()) }, Controller: c}, clk, obs)
	var s1, s2, s3 Slot
	if !g.TryAcquireSlot("a", Tier{Name: "t"}, &s1) {
		t.Fatal("a free slot was not taken")
	}
	if g.TryAcquireSlot("a", Tier{Name: "t"}, &s2) {
		t.Fatal("a slot past capacity was taken")
	}
	// A queued request keeps its place: a free slot goes to it, not to a try.
	queued := make(chan error, 1)
	go func() { _, err := g.AcquireSlot(context.Background(), "b", Tier{Name: "t"}, &s3); queued <- err }()
	for {
		obs.mu.Lock()
		n := obs.depth["t"]
		obs.mu.Unlock()
		if n == 1 {
			break
		}
		runtime.Gosched()
	}
	capacity.Store(2)
	// The pump admits the queued one first.
	if g.TryAcquireSlot("a", Tier{Name: "t"}, &s2) {
		t.Fatal("a try took the slot that a queued request waits for")
	}
	if err := <-queued; err != nil {
		t.Fatal(err)
	}
	s1.Release()
	if !g.TryAcquireSlot("a", Tier{Name: "t"}, &s2) {
		t.Fatal("a released slot was not taken")
	}
	s2.Release()
	s3.Release()
}

func TestAcquireMovedSlotCountsNoDecision(t *testing.T) {
	c, clk, obs := newCtl(t, oneTier(Tier{Name: "t"}))
	g := NewGate(GateConfig{Capacity: func() int { return 1 }, Controller: c}, clk, obs)
	var s1, s2 Slot
	if _, err := g.AcquireMovedSlot(context.Background(), "a", Tier{Name: "t"}, &s1); err != nil {
		t.Fatal(err)
	}
	if _, err := g.AcquireSlot(context.Background(), "a", Tier{Name: "t", Priority: -1}, &s2); err == nil {
		t.Fatal("a full gate admitted a sheddable request")
	}
	s1.Release()
	obs.mu.Lock()
	defer obs.mu.Unlock()
	if len(obs.decisions) != 1 || obs.decisions[0] != "a/t/"+CodeSaturated {
		t.Fatalf("decisions %v: want only the second request's refusal (a moved request was counted where it arrived)", obs.decisions)
	}
}
