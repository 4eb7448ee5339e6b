#!/usr/bin/env bash
# Runs Narsil's whole test suite: unit tests, end-to-end gRPC tests over
# loopback, and the benches compiled and run once in test mode.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

require_rust
step "cargo test (workspace, all targets)"
cargo test --workspace --all-targets -j "${NARSIL_BUILD_JOBS}" --locked
step "all tests passed"
