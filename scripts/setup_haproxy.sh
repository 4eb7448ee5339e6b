#!/usr/bin/env bash
# Installs HAProxy (Debian package `haproxy`) if it is missing, for
# benchmarks/rolling_restart.py. Uses sudo when not root.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

if command -v haproxy >/dev/null 2>&1; then
  step "haproxy ready ($(haproxy -v | head -1))"
  exit 0
fi
command -v apt-get >/dev/null 2>&1 || die "haproxy not found and no apt-get: install HAProxy 2.4 or newer"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
step "installing haproxy (apt-get)"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq haproxy >/dev/null
haproxy -v | head -1
