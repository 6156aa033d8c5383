package proxy

import (
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"

	"github.com/llmproxy/caddy-llm-proxy/admission"
)

// mapKeys is a KeyLookup over a map: key → tenant, tier.
type mapKeys map[string][2]string

func (m mapKeys) Lookup(key string) (tenant, tier string, ok bool) {
	v, ok := m[key]
	return v[0], v[1], ok
}

const secretKey = "sk-acme-0123456789abcdef"

func testKeys() *KeyIdentifier {
	return &KeyIdentifier{
		Keys:           mapKeys{secretKey: {"acme", ""}, "sk-batch": {"acme", "batch"}},
		TenantHeader:   "X-Tenant",
		TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("fd00::/8")},
		Resolve: func(tenant, tier string) (string, bool) {
			switch {
			case tier != "":
				return tier, true
			case tenant == "acme":
				return "gold", true
			case strings.HasPrefix(tenant, "team-"):
				return "default", true
			}
			return "", false
		},
	}
}

func keyRequest(peer string, header ...string) *http.Request {
	r := post(`{"model":"m","user":"other","tenant":"other"}`)
	r.RemoteAddr = peer
	for i := 0; i+1 < len(header); i += 2 {
		r.Header.Set(header[i], header[i+1])
	}
	return r
}

func TestKeyIdentifierFindsTheKey(t *testing.T) {
	cases := []struct {
		name   string
		header []string
		want   Identity
	}{
		{"bearer", []string{"Authorization", "Bearer " + secretKey}, Identity{Tenant: "acme", Tier: "gold"}},
		{"bearer scheme in any case", []string{"Authorization", "bEaReR  " + secretKey + " "}, Identity{Tenant: "acme", Tier: "gold"}},
		{"api-key", []string{"api-key", secretKey}, Identity{Tenant: "acme", Tier: "gold"}},
		{"x-api-key", []string{"x-api-key", secretKey}, Identity{Tenant: "acme", Tier: "gold"}},
		{"bearer wins over api-key", []string{"Authorization", "Bearer " + secretKey, "api-key", "sk-batch"}, Identity{Tenant: "acme", Tier: "gold"}},
		{"api-key wins over x-api-key", []string{"api-key", "sk-batch", "x-api-key", secretKey}, Identity{Tenant: "acme", Tier: "batch"}},
		{"a non-bearer authorization falls back to api-key", []string{"Authorization", "Basic Zm9vOmJhcg==", "api-key", secretKey}, Identity{Tenant: "acme", Tier: "gold"}},
		{"the key's own tier", []string{"Authorization", "Bearer sk-batch"}, Identity{Tenant: "acme", Tier: "batch"}},
		{"an untrusted peer's tenant header is ignored and stripped", []string{"Authorization", "Bearer " + secretKey, "X-Tenant", "team-evil"},
			Identity{Tenant: "acme", Tier: "gold", StripHeader: "X-Tenant"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			id, err := testKeys().Identify(keyRequest("192.0.2.1:5000", tc.header...), RequestInfo{})
			if tc.want.StripHeader == "" {
				tc.want.StripHeader = "X-Tenant" // the peer is untrusted
			}
			if err != nil || id != tc.want {
				t.Fatalf("Identify = %+v, %v; want %+v", id, err, tc.want)
			}
		})
	}
}

func TestKeyIdentifierTrustsTheTenantHeaderOnlyFromTrustedPeers(t *testing.T) {
	cases := []struct {
		name, peer string
		want       Identity
	}{
		{"trusted IPv4 peer", "10.1.2.3:4000", Identity{Tenant: "team-a", Tier: "default"}},
		{"trusted IPv4-mapped peer", "[::ffff:10.1.2.3]:4000", Identity{Tenant: "team-a", Tier: "default"}},
		{"trusted IPv6 peer", "[fd00::1]:4000", Identity{Tenant: "team-a", Tier: "default"}},
		{"untrusted peer: the key decides", "192.0.2.1:4000", Identity{Tenant: "acme", Tier: "gold", StripHeader: "X-Tenant"}},
		// X-Forwarded-For is the client's to write; only the connection counts.
		{"untrusted peer claiming a trusted address", "192.0.2.1:4000", Identity{Tenant: "acme", Tier: "gold", StripHeader: "X-Tenant"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := keyRequest(tc.peer, "Authorization", "Bearer "+secretKey, "X-Tenant", "team-a", "X-Forwarded-For", "10.0.0.1")
			id, err := testKeys().Identify(r, RequestInfo{})
			if err != nil || id != tc.want {
				t.Fatalf("Identify = %+v, %v; want %+v", id, err, tc.want)
			}
		})
	}
	t.Run("trusted peer without the header: the key decides", func(t *testing.T) {
		id, err := testKeys().Identify(keyRequest("10.1.2.3:4000", "Authorization", "Bearer "+secretKey), RequestInfo{})
		if err != nil || id != (Identity{Tenant: "acme", Tier: "gold"}) {
			t.Fatalf("Identify = %+v, %v", id, err)
		}
	})
	t.Run("trusted peer naming a tenant without a tier is unknown", func(t *testing.T) {
		_, err := testKeys().Identify(keyRequest("10.1.2.3:4000", "X-Tenant", "nobody"), RequestInfo{})
		if ge, ok := err.(*GatewayError); !ok || ge.Status != 401 {
			t.Fatalf("error %v, want a 401", err)
		}
	})
}

