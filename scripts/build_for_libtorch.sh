#!/usr/bin/env bash
# Builds a stripped `narsil` (--features torch, the `image` profile) against
# another libtorch than the project's, from that PyTorch version's PyPI wheel,
# and writes a folder to carry to a machine that has that PyTorch: the
# binary, the CUDA shim (libnarsil_cuda_shim.so: CUDA graphs and streams;
# the build fails without it), the small split test model with its golden
# requests, the sequence models of its phases S, G and R (split-din/,
# split-hstu/, split-gr/), and scripts/gpu_check.sh with
# models/model_files.py.
#
#   scripts/build_for_libtorch.sh [TORCH_VERSION] [OUT_DIR]
#
# TORCH_VERSION defaults to 2.11.0 (the GPU machines' PyTorch: 2.11.0+cu130,
# the same git hash as PyPI's torch==2.11.0); OUT_DIR to
# target/carry-torch-TORCH_VERSION in the checkout (ignored by git, so the
# device tool carries it with `carry`; docs/guide/gpu.md). The project's own
# Cargo.toml, Cargo.lock and target/ are never touched: the sources are
# copied to $NARSIL_BUILD_CACHE/src-torch-VERSION, tch and torch-sys are set
# there to the version that compiles against those headers (tch 0.26 does not
# compile against 2.11's: `_philox_*`, `_upsample_lanczos2d_aa`,
# `_flash_attention_forward_no_dropout_inplace` missing), and built in a
# target directory of its own.
#
# Environment:
#   NARSIL_BUILD_CACHE  wheels, unpacked libtorch, sources and target
#                       (default ~/.cache/narsil)
#   NARSIL_TCH_VERSION  the tch/torch-sys version (default: by TORCH_VERSION)
#   NARSIL_BUILD_JOBS   cargo -j (default 2)
#   NARSIL_CUDA_INCLUDE CUDA runtime headers for the shim (default: the
#                       project venv's nvidia/cu13/include, with
#                       nvidia-cuda-crt; else the nvidia-cuda-runtime and
#                       nvidia-cuda-crt wheels, downloaded beside the torch
#                       wheel and unpacked)
#
# On the GPU machine (no Rust there):
#   TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__)+"/lib")')
#   LD_LIBRARY_PATH=$TL LD_PRELOAD=$TL/libtorch_cuda.so ./narsil serve --model split --device cuda
# or simply: ./gpu_check.sh (in the carried folder).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TORCH_VERSION="${1:-2.11.0}"
CACHE="${NARSIL_BUILD_CACHE:-$HOME/.cache/narsil}"
OUT="${2:-$ROOT/target/carry-torch-$TORCH_VERSION}"
# The CUDA 13.0 runtime's headers, as the project venv pins them
# (scripts/setup_python.sh): the GPU machines' torch 2.11.0+cu130 runs CUDA 13.0.
CUDA_RUNTIME_WHEEL="nvidia-cuda-runtime==13.0.96"
CUDA_CRT_WHEEL="nvidia-cuda-crt==13.0.88"
JOBS="${NARSIL_BUILD_JOBS:-2}"
LIMIT_MIB=60

die() { echo "build_for_libtorch: $*" >&2; exit 1; }
step() { echo "== $*" >&2; }

case "${NARSIL_TCH_VERSION:-}" in
  "") case "$TORCH_VERSION" in
        2.13.*) TCH=0.26 ;;
        2.12.*) TCH=0.25 ;;
        2.11.*) TCH=0.24 ;;
        2.10.*) TCH=0.23 ;;
        *) die "no tch version known for torch $TORCH_VERSION: set NARSIL_TCH_VERSION" ;;
      esac ;;
  *) TCH="$NARSIL_TCH_VERSION" ;;
esac

PIP="$ROOT/.venv/bin/pip"
[ -x "$PIP" ] || PIP="$(command -v pip3 || command -v pip || true)"
[ -n "$PIP" ] || die "no pip to download the torch==$TORCH_VERSION wheel with"
command -v unzip >/dev/null || die "unzip is needed to unpack the wheel"

step "torch==$TORCH_VERSION wheel"
mkdir -p "$CACHE/wheels"
WHEEL="$(ls "$CACHE"/wheels/torch-"$TORCH_VERSION"-*.whl 2>/dev/null | head -1 || true)"
if [ -z "$WHEEL" ]; then
  "$PIP" download "torch==$TORCH_VERSION" --no-deps -d "$CACHE/wheels" >&2 \
    || die "pip could not download torch==$TORCH_VERSION"
  WHEEL="$(ls "$CACHE"/wheels/torch-"$TORCH_VERSION"-*.whl | head -1)"
