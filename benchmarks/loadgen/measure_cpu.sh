#!/usr/bin/env bash
# The harness's CPU measurements in one go, server and client on cores of
# their own: Narsil pinned to core 0 with one lane and one forward thread,
# LoadGen (benchmarks/loadgen/run.py) pinned to core 1.
#
#   benchmarks/loadgen/measure_cpu.sh MODEL_DIR OUT [PRECISION...]
#
# MODEL_DIR: an export of `models/export_torchrec.py --shape mlperf-dlrm-v2
# --split` (its split/ form is served; loadgen_golden.npz checks accuracy).
# PRECISION: fp32, bf16, int8 (default: fp32 and bf16; int8 needs the export's
# --int8 package, dense_int8.pt2). For each: the accuracy pass, an
# Offline run and the Server bisection; first the client's own ceiling
# against the mock backend answering at once. Every run's LoadGen logs and
# results.json land under OUT/<step>/. Run lengths: LOADGEN_DURATION_S
# (default 60) for Offline and the confirming Server run, LOADGEN_STEP_S
# (default 30) for each bisection step. Needs a release build
# (NARSIL_BIN, default target/release/narsil, --features torch) and the
# harness's venv (benchmarks/loadgen/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL_DIR=${1:?usage: measure_cpu.sh MODEL_DIR OUT [PRECISION...]}
OUT=${2:?usage: measure_cpu.sh MODEL_DIR OUT [PRECISION...]}
shift 2
[ $# -gt 0 ] && PRECISIONS=("$@") || PRECISIONS=(fp32 bf16)
BIN=${NARSIL_BIN:-target/release/narsil}
PY=benchmarks/loadgen/.venv/bin/python
DURATION=${LOADGEN_DURATION_S:-60}
STEP=${LOADGEN_STEP_S:-30}
MAX_ROWS=$(python3 -c "import json; print(json.load(open('$MODEL_DIR/manifest.json')).get('max_rows', 0))")
PORT=${LOADGEN_PORT:-50071}
ADDR=127.0.0.1:$PORT
mkdir -p "$OUT"
[ -x "$BIN" ] || { echo "$BIN not found: cargo build --release --features torch" >&2; exit 1; }
[ -x "$PY" ] || { echo "$PY not found: benchmarks/loadgen/setup.sh" >&2; exit 1; }

SERVER=""
stop_server() { [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null && wait "$SERVER" 2>/dev/null; SERVER=""; }
trap stop_server EXIT

serve() {  # serve NAME FLAGS...: starts Narsil on core 0 and waits until it answers
  local name=$1; shift
  taskset -c 0 "$BIN" serve --addr "$ADDR" --lanes 1 --intra-op-threads 1 --max-forward-threads 1 \
    --log-level warn "$@" >"$OUT/$name.server.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 600); do
    if "$BIN" load --addr "http://$ADDR" --requests 1 --warmup 0 --samples-per-request 1 --json 2>/dev/null |
        grep -q '"OK"'; then return 0; fi
    kill -0 "$SERVER" 2>/dev/null || { cat "$OUT/$name.server.log" >&2; exit 1; }
    sleep 0.5
  done
  echo "$name never answered" >&2; exit 1
}

harness() {  # harness STEP FLAGS...: run.py on core 1
  local step=$1; shift
  echo "== $step ($(uptime | sed 's/.*load average/load average/'))"
  taskset -c 1 "$PY" benchmarks/loadgen/run.py --addr "$ADDR" --max-rows "$MAX_ROWS" --out "$OUT/$step" "$@"
}

# The client's ceiling: the mock answers at once (no forward, scores made up). LOADGEN_SKIP_MOCK=1 skips it.
if [ -z "${LOADGEN_SKIP_MOCK:-}" ]; then
serve mock --backend mock --mock-latency-ms 0 --mock-table-rows "${MAX_ROWS:-1000000}"
harness mock-offline --scenario Offline --target-qps 200 --duration-s "$DURATION" --max-inflight 16 \
  --note "client ceiling: mock backend, 0 ms"
harness mock-server --scenario Server --find-peak --qps-low 100 --qps-high 400 --precision 0.1 --max-steps 3 \
  --duration-s "$STEP" --confirm-s "$DURATION" --note "client ceiling: mock backend, 0 ms"
stop_server
fi

for precision in "${PRECISIONS[@]}"; do
  bound=1e-5; [ "$precision" = fp32 ] || bound=2e-2
  serve "$precision" --backend torch --model "$MODEL_DIR/split" --dense-precision "$precision"
  harness "$precision-accuracy" --mode accuracy --golden "$MODEL_DIR/loadgen_golden.npz" --score-bound "$bound" \
    --note "split, $precision dense"
  # A first guess: a run that ends early is rerun at its rate.
  case $precision in fp32) offline_qps=4 ;; bf16) offline_qps=8 ;; *) offline_qps=30 ;; esac
  harness "$precision-offline" --scenario Offline --target-qps "$offline_qps" --duration-s "$DURATION" \
    --note "split, $precision dense"
  # LoadGen's early stopping accepts a Server p99 only from 459 queries with none over the bound:
  # LOADGEN_MIN_QUERIES (default 480) a step; at a few queries/s that takes minutes, and fewer make
  # every run INVALID whatever its latency.
  harness "$precision-server" --scenario Server --find-peak --qps-low "${LOADGEN_QPS_LOW:-2}" \
    --qps-high "${LOADGEN_QPS_HIGH:-8}" --duration-s "$STEP" --confirm-s "$DURATION" \
    --min-queries "${LOADGEN_MIN_QUERIES:-480}" --note "split, $precision dense"
  stop_server
done
echo "results under $OUT"