func TestKeyIdentifierUnknownKeys(t *testing.T) {
	for _, header := range [][]string{
		nil,
		{"Authorization", "Bearer sk-not-a-key-42"},
		{"Authorization", "Bearer "},
		{"x-api-key", "sk-not-a-key-42"},
	} {
		t.Run("refused: "+strings.Join(header, " "), func(t *testing.T) {
			id, err := testKeys().Identify(keyRequest("192.0.2.1:1", header...), RequestInfo{})
			ge, ok := err.(*GatewayError)
			if !ok || ge.Status != 401 || ge.Code != "invalid_api_key" || ge.Type != TypeInvalidRequest || id != (Identity{}) {
				t.Fatalf("Identify = %+v, %v; want a 401 invalid_api_key", id, err)
			}
			if strings.Contains(ge.Error(), "sk-not-a-key-42") {
				t.Fatalf("the error names the key: %v", ge)
			}
		})
		t.Run("unknown tier: "+strings.Join(header, " "), func(t *testing.T) {
			k := testKeys()
			k.UnknownTier = "free"
			id, err := k.Identify(keyRequest("192.0.2.1:1", header...), RequestInfo{})
			if err != nil || id != (Identity{Tenant: admission.UnknownTenant, Tier: "free", StripHeader: "X-Tenant"}) {
				t.Fatalf("Identify = %+v, %v", id, err)
			}
		})
	}
	t.Run("a known key whose tenant has no tier is a configuration error", func(t *testing.T) {
		k := testKeys()
		k.Keys = mapKeys{secretKey: {"orphan", ""}}
		_, err := k.Identify(keyRequest("192.0.2.1:1", "Authorization", "Bearer "+secretKey), RequestInfo{})
		if _, isGW := err.(*GatewayError); err == nil || isGW || strings.Contains(err.Error(), secretKey) {
			t.Fatalf("error %v: want a plain error without the key", err)
		}
	})
	t.Run("the zero value knows no keys", func(t *testing.T) {
		_, err := (&KeyIdentifier{}).Identify(keyRequest("192.0.2.1:1", "Authorization", "Bearer "+secretKey), RequestInfo{})
		if ge, ok := err.(*GatewayError); !ok || ge.Status != 401 {
			t.Fatalf("error %v", err)
		}
	})
}

// Through the lifecycle: the 401 body never holds the key, nothing reaches
// an upstream, and the Result holds no key.
func TestUnknownKeyIs401WithoutTheKey(t *testing.T) {
	up := newUpstream(t, sseUpstream(chunkA, done))
	p, _, obs := newTestProxy(t, Config{Identifier: testKeys()}, up)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, keyRequest("192.0.2.1:1", "Authorization", "Bearer sk-not-a-key-42"))
	if w.Code != 401 || res.Outcome != OutcomeRefused || up.calls.Load() != 0 || len(obs.results) != 1 {
		t.Fatalf("code %d outcome %v upstream calls %d", w.Code, res.Outcome, up.calls.Load())
	}
	body := w.Body.String()
	if !strings.Contains(body, `"code":"invalid_api_key"`) || !strings.Contains(body, `"type":"invalid_request_error"`) || strings.Contains(body, "sk-not-a-key-42") {
		t.Fatalf("body %s", body)
	}
	if s := strings.Join([]string{res.Identity.Tenant, res.Identity.Tier, res.Identity.StripHeader}, " "); strings.Contains(s, "sk-") {
		t.Fatalf("the Result holds the key: %+v", res.Identity)
	}
}

// Upstream headers: client copies of ours are stripped, ours are set, the
// tenant header of an untrusted peer is stripped, and a body field naming a
// tenant changes nothing.
func TestTenantHeadersUpstream(t *testing.T) {
	var got http.Header
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		got = r.Header.Clone()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"finish_reason":"stop"}]}`)
	})
	cases := []struct {
		name, peer            string
		tenant, tier, xTenant string
		identifier            Identifier
		wantTenant, wantTier  string
		wantHeader            string
	}{
		{"untrusted peer", "192.0.2.1:1", "evil", "platinum", "team-evil", testKeys(), "acme", "gold", ""},
		{"trusted peer", "10.0.0.9:1", "evil", "platinum", "team-a", testKeys(), "team-a", "default", "team-a"},
		{"no identifier: ours removed, none set", "192.0.2.1:1", "evil", "platinum", "team-a", nil, "", "", "team-a"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p, _, _ := newTestProxy(t, Config{Identifier: tc.identifier}, up)
			r := keyRequest(tc.peer, "Authorization", "Bearer "+secretKey, "X-LLM-Proxy-Tenant", tc.tenant,
				"X-LLM-Proxy-Tier", tc.tier, "X-Tenant", tc.xTenant)
			res := p.ServeHTTP(httptest.NewRecorder(), r)
			if res.Outcome != OutcomeSuccess {
				t.Fatalf("outcome %v", res.Outcome)
			}
			if v := got.Values("X-LLM-Proxy-Tenant"); strings.Join(v, ",") != tc.wantTenant && !(tc.wantTenant == "" && len(v) == 0) {
				t.Fatalf("X-LLM-Proxy-Tenant %q, want %q", v, tc.wantTenant)
			}
			if v := got.Values("X-LLM-Proxy-Tier"); strings.Join(v, ",") != tc.wantTier && !(tc.wantTier == "" && len(v) == 0) {
				t.Fatalf("X-LLM-Proxy-Tier %q, want %q", v, tc.wantTier)
			}
			if v := got.Get("X-Tenant"); v != tc.wantHeader {
				t.Fatalf("X-Tenant %q upstream, want %q", v, tc.wantHeader)
			}
			if tc.identifier != nil && res.Identity.Tenant != tc.wantTenant {
				t.Fatalf("charged to %q, want %q", res.Identity.Tenant, tc.wantTenant)
			}
		})
	}
}