fi
LIBTORCH_DIR="$CACHE/libtorch-$TORCH_VERSION"
if [ ! -f "$LIBTORCH_DIR/torch/lib/libtorch_cpu.so" ]; then
  step "unpacking torch/lib and torch/include from $(basename "$WHEEL")"
  rm -rf "$LIBTORCH_DIR"
  unzip -q "$WHEEL" 'torch/lib/*' 'torch/include/*' 'torch/share/*' -d "$LIBTORCH_DIR" \
    || die "cannot unpack $WHEEL"
fi

step "sources copied to $CACHE/src-torch-$TORCH_VERSION, tch $TCH"
SRC="$CACHE/src-torch-$TORCH_VERSION"
mkdir -p "$SRC"
# Tracked and untracked-but-not-ignored files, as they are in the work tree
# (files deleted there but still tracked are skipped).
(cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 -r ls -d 2>/dev/null | tar -cf - -T -) \
  | tar -C "$SRC" -xf - \
  || die "cannot copy the sources"
sed -i -E "s/^tch = \"[^\"]+\"/tch = \"$TCH\"/; s/^torch-sys = \"[^\"]+\"/torch-sys = \"$TCH\"/" \
  "$SRC/crates/narsil-torch/Cargo.toml"
sed -i -E "s/^torch-sys = \{ version = \"[^\"]+\"/torch-sys = { version = \"$TCH\"/" "$SRC/Cargo.toml"
grep -q "^tch = \"$TCH\"" "$SRC/crates/narsil-torch/Cargo.toml" || die "could not set tch $TCH"
(cd "$SRC" && cargo update -p tch -p torch-sys >&2) || die "cargo could not resolve tch $TCH"

# The CUDA shim's headers: NARSIL_CUDA_INCLUDE, else the project venv's,
# else the two header wheels unpacked into the cache.
has_cuda_headers() { [ -f "$1/cuda_runtime_api.h" ] && [ -f "$1/crt/host_config.h" ]; }
CUDA_INCLUDE="${NARSIL_CUDA_INCLUDE:-}"
if [ -z "$CUDA_INCLUDE" ]; then
  for dir in "$ROOT"/.venv/lib/python3*/site-packages/nvidia/cu13/include "$CACHE/cuda-headers/nvidia/cu13/include"; do
    if has_cuda_headers "$dir"; then CUDA_INCLUDE="$dir"; break; fi
  done
fi
if [ -z "$CUDA_INCLUDE" ]; then
  step "CUDA runtime headers: $CUDA_RUNTIME_WHEEL and $CUDA_CRT_WHEEL into $CACHE/cuda-headers"
  "$PIP" download "$CUDA_RUNTIME_WHEEL" "$CUDA_CRT_WHEEL" --no-deps -d "$CACHE/wheels" >&2 \
    || die "pip could not download $CUDA_RUNTIME_WHEEL and $CUDA_CRT_WHEEL (the CUDA shim's headers)"
  for wheel in "$CACHE"/wheels/nvidia_cuda_runtime-13.0.96-*.whl "$CACHE"/wheels/nvidia_cuda_crt-13.0.88-*.whl; do
    unzip -qo "$wheel" 'nvidia/*/include/*' -d "$CACHE/cuda-headers" || die "cannot unpack $wheel"
  done
  CUDA_INCLUDE="$CACHE/cuda-headers/nvidia/cu13/include"
fi
has_cuda_headers "$CUDA_INCLUDE" \
  || die "no CUDA runtime headers (cuda_runtime_api.h and crt/host_config.h) in $CUDA_INCLUDE: the CUDA shim cannot be built"

step "cargo build --profile image --features torch (target $CACHE/target-torch-$TORCH_VERSION, CUDA headers $CUDA_INCLUDE)"
(
  cd "$SRC"
  unset LIBTORCH_USE_PYTORCH
  export LIBTORCH="$LIBTORCH_DIR/torch" LIBTORCH_BYPASS_VERSION_CHECK=1
  export NARSIL_CUDA_INCLUDE="$CUDA_INCLUDE"
  export RUSTFLAGS="-C link-arg=-Wl,--allow-shlib-undefined"
  export CARGO_TARGET_DIR="$CACHE/target-torch-$TORCH_VERSION"
  cargo build --profile image --features torch --bin narsil -j "$JOBS" >&2
) || die "the build against libtorch $TORCH_VERSION (tch $TCH) failed (see above)"

