#!/usr/bin/env bash
# The GPU check: one command for a lent GPU machine (PyTorch 2.11 in its
# python3, no Rust), run in the folder scripts/build_for_libtorch.sh writes
# (narsil, libnarsil_cuda_shim.so, model_files.py, split/, golden.json,
# BUILD). Made for the device tool as it is: 15 minutes of device time a
# task (starts included), 10 minutes a call, at most 8 files of at most 2
# folders' depth back from $OUT. So:
#
#   * work files (server logs, the default-size tables) live in the
#     machine's /tmp; at exit, whatever happened, at most 4 small files are
#     copied to $OUT (or ./gpu_check_out): table.txt (the results),
#     servers.txt (the head and tail of every server's log), failures.txt
#     (what failed, with the failing server's log tail) and commands.txt;
#   * every server and client runs under `timeout`, requests carry
#     --timeout-ms, a server is killed 10 s after SIGTERM, and each phase has
#     its own limit, so a hang costs one phase, never the call;
#   * LD_PRELOAD (libtorch_cuda, which a tch binary built against the wheel
#     needs to see CUDA) is given to the narsil processes only;
#   * every section says what the server logged of its CUDA graphs ("CUDA
#     graphs: used for buckets [..]" or "not used: why").
#
# Phase A (<= NARSIL_GPU_PHASE_A_SECS, 150): golden parity on CUDA (FP32
# within 1e-5, bf16 within 2e-2 of the golden scores), alone (one client)
# and fused (8 clients at once): tables in GPU memory and on the host, CUDA
# graphs on and off, and --stage-ahead on with 2 lanes (the copy stream,
# events and double buffer); in each, ranking requests (the user's features
# once: the tensor stage's gather, or the host stage's broadcast) against
# their flat twins, within the same tolerance.
# Phase S (<= NARSIL_GPU_PHASE_S_SECS, 120): the sequence model (a DIN
# ranker, `split-din/` beside this script: models/export_din.py's split
# form) on the device, tables on the host, eager: its golden scores (FP32
# within 1e-5, bf16 within 2e-2 of TorchRec's eager forward), grouped vs
# flat ranking requests (200 candidates), and (FP32) c16 with 500
# candidates, grouped and flat.
# Phase G (<= NARSIL_GPU_PHASE_G_SECS, 120): the HSTU generative ranker
# (`split-hstu/`: models/export_hstu.py's split form in the GPU shape
# scripts/build_for_libtorch.sh exports) the same way: golden parity (FP32
# within 1e-5, bf16 within 1e-1 of its eager forward), grouped vs flat, and
# c16 with 100 candidates, grouped and flat.
# Phase R (<= NARSIL_GPU_PHASE_R_SECS, 90): a generative ranker imported
# from a GR checkpoint (`split-gr/`: models/import_gr.py's import of GR's
# streaming test checkpoint with GR's GPU clamp, --clamp triton) the same
# way: GR's own scores of its golden users alone, as ranking requests (FP32 within
# 1e-5, bf16 within 3e-2), and c16 with 64 candidates, grouped and flat;
# no grouped vs flat (a flat row is a request of its own: they differ).
# Phase B (<= NARSIL_GPU_PHASE_B_SECS, 180): `narsil load`, 100 samples a
# request, c1/c16/c64/c256, batch mode (2 lanes, stage ahead) and worker
# mode (16 lanes), on 26 x NARSIL_GPU_CHECK_ROWS (100,000) x 64 INT8 tables
# generated here with the test model's dense network; then the zero-cost
# mock at c256.
# Phase V (<= NARSIL_GPU_PHASE_V_SECS, 120): MLPerf DLRM-v2's shape (13
# dense, 26 bags, dimension 128, 3 DCNv2 cross layers of rank 512, dense
# arch 512-256-128, over arch 1024-1024-512-256-1; synthetic weights made
# here with PyTorch alone) on 26 x NARSIL_GPU_CHECK_V2_ROWS (200,000) x 128
# INT8 tables in GPU memory: `narsil load` with requests of 270 pairs (MLPerf's
# mean query), 8 Zipf 1.05 ids a bag, c1/c16/c64, FP32 and bf16; the
# queries/s per GPU beside MLPerf's ~74-80k (an H200, TensorRT, all INT8,
# inputs already on the device).
#
# The exact device call is in docs/guide/gpu.md. Environment: NARSIL_BIN,
# NARSIL_GPU_CHECK_PHASES ("A S G R B V"; some of them for a rerun),
# NARSIL_GPU_DEVICE (cuda:0), NARSIL_GPU_LOAD_SECS (5 per load point),
# NARSIL_GPU_CHECK_DIR (work files; default a new /tmp folder),
# NARSIL_GPU_CHECK_DRY_RUN=1 (the same steps on the CPU, through the device
# lane on the CPU device, with short load points and small tables: checks
# this script, not the GPU; CI runs it through scripts/gpu_check_dry.sh).
# Exits 0 when every parity check passed and every load point answered.
set -uo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
SELF="$HERE/$(basename "$0")"
export BIN="${NARSIL_BIN:-$HERE/narsil}"
export MODEL="${NARSIL_GPU_CHECK_MODEL:-$HERE/split}"
# The INT8 model's golden scores: the split form serves the same ones.
export GOLDEN="${NARSIL_GPU_CHECK_GOLDEN:-$HERE/golden.json}"
export DRY="${NARSIL_GPU_CHECK_DRY_RUN:-}"
export DEVICE="${NARSIL_GPU_DEVICE:-cuda:0}"
export SECS="${NARSIL_GPU_LOAD_SECS:-5}"
export ROWS="${NARSIL_GPU_CHECK_ROWS:-100000}"
LIMIT_A="${NARSIL_GPU_PHASE_A_SECS:-150}"
LIMIT_B="${NARSIL_GPU_PHASE_B_SECS:-180}"
LIMIT_S="${NARSIL_GPU_PHASE_S_SECS:-120}"
LIMIT_G="${NARSIL_GPU_PHASE_G_SECS:-120}"
LIMIT_R="${NARSIL_GPU_PHASE_R_SECS:-90}"
LIMIT_V="${NARSIL_GPU_PHASE_V_SECS:-120}"
export V2_ROWS="${NARSIL_GPU_CHECK_V2_ROWS:-200000}"
# The sequence model (phase S) and its golden file.
export SEQUENCE_MODEL="${NARSIL_GPU_CHECK_SEQUENCE_MODEL:-$HERE/split-din}"
# The generative ranker (phase G) and its golden file.
export HSTU_MODEL="${NARSIL_GPU_CHECK_HSTU_MODEL:-$HERE/split-hstu}"
# The GR checkpoint's import (phase R) and its golden file.
export GR_MODEL="${NARSIL_GPU_CHECK_GR_MODEL:-$HERE/split-gr}"
# NARSIL_GPU_CHECK_PHASES=A (or B, S, G, R, V): some phases only, for a rerun.
PHASES="${NARSIL_GPU_CHECK_PHASES:-A S G R B V}"
export ADDR="127.0.0.1:${NARSIL_GPU_CHECK_PORT:-50151}"
if [ -n "$DRY" ]; then
  DEVICE=cpu
  SECS="${NARSIL_GPU_LOAD_SECS:-1}"
  ROWS="${NARSIL_GPU_CHECK_ROWS:-5000}"
  V2_ROWS="${NARSIL_GPU_CHECK_V2_ROWS:-2000}"
