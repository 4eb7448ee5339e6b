#!/usr/bin/env bash
# Creates (or reuses) the project venv at .venv with libtorch, FBGEMM and
# TorchRec: the torch backend links against this venv's libtorch and the model
# export scripts run in it. Idempotent: a venv that already has the pinned
# versions is left alone (delete .venv to start over).
#
# NARSIL_FBGEMM_PACKAGE=fbgemm-gpu installs FBGEMM's CUDA build instead of the
# CPU one, for INT8 models exported and served on an NVIDIA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

TORCH_VERSION=2.13.0
FBGEMM_VERSION=1.8.0
FBGEMM_PACKAGE="${NARSIL_FBGEMM_PACKAGE:-fbgemm-gpu-cpu}"
TORCHREC_VERSION=1.8.0
VENV="${NARSIL_VENV:-.venv}"
TRITONCLIENT_VERSION=2.73.0
# PT2E static quantization (prepare_pt2e/convert_pt2e, X86InductorQuantizer)
# for export_dlrm.py --int8: torch 2.13 moved it out of torch.ao into torchao.
TORCHAO_VERSION=0.18.0
# The CUDA runtime's crt/ headers, which the CUDA shim (CUDA graphs and
# streams, crates/narsil-torch/csrc/cuda_shim.cpp) compiles against: the
# torch wheel's nvidia-cuda-runtime lacks them (headers only, a few MB).
CUDA_CRT_VERSION=13.0.88
STAMP="$VENV/.narsil-torch-${TORCH_VERSION}-${FBGEMM_PACKAGE}-${FBGEMM_VERSION}-torchrec-${TORCHREC_VERSION}-tritonclient-${TRITONCLIENT_VERSION}-torchao-${TORCHAO_VERSION}-crt-${CUDA_CRT_VERSION}-v3"

if [ -f "$STAMP" ]; then
  step "python venv ready ($VENV)"
  exit 0
fi

PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null 2>&1 || die "python3 not found"
if [ ! -x "$VENV/bin/python" ]; then
  step "creating python venv at $VENV"
  "$PYTHON" -m venv "$VENV" || die "python3 -m venv failed (on Debian: apt-get install python3-venv)"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

step "installing torch==$TORCH_VERSION and $FBGEMM_PACKAGE==$FBGEMM_VERSION (about 4 GB the first time)"
"${PIP[@]}" install --progress-bar off \
  "torch==$TORCH_VERSION" "$FBGEMM_PACKAGE==$FBGEMM_VERSION" \
  numpy safetensors grpcio "grpcio-tools<1.80" "grpcio-health-checking<1.80" "protobuf<7" matplotlib \
  "tritonclient[grpc]==$TRITONCLIENT_VERSION" \
  iopath pyre-extensions tensordict torchmetrics tqdm

# torchrec's own requirements pull the CUDA fbgemm-gpu, which would sit beside
# the CPU build above: install it alone and let the line above provide its deps.
step "installing torchrec==$TORCHREC_VERSION (no deps)"
"${PIP[@]}" install --progress-bar off --no-deps "torchrec==$TORCHREC_VERSION"

# torchao declares no torch requirement (0.18.0 works with torch 2.13): no deps.
step "installing torchao==$TORCHAO_VERSION and nvidia-cuda-crt==$CUDA_CRT_VERSION (no deps)"
"${PIP[@]}" install --progress-bar off --no-deps "torchao==$TORCHAO_VERSION" "nvidia-cuda-crt==$CUDA_CRT_VERSION"

step "checking that torchrec, FBGEMM and torchao's PT2E quantization import"
"$VENV/bin/python" - <<'PY'
import torch, fbgemm_gpu, torchrec  # noqa: F401
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e  # noqa: F401
from torchrec.models.dlrm import DLRM  # noqa: F401
print(f"torch {torch.__version__}, torchrec {torchrec.__version__ if hasattr(torchrec, '__version__') else '?'}")
PY
touch "$STAMP"
step "python venv ready ($VENV)"
