package admission

import "testing"

// TestTenantViewFollowsAReload: the admin view shows the limits of the
// config in force, also for a tenant known only through a key's tier, and
// before the tenant sends another request (it showed the old limits until
// then).
func TestTenantViewFollowsAReload(t *testing.T) {
	cfg := Config{Tiers: []Tier{{Name: "gold", RPM: 5}}}
	c, _, _ := newCtl(t, cfg)
	tk, ref := c.Reserve(Request{Tenant: "acme", Tier: "gold"})
	if ref != nil {
		t.Fatal(ref)
	}
	tk.Settle(Usage{}, 0)
	if v := view(c, "acme"); v.RPM != 5 {
		t.Fatalf("before the reload: rpm %d, want 5", v.RPM)
	}
	if err := c.SetConfig(Config{Tiers: []Tier{{Name: "gold", RPM: 8}}}); err != nil {
		t.Fatal(err)
	}
	if v := view(c, "acme"); v.RPM != 8 || v.RequestsInWindow != 1 {
		t.Fatalf("after the reload: rpm %d, requests %d; want 8 and the 1 counted before", v.RPM, v.RequestsInWindow)
	}
}
