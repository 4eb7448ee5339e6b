#!/usr/bin/env bash
# The GPU check (issue 47): one command on a GPU machine that has PyTorch
# (2.11 on the machines lent here) in its python3 and no Rust, run in the
# folder scripts/build_for_libtorch.sh writes (narsil, libnarsil_cuda_shim.so,
# split/ with golden.json). Prints one table:
#
#   * golden parity on CUDA: FP32 within 1e-5 and bf16 within 2e-2 of the
#     golden scores, tables in GPU memory and on the host; alone (one client)
#     and fused (8 concurrent clients, batches held up to 2 ms to fuse);
#   * `narsil load`, 100 samples a request, at c1, c16, c64, c256, in batch
#     mode and in worker mode (one forward per request), on a model of the
#     default size (26 x 100,000 x 64 INT8 tables, generated here with the
#     test model's dense network), with req/s, p50/p99, the server's GPU
#     memory (nvidia-smi), its CPU per request and its busy cores;
#   * the zero-cost mock at c256: req/s, server CPU per request, busy cores.
#
# It stops at the first thing that fails, saying what, with the server's log.
# Takes ~4-6 minutes. Environment: NARSIL_BIN, NARSIL_GPU_DEVICE (cuda:0),
# NARSIL_GPU_LOAD_SECS (8 per load point), NARSIL_GPU_CHECK_DIR (work files;
# $OUT/gpu_check when $OUT is set, else ./gpu_check_out).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
BIN="${NARSIL_BIN:-$HERE/narsil}"
MODEL="$HERE/split"
# The INT8 model's golden scores: the split form serves the same ones.
GOLDEN="$HERE/golden.json"
DEVICE="${NARSIL_GPU_DEVICE:-cuda:0}"
SECS="${NARSIL_GPU_LOAD_SECS:-8}"
WORK="${NARSIL_GPU_CHECK_DIR:-${OUT:+$OUT/gpu_check}}"
WORK="${WORK:-$HERE/gpu_check_out}"
PORT=50151
ADDR="127.0.0.1:$PORT"
mkdir -p "$WORK"
TABLE="$WORK/table.txt"
: > "$TABLE"
SERVER_PID=""

fail() {
  echo "gpu_check: FAILED: $*" >&2
  if [ -n "$SERVER_PID" ] && [ -f "$WORK/server.log" ]; then
    echo "--- last 40 lines of the server's log ($WORK/server.log) ---" >&2
    tail -40 "$WORK/server.log" >&2
  fi
  stop_server
  echo "--- table so far ---" >&2
  cat "$TABLE" >&2
  exit 1
}
row() { printf '%s\n' "$*" | tee -a "$TABLE"; }

stop_server() {
  if [ -n "$SERVER_PID" ]; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
  fi
}
trap stop_server EXIT

# NARSIL_GPU_CHECK_DRY_RUN=1: the same steps on the CPU (no GPU, no
# LD_PRELOAD, the device path never taken), to check this script itself.
DRY="${NARSIL_GPU_CHECK_DRY_RUN:-}"
[ -n "$DRY" ] && DEVICE=cpu
[ -x "$BIN" ] || fail "no narsil binary at $BIN (set NARSIL_BIN)"
[ -f "$MODEL/schema.json" ] || fail "no split test model at $MODEL"
[ -f "$GOLDEN" ] || fail "no golden.json (the test model's, with scores_int8) at $GOLDEN"
[ -n "$DRY" ] || command -v nvidia-smi >/dev/null || fail "no nvidia-smi: not a GPU machine?"
command -v python3 >/dev/null || fail "no python3"
TL="$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__)+"/lib")')" \
  || fail "python3 cannot import torch"
if [ -z "$DRY" ]; then
  python3 -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || fail "PyTorch sees no CUDA device"
  export LD_LIBRARY_PATH="$TL${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LD_PRELOAD="$TL/libtorch_cuda.so"
fi
if [ -f "$HERE/libnarsil_cuda_shim.so" ]; then export NARSIL_CUDA_SHIM="$HERE/libnarsil_cuda_shim.so"; fi
"$BIN" --version >/dev/null 2>&1 || "$BIN" --help >/dev/null 2>&1 || fail "$BIN does not start: $("$BIN" --help 2>&1 | tail -3)"

