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
apt_install haproxy
haproxy -v | head -1
