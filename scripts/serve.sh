#!/usr/bin/env bash
# One command from a fresh checkout to a serving Narsil: sets up the Python
# venv (libtorch, FBGEMM, TorchRec), exports the default DLRM (26 tables x
# 100,000 rows x 64, INT8) if it is missing, builds the release binary with
# the libtorch backend and serves the model's split form (its dense network
# an AOTInductor .pt2 package: the fastest form that keeps its scores) on
# 127.0.0.1:50051.
#
# Extra arguments go to `narsil serve` (see `--help`), e.g.
#   scripts/serve.sh --execution-mode worker --lanes 2
#   scripts/serve.sh --backend mock --mock-latency-ms 5
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

backend=torch
has_model=0
prev=""
for arg in "$@"; do
  case "$arg" in
    --backend=*) backend="${arg#--backend=}" ;;
    --model|--model=*) has_model=1 ;;
  esac
  [ "$prev" = "--backend" ] && backend="$arg"
  prev="$arg"
done
[ -n "${NARSIL_BACKEND:-}" ] && [ "$backend" = torch ] && backend="$NARSIL_BACKEND"
[ -n "${NARSIL_MODEL:-}" ] && has_model=1

require_rust
use_project_torch
extra=()
if [ "$backend" = torch ]; then
  # The flag, if given, wins over the environment.
  export NARSIL_BACKEND=torch
  if [ "$has_model" = 0 ]; then
    # The default DLRM in its fastest form that keeps its scores: split
    # (tables in Narsil's embedding stage), the dense network as an
    # AOTInductor package (dense.pt2, FP32, within 1e-5 of the TorchScript
    # network's scores; `--dense-form auto` picks it). An export made
    # before without its split form is made again.
    export_model default --split
    [ -f models/generated/default/split/schema.json ] \
      || .venv/bin/python models/export_dlrm.py --out models/generated/default --force --split
    extra=(--model models/generated/default/split)
    step "the default DLRM, split with its dense network as a .pt2 package (its single file: --model models/generated/default/model_default.pt)"
  fi
fi
step "building narsil (release, --features torch)"
cargo build --release --features torch -j "${NARSIL_BUILD_JOBS}" --locked
step "serving ($backend): narsil serve ${extra[*]} $*"
exec target/release/narsil serve "${extra[@]}" "$@"
