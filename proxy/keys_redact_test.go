package proxy

import (
	"net/http/httptest"
	"testing"
)

type keyOnly struct{}

func (keyOnly) Lookup(key string) (string, string, bool) { return "acme", "gold", key == "sk-secret" }

// TestKeyHeadersAreRedactedForTheAccessLog: after identify, the client's
// request (which Caddy's access log records) no longer holds the key in
// api-key or x-api-key, while a pool that forwards keys still gets it.
func TestKeyHeadersAreRedactedForTheAccessLog(t *testing.T) {
	for _, h := range []string{"X-Api-Key", "Api-Key"} {
		for _, key := range []string{"sk-secret", "sk-unknown"} {
			p, err := New(Config{Transport: schemeTransport{nil}, Balancer: &listBalancer{addrs: []string{"u:1"}},
				Identifier: &KeyIdentifier{Keys: keyOnly{}, Resolve: func(_, tier string) (string, bool) { return tier, true }},
				Headers:    Headers{ForwardKeys: true}})
			if err != nil {
				t.Fatal(err)
			}
			r := post(`{"model":"m"}`)
			r.Header.Set(h, key)
			x := &exchange{p: p, w: httptest.NewRecorder(), r: r}
			ok := x.identify()
			if got := r.Header.Get(h); got != "REDACTED" {
				t.Errorf("%s %s: the client's request still holds %q", h, key, got)
			}
			if key == "sk-secret" && (!ok || x.outHeader.Get(h) != key) {
				t.Errorf("%s: identified %v, upstream header %q; want the key forwarded", h, ok, x.outHeader.Get(h))
			}
		}
	}
}

// TestKeyHeadersAreRedactedWhenTheReadFails: a request refused before
// identify (invalid JSON) leaves no key for the access log either.
func TestKeyHeadersAreRedactedWhenTheReadFails(t *testing.T) {
	p, err := New(Config{Transport: schemeTransport{nil}, Balancer: &listBalancer{addrs: []string{"u:1"}},
		Identifier: &KeyIdentifier{Keys: keyOnly{}, Resolve: func(_, tier string) (string, bool) { return tier, true }}})
	if err != nil {
		t.Fatal(err)
	}
	r := post(`{not json`)
	r.Header.Set("X-Api-Key", "sk-secret")
	w := httptest.NewRecorder()
	p.ServeHTTP(w, r)
	if w.Code != 400 || r.Header.Get("X-Api-Key") != "REDACTED" {
		t.Fatalf("status %d, x-api-key left %q; want 400 and REDACTED", w.Code, r.Header.Get("X-Api-Key"))
	}
}