step "carry folder $OUT"
TARGET="$CACHE/target-torch-$TORCH_VERSION/image"
rm -rf "$OUT"
mkdir -p "$OUT"
strip -o "$OUT/narsil" "$TARGET/narsil"
SHIM="$(ls -t "$TARGET"/build/narsil-torch-*/out/libnarsil_cuda_shim.so 2>/dev/null | head -1 || true)"
[ -n "$SHIM" ] || die "no CUDA shim was built (see the build's warnings above): a GPU check without it would measure eager forwards on one stream"
strip -o "$OUT/libnarsil_cuda_shim.so" "$SHIM"
MODEL="$ROOT/models/generated/test-small/split"
[ -f "$MODEL/schema.json" ] || die "no test model at $MODEL: run scripts/test.sh (it exports one) first"
mkdir -p "$OUT/split"
# The CPU-compiled .pt2 packages are not served on CUDA, and the split
# golden file's pooled blocks are not needed: left behind. The INT8 model's
# golden file holds the scores the split form serves.
(cd "$MODEL" && tar --exclude='*.pt2' --exclude=golden.json --exclude=dense.safetensors -cf - .) | (cd "$OUT/split" && tar -xf -)
cp "$MODEL/../golden.json" "$OUT/golden.json"
# carry_split SRC NAME PHASE: the split model in SRC with its golden file,
# without its CPU packages, as $OUT/NAME, where the tests made it (else
# gpu_check.sh's PHASE will say skipped).
carry_split() {
  local src=$1 name=$2 phase=$3
  if [ -f "$src/golden.json" ]; then
    mkdir -p "$OUT/$name"
    (cd "$src" && tar --exclude='*.pt2' -cf - .) | (cd "$OUT/$name" && tar -xf -)
  else
    echo "build_for_libtorch: no model with a golden file at $src (scripts/test.sh makes it): gpu_check.sh's phase $phase will say skipped" >&2
  fi
}
# The sequence model (gpu_check.sh's phase S).
carry_split "$ROOT/models/generated/test-din/split" split-din S
# The generative ranker (phase G) in its GPU shape (a DLRMv3-like ranker
# scaled to the carry limit: 5 STU layers of width 256, 4 heads of 64,
# histories of up to 1,024 positions, 50k items x 128), exported here once
# (about 10 minutes on 2 vCPUs: its reference scores every golden request
# in Python; 18 MiB), its split form carried without the CPU package.
HSTU_GPU="$ROOT/models/generated/gpu-hstu"
if [ ! -f "$HSTU_GPU/split/schema.json" ]; then
  echo "build_for_libtorch: exporting $HSTU_GPU (the GPU check's generative ranker)" >&2
  "$ROOT/.venv/bin/python" "$ROOT/models/export_hstu.py" --out "$HSTU_GPU" --force --item-rows 50000 \
    --user-rows 10000 --embedding-dim 128 --model-dim 256 --layers 5 --heads 4 --head-dim 64 --max-len 1024 \
    --head-arch 256,64 || die "exporting $HSTU_GPU failed"
fi
carry_split "$HSTU_GPU/split" split-hstu G
# The GR checkpoint's import with GR's GPU clamp (phase R; 2 MiB).
carry_split "$ROOT/models/generated/gr-streaming-triton" split-gr R
cp "$ROOT/scripts/gpu_check.sh" "$OUT/gpu_check.sh"
# What gpu_check.sh's default-size model copies from split/ (every file its
# schema names).
cp "$ROOT/models/model_files.py" "$OUT/model_files.py"
echo "torch $TORCH_VERSION, tch $TCH, built $(date -u +%FT%TZ) from $(cd "$ROOT" && git rev-parse --short HEAD)" > "$OUT/BUILD"
BYTES=$(du -sb "$OUT" | cut -f1)
MIB=$(( (BYTES + 1048575) / 1048576 ))
ls -la "$OUT" >&2
[ "$MIB" -le "$LIMIT_MIB" ] || die "the carry folder is $MIB MiB, over $LIMIT_MIB MiB"
echo "carry folder: $OUT ($MIB MiB; the device tool's carry takes at most 64 MiB)"
