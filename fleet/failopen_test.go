package fleet

import (
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/admission"
)

// TestFailOpenLimitsUseTheShareBeforeTheConnection: before the config's
// connection is open, a tenant gets this gateway's share of its limits
// (max_concurrent 6 over 3 expected instances: 2), decided locally, and a
// fail_closed tier gets 503; the holds settle where they were taken.
func TestFailOpenLimitsUseTheShareBeforeTheConnection(t *testing.T) {
	f := NewFailOpenLimits(func() *Limits { return nil }, 3)
	if f.Fleet() != nil {
		t.Fatal("a fleet store before the connection is open")
	}
	q := admission.Quota{Tenant: "acme", MaxConcurrent: 6, Prompt: 10, Need: 10}
	var holds []*admission.Hold
	for range 3 {
		h := new(admission.Hold)
		d := f.Reserve(&q, h)
		if !d.Local {
			t.Fatalf("decision %+v: want a local one", d)
		}
		if d.Code == "" {
			holds = append(holds, h)
		}
	}
	if len(holds) != 2 {
		t.Fatalf("%d admitted on a share of max_concurrent 6 over 3 gateways, want 2", len(holds))
	}
	f.Settle(holds[0], 10)
	f.Cancel(holds[1])
	if d := f.Reserve(&q, new(admission.Hold)); d.Code != "" {
		t.Fatalf("after both holds were given back: %+v, want admitted", d)
	}
	strict := admission.Quota{Tenant: "strict", RPM: 10, FailClosed: true, Need: 1}
	if d := f.Reserve(&strict, new(admission.Hold)); d.Code != admission.CodeFleetUnavailable {
		t.Fatalf("a fail_closed tier before the connection: %+v, want %s", d, admission.CodeFleetUnavailable)
	}
}
