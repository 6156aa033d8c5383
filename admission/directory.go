package admission

import (
	"bufio"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strings"
	"unsafe"
)

// dirEntry is one key of a Directory; next chains entries whose hashes
// share their first 8 bytes (-1 ends the chain).
type dirEntry struct {
	hash         [32]byte
	tenant, tier string
	next         int32
}

// keyBytes returns the bytes of s without copying them (sha256 only reads
// them), so that hashing a presented key allocates nothing whatever its
// length.
func keyBytes(s string) []byte { return unsafe.Slice(unsafe.StringData(s), len(s)) }

// bucketOf is a hash's index in the Directory: its first 8 bytes. The map
// lookup's timing depends on these bytes only, which tell an attacker
// nothing about any key (finding a key from them is a sha256 preimage).
func bucketOf(h *[32]byte) uint64 { return binary.LittleEndian.Uint64(h[:8]) }

func newDirectory(keys []Key) (*Directory, error) {
	d := &Directory{idx: make(map[uint64]int32, len(keys)), ents: make([]dirEntry, 0, len(keys))}
	for i, k := range keys {
		if k.Tenant == "" {
			return nil, fmt.Errorf("key %d: no tenant", i)
		}
		b := bucketOf(&k.Hash)
		first, ok := d.idx[b]
		if !ok {
			first = -1
		}
		for j := first; j >= 0; j = d.ents[j].next {
			if d.ents[j].hash == k.Hash {
				// Name the tenants, never the key or its hash.
				return nil, fmt.Errorf("key %d (tenant %q): duplicate of a key of tenant %q", i, k.Tenant, d.ents[j].tenant)
			}
		}
		d.ents = append(d.ents, dirEntry{hash: k.Hash, tenant: k.Tenant, tier: k.Tier, next: first})
		d.idx[b] = int32(len(d.ents) - 1)
	}
	return d, nil
}

func (d *Directory) lookup(key string) (tenant, tier string, ok bool) {
	if d == nil || len(d.ents) == 0 {
		return "", "", false
	}
	h := sha256.Sum256(keyBytes(key))
	i, found := d.idx[bucketOf(&h)]
	if !found {
		return "", "", false
	}
	// Every entry of the chain is compared in full and in constant time;
	// the chain is almost always one entry long.
	var hit *dirEntry
	for ; i >= 0; i = d.ents[i].next {
		e := &d.ents[i]
		if subtle.ConstantTimeCompare(e.hash[:], h[:]) == 1 {
			hit = e
		}
	}
	if hit == nil {
		return "", "", false
	}
	return hit.tenant, hit.tier, true
}

// ErrBlankLine is returned by ParseKeyLine for a line that holds no key: an
// empty line, only spaces, or a comment (first non-space character '#').
// Readers of a keys file skip such lines.
var ErrBlankLine = errors.New("blank or comment line")

// hashPrefix marks a key given as the hex sha256 of the key.
const hashPrefix = "sha256:"

// ParseKeyLine parses one line of a keys file:
//
//	<key>|sha256:<hex> <tenant> [<tier>]
//
// fields separated by spaces or tabs. The first field is the key as clients
// send it, or "sha256:" followed by the 64 hex digits (either case) of the
// sha256 of the key; a literal key can therefore not begin with "sha256:".
// The tier, when given, overrides the tenant's configured tier for requests
// with this key. A blank or comment line returns ErrBlankLine. Errors never
// contain the key or its hash, only the field that is wrong.
func ParseKeyLine(line string) (Key, error) {
	line = strings.TrimSpace(line)
	if line == "" || line[0] == '#' {
		return Key{}, ErrBlankLine
	}
	f := strings.Fields(line)
	if len(f) < 2 || len(f) > 3 {
		return Key{}, fmt.Errorf("want <key>|sha256:<hex> <tenant> [<tier>], got %d fields", len(f))
	}
	k := Key{Tenant: f[1]}
	if len(f) == 3 {
		k.Tier = f[2]
	}
	if hx, ok := strings.CutPrefix(f[0], hashPrefix); ok {
		if len(hx) != 2*sha256.Size {
			return Key{}, fmt.Errorf("tenant %q: sha256 key: want %d hex digits, got %d", k.Tenant, 2*sha256.Size, len(hx))
		}
		if _, err := hex.Decode(k.Hash[:], []byte(hx)); err != nil {
			return Key{}, fmt.Errorf("tenant %q: sha256 key: not hex", k.Tenant)
		}
		return k, nil
	}
	k.Hash = HashKey(f[0])
	return k, nil
}

// ParseKeys reads a keys file (ParseKeyLine's lines; blank and comment lines
// skipped). name labels errors, which read "<name>:<line>: <what>" and never
// contain a key. Duplicate keys are left to NewDirectory.
func ParseKeys(r io.Reader, name string) ([]Key, error) {
	var keys []Key
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for n := 1; sc.Scan(); n++ {
		k, err := ParseKeyLine(sc.Text())
		if errors.Is(err, ErrBlankLine) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("%s:%d: %w", name, n, err)
		}
		keys = append(keys, k)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return keys, nil
}
