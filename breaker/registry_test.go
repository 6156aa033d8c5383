package breaker_test

import (
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

func TestRegistry(t *testing.T) {
	clk := newClock()
	rec := new(recorder)
	r := breaker.NewRegistry(breaker.WithClock(clk), breaker.WithListener(rec.listen))
	if _, ok := r.Lookup("a"); ok {
		t.Fatal("lookup in empty registry")
	}
	b := r.Get("b:8000", breaker.Settings{})
	a := r.Get("a:8000", breaker.Settings{})
	if again := r.Get("b:8000", breaker.Settings{}); again != b {
		t.Fatal("Get returned a new breaker for an existing key")
	}
	if got, ok := r.Lookup("a:8000"); !ok || got != a {
		t.Fatal("Lookup")
	}
	all := r.All()
	if len(all) != 2 || all[0].Key() != "a:8000" || all[1].Key() != "b:8000" {
		t.Fatalf("All = %v", all)
	}

	// A reload's settings apply to the existing breaker and its state.
	for range 2 {
		p, _ := b.Allow()
		p.Done(breaker.Failure, 0, "")
	}
	if r.Get("b:8000", breaker.Settings{ConsecutiveFailures: 2}) != b {
		t.Fatal("Get with new settings replaced the breaker")
	}
	p, _ := b.Allow()
	p.Done(breaker.Failure, 0, "")
	if b.State() != breaker.Open {
		t.Fatalf("state %s, want open under the new threshold", b.State())
	}
	if trs := rec.all(); len(trs) != 1 || trs[0].Key != "b:8000" {
		t.Fatalf("shared listener got %+v", trs)
	}

	r.Delete("b:8000")
	if _, ok := r.Lookup("b:8000"); ok {
		t.Fatal("deleted key still there")
	}
	if r.Get("b:8000", breaker.Settings{}).State() != breaker.Closed {
		t.Fatal("re-created breaker not fresh")
	}
}

// With a store, a key dropped from the registry and added again (an
// upstream removed by one reload and restored by the next) stays open.
func TestRegistryWithStoreKeepsOpenStateAcrossDelete(t *testing.T) {
	clk := newClock()
	r := breaker.NewRegistry(breaker.WithClock(clk), breaker.WithStore(breaker.NewMemoryStore()))
	b := r.Get("a", breaker.Settings{})
	b.ForceOpen(0, "maintenance")
	r.Delete("a")
	if s := r.Get("a", breaker.Settings{}).Snapshot(); s.State != breaker.Open {
		t.Fatalf("re-created breaker %+v", s)
	}
}
