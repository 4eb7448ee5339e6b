#!/usr/bin/env bash
# Runs Narsil's whole test suite: unit tests, end-to-end gRPC tests over
# loopback (mock and libtorch backends), and the benches compiled and run once
# in test mode. Sets up the Python venv (libtorch, FBGEMM, TorchRec) and a
# small exported test model first if they are missing, and the system
# packages the tests run (scripts/setup_system.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

require_rust
# System packages the tests run (redis-server), installed here, once and
# serially: no test installs anything.
bash scripts/setup_system.sh
use_project_torch
export_model test-small --num-rows 1000 --split --split-fp32
export_model test-small-b --num-rows 1000 --seed 1 --golden-seed 0
export_torchrec_model test-torchrec-dlrm --kind dlrm --split
export_torchrec_model test-torchrec-dcn --kind dlrm_dcn --split --pt2
export_torchrec_model test-torchrec-multitask --kind multitask --split --pt2
step "building the tests (workspace, all targets, --features torch)"
cargo test --workspace --all-targets --features torch -j "${NARSIL_BUILD_JOBS}" --locked --no-run
# A cold build writes gigabytes; on a 2-vCPU machine their writeback competes
# with the timing-bound tests (overload, deadlines) for CPU. Flush it first.
step "flushing the build's writes to disk"
sync
step "cargo test (workspace, all targets, --features torch)"
cargo test --workspace --all-targets --features torch -j "${NARSIL_BUILD_JOBS}" --locked
step "all tests passed"