fi
# narsil load's request shape in load_point (phase V sets its own).
LOAD_SAMPLES=100
LOAD_FLAGS=()

# ---- helpers shared by the phases ----------------------------------------

row() { printf '%s\n' "$*" >> "$TABLE"; printf '%s\n' "$*"; }
# A failure: one line in the table, the details in failures.txt.
failed() {
  row "FAILED: $*"
  {
    echo "=== FAILED: $*"
    if [ -n "${SERVER_LOG:-}" ] && [ -f "$SERVER_LOG" ]; then
      echo "--- last 60 lines of $(basename "$SERVER_LOG") ---"
      tail -60 "$SERVER_LOG"
    fi
    echo
  } >> "$WORK/failures.txt"
  echo 1 > "$WORK/failed"
}

# Runs a narsil client for at most LIMIT_S seconds: `narsil_run LIMIT_S
# ARGS...` (through --exec-narsil: the CUDA libraries for narsil only).
narsil_run() {
  local limit=$1
  shift
  timeout -k 5 "$limit" "$SELF" --exec-narsil "$@"
}

stop_server() {
  local pid
  pid="$(cat "$WORK/server.pid" 2>/dev/null || true)"
  [ -n "$pid" ] || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "server $pid still running 10 s after SIGTERM: killed" >> "${SERVER_LOG:-/dev/null}"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
  rm -f "$WORK/server.pid"
}

