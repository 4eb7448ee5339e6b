#!/usr/bin/env bash
# Builds Narsil's container images with podman (installed from Debian when
# missing), each FROM scratch:
#   narsil        the pure-Rust build (Burn backend): the stripped binary and
#                 the glibc libraries it maps;
#   narsil-torch  the libtorch/FBGEMM build against the project venv: the
#                 stripped binary and only the libraries a serving process maps.
# Which libraries: the binary serves the check repository (image_lib.sh) on
# this machine and answers its golden requests; every file its
# /proc/PID/maps then names (linked, and dlopened: FBGEMM's operators and
# what libtorch.so pulls in) goes into the image, nothing else.
#
# Usage: scripts/build_images.sh [small|torch|all]   (default: all)
# Tags: NAME:VERSION-COMMIT (written to target/images/NAME/TAG), NAME:VERSION
# (the one deploy/'s manifests name) and NAME:latest; the image of the
# previous build's VERSION-COMMIT tag is removed. Files staged under
# target/images/NAME/.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
source scripts/image_lib.sh

case "${1:-all}" in
  all) kinds=(small torch) ;;
  small | torch) kinds=("$1") ;;
  *) die "usage: scripts/build_images.sh [small|torch|all]" ;;
esac

require_rust
require_podman

build_image() {
  local kind="$1" name work features=()
  name=$(image_name "$kind")
  work="target/images/$name"
  if [ "$kind" = torch ]; then
    use_project_torch
    features=(--features torch)
  fi
  export_model test-small --num-rows 1000 --split --split-fp32

  step "building the $name binary (cargo --profile image ${features[*]})"
  cargo build --profile image --bin narsil -j "$NARSIL_BUILD_JOBS" --locked "${features[@]}"
  local previous=""
  previous=$(cat "$work/TAG" 2>/dev/null) || true
  rm -rf "$work"
  mkdir -p "$work/context/rootfs"
  # Both images build to target/image/narsil: keep this one's copy.
  cp target/image/narsil "$work/narsil"

  step "serving the check repository with it, to list the libraries it maps"
  check_repository "$kind" "$work/check" >"$work/checks"
  VERIFY_CMD=("$work/narsil" verify)
  GOLDEN_DIR="$work/check/golden"
  LOG_FILE="$work/serve.log"
  serve_and_verify "$work/checks" "$work/maps" "$work/narsil" serve --model-repository "$work/check/models"

  step "staging $work/context/rootfs"
  stage_rootfs "$work/narsil" "$work/maps" "$work/context/rootfs"

  local tag
  tag=$(image_tag)
  podman build --quiet -f "deploy/images/$name.Containerfile" \
    --label "org.opencontainers.image.title=$name" \
    --label "org.opencontainers.image.version=$tag" \
    --label "org.opencontainers.image.revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
    -t "$name:$tag" -t "$name:${tag%%-*}" -t "$name:latest" "$work/context" >/dev/null
  echo "$tag" >"$work/TAG"
  # The image this script built before goes (the torch one is 2.9 GB).
  if [ -n "$previous" ] && [ "$previous" != "$tag" ]; then
    podman rmi "$name:$previous" >/dev/null 2>&1 || true
  fi
  local bytes
  bytes=$(podman image inspect --format '{{.Size}}' "$name:$tag")
  step "built $name:$tag ($((bytes / 1000000)) MB); its largest files:"
  (cd "$work/context/rootfs" && find . -type f -printf '%s %p\n' | sort -rn | head -8 \
    | awk '{ printf "  %8.1f MB  %s\n", $1 / 1e6, substr($2, 2) }') >&2
}

# stage_rootfs BINARY MAPS ROOT: the binary at $IMAGE_BIN; each library MAPS
# names: from the Python environment's site-packages under $IMAGE_SITE
# (the same relative paths, so libtorch's $ORIGIN rpaths and the fbgemm_gpu
# directory beside torch still resolve), any other in
# /usr/lib/x86_64-linux-gnu with a link by its soname; the dynamic loader
# where the binary names it.
stage_rootfs() {
  local binary="$1" maps="$2" root="$3" site="" lib dest soname interpreter
  if [ -x .venv/bin/python ]; then
    site=$(realpath "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')")
  fi
  mkdir -p "$root$(dirname "$IMAGE_BIN")" "$root/usr/lib/x86_64-linux-gnu" "$root/models" "$root/tmp"
  chmod 1777 "$root/tmp"
  cp "$binary" "$root$IMAGE_BIN"
  awk '$6 ~ /^\// && $6 ~ /\.so(\.|$)/ { print $6 }' "$maps" | sort -u | while read -r lib; do
    if [ -n "$site" ] && [ "${lib#"$site"/}" != "$lib" ]; then
      dest="$root$IMAGE_SITE/${lib#"$site"/}"
    else
      dest="$root/usr/lib/x86_64-linux-gnu/$(basename "$lib")"
    fi
    mkdir -p "$(dirname "$dest")"
    cp "$lib" "$dest"
    soname=$(readelf -d "$lib" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
    if [ -n "$soname" ] && [ "$soname" != "$(basename "$lib")" ] && [ ! -e "$(dirname "$dest")/$soname" ]; then
      ln -s "$(basename "$lib")" "$(dirname "$dest")/$soname"
    fi
  done
  interpreter=$(readelf -l "$binary" | sed -n 's/.*Requesting program interpreter: \(.*\)\]/\1/p')
  [ -n "$interpreter" ] || die "$binary names no program interpreter"
  if [ ! -e "$root$interpreter" ]; then
    mkdir -p "$root$(dirname "$interpreter")"
    ln -s "/usr/lib/x86_64-linux-gnu/$(basename "$interpreter")" "$root$interpreter"
  fi
  [ -e "$root/usr/lib/x86_64-linux-gnu/$(basename "$interpreter")" ] \
    || die "the dynamic loader $interpreter was not among the mapped files"
}

for kind in "${kinds[@]}"; do
  build_image "$kind"
done
