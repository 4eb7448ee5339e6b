#!/usr/bin/env bash
# One command from a fresh checkout to a serving Narsil: sets up the Python
# venv (libtorch, FBGEMM, TorchRec), exports the default DLRM (26 tables x
# 100,000 rows x 64, INT8) if it is missing, builds the release binary with
# the libtorch backend and serves it on 127.0.0.1:50051.
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
    export_model default
    extra=(--model models/generated/default/model_default.pt)
  fi
fi
step "building narsil (release, --features torch)"
cargo build --release --features torch -j "${NARSIL_BUILD_JOBS}" --locked
step "serving ($backend): narsil serve ${extra[*]} $*"
exec target/release/narsil serve "${extra[@]}" "$@"