# start_server NAME [VAR=VALUE ...] -- FLAGS...: `narsil serve` (at most
# the phase's length), waited for until SERVING (at most 90 s).
start_server() {
  local name=$1 envs=() line
  shift
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  stop_server
  SERVER_LOG="$WORK/server-$name.log"
  echo "[$name] ${envs[*]} narsil serve --addr $ADDR $*" >> "$WORK/commands.txt"
  # Its pid is narsil's own (exec all the way), for stop_server.
  env "${envs[@]}" bash -c 'echo $$ > "$0"; exec "$@"' "$WORK/server.pid" \
    "$SELF" --exec-narsil serve --addr "$ADDR" "$@" > "$SERVER_LOG" 2>&1 &
  for _ in $(seq 1 450); do
    if grep -q "warm version; SERVING" "$SERVER_LOG" 2>/dev/null; then
      line="$(grep -o 'CUDA graphs: .*' "$SERVER_LOG" | sed 's/\x1b\[[0-9;]*m//g' | sort | uniq -c \
        | awk '{ n = $1; $1 = ""; printf "%s%s (%d lane%s)", (NR > 1 ? "; " : ""), substr($0, 2), n, (n > 1 ? "s" : "") }')"
      GRAPHS="${line:-CUDA graphs: nothing logged}"
      return 0
    fi
    if ! kill -0 "$(cat "$WORK/server.pid" 2>/dev/null || echo 0)" 2>/dev/null && [ -s "$SERVER_LOG" ]; then
      failed "[$name] narsil serve exited during start-up"
      rm -f "$WORK/server.pid"
      return 1
    fi
    sleep 0.2
  done
  failed "[$name] narsil serve was not SERVING after 90 s"
  stop_server
  return 1
}

# ---- phase A: parity -------------------------------------------------------

verify() { # output file
  narsil_run 60 verify --addr "http://$ADDR" --golden "$GOLDEN" --scores int8 \
    --tolerance "$TOLERANCE" --wait-secs 10 > "$1" 2>&1
}

parity() { # name precision tables(device|host) [VAR=VALUE ...] -- FLAGS...
  local name=$1 precision=$2 tables=$3 budget alone fused i pids=()
  shift 3
  TOLERANCE=$([ "$precision" = bf16 ] && echo 2e-2 || echo 1e-5)
  budget=$([ "$tables" = device ] && echo 17179869184 || echo 0)
  if [ "$precision" = bf16 ] && [ -n "$DRY" ] && ! grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
    row "| $name | $precision | $tables | skipped: this CPU has no bf16 instructions (dry run) | | | | |"
    return 0
  fi
  start_server "$name" NARSIL_DEVICE_TABLE_BYTES="$budget" "$@" --backend torch --model "$MODEL" \
    --device "$DEVICE" --dense-precision "$precision" --execution-mode batch --max-batch-requests 16 \
    --batch-timeout-ms 2 || return 0
  if verify "$WORK/verify-$name.log"; then
    alone="ok ($(grep -o 'max |diff| [^)]*' "$WORK/verify-$name.log"))"
  else
    alone="FAILED"
    failed "[$name] parity alone: $(tail -2 "$WORK/verify-$name.log" | tr '\n' ' ')"
  fi
  for i in 1 2 3 4 5 6 7 8; do
    verify "$WORK/verify-$name-$i.log" &
    pids+=($!)
  done
  fused=ok
  for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
      fused=FAILED
      failed "[$name] parity fused, client $((i + 1)): $(tail -2 "$WORK/verify-$name-$((i + 1)).log" | tr '\n' ' ')"
    fi
  done
  row "| $name | $precision | $tables | ${alone//|/} | $fused | $(ranking "$name") | $TOLERANCE | $GRAPHS |"
  stop_server
}

# Ranking requests on the running server (the test model declares cat_0 to
# cat_12 and the dense features request-level): 48 grouped requests of 200
# candidates, 4 at once, each answer compared with its flat twin's scores
# (narsil load --compare-flat); prints the largest difference, or FAILED.
ranking() { # name
  local name=$1 out="$WORK/ranking-$1.json" diff
  if ! narsil_run 60 load --addr "http://$ADDR" --candidates 200 --ranking-form grouped --compare-flat 16 \
      --requests 48 --warmup 0 --concurrency 4 --json > "$out" 2> "$WORK/ranking-$name.log"; then
    failed "[$name] ranking requests: $(tail -2 "$WORK/ranking-$name.log" | tr '\n' ' ')"
    echo FAILED
    return 0
  fi
  diff="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["max_abs_diff_vs_flat"])' "$out" 2>&1)"
  if python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) <= float(sys.argv[2]) else 1)' "$diff" "$TOLERANCE" 2>/dev/null; then
    echo "ok (max diff $diff)"
  else
    failed "[$name] ranking requests: grouped vs flat max |diff| $diff > $TOLERANCE"
    echo FAILED
  fi
}

