#!/usr/bin/env bash
# gpu_check.sh's dry run on this machine (CI runs it after the tests): the
# GPU check's every step on the CPU, with the binary built here
# (target/debug/narsil unless NARSIL_BIN says otherwise), the small split
# test model scripts/test.sh exports, split models served through the
# device lane on the CPU device (NARSIL_DEVICE_PATH_ON_CPU=1: staging, the
# tensor stage, padded buckets, the stage-ahead hand-off), short load points
# and small tables. It checks the script and the device lane's host logic,
# not a GPU. Results in target/gpu_check_dry/ (table.txt first), its work
# files in target/gpu_check_dry/work/ (replaced by the next run, not left
# in /tmp: ~150 MiB a run).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
use_project_torch
MODEL=models/generated/test-small
[ -f "$MODEL/split/schema.json" ] || die "no split test model at $MODEL/split: run scripts/test.sh first"
export NARSIL_BIN="${NARSIL_BIN:-$PWD/target/debug/narsil}"
[ -x "$NARSIL_BIN" ] || die "no narsil binary at $NARSIL_BIN: run scripts/test.sh (or cargo build --features torch) first"
step "gpu_check.sh dry run (on the CPU, $NARSIL_BIN)"
rm -rf target/gpu_check_dry/work
NARSIL_GPU_CHECK_DRY_RUN=1 \
  NARSIL_GPU_CHECK_DIR="$PWD/target/gpu_check_dry/work" \
  NARSIL_GPU_CHECK_MODEL="$PWD/$MODEL/split" \
  NARSIL_GPU_CHECK_GOLDEN="$PWD/$MODEL/golden.json" \
  NARSIL_GPU_CHECK_SEQUENCE_MODEL="$PWD/models/generated/test-din/split" \
  NARSIL_GPU_CHECK_HSTU_MODEL="$PWD/models/generated/test-hstu/split" \
  NARSIL_GPU_CHECK_GR_MODEL="$PWD/models/generated/gr-streaming-triton" \
  OUT="$PWD/target/gpu_check_dry" \
  bash scripts/gpu_check.sh
