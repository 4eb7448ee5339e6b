# Helpers shared by scripts/build_images.sh and scripts/check_images.sh
# (sourced after scripts/lib.sh, not run).
#
# Images: `small` is narsil (pure Rust, Burn), `torch` is narsil-torch
# (libtorch + FBGEMM). Each is checked on a small repository made from the
# test model (models/generated/test-small), two models in it, each with the
# golden scores its backend must serve.

IMAGE_BIN=/usr/local/bin/narsil
IMAGE_SITE=/opt/narsil/site-packages

image_name() {
  case "$1" in
    small) echo narsil ;;
    torch) echo narsil-torch ;;
    *) die "unknown image '$1' (small, torch or all)" ;;
  esac
}

# The tag every image gets: the crate version and the commit it was built
# from (`-dirty` when the work tree has changes).
image_tag() {
  local version commit
  version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
  commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
  git diff --quiet HEAD 2>/dev/null || commit="$commit-dirty"
  echo "$version-$commit"
}

require_podman() {
  bash scripts/setup_system.sh podman
}

# check_repository KIND DIR: writes the check's model repository to
# DIR/models and its golden files to DIR/golden/<model>/golden.json, and
# prints one "MODEL SCORES" line per model to verify.
check_repository() {
  local kind="$1" dir="$2" model=models/generated/test-small
  [ -f "$model/golden.json" ] || die "no test model in $model (scripts/test.sh exports it)"
  rm -rf "$dir/models" "$dir/golden"
  mkdir -p "$dir/models/dlrm/1" "$dir/models/dlrm-split" "$dir/golden/dlrm" "$dir/golden/dlrm-split"
  if [ "$kind" = small ]; then
    cp "$model/weights_fp32.safetensors" "$dir/models/dlrm/1/model.safetensors"
    echo "dlrm fp32"
  else
    cp "$model/model_default.pt" "$dir/models/dlrm/1/model.pt"
    echo "dlrm int8"
  fi
  cp -r "$model/split" "$dir/models/dlrm-split/1"
  # The split model's scores equal the INT8 single-file model's bit for bit.
  cp "$model/golden.json" "$dir/golden/dlrm/golden.json"
  cp "$model/golden.json" "$dir/golden/dlrm-split/golden.json"
  echo "dlrm-split int8"
  chmod -R a+rX "$dir/models" "$dir/golden"
}

# serve_and_verify CHECKS MAPS_OUT SERVER_CMD... : starts SERVER_CMD (a
# `narsil serve`, given --addr and --metrics-addr on free ports), verifies
# each "MODEL SCORES" line of the file CHECKS with VERIFY_CMD (an array set
# by the caller, given --golden paths under GOLDEN_DIR), copies the server's
# /proc/PID/maps to MAPS_OUT (unless it is -), then stops it with SIGTERM
# and fails unless it exits 0 within 30 s.
serve_and_verify() {
  local checks="$1" maps_out="$2"
  shift 2
  local port metrics_port pid verifier model scores status=0
  port=$(free_port)
  metrics_port=$(free_port)
  "$@" --addr "127.0.0.1:$port" --metrics-addr "127.0.0.1:$metrics_port" >"$LOG_FILE" 2>&1 &
  pid=$!
  while read -r model scores; do
    "${VERIFY_CMD[@]}" --addr "http://127.0.0.1:$port" --model "$model" --scores "$scores" \
      --golden "$GOLDEN_DIR/$model/golden.json" --wait-secs 120 &
    verifier=$!
    # The check must end before the server does.
    while kill -0 "$verifier" 2>/dev/null && kill -0 "$pid" 2>/dev/null; do
      sleep 0.1
    done
    if ! kill -0 "$pid" 2>/dev/null; then
      kill "$verifier" 2>/dev/null || true
      wait "$verifier" 2>/dev/null || true
      printf 'error: the server exited while being checked\n' >&2
      status=1
    elif ! wait "$verifier"; then
      status=1
    fi
    [ "$status" = 0 ] || break
  done <"$checks"
  if ! kill -0 "$pid" 2>/dev/null; then
    wait "$pid" || true
    printf -- '--- server log (%s) ---\n' "$LOG_FILE" >&2
    tail -40 "$LOG_FILE" >&2
    return 1
  fi
  [ "$maps_out" = - ] || cp "/proc/$pid/maps" "$maps_out" || status=1
  kill -TERM "$pid" 2>/dev/null || true
  local waited=0
  while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt 300 ]; do
    sleep 0.1
    waited=$((waited + 1))
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL "$pid"
    printf 'error: the server did not stop within 30 s of SIGTERM\n' >&2
    status=1
  elif ! wait "$pid"; then
    printf 'error: the server exited with a failure after SIGTERM\n' >&2
    status=1
  fi
  if [ "$status" != 0 ]; then
    printf -- '--- server log (%s) ---\n' "$LOG_FILE" >&2
    tail -40 "$LOG_FILE" >&2
  fi
  return "$status"
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