phase_a() {
  local graphs=()
  # The dry run pads to buckets on the CPU device (the same bucket logic).
  [ -n "$DRY" ] && graphs=(NARSIL_CUDA_GRAPH_BUCKETS=128,256,512,1024)
  row ""
  row "## A. golden parity on $DEVICE (narsil verify against golden.json, int8 tables; fused: 8 clients at once)"
  row "| section | precision | tables | alone | fused | ranking: grouped vs flat | tolerance | CUDA graphs (the server's log) |"
  row "|---|---|---|---|---|---|---|---|"
  parity fp32-device fp32 device "${graphs[@]}" --
  parity fp32-host fp32 host "${graphs[@]}" --
  parity bf16-device bf16 device "${graphs[@]}" --
  parity bf16-host bf16 host "${graphs[@]}" --
  parity fp32-device-eager fp32 device NARSIL_CUDA_GRAPH_BUCKETS= --
  parity fp32-device-stage-ahead-2-lanes fp32 device "${graphs[@]}" -- --lanes 2 --stage-ahead on
}

# ---- phase S: a sequence model ---------------------------------------------

# sequence_section TITLE DIR BF16_TOLERANCE CANDIDATES [NO_TWINS]: a
# sequence model's golden parity (FP32 within 1e-5, bf16 within
# BF16_TOLERANCE of its eager reference), grouped vs flat ranking requests
# (unless NO_TWINS, then said in their place: why the two score
# differently), and (FP32) c16 with CANDIDATES candidates a request,
# grouped and flat.
sequence_section() {
  local title=$1 dir=$2 bf16_tolerance=$3 candidates=$4 no_twins=${5:-} key name precision tolerance c16 form twins
  row ""
  row "## $title on $DEVICE: tables on the host, eager"
  if [ ! -f "$dir/schema.json" ]; then
    row "skipped: no model at $dir (scripts/build_for_libtorch.sh carries it)"
    return 0
  fi
  key="$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["requests"][0]; print("int8" if r.get("scores_int8") else next(iter(r["outputs"])))' "$dir/golden.json" 2>/dev/null || echo default)"
  row "| precision | golden (the model's eager forward; golden.json's requests) | ranking: grouped vs flat | tolerance | CUDA graphs |"
  row "|---|---|---|---|---|"
  for precision in fp32 bf16; do
    name="$(basename "$(dirname "$dir")")-$(basename "$dir")-$precision"
    tolerance=$([ "$precision" = bf16 ] && echo "$bf16_tolerance" || echo 1e-5)
    if [ "$precision" = bf16 ] && [ -n "$DRY" ] && ! grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
      row "| bf16 | skipped: this CPU has no bf16 instructions (dry run) | | | |"
      continue
    fi
    start_server "$name" -- --backend torch --model "$dir" --device "$DEVICE" --execution-mode batch \
      --dense-precision "$precision" --max-batch-requests 16 --batch-timeout-ms 2 --max-batch-tokens 65536 || continue
    local golden=FAILED
    if narsil_run 60 verify --addr "http://$ADDR" --golden "$dir/golden.json" --scores "$key" \
        --tolerance "$tolerance" --wait-secs 10 > "$WORK/verify-$name.log" 2>&1; then
      golden="ok ($(grep -o 'max |diff| [^)]*' "$WORK/verify-$name.log"))"
    else
      failed "[$name] golden: $(tail -2 "$WORK/verify-$name.log" | tr '\n' ' ')"
    fi
    TOLERANCE=$tolerance
    twins="not compared: $no_twins"
    [ -n "$no_twins" ] || twins="$(ranking "$name")"
    row "| $precision | ${golden//|/} | $twins | $tolerance | $GRAPHS |"
    [ "$precision" = fp32 ] || { stop_server; continue; }
    row ""
    row "| form | clients | candidates | req/s | candidates/s | p50 ms | p99 ms | errors |"
    row "|---|---|---|---|---|---|---|---|"
    for form in grouped flat; do
      c16="$WORK/load-$name-$form.json"
      if narsil_run "$((SECS + 60))" load --addr "http://$ADDR" --candidates "$candidates" --ranking-form "$form" \
          --concurrency 16 --connections 16 --duration "$SECS" --warmup 16 --timeout-ms 10000 --allow-failures \
          --json > "$c16" 2> "$WORK/load-$name-$form.log"; then
        row "$(timeout 30 python3 - "$c16" "$form" "$candidates" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"| {sys.argv[2]} | c16 | {sys.argv[3]} | {r['req_per_s']:.0f} | {r.get('candidates_per_s', 0):.0f} | "
      f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['requests'] - r['ok']} |")
