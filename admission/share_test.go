package admission

import (
	"testing"
	"time"
)

func TestReserveShare(t *testing.T) {
	local := NewLocalLimits(nil)
	q := Quota{Tenant: "acme", MaxConcurrent: 6, RPM: 90, TPM: 3000, Prompt: 10, Need: 10}
	var holds []*Hold
	admitted := 0
	for range 5 {
		h := new(Hold)
		d := ReserveShare(local, 3, time.Second, &q, h)
		if !d.Local || d.MaxConcurrent != 2 || d.RPM != 30 || d.TPM != 1000 {
			t.Fatalf("decision %+v: want Local with the limits divided by 3", d)
		}
		if d.Code == "" {
			admitted++
			if h.Ref != local {
				t.Fatal("an admitted hold does not point at the local store it settles with")
			}
			holds = append(holds, h)
		} else if d.Code != CodeTenantConcurrency {
			t.Fatalf("refusal %q, want tenant_concurrency", d.Code)
		}
	}
	if admitted != 2 {
		t.Fatalf("%d admitted on a share of max_concurrent 6 over 3 gateways, want 2", admitted)
	}
	for _, h := range holds {
		local.Settle(h, 10)
	}
	// Fits the fleet's tpm, not this gateway's share: wait, do not give up.
	big := Quota{Tenant: "big", TPM: 3000, Prompt: 1500, Need: 1500}
	if d := ReserveShare(local, 3, 2*time.Second, &big, new(Hold)); d.Code != CodeTenantTPM || d.RetryAfter != 2*time.Second {
		t.Fatalf("a 1500-token request on a 1000-token share of tpm 3000: %+v, want tenant_tpm with retry", d)
	}
	fc := Quota{Tenant: "strict", RPM: 10, FailClosed: true}
	if d := ReserveShare(local, 3, time.Second, &fc, new(Hold)); d.Code != CodeFleetUnavailable || d.RetryAfter != time.Second {
		t.Fatalf("fail_closed: %+v, want fleet_unavailable with retry", d)
	}
	if d := ReserveShare(local, 1, time.Second, &Quota{Tenant: "one", RPM: 1}, new(Hold)); d.Code != "" || d.RPM != 1 {
		t.Fatalf("one instance keeps the whole limit: %+v", d)
	}
}