GPU="$( ([ -n "$DRY" ] && echo "DRY RUN on the CPU: no GPU") || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
row "# Narsil GPU check: $(date -u +%FT%TZ), $GPU, $(nproc) host cores, torch $(python3 -c 'import torch;print(torch.__version__)'), $(cat "$HERE/BUILD" 2>/dev/null || echo 'build unknown')"
echo "CUDA shim: ${NARSIL_CUDA_SHIM:-none carried (CUDA graphs unavailable)}" | tee -a "$TABLE"

# Starts `narsil serve` with the given flags; waits until SERVING.
start_server() {
  stop_server
  "$BIN" serve --addr "$ADDR" "$@" > "$WORK/server.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 240); do
    if grep -q "SERVING" "$WORK/server.log" 2>/dev/null && ! grep -q "NOT_SERVING" "$WORK/server.log"; then
      return 0
    fi
    kill -0 "$SERVER_PID" 2>/dev/null || fail "narsil serve $* exited during start-up"
    sleep 0.5
  done
  fail "narsil serve $* was not SERVING after 120 s"
}

# The server's CPU seconds so far (user + system, all threads).
server_cpu() {
  awk -v hz="$(getconf CLK_TCK)" '{ print ($14 + $15) / hz }' "/proc/$SERVER_PID/stat"
}

# The server's GPU memory (MiB), from nvidia-smi's compute apps.
gpu_mib() {
  local used
  [ -n "$DRY" ] && { echo n/a; return; }
  used="$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null \
    | awk -F', *' -v pid="$SERVER_PID" '$1 == pid { print $2 }')"
  echo "${used:-n/a}"
}

# ---- 1. golden parity on CUDA --------------------------------------------
row ""
row "## golden parity on $DEVICE (narsil verify against golden.json; int8 tables)"
row "| precision | tables | alone | fused (8 clients) | tolerance |"
row "|---|---|---|---|---|"
for case in "fp32 device 1e-5" "fp32 host 1e-5" "bf16 device 2e-2" "bf16 host 2e-2"; do
  set -- $case
  precision=$1 tables=$2 tolerance=$3
  budget=$([ "$tables" = device ] && echo 17179869184 || echo 0)
  NARSIL_DEVICE_TABLE_BYTES=$budget start_server --backend torch --model "$MODEL" --device "$DEVICE" \
    --dense-precision "$precision" --execution-mode batch --max-batch-requests 16 --batch-timeout-ms 2
  alone="$("$BIN" verify --addr "http://$ADDR" --golden "$GOLDEN" --scores int8 --tolerance "$tolerance" 2>&1 | tail -1)" \
    || fail "parity $precision, tables on the $tables, alone: $alone"
  pids=()
  for i in $(seq 1 8); do
    "$BIN" verify --addr "http://$ADDR" --golden "$GOLDEN" --scores int8 --tolerance "$tolerance" \
      > "$WORK/verify_$i.log" 2>&1 &
    pids+=($!)
  done
  fused=ok
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || fused="FAILED: $(tail -1 "$WORK/verify_$((i + 1)).log")"
  done
  row "| $precision | $tables | ${alone//|//} | $fused | $tolerance |"
  [ "$fused" = ok ] || fail "parity $precision, tables on the $tables, fused: $fused"
  grep -q "capture failed" "$WORK/server.log" && row "  (a CUDA graph capture failed: eager forwards; see the server log)"
done
stop_server

# ---- 2. load on a model of the default size --------------------------------
BIG="$WORK/default-size"
if [ ! -f "$BIG/schema.json" ]; then
  python3 - "$MODEL" "$BIG" <<'EOF' || fail "cannot generate the default-size tables"
import ctypes, hashlib, json, os, shutil, sys
import torch  # not numpy: PyTorch's wheel does not bring it
src, dst = sys.argv[1], sys.argv[2]
rows, dim = 100_000, 64
os.makedirs(os.path.join(dst, "tables"), exist_ok=True)
schema = json.load(open(os.path.join(src, "schema.json")))
shutil.copy(os.path.join(src, schema["dense_network"]), os.path.join(dst, schema["dense_network"]))
generator = torch.Generator().manual_seed(0)
for table in schema["tables"]:
    assert table["dim"] == dim and table["storage"] == "int8_rowwise", table
    data = torch.zeros((rows, table["row_bytes"]), dtype=torch.uint8)
    data[:, 4:4 + dim] = torch.randint(0, 256, (rows, dim), dtype=torch.uint8, generator=generator)
    scale = torch.rand(rows, generator=generator) * 9e-3 + 1e-3
    bias = -torch.rand(rows, generator=generator) * 0.5
    data[:, 0:4] = torch.stack([scale, bias], dim=1).to(torch.float16).contiguous().view(torch.uint8)
    blob = ctypes.string_at(data.data_ptr(), data.numel())
    with open(os.path.join(dst, table["file"]), "wb") as f:
        f.write(blob)
    table["rows"] = rows
    table["sha256"] = hashlib.sha256(blob).hexdigest()
    table.pop("layout", None)
