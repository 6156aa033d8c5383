package admission

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
)

const secret = "sk-live-0123456789abcdef0123456789abcdef0123456789"

func TestDirectoryLookup(t *testing.T) {
	h := sha256.Sum256([]byte("hashed-key"))
	d, err := NewDirectory([]Key{
		{Hash: HashKey(secret), Tenant: "acme"},
		{Hash: h, Tenant: "beta", Tier: "gold"},
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		key, tenant, tier string
		ok                bool
	}{
		{secret, "acme", "", true},
		{"hashed-key", "beta", "gold", true},
		{secret[:len(secret)-1], "", "", false},
		{secret + "x", "", "", false},
		{"", "", "", false},
	} {
		tenant, tier, ok := d.Lookup(tc.key)
		if tenant != tc.tenant || tier != tc.tier || ok != tc.ok {
			t.Errorf("Lookup(len %d) = %q %q %v", len(tc.key), tenant, tier, ok)
		}
	}
	if d.Len() != 2 {
		t.Fatalf("Len %d", d.Len())
	}
	var nilDir *Directory
	if _, _, ok := nilDir.Lookup(secret); ok || nilDir.Len() != 0 {
		t.Fatal("nil directory found a key")
	}
}

func TestDirectoryRefusesDuplicatesWithoutNamingTheKey(t *testing.T) {
	_, err := NewDirectory([]Key{{Hash: HashKey(secret), Tenant: "a"}, {Hash: HashKey(secret), Tenant: "b"}})
	if err == nil || !strings.Contains(err.Error(), "duplicate") {
		t.Fatalf("err %v", err)
	}
	hx := HashKey(secret)
	if strings.Contains(err.Error(), secret) || strings.Contains(err.Error(), hex.EncodeToString(hx[:])) {
		t.Fatalf("error shows the key: %v", err)
	}
	if _, err := NewDirectory([]Key{{Hash: HashKey(secret)}}); err == nil {
		t.Fatal("a key with no tenant")
	}
}

func TestDirectoryLookupAllocatesNothing(t *testing.T) {
	d, _ := NewDirectory([]Key{{Hash: HashKey(secret), Tenant: "acme"}})
	long := strings.Repeat("k", 200)
	for _, key := range []string{secret, long, "short"} {
		if a := testing.AllocsPerRun(100, func() { d.Lookup(key) }); a != 0 {
			t.Errorf("Lookup of %d bytes: %v allocs", len(key), a)
		}
	}
}

func TestDirectoryComparesInConstantTime(t *testing.T) {
	// Two hashes in one chain (same first 8 bytes): both are compared in
	// full whichever matches; a lookup hits the right one.
	var a, b [32]byte
	a[31], b[31] = 1, 2
	d, err := NewDirectory([]Key{{Hash: a, Tenant: "a"}, {Hash: b, Tenant: "b"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(d.idx) != 1 || d.ents[d.idx[0]].next < 0 {
		t.Fatalf("not chained: %v", d.idx)
	}
	for _, e := range d.ents {
		h := e.hash
		// Lookup takes a key; exercise the chain directly with the hash.
		i := d.idx[bucketOf(&h)]
		found := ""
		for ; i >= 0; i = d.ents[i].next {
			if d.ents[i].hash == h {
				found = d.ents[i].tenant
			}
		}
		if found != e.tenant {
			t.Fatalf("chain lookup %q, want %q", found, e.tenant)
		}
	}
}

func TestParseKeyLine(t *testing.T) {
	hx := HashKey(secret)
	hexKey := hex.EncodeToString(hx[:])
	for _, tc := range []struct {
		line string
		want Key
		err  string
	}{
		{secret + " acme", Key{Hash: hx, Tenant: "acme"}, ""},
		{"  " + secret + "\tacme  gold ", Key{Hash: hx, Tenant: "acme", Tier: "gold"}, ""},
		{"sha256:" + hexKey + " acme", Key{Hash: hx, Tenant: "acme"}, ""},
		{"sha256:" + strings.ToUpper(hexKey) + " acme gold", Key{Hash: hx, Tenant: "acme", Tier: "gold"}, ""},
		{"", Key{}, ErrBlankLine.Error()},
		{"   # a comment", Key{}, ErrBlankLine.Error()},
		{secret, Key{}, "got 1 fields"},
		{secret + " acme gold extra", Key{}, "got 4 fields"},
		{"sha256:abcd acme", Key{}, "want 64 hex digits, got 4"},
		{"sha256:" + strings.Repeat("zz", 32) + " acme", Key{}, "not hex"},
	} {
		k, err := ParseKeyLine(tc.line)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%q: err %v, want %q", tc.line, err, tc.err)
			}
			if err != nil && strings.Contains(err.Error(), secret) {
				t.Errorf("error shows the key: %v", err)
			}
			continue
		}
		if err != nil || k != tc.want {
			t.Errorf("%q: %+v, %v", tc.line, k, err)
		}
	}
}

func TestParseKeysNamesTheLine(t *testing.T) {
	keys, err := ParseKeys(strings.NewReader("# keys\n\n"+secret+" acme\nk2 beta gold\n"), "keys.txt")
	if err != nil || len(keys) != 2 || keys[1].Tier != "gold" {
		t.Fatalf("%+v %v", keys, err)
	}
	_, err = ParseKeys(strings.NewReader("k1 a\n"+secret+"\n"), "keys.txt")
	if err == nil || !strings.HasPrefix(err.Error(), "keys.txt:2: ") || strings.Contains(err.Error(), secret) {
		t.Fatalf("err %v", err)
	}
}

func FuzzParseKeyLine(f *testing.F) {
	for _, s := range []string{
		secret + " acme", "sha256:" + strings.Repeat("ab", 32) + " t tier", "", "#", "a b c d",
		"sha256: x", "sha256:" + strings.Repeat("A", 64) + "\tt", "\x00 \xff", "k\u00a0t",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, line string) {
		k, err := ParseKeyLine(line)
		if err != nil {
			if k != (Key{}) {
				t.Fatalf("key with an error: %+v", k)
			}
			if !errors.Is(err, ErrBlankLine) {
				if f := strings.Fields(line); len(f) > 0 && len(f[0]) > 8 && strings.Contains(err.Error(), f[0]) {
					t.Fatalf("error shows the key field: %v", err)
				}
			}
			return
		}
		if k.Tenant == "" || strings.ContainsAny(k.Tenant+k.Tier, " \t\n") {
			t.Fatalf("bad key %+v from %q", k, line)
		}
		// A literal key round-trips through its hash.
		if f := strings.Fields(line); !strings.HasPrefix(f[0], hashPrefix) && k.Hash != HashKey(f[0]) {
			t.Fatalf("hash of %q", line)
		}
		d, err := NewDirectory([]Key{k})
		if err != nil {
			t.Fatal(err)
		}
		if f := strings.Fields(line); !strings.HasPrefix(f[0], hashPrefix) {
			if tenant, _, ok := d.Lookup(f[0]); !ok || tenant != k.Tenant {
				t.Fatalf("lookup of the parsed key failed")
			}
		}
	})
}
