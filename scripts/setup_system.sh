#!/usr/bin/env bash
# Installs the Debian packages Narsil's tests and benchmarks run, once and
# serially, before anything runs them (tests run in parallel and must never
# install: parallel apt-get runs fail on dpkg's lock). Uses sudo when not root.
#
#   scripts/setup_system.sh            what the test suite needs (redis-server)
#   scripts/setup_system.sh PROGRAM... those programs: redis-server, haproxy, podman
#
# Programs already on PATH are left alone; the rest are installed in one
# apt-get run.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

# The Debian package that provides each program.
package_of() {
  case "$1" in
    redis-server | redis-cli) echo redis-server ;;
    haproxy) echo haproxy ;;
    podman) echo podman ;;
    *) die "setup_system.sh: unknown program '$1' (known: redis-server, haproxy, podman)" ;;
  esac
}

programs=("$@")
[ "${#programs[@]}" -gt 0 ] || programs=(redis-server redis-cli)
missing=()
for program in "${programs[@]}"; do
  package=$(package_of "$program")
  command -v "$program" >/dev/null 2>&1 && continue
  [[ " ${missing[*]-} " == *" $package "* ]] || missing+=("$package")
done
if [ "${#missing[@]}" -eq 0 ]; then
  step "system packages ready (${programs[*]})"
  exit 0
fi
apt_install "${missing[@]}"
