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
# --int8 (dense_int8.pt2 for crates/narsil-torch/tests/int8_dense.rs and the
# DLRM_DCN's INT8 test in tests/torchrec_models_e2e.rs, ~30 s more) on x86
# CPUs with AVX2 or INT8 dot-product instructions (activations in 7 bits on
# AVX2 alone): elsewhere the export refuses it and the tests say skipped.
INT8_EXPORT=()
if grep -qwE 'avx2|avx512_vnni|avx_vnni|amx_int8' /proc/cpuinfo 2>/dev/null; then INT8_EXPORT=(--int8); fi
export_model test-small --num-rows 1000 --split --split-fp32 "${INT8_EXPORT[@]}"
export_model test-small-b --num-rows 1000 --seed 1 --golden-seed 0
export_torchrec_model test-torchrec-dlrm --kind dlrm --split
export_torchrec_model test-torchrec-dcn --kind dlrm_dcn --split --pt2 "${INT8_EXPORT[@]}"
export_torchrec_model test-torchrec-multitask --kind multitask --split --pt2
export_with models/export_torchrec_mc.py test-torchrec-mc --split
export_with models/export_din.py test-din --split --pt2
# A team's TorchRec DIN and BST-like model (an EmbeddingCollection over the
# history and the candidate), single files split by models/extract_split.py.
export_with models/export_torchrec_din.py test-torchrec-din --extract
export_with models/export_torchrec_din.py test-torchrec-bst --kind bst --name team-bst --extract
export_with models/export_hstu.py test-hstu --pt2
export_with models/export_raw_echo.py test-raw-echo
# kuairand with the default clamp also as its network compiled by AOTInductor (`--pt2`, ~50 s:
# millisecond timestamps).
for set in streaming kuairand; do
  for clamp in pytorch triton; do
    pt2=()
    [ "$set-$clamp" = kuairand-pytorch ] && pt2=(--pt2)
    import_gr_model "$set" "$clamp" "${pt2[@]}"
  done
done
step "building the tests (workspace, all targets, --features torch)"
cargo test --workspace --all-targets --features torch -j "${NARSIL_BUILD_JOBS}" --locked --no-run
# A cold build writes gigabytes; on a 2-vCPU machine their writeback competes
# with the timing-bound tests (overload, deadlines) for CPU. Flush it first.
step "flushing the build's writes to disk"
sync
step "cargo test (workspace, all targets, --features torch)"
cargo test --workspace --all-targets --features torch -j "${NARSIL_BUILD_JOBS}" --locked --no-fail-fast
step "all tests passed"
