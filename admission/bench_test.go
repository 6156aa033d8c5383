package admission

import (
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// hotPathConfig is a tier with every tenant limit on, high enough that
// nothing is refused.
func hotPathConfig() Config {
	return oneTier(Tier{MaxConcurrent: 1 << 20, RPM: 1 << 30, TPM: 1 << 40, TTFTSLO: time.Second})
}

func TestReserveAndSettleAllocateNothing(t *testing.T) {
	c, err := NewController(hotPathConfig(), newFakeClock(), nil) // the recording observer allocates
	if err != nil {
		t.Fatal(err)
	}
	d, _ := NewDirectory([]Key{{Hash: HashKey(secret), Tenant: "a"}})
	var tk Ticket
	u := Usage{PromptTokens: 100, CompletionTokens: 200, Verdict: VerdictSuccess, TTFT: 100 * time.Millisecond}
	admit := func() {
		tenant, tier, _ := d.Lookup(secret)
		if r := c.ReserveInto(&tk, Request{Tenant: tenant, Tier: tier, PromptTokens: 100, MaxTokens: 500}); r != nil {
			t.Fatal(r)
		}
		_ = tk.Limits()
		tk.Settle(u, 0)
	}
	admit() // creates the tenant's state and breaker
	if a := testing.AllocsPerRun(1000, admit); a != 0 {
		t.Fatalf("Lookup + ReserveInto + Settle: %v allocs", a)
	}
	// Reserve allocates its Ticket, and only that.
	if a := testing.AllocsPerRun(1000, func() {
		tk, _ := c.Reserve(Request{Tenant: "a", PromptTokens: 100})
		tk.Settle(u, 0)
	}); a != 1 {
		t.Fatalf("Reserve + Settle: %v allocs, want 1 (the Ticket)", a)
	}
}

// BenchmarkAdmitHotPath is identify + admit + settle with no queueing:
// Directory.Lookup of a 51-byte key, Controller.ReserveInto (Reserve in
// the /Reserve variant) on a tenant with max_concurrent, rpm, tpm and a
// tenant breaker, and Ticket.Settle with a success. Goroutines use 64
// tenants round-robin (/tenants) or all the same one (/one_tenant, the
// worst case: one tenant's lock). Run with -cpu 1,2,8.
func BenchmarkAdmitHotPath(b *testing.B) {
	for _, bc := range []struct {
		name    string
		tenants int
		into    bool
	}{{"tenants", 64, true}, {"one_tenant", 1, true}, {"tenants/Reserve", 64, false}} {
		b.Run(bc.name, func(b *testing.B) {
			c, err := NewController(hotPathConfig(), clock.Real, nil)
			if err != nil {
				b.Fatal(err)
			}
			keys := make([]Key, bc.tenants)
			raw := make([]string, bc.tenants)
			for i := range keys {
				raw[i] = secret[:40] + strconv.Itoa(1000000+i)
				keys[i] = Key{Hash: HashKey(raw[i]), Tenant: "tenant-" + strconv.Itoa(i)}
			}
			d, err := NewDirectory(keys)
			if err != nil {
				b.Fatal(err)
			}
			u := Usage{PromptTokens: 100, CompletionTokens: 200, Verdict: VerdictSuccess, TTFT: 100 * time.Millisecond}
			var next atomic.Int64
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				i := int(next.Add(1))
				var tk Ticket
				for pb.Next() {
					i++
					tenant, tier, ok := d.Lookup(raw[i%bc.tenants])
					if !ok {
						b.Fatal("unknown key")
					}
					req := Request{Tenant: tenant, Tier: tier, PromptTokens: 100, MaxTokens: 500}
					if bc.into {
						if r := c.ReserveInto(&tk, req); r != nil {
							b.Fatal(r)
						}
						tk.Settle(u, 0)
						continue
					}
					t, r := c.Reserve(req)
					if r != nil {
						b.Fatal(r)
					}
					t.Settle(u, 0)
				}
			})
		})
	}
}
