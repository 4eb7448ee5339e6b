#!/usr/bin/env bash
# DLRMv3 under LoadGen on the CPU: the same DLRMv3-shaped queries
# (models/dlrmv3_traffic.py, `run.py --model-key dlrm-v3`: Server p99 <= 80 ms)
# drive, in turn, Narsil serving a GR import and GR's own eager forward
# (benchmarks/baselines/gr_eager_server.py), each pinned to core 0, LoadGen
# pinned to core 1. First the client's ceiling: the GR server answering every
# request as soon as it is read (--no-forward).
#
#   GR_CHECKOUT=... benchmarks/loadgen/measure_dlrmv3.sh IMPORT_DIR OUT
#
# A rerun into the same OUT skips the bisections already measured there.
#
# IMPORT_DIR: models/import_gr.py's import, with --golden, of the checkpoint
# models/gr/make_gr_golden.py wrote for GR_SET (default dlrmv3-cpu) at
# GR_CHECKPOINT (default models/generated/gr/$GR_SET/checkpoint); see
# models/gr/README.md. Each server is first checked against GR's golden
# scores (`narsil verify`, 1e-5). Then each gets the Server bisection
# (LOADGEN_STEP_S per step, default 30; the peak confirmed for
# LOADGEN_DURATION_S, default 60; LOADGEN_MIN_QUERIES per run, default 480:
# with none over the bound, LoadGen's early stopping accepts a p99 from 459
# queries on; LOADGEN_MAX_STEPS bisection steps, default 4).
# Bisection ranges: NARSIL_QPS, GR_QPS, CEILING_QPS ("LOW HIGH"). Shape:
# DLRMV3_HISTORY (default 256-1024), DLRMV3_CANDIDATES (default 64-256).
# Needs a release build (NARSIL_BIN, default target/release/narsil), the
# harness's venv (benchmarks/loadgen/setup.sh) and GR's dependencies in the
# project venv (models/gr/README.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
IMPORT=${1:?usage: measure_dlrmv3.sh IMPORT_DIR OUT}
OUT=${2:?usage: measure_dlrmv3.sh IMPORT_DIR OUT}
: "${GR_CHECKOUT:?set GR_CHECKOUT to a generative-recommenders checkout (models/gr/README.md)}"
SET=${GR_SET:-dlrmv3-cpu}
CHECKPOINT=${GR_CHECKPOINT:-models/generated/gr/$SET/checkpoint}
BIN=${NARSIL_BIN:-target/release/narsil}
PY=benchmarks/loadgen/.venv/bin/python
STEP=${LOADGEN_STEP_S:-30}
DURATION=${LOADGEN_DURATION_S:-60}
MIN_QUERIES=${LOADGEN_MIN_QUERIES:-480}
MAX_STEPS=${LOADGEN_MAX_STEPS:-4}
read -r -a NARSIL_RANGE <<<"${NARSIL_QPS:-4 16}"
read -r -a GR_RANGE <<<"${GR_QPS:-1 4}"
read -r -a CEILING_RANGE <<<"${CEILING_QPS:-20 80}"
ADDR=127.0.0.1:${LOADGEN_PORT:-50072}
mkdir -p "$OUT"
[ -x "$BIN" ] || { echo "$BIN not found: cargo build --release --features torch" >&2; exit 1; }
[ -x "$PY" ] || { echo "$PY not found: benchmarks/loadgen/setup.sh" >&2; exit 1; }
[ -f "$IMPORT/golden.json" ] || { echo "$IMPORT/golden.json not found: import with --golden" >&2; exit 1; }

TASK=$(python3 -c 'import json,sys; print(next(iter(json.load(open(sys.argv[1]))["requests"][0]["outputs"])))' \
  "$IMPORT/golden.json")
SERVER=""
stop_server() {  # a server killed by the signal exits 143: not a failure here
  if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true; fi
  SERVER=""
}
trap stop_server EXIT

