#!/usr/bin/env bash
# Builds TorchRec's C++ inference server (torchrec/inference/server.cpp) for
# the CPU, against the project venv's libtorch and FBGEMM, so that
# benchmarks/torchrec_dlrm_compare.py can run it beside Narsil.
#
#   benchmarks/torchrec_cpp/build.sh TORCHREC_CHECKOUT [OUT_DIR]
#
# TORCHREC_CHECKOUT is a clone of https://github.com/meta-pytorch/torchrec.
# Writes OUT_DIR/torchrec_server (default benchmarks/torchrec_cpp/build).
#
# Upstream's CMakeLists points into its author's home directory and sets no
# build type, and the PyPI torch wheel's TorchConfig wants a CUDA toolkit, so
# this script compiles directly (g++ -O2, C++17, the wheel's CXX11 ABI):
#   * gRPC, protobuf and absl from Debian (installed here when missing);
#   * torch/include without the wheel's bundled google/protobuf headers,
#     which clash with Debian's protobuf;
#   * every fbgemm_gpu library linked with --no-as-needed and an rpath, so
#     FBGEMM's operators are registered before the model is loaded.
# Changes to server.cpp, applied to a copy (the checkout is not touched):
#   * CUDA to CPU: its 3 `.to(torch::kCUDA)` and 3 `.device(torch::kCUDA, 0)`;
#   * `c10::InferenceMode` in Predict: upstream runs its handler threads with
#     autograd on (its NoGradGuard only covers main's thread). A fair tuning,
#     stated in REPORTS.md#torchrec-cpp-server.
# Everything else is upstream's: one forward per request, a std::cout line
# per request, fixed port 50051 on 0.0.0.0, int32 lengths and ids.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib.sh

CHECKOUT="${1:-}"
OUT="${2:-benchmarks/torchrec_cpp/build}"
[ -n "$CHECKOUT" ] || die "usage: $0 TORCHREC_CHECKOUT [OUT_DIR] (a clone of https://github.com/meta-pytorch/torchrec)"
SERVER="$CHECKOUT/torchrec/inference/server.cpp"
PROTO="$CHECKOUT/torchrec/inference/protos/predictor.proto"
[ -f "$SERVER" ] && [ -f "$PROTO" ] || die "$CHECKOUT has no torchrec/inference/server.cpp and protos/predictor.proto"

PACKAGES=(g++ pkg-config protobuf-compiler protobuf-compiler-grpc libprotobuf-dev libgrpc++-dev libabsl-dev)
if ! dpkg -s "${PACKAGES[@]}" >/dev/null 2>&1; then
  step "installing ${PACKAGES[*]}"
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get install -y --no-install-recommends "${PACKAGES[@]}" \
    || { $SUDO apt-get update && $SUDO apt-get install -y --no-install-recommends "${PACKAGES[@]}"; }
fi

bash scripts/setup_python.sh
TORCH=$(.venv/bin/python -c 'import os, torch; print(os.path.dirname(torch.__file__))')
FBGEMM=$(.venv/bin/python -c 'import os, fbgemm_gpu; print(os.path.dirname(fbgemm_gpu.__file__))')

mkdir -p "$OUT/torch_include"
OUT=$(cd "$OUT" && pwd)
for entry in "$TORCH"/include/*; do
  [ "$(basename "$entry")" = google ] || ln -sfn "$entry" "$OUT/torch_include/"
done

step "patching a copy of server.cpp for the CPU"
cp "$SERVER" "$OUT/server.cpp"
cuda_to=$(grep -c '\.to(torch::kCUDA)' "$OUT/server.cpp" || true)
cuda_device=$(grep -c '\.device(torch::kCUDA, 0)' "$OUT/server.cpp" || true)
[ "$cuda_to" = 3 ] && [ "$cuda_device" = 3 ] \
  || die "server.cpp has changed upstream ($cuda_to .to(kCUDA), $cuda_device .device(kCUDA, 0); expected 3 and 3)"
sed -i -e 's/\.to(torch::kCUDA)/.to(torch::kCPU)/g' \
  -e 's/\.device(torch::kCUDA, 0)/.device(torch::kCPU)/g' \
  -e '0,/^\(\s*\)c10::Dict<std::string, at::Tensor> dict;/s//\1c10::InferenceMode inference_mode;\n\1c10::Dict<std::string, at::Tensor> dict;/' \
  "$OUT/server.cpp"
grep -q 'c10::InferenceMode inference_mode;' "$OUT/server.cpp" || die "could not add InferenceMode to Predict"

step "generating the predictor.proto stubs"
protoc -I "$(dirname "$PROTO")" --cpp_out="$OUT" --grpc_out="$OUT" \
  --plugin=protoc-gen-grpc="$(command -v grpc_cpp_plugin)" "$PROTO"

step "compiling torchrec_server (about 2 minutes)"
# shellcheck disable=SC2046
g++ -O2 -std=c++17 -D_GLIBCXX_USE_CXX11_ABI=1 -w \
  -I "$OUT" -I "$OUT/torch_include" -I "$OUT/torch_include/torch/csrc/api/include" \
  "$OUT/server.cpp" "$OUT/predictor.pb.cc" "$OUT/predictor.grpc.pb.cc" \
  -o "$OUT/torchrec_server" \
  -L "$TORCH/lib" -Wl,-rpath,"$TORCH/lib" -Wl,-rpath,"$FBGEMM" \
  -Wl,--no-as-needed -ltorch -ltorch_cpu -lc10 "$FBGEMM"/*.so -Wl,--as-needed \
  $(pkg-config --libs grpc++ protobuf absl_flags_parse absl_str_format_internal) -lgrpc++_reflection
step "built $OUT/torchrec_server"
