package caddymodule

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// TestExampleCaddyfilesLoad adapts and provisions every Caddyfile under
// caddyfile-examples/, so the examples the README points to stay true.
func TestExampleCaddyfilesLoad(t *testing.T) {
	files, err := filepath.Glob("../caddyfile-examples/*.Caddyfile")
	if err != nil || len(files) == 0 {
		t.Fatalf("no example Caddyfiles (%v)", err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			src, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			out, err := adapt(t, string(src))
			if err != nil {
				t.Fatalf("adapt: %v", err)
			}
			if err := caddy.Validate(mustConfig(t, out)); err != nil {
				t.Fatalf("provision: %v", err)
			}
		})
	}
}