serve() {  # serve NAME BOUND COMMAND...: starts COMMAND on core 0, waits until it gives GR's golden scores within BOUND
  local name=$1 bound=$2; shift 2
  taskset -c 0 "$@" >"$OUT/$name.server.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 60); do
    kill -0 "$SERVER" 2>/dev/null || { cat "$OUT/$name.server.log" >&2; echo "$name exited" >&2; exit 1; }
    if "$BIN" verify --addr "http://$ADDR" --golden "$IMPORT/golden.json" --scores "$TASK" \
        --tolerance "$bound" --wait-secs 5 >"$OUT/$name.verify.log" 2>&1; then
      echo "== $name: $(tail -1 "$OUT/$name.verify.log")"
      return 0
    fi
  done
  cat "$OUT/$name.verify.log" "$OUT/$name.server.log" >&2
  exit 1
}

GR_SERVER=(.venv/bin/python benchmarks/baselines/gr_eager_server.py --set "$SET" --checkpoint "$CHECKPOINT"
  --model-info "$OUT/model_info.bin" --addr "$ADDR" --intra-op-threads 1)

peak() {  # peak STEP LOW HIGH NOTE: the Server bisection on core 1 (skipped where OUT/STEP has its results)
  if [ -f "$OUT/$1/results.json" ]; then echo "== $1: measured before ($OUT/$1/results.json)"; return 0; fi
  echo "== $1 ($(uptime | sed 's/.*load average/load average/'))"
  taskset -c 1 "$PY" benchmarks/loadgen/run.py --addr "$ADDR" --model-key dlrm-v3 --out "$OUT/$1" \
    --history "${DLRMV3_HISTORY:-256-1024}" --candidates "${DLRMV3_CANDIDATES:-64-256}" \
    --scenario Server --find-peak --qps-low "$2" --qps-high "$3" --precision 0.1 --max-steps "$MAX_STEPS" \
    --duration-s "$STEP" --confirm-s "$DURATION" --min-queries "$MIN_QUERIES" --note "$4"
}

# Narsil first: the GR server answers ModelInfo with what Narsil answers for the import.
serve narsil 1e-5 "$BIN" serve --backend torch --model "$IMPORT" --addr "$ADDR" --lanes 1 --intra-op-threads 1 \
  --max-forward-threads 1 --log-level warn
"$PY" - "$ADDR" "$OUT/model_info.bin" <<'EOF'
import sys
import grpc
with grpc.insecure_channel(sys.argv[1]) as channel:
    info = channel.unary_unary("/narsil.v1.Predictor/ModelInfo")(b"", timeout=30)
open(sys.argv[2], "wb").write(info)
EOF
peak narsil "${NARSIL_RANGE[@]}" "Narsil, GR import, FP32, 1 lane, 1 forward thread, core 0"
stop_server

serve ceiling 1 "${GR_SERVER[@]}" --no-forward  # any scores: it answers zeros
peak ceiling "${CEILING_RANGE[@]}" "client ceiling: Python gRPC server answering at once, core 0"
stop_server

serve gr-eager 1e-5 "${GR_SERVER[@]}"
peak gr-eager "${GR_RANGE[@]}" "GR eager forward (PyTorch kernels), 1 thread, one request at a time, core 0"
stop_server

"$PY" - "$OUT" <<'EOF'
import json, os, sys
peaks = {}
for step in ("ceiling", "narsil", "gr-eager"):
    with open(os.path.join(sys.argv[1], step, "results.json")) as f:
        peaks[step] = json.load(f)["peak"]
    # The run that gave the peak: the confirming one, else the VALID one at that rate.
    at_peak = [r for r in peaks[step]["runs"] if r["result"] == "VALID" and r["target_qps"] == peaks[step]["peak_qps"]]
    best = peaks[step].get("confirmed") if (peaks[step].get("confirmed") or {}).get("result") == "VALID" \
        else (at_peak[-1] if at_peak else None)
    extra = f", p99 {best['p99_ms']:.1f} ms, {best['mean_pairs_per_query']:.0f} candidates/query" if best else ""
    print(f"{step}: highest VALID Server rate {peaks[step]['peak_qps']} queries/s{extra}")
if peaks["narsil"]["peak_qps"] and peaks["gr-eager"]["peak_qps"]:
    print(f"Narsil / GR eager: {peaks['narsil']['peak_qps'] / peaks['gr-eager']['peak_qps']:.2f}x")
EOF