EOF
)"
      else
        failed "[$name] narsil load $form: $(tail -2 "$WORK/load-$name-$form.log" | tr '\n' ' ')"
      fi
    done
    row ""
    stop_server
  done
}

phase_s() {
  sequence_section "S. a sequence model (DIN: a user history of two aligned channels)" "$SEQUENCE_MODEL" 2e-2 500
}

phase_g() {
  sequence_section "G. a generative ranker (HSTU: contexts, history and candidates through STU layers)" \
    "$HSTU_MODEL" 1e-1 100
}

# bf16 within 3e-2 of GR's FP32 scores: models/check_gr_parity.py --bf16
# measured 1.3e-2 on this checkpoint (3.3e-2 on kuairand's 8 tasks), so
# 3e-2 allows the GPU's bf16 kernels over twice that. The dry run sends 8
# candidates, not 64: a flat request of 64 rows is 64 histories, seconds
# on 2 CPU cores, and c16 of them overruns its deadlines.
phase_r() {
  sequence_section "R. a GR checkpoint (DlrmHSTU, streaming, --clamp triton: GR's GPU clamp)" "$GR_MODEL" 3e-2 \
    "$([ -n "$DRY" ] && echo 8 || echo 64)" "a flat row is a request of its own (GR's N = contexts + history + 1)"
}

# ---- phase B: load ---------------------------------------------------------

# The server's CPU seconds so far (user + system, all threads).
server_cpu() {
  awk -v hz="$(getconf CLK_TCK)" '{ print ($14 + $15) / hz }' "/proc/$(cat "$WORK/server.pid")/stat" 2>/dev/null || echo 0
}

# The server's GPU memory (MiB), from nvidia-smi's compute apps.
gpu_mib() {
  local used
  [ -n "$DRY" ] && { echo n/a; return; }
  used="$(timeout 10 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null \
    | awk -F', *' -v pid="$(cat "$WORK/server.pid")" '$1 == pid { print $2 }')"
  echo "${used:-n/a}"
}

load_point() { # mode concurrency
  local mode=$1 c=$2 json="$WORK/load-$1-c$2.json" log="$WORK/load-$1-c$2.log" before after
  local flags=(--addr "http://$ADDR" --concurrency "$c" --connections "$((c < 16 ? c : 16))"
    --samples-per-request "$LOAD_SAMPLES" --timeout-ms 5000 --warmup 0 --allow-failures "${LOAD_FLAGS[@]}")
  # Warm-up apart, so that the server's CPU is read around the measured
  # requests only.
  if ! narsil_run 60 load "${flags[@]}" --requests "$((c * 4 < 200 ? 200 : c * 4))" > /dev/null 2> "$log"; then
    failed "narsil load $mode c$c (warm-up): $(tail -2 "$log" | tr '\n' ' ')"
    return 0
  fi
  before="$(server_cpu)"
  if ! narsil_run "$((SECS + 60))" load "${flags[@]}" --duration "$SECS" --json > "$json" 2> "$log"; then
    failed "narsil load $mode c$c: $(tail -2 "$log" | tr '\n' ' ')"
    return 0
  fi
  after="$(server_cpu)"
  timeout 30 python3 - "$json" "$before" "$after" "$mode" "$c" "$(gpu_mib)" > "$WORK/point.txt" <<'EOF'
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
  local rc=$?
  row "$(tail -1 "$WORK/point.txt")"
  [ "$rc" = 0 ] || failed "narsil load $mode c$c: no request succeeded"
}

# make_default_size_model SOURCE DEST ROWS: the split model SOURCE with
# every table ROWS rows of random INT8 values (its own dim), in DEST (kept if
# there), every other file SOURCE's schema names copied but the CPU's .pt2
# packages and the Burn weights (models/model_files.py, which
# build_for_libtorch.sh carries beside this script).
make_default_size_model() {
  local src=$1 big=$2 rows=$3
  [ -f "$big/schema.json" ] && return 0
  timeout 120 python3 - "$src" "$big" "$rows" "$HERE" <<'EOF'
import ctypes, hashlib, json, os, sys
src, dst, rows, here = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
sys.path[:0] = [here, os.path.join(here, "..", "models")]
import torch  # not numpy: PyTorch's wheel does not bring it
from model_files import copy_named_files, drop_packages, read_schema
os.makedirs(os.path.join(dst, "tables"), exist_ok=True)
schema = read_schema(src)
drop_packages(schema)
schema.pop("dense_weights", None)
for table in schema["tables"]:
    table.pop("layout", None)
copy_named_files(src, dst, schema, skip=[table["file"] for table in schema["tables"]])
generator = torch.Generator().manual_seed(0)
for table in schema["tables"]:
    dim = table["dim"]
    assert table["storage"] == "int8_rowwise" and table["row_bytes"] >= 4 + dim, table
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
json.dump(schema, open(os.path.join(dst, "schema.json"), "w"), indent=1)
print(f"default-size model: {len(schema['tables'])} x {rows} x {dim} INT8 in {dst}")
EOF
}

