#!/usr/bin/env bash
# CI's gates besides the tests: formatting (rustfmt), lints (clippy, every
# warning an error, every target, with the libtorch backend), and the
# pure-Rust binary built without the torch feature (what `cargo build`
# gives a user with no Python). Sets up the Python venv first if it is
# missing (clippy with --features torch links against its libtorch).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

require_rust
step "cargo fmt --check"
cargo fmt --all --check || die "formatting differs: run cargo fmt --all"
use_project_torch
step "cargo clippy (workspace, all targets, --features torch, warnings are errors)"
cargo clippy --workspace --all-targets --features torch -j "${NARSIL_BUILD_JOBS}" --locked -- -D warnings
# NARSIL_PURE_RUST_PROFILE=image (as CI sets it) builds it as the small
# container image's binary, which scripts/build_images.sh then finds built.
profile="${NARSIL_PURE_RUST_PROFILE:-dev}"
step "building the pure-Rust binary (no torch feature, --profile $profile)"
cargo build --bin narsil --profile "$profile" -j "${NARSIL_BUILD_JOBS}" --locked
step "all checks passed"
