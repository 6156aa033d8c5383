// Package fuzzseed keeps the seed corpus of a package's fuzz targets under
// testdata/fuzz in step with the seed lists its tests add with f.Add, so
// that a plain `go test` runs every seed as a test even where a target's
// seeds are built from values no f.Add of another package sees. It is
// imported by tests only.
package fuzzseed

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// File is the content of one corpus file whose arguments are the Go
// literals args ("[]byte(\"x\")", "uint16(3)").
func File(args ...string) string {
	s := "go test fuzz v1\n"
	for _, a := range args {
		s += a + "\n"
	}
	return s
}

// Check compares corpora (fuzz target name to its seed files' contents,
// in order) with testdata/fuzz/<target>/seed-NN of the package under
// test, reporting each one missing or stale; with update it writes them
// instead. pkg names the package in the message that says how to update.
func Check(t testing.TB, corpora map[string][]string, update bool, pkg string) {
	t.Helper()
	for target, files := range corpora {
		for i, content := range files {
			path := filepath.Join("testdata", "fuzz", target, fmt.Sprintf("seed-%02d", i))
			if update {
				if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
					t.Fatal(err)
				}
				continue
			}
			if got, err := os.ReadFile(path); err != nil || string(got) != content {
				t.Errorf("%s is missing or stale; run go test -run TestFuzzSeedFiles %s -update-seeds", path, pkg)
			}
		}
	}
}