phase_b() {
  local big="$WORK/default-size" c
  local head="| mode | clients | req/s | p50 ms | p99 ms | mean fused rows | server CPU µs/req | busy cores | GPU MiB | errors |"
  local line="|---|---|---|---|---|---|---|---|---|---|"
  local device_lane=()
  [ -n "$DRY" ] && device_lane=(NARSIL_CUDA_GRAPH_BUCKETS=128,256,512,1024)
  if ! make_default_size_model "$MODEL" "$big" "$ROWS" > "$WORK/generate.log" 2>&1; then
    failed "cannot generate the default-size tables: $(tail -3 "$WORK/generate.log" | tr '\n' ' ')"
    return 0
  fi
  row ""
  row "## B. narsil load on $DEVICE: 26 x $ROWS x 64 INT8 tables in GPU memory, FP32, 100 samples a request, $SECS s a point"
  if start_server batch NARSIL_DEVICE_TABLE_BYTES=17179869184 "${device_lane[@]}" -- --backend torch \
    --model "$big" --device "$DEVICE" --execution-mode batch --lanes 2 --max-batch-requests 64 --stage-ahead on; then
    row "batch mode, 2 lanes, stage ahead: $GRAPHS"
    row "$head"
    row "$line"
    for c in 1 16 64 256; do load_point batch "$c"; done
  fi
  if start_server worker NARSIL_DEVICE_TABLE_BYTES=17179869184 "${device_lane[@]}" -- --backend torch \
    --model "$big" --device "$DEVICE" --execution-mode worker --lanes 16; then
    row "worker mode, 16 lanes: $GRAPHS"
    row "$head"
    row "$line"
    for c in 1 16 64 256; do load_point worker "$c"; done
  fi
  stop_server
  row ""
  row "## zero-cost mock (--backend mock --mock-latency-ms 0), batch mode, 4 lanes, c256 (CUDA graphs: none, the mock runs no model)"
  row "$head"
  row "$line"
  if start_server mock -- --backend mock --mock-latency-ms 0 --execution-mode batch --lanes 4 --max-batch-requests 64; then
    load_point mock 256
  fi
  stop_server
}

# ---- phase V: DLRM-v2's shape --------------------------------------------

