#!/usr/bin/env bash
# What `make bench` (scripts/bench.sh) needs beyond Go and ./caddy: nginx,
# from Debian's packages when missing. The package's service is not used
# (the suite runs nginx itself, unprivileged, with its own config in a temp
# dir); where the package's install would start it, it is stopped again.
set -euo pipefail

if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then
	exit 0
fi
if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
echo "setup-bench: installing nginx (apt-get install -y nginx)" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nginx >/dev/null
# Debian's postinst starts the service where an init system runs; the
# suite listens on its own ports, but a system nginx on :80 is not asked for.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet nginx 2>/dev/null; then
	$sudo systemctl stop nginx || true
	$sudo systemctl disable nginx >/dev/null 2>&1 || true
fi
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || { echo "setup-bench: nginx still missing after apt-get" >&2; exit 1; }
