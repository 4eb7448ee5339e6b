#!/usr/bin/env bash
# Creates (or reuses) the LoadGen harness's own venv, benchmarks/loadgen/.venv
# (NARSIL_LOADGEN_VENV to put it elsewhere): MLPerf's LoadGen
# (mlcommons-loadgen, from PyPI), grpcio and grpcio-tools for Narsil's proto,
# numpy. It is the benchmark's alone: the project venv, the build and the
# test suite neither need nor touch it. Idempotent: a venv that has the
# pinned versions is left alone (delete it to start over).
set -euo pipefail
cd "$(dirname "$0")"

LOADGEN_VERSION=6.0.17
GRPC_VERSION=1.76.0
VENV="${NARSIL_LOADGEN_VENV:-.venv}"
STAMP="$VENV/.narsil-loadgen-${LOADGEN_VERSION}-grpc-${GRPC_VERSION}-v1"

if [ -f "$STAMP" ]; then
  echo "loadgen venv ready ($VENV)"
  exit 0
fi
PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null 2>&1 || { echo "python3 not found" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating the loadgen venv at $VENV"
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip --disable-pip-version-check install --progress-bar off \
  "mlcommons-loadgen==$LOADGEN_VERSION" "grpcio==$GRPC_VERSION" "grpcio-tools==$GRPC_VERSION" \
  "protobuf>=6.31,<7" numpy
"$VENV/bin/python" -c "import mlperf_loadgen, grpc, numpy; print('mlperf_loadgen', mlperf_loadgen.__file__)"
touch "$STAMP"
echo "loadgen venv ready ($VENV)"