# make_dlrm_v2_source DEST: a split model's schema.json and dense.pt at
# MLPerf DLRM-v2's shape (TorchRec DLRM_DCN's layers, the cross layers as
# linear layers), synthetic weights, written with PyTorch alone (the device
# has no TorchRec); its tables are make_default_size_model's to write.
make_dlrm_v2_source() {
  local dest=$1
  [ -f "$dest/schema.json" ] && return 0
  mkdir -p "$dest"
  # From a file, not stdin: torch.jit.script reads the module's source.
  cat > "$dest/make_dense.py" <<'EOF'
import json, os, sys
import torch
from torch import nn
dest = sys.argv[1]
torch.manual_seed(0)
features, dim, rank = 26, 128, 512
width = (features + 1) * dim


def mlp(sizes):
    layers = []
    for i, o in zip(sizes, sizes[1:]):
        layers += [nn.Linear(i, o), nn.ReLU()]
    return layers


class DlrmV2Dense(nn.Module):
    """forward(dense f32[B, 13], pooled f32[B, 26 * 128]) -> f32[B], in
    the dtype of its weights (Narsil casts them for bf16)."""

    def __init__(self):
        super().__init__()
        self.dense_arch = nn.Sequential(*mlp([13, 512, 256, dim]))
        self.v0, self.v1, self.v2 = (nn.Linear(width, rank, bias=False) for _ in range(3))
        self.w0, self.w1, self.w2 = (nn.Linear(rank, width) for _ in range(3))
        for w in (self.w0, self.w1, self.w2):
            w.weight.data.mul_(0.1)
        self.over_arch = nn.Sequential(*mlp([width, 1024, 1024, 512, 256]), nn.Linear(256, 1))
        self.last = self.over_arch[-1]

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        dtype = self.last.weight.dtype
        x0 = torch.cat([self.dense_arch(dense.to(dtype)), pooled.to(dtype)], dim=1)
        x = x0 * self.w0(self.v0(x0)) + x0
        x = x0 * self.w1(self.v1(x)) + x
        x = x0 * self.w2(self.v2(x)) + x
        return torch.sigmoid(self.over_arch(x).float()).reshape(-1)


network = DlrmV2Dense().eval()
flops = sum(2 * m.in_features * m.out_features for m in network.modules() if isinstance(m, nn.Linear))
torch.jit.script(network).save(os.path.join(dest, "dense.pt"))
schema = {
    "format": "narsil-split-1", "name": "dlrm-v2-shape", "version": "1", "num_dense": 13,
    "tables": [{"name": f"t_cat_{i}", "rows": 1, "dim": dim, "storage": "int8_rowwise",
                "row_bytes": (4 + dim + 15) // 16 * 16, "file": f"tables/t_cat_{i}.bin"} for i in range(features)],
    "features": [{"name": f"cat_{i}", "table": f"t_cat_{i}", "pooling": "sum", "weighted": False}
                 for i in range(features)],
    "outputs": ["default"], "dense_network": "dense.pt", "dense_flops_per_sample": flops,
}
json.dump(schema, open(os.path.join(dest, "schema.json"), "w"), indent=1)
print(f"DLRM-v2 shape: {flops / 1e6:.2f} MFLOP a pair, dense.pt in {dest}")
EOF
  timeout 120 python3 "$dest/make_dense.py" "$dest"
}

# Requests of 270 pairs (MLPerf's mean query), 8 ids a bag (214 a pair in
# MLPerf), first ids Zipf 1.05; FP32 and bf16, tables in GPU memory.
phase_v() {
  local source="$WORK/dlrm-v2-source" model="$WORK/dlrm-v2" precision c
  local head="| precision | clients | queries/s | p50 ms | p99 ms | mean fused pairs | server CPU µs/query | busy cores | GPU MiB | errors |"
  if ! { make_dlrm_v2_source "$source" && make_default_size_model "$source" "$model" "$V2_ROWS"; } \
      > "$WORK/generate-v2.log" 2>&1; then
    failed "cannot make the DLRM-v2-shaped model: $(tail -3 "$WORK/generate-v2.log" | tr '\n' ' ')"
    return 0
  fi
  LOAD_SAMPLES=270
  LOAD_FLAGS=(--ids-per-feature 8 --id-distribution zipf:1.05)
  # The dry run checks the steps, not the speed: a tenth of a query on the CPU.
  [ -n "$DRY" ] && LOAD_SAMPLES=27
  row ""
  row "## V. DLRM-v2's shape on $DEVICE ($(grep -o '[0-9.]* MFLOP a pair' "$WORK/generate-v2.log")): 26 x $V2_ROWS x 128 INT8 tables in GPU memory, $LOAD_SAMPLES pairs a query (8 Zipf 1.05 ids a bag), $SECS s a point; MLPerf's anchor: ~74-80k queries/s per H200 (TensorRT, all INT8, inputs on the device)"
  for precision in fp32 bf16; do
    if [ "$precision" = bf16 ] && [ -n "$DRY" ] && ! grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
      row "bf16: skipped: this CPU has no bf16 instructions (dry run)"
      continue
    fi
    start_server "v2-$precision" NARSIL_DEVICE_TABLE_BYTES=17179869184 -- --backend torch --model "$model" \
      --device "$DEVICE" --dense-precision "$precision" --execution-mode batch --lanes 2 \
      --max-batch-requests 64 --stage-ahead on || continue
    row "$precision, batch mode, 2 lanes, stage ahead: $GRAPHS"
    row "$head"
    row "|---|---|---|---|---|---|---|---|---|---|"
    for c in 1 16 64; do load_point "$precision" "$c"; done
  done
  stop_server
}

# ---- entry points ----------------------------------------------------------

case "${1:-}" in
  --exec-narsil) # internal: narsil, with the machine's CUDA libraries
    shift
    [ -n "$DRY" ] && exec "$BIN" "$@"
    exec env LD_LIBRARY_PATH="$TL${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" LD_PRELOAD="$TL/libtorch_cuda.so" "$BIN" "$@" ;;
  --default-size-model) # internal: make_default_size_model SOURCE DEST ROWS alone (tests/model_writers_e2e.rs)
    shift
    make_default_size_model "$@"
    exit ;;
  --phase) # internal: one phase, under the caller's time limit
    trap stop_server EXIT
    case "$2" in A) phase_a ;; B) phase_b ;; S) phase_s ;; G) phase_g ;; R) phase_r ;; V) phase_v ;; esac
    exit 0 ;;
