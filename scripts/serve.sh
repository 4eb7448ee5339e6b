#!/usr/bin/env bash
# One command from a fresh checkout to a serving Narsil: builds the release
# binary and serves. Extra arguments go to `narsil serve` (see --help).
# Default: the fixed-latency mock backend on 127.0.0.1:50051.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

require_rust
step "building narsil (release)"
cargo build --release -j "${NARSIL_BUILD_JOBS}" --locked
step "serving: target/release/narsil serve $*"
exec target/release/narsil serve "$@"
