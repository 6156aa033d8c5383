#!/usr/bin/env bash
# Builds ./caddy: Caddy at the pinned version with this module, via xcaddy.
#
# The build is cached by the content of the Go sources that go into the
# binary (the non-test .go files of the linked packages, go.mod, go.sum): an
# unchanged tree reuses .cache/caddy-<hash> instead of spending minutes on a
# rebuild.
#
# Usage: ./xcaddy.sh [output-path]    (default ./caddy)
set -euo pipefail
cd "$(dirname "$0")"
root=$(pwd)

CADDY_VERSION=v2.11.9
XCADDY_VERSION=v0.4.5
out=${1:-$root/caddy}

gobin=$(go env GOPATH)/bin
xcaddy=$gobin/xcaddy
if ! "$xcaddy" version 2>/dev/null | grep -q "$XCADDY_VERSION"; then
	echo "xcaddy.sh: installing xcaddy $XCADDY_VERSION" >&2
	go install "github.com/caddyserver/xcaddy/cmd/xcaddy@$XCADDY_VERSION"
fi

# The packages of this module that the binary links (not the mock, the
# load generator or tests): a change anywhere else reuses the cached build.
module=$(go list -m)
pkgdirs=$(go list -deps -f "{{with .Module}}{{if eq .Path \"$module\"}}{{\$.Dir}}{{end}}{{end}}" .)
hash=$( { echo "$CADDY_VERSION $XCADDY_VERSION $(go version)"; \
	for dir in $pkgdirs; do ls "$dir"/*.go; done | grep -v '_test\.go$' | LC_ALL=C sort | xargs sha256sum; \
	sha256sum go.mod go.sum; } | sha256sum | cut -c1-16)
cached=$root/.cache/caddy-$hash
if [ ! -x "$cached" ]; then
	echo "xcaddy.sh: building caddy $CADDY_VERSION with llm_proxy (cache key $hash)" >&2
	mkdir -p "$root/.cache"
	# The module registry refuses unknown module paths with an error instead of
	# "not found", so resolving our own module's latest version fails. "|off"
	# after the first registry makes Go stop there and use the local replacement.
	proxy=$(go env GOPROXY | cut -d, -f1 | cut -d'|' -f1)
	GOPROXY="$proxy|off" CGO_ENABLED=0 XCADDY_SKIP_CLEANUP=0 \
		"$xcaddy" build "$CADDY_VERSION" \
		--output "$cached.tmp" \
		--with "github.com/llmproxy/caddy-llm-proxy=$root"
	mv "$cached.tmp" "$cached"
	# Keep the five newest builds.
	ls -1t "$root"/.cache/caddy-* 2>/dev/null | tail -n +6 | xargs -r rm -f
fi
if [ "$out" != "$cached" ]; then
	cp -f "$cached" "$out.tmp" && mv -f "$out.tmp" "$out"
fi
echo "$out"
