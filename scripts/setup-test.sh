#!/usr/bin/env bash
# Everything `make test` needs beyond Go: Node.js and npm (for the SDK
# end-to-end tests: openai, @anthropic-ai/sdk, the Vercel AI SDK),
# redis-server (the fleet tests start their own) and prometheus with
# promtool (deploy/ and e2e/prometheus_test.go), from Debian's packages
# when missing; the SDKs themselves (npm ci, pinned
# by e2e/node/package-lock.json); and ./caddy (./xcaddy.sh, which installs
# xcaddy and caches the build).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
	echo "setup-test: installing nodejs and npm" >&2
	$sudo apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nodejs npm >/dev/null
fi
# Tests run redis-server themselves (internal/redistest), on their own
# ports; the package's service is not needed.
if ! command -v redis-server >/dev/null 2>&1; then
	echo "setup-test: installing redis-server" >&2
	$sudo apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null
fi
# promtool checks the rules and the dashboard's queries (go test ./deploy);
# e2e/prometheus_test.go runs prometheus itself, on its own port and data
# directory. Both come with Debian's prometheus package; its service is not
# needed (and not started where there is no init system).
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
	echo "setup-test: installing prometheus (prometheus, promtool)" >&2
	$sudo apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
# The official SDKs the e2e tests drive (openai, @anthropic-ai/sdk, the
# Vercel AI SDK: ai and @ai-sdk/openai), pinned in e2e/node/package.json:
# npm ls fails when any of them is missing or at another version.
if ! (cd e2e/node && npm ls --depth=0 >/dev/null 2>&1); then
	echo "setup-test: npm ci in e2e/node" >&2
	(cd e2e/node && npm ci --no-audit --no-fund --loglevel=error)
fi
./xcaddy.sh >/dev/null