esac

RESULTS="${OUT:-$HERE/gpu_check_out}"
export WORK="${NARSIL_GPU_CHECK_DIR:-$(mktemp -d /tmp/narsil-gpu-check.XXXXXX)}"
mkdir -p "$WORK" "$RESULTS"
export TABLE="$WORK/table.txt"
: > "$TABLE"
: > "$WORK/commands.txt"
: > "$WORK/failures.txt"
rm -f "$WORK/failed" "$WORK/server.pid"
started=$SECONDS

# At exit, whatever happened: the server stopped, and the few small files
# that matter copied to $RESULTS (each at most 1 MiB).
collect() {
  stop_server
  {
    for log in "$WORK"/server-*.log; do
      [ -f "$log" ] || continue
      echo "=== $(basename "$log") ($(wc -l < "$log") lines): first 40 and last 40 lines"
      head -40 "$log"
      echo "..."
      tail -40 "$log"
      echo
    done
  } > "$WORK/servers.txt"
  for f in table.txt servers.txt failures.txt commands.txt; do
    head -c 1048576 "$WORK/$f" > "$RESULTS/$f" 2>/dev/null || true
  done
  echo "gpu_check: results in $RESULTS (table.txt, servers.txt, failures.txt, commands.txt); work files in $WORK"
}
trap collect EXIT

preflight() {
  [ -x "$BIN" ] || { failed "no narsil binary at $BIN (set NARSIL_BIN)"; return 1; }
  [ -f "$MODEL/schema.json" ] || { failed "no split test model at $MODEL"; return 1; }
  [ -f "$GOLDEN" ] || { failed "no golden.json (the test model's, with scores_int8) at $GOLDEN"; return 1; }
  command -v python3 > /dev/null || { failed "no python3"; return 1; }
  TL="$(timeout 60 python3 -c 'import torch,os;print(os.path.dirname(torch.__file__)+"/lib")')" \
    || { failed "python3 cannot import torch"; return 1; }
  export TL
  if [ -z "$DRY" ]; then
    command -v nvidia-smi > /dev/null || { failed "no nvidia-smi: not a GPU machine?"; return 1; }
    timeout 60 python3 -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
      || { failed "PyTorch sees no CUDA device"; return 1; }
    if [ -f "$HERE/libnarsil_cuda_shim.so" ]; then
      export NARSIL_CUDA_SHIM="$HERE/libnarsil_cuda_shim.so"
    else
      row "WARNING: no libnarsil_cuda_shim.so beside narsil: no CUDA graphs, one stream (rebuild with scripts/build_for_libtorch.sh)"
    fi
  else
    # The dry run serves split models through the device lane on the CPU.
    export NARSIL_DEVICE_PATH_ON_CPU=1
  fi
  narsil_run 60 --version > /dev/null 2>&1 || narsil_run 60 --help > "$WORK/help.log" 2>&1 \
    || { failed "$BIN does not start: $(tail -3 "$WORK/help.log" | tr '\n' ' ')"; return 1; }
}

if preflight; then
  GPU="$( ([ -n "$DRY" ] && echo "DRY RUN on the CPU ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)): no GPU") \
    || timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
  row "# Narsil GPU check: $(date -u +%FT%TZ), $GPU, $(nproc) host cores, torch $(timeout 60 python3 -c 'import torch;print(torch.__version__)'), $(cat "$HERE/BUILD" 2>/dev/null || echo 'build unknown'), carried $([ -n "$DRY" ] && echo n/a || echo "$(( ($(du -sb "$HERE" | cut -f1) + 1048575) / 1048576 )) MiB")"
  row "CUDA shim: ${NARSIL_CUDA_SHIM:-none}"
  for phase in $PHASES; do
    case "$phase" in A) limit=$LIMIT_A ;; S) limit=$LIMIT_S ;; G) limit=$LIMIT_G ;; R) limit=$LIMIT_R ;; V) limit=$LIMIT_V ;;
      *) limit=$LIMIT_B ;; esac
    phase_started=$SECONDS
    timeout -k 10 "$limit" bash "$SELF" --phase "$phase"
    rc=$?
    stop_server
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
      failed "phase $phase stopped at its limit of $limit s"
    fi
    row ""
    row "phase $phase: $((SECONDS - phase_started)) s (limit $limit s)"
  done
fi
row ""
if [ -f "$WORK/failed" ]; then
  row "gpu_check: FAILED after $((SECONDS - started)) s (see failures.txt)"
  exit 1
fi
row "gpu_check: passed in $((SECONDS - started)) s"
