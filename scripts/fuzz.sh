#!/usr/bin/env bash
# Fuzzes decode + validate of both protocols (fuzz/fuzz_targets) with
# cargo-fuzz (libFuzzer) for SECONDS seconds (default 60), installing
# cargo-fuzz first if it is missing. Runs on the stable toolchain:
# RUSTC_BOOTSTRAP=1 lets rustc accept the few unstable flags cargo-fuzz
# passes, so no nightly is needed. The corpus grows in fuzz/corpus/ (seeded
# from fuzz/seeds/: valid requests of both protocols); crashes land in
# fuzz/artifacts/.
#   scripts/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

seconds="${1:-60}"
require_rust
if ! cargo fuzz --version >/dev/null 2>&1; then
  step "installing cargo-fuzz from crates.io"
  cargo install cargo-fuzz --locked -j "${NARSIL_BUILD_JOBS}"
fi
export RUSTC_BOOTSTRAP=1
mkdir -p fuzz/corpus/decode_validate
step "fuzzing decode_validate for ${seconds}s"
# No sanitizer: the decoded and validated code is safe Rust; panics and
# failed assertions are what the target looks for.
CARGO_BUILD_JOBS="${NARSIL_BUILD_JOBS}" cargo fuzz run decode_validate \
  --sanitizer none --release --debug-assertions \
  fuzz/corpus/decode_validate fuzz/seeds/decode_validate \
  -- -max_total_time="${seconds}" -print_final_stats=1