for key in ("dense_package", "dense_package_bf16", "dense_weights"):
    schema.pop(key, None)
json.dump(schema, open(os.path.join(dst, "schema.json"), "w"), indent=1)
print(f"default-size model: {len(schema['tables'])} x {rows} x {dim} INT8 in {dst}")
EOF
fi

load_point() { # mode, concurrency
  local mode=$1 c=$2 json="$WORK/load_$1_c$2.json" before after
  local flags=(--addr "http://$ADDR" --concurrency "$c" --connections "$(( c < 16 ? c : 16 ))" --samples-per-request 100)
  # Warm-up apart, so that the server's CPU is read around the measured
  # requests only.
  "$BIN" load "${flags[@]}" --requests "$(( c * 4 < 200 ? 200 : c * 4 ))" --warmup 0 > /dev/null 2> "$WORK/load_$1_c$2.log" \
    || fail "narsil load $mode c$c (warm-up): $(tail -3 "$WORK/load_$1_c$2.log")"
  before="$(server_cpu)"
  "$BIN" load "${flags[@]}" --duration "$SECS" --warmup 0 --json > "$json" 2> "$WORK/load_$1_c$2.log" \
    || fail "narsil load $mode c$c: $(tail -3 "$WORK/load_$1_c$2.log")"
  after="$(server_cpu)"
  python3 - "$json" "$before" "$after" "$mode" "$c" "$(gpu_mib)" <<'EOF' | tee -a "$TABLE"
import json, sys
r = json.load(open(sys.argv[1]))
cpu = float(sys.argv[3]) - float(sys.argv[2])
ok = max(r["ok"], 1)
errors = r["requests"] - r["ok"]
print(f"| {sys.argv[4]} | c{sys.argv[5]} | {r['req_per_s']:.0f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
      f"{r.get('mean_fused_rows', 0):.0f} | {cpu / ok * 1e6:.0f} | {cpu / r['elapsed_s']:.2f} | {sys.argv[6]} | {errors} |")
if r["ok"] == 0:
    sys.exit(f"no request succeeded: {r['by_code']}")
EOF
}

row ""
row "## narsil load on $DEVICE: 26 x 100,000 x 64 INT8 tables in GPU memory, FP32, 100 samples a request, ${SECS} s a point"
row "| mode | clients | req/s | p50 ms | p99 ms | mean fused rows | server CPU µs/req | busy cores | GPU MiB | errors |"
row "|---|---|---|---|---|---|---|---|---|---|"
NARSIL_DEVICE_TABLE_BYTES=17179869184 start_server --backend torch --model "$BIG" --device "$DEVICE" \
  --execution-mode batch --lanes 2 --max-batch-requests 64 --stage-ahead on
for c in 1 16 64 256; do load_point batch "$c"; done
NARSIL_DEVICE_TABLE_BYTES=17179869184 start_server --backend torch --model "$BIG" --device "$DEVICE" \
  --execution-mode worker --lanes 16
for c in 1 16 64 256; do load_point worker "$c"; done
stop_server

# ---- 3. the zero-cost mock -------------------------------------------------
row ""
row "## zero-cost mock (--backend mock --mock-latency-ms 0), batch mode, 4 lanes, c256"
row "| mode | clients | req/s | p50 ms | p99 ms | mean fused rows | server CPU µs/req | busy cores | GPU MiB | errors |"
row "|---|---|---|---|---|---|---|---|---|---|"
start_server --backend mock --mock-latency-ms 0 --execution-mode batch --lanes 4 --max-batch-requests 64
load_point mock 256
stop_server

row ""
row "gpu_check: done (table in $TABLE)"
