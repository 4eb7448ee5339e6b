# Shared helpers for Narsil's scripts (sourced, not run).

: "${NARSIL_BUILD_JOBS:=2}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

step() { printf '\n==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# apt_install PACKAGE...: installs Debian packages (sudo when not root),
# refreshing the package lists only if the first try fails.
apt_install() {
  command -v apt-get >/dev/null 2>&1 || die "no apt-get: install $* yourself"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  step "installing $* (apt-get)"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null \
    || { $sudo apt-get update -q >/dev/null && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null; } \
    || die "could not install $* (apt-get install $*)"
}

# Puts rustup's cargo on PATH if it is installed but not on PATH yet.
require_rust() {
  if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  fi
  command -v cargo >/dev/null 2>&1 || die "cargo not found: install Rust with https://rustup.rs"
}

# Builds against the project venv's libtorch (see scripts/setup_python.sh):
# torch-sys asks the `python` on PATH where torch lives.
use_project_torch() {
  bash scripts/setup_python.sh
  export PATH="$PWD/.venv/bin:$PATH"
  export LIBTORCH_USE_PYTORCH=1
}

# Exports a DLRM into models/generated/$1 unless an export of the current
# format (EXPORT_FORMAT in models/export_dlrm.py) is there already.
# Extra arguments go to models/export_dlrm.py.
export_model() {
  export_with models/export_dlrm.py "$@"
}

# export_torchrec_model NAME [ARGS]: a TorchRec-signature model
# (models/export_torchrec.py) into models/generated/NAME.
export_torchrec_model() {
  export_with models/export_torchrec.py "$@"
}

# Imports GR's test checkpoint models/testdata/gr/SET (written by GR's own code) with
# models/import_gr.py into models/generated/gr-SET-CLAMP (with narsil verify's golden.json of GR's
# golden scores), and checks it against them (models/check_gr_parity.py), unless an import of the
# current IMPORT_FORMAT is there (with its dense.pt2 where `--pt2` is among the further flags, which
# go to the importer).
import_gr_model() {
  local set="$1" clamp="$2"
  shift 2
  local data="models/testdata/gr/$set" out="models/generated/gr-$set-$clamp" format
  if [ ! -d "$data" ]; then
    echo "skipped: importing $out: no $data"
    return
  fi
  format=$(sed -n 's/^IMPORT_FORMAT = //p' models/import_gr.py)
  if ! grep -q "\"import_format\": $format," "$out/import.json" 2>/dev/null \
      || { [[ " $* " == *" --pt2 "* ]] && [ ! -f "$out/dense.pt2" ]; }; then
    step "importing $data into $out (clamp $clamp $*) and checking it against GR's golden scores"
    .venv/bin/python models/import_gr.py "$data/checkpoint" "$data/hparams.json" "$out" --clamp "$clamp" \
      --golden "$data/golden.json" --force "$@"
    .venv/bin/python models/check_gr_parity.py "$out" "$data/golden.json"
  fi
}

export_with() {
  local script="$1" name="$2"
  shift 2
  local format
  format=$(sed -n 's/^EXPORT_FORMAT = //p' "$script")
  if ! grep -q "\"export_format\": $format," "models/generated/$name/manifest.json" 2>/dev/null; then
    step "exporting models/generated/$name with $script"
    .venv/bin/python "$script" --out "models/generated/$name" --force "$@"
  fi
}
