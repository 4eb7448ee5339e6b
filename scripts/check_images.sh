#!/usr/bin/env bash
# Checks that Narsil's container images are complete: builds them
# (scripts/build_images.sh; --no-build checks the images already built),
# exports each image's root file system (`podman create` + `podman export`)
# and, in a chroot of it made read-only, starts the image's own entry point
# with the image's own environment and user on a model repository at
# /models, gets the golden scores of both its models over gRPC (`narsil
# verify`, run from the image too) and stops it with SIGTERM. A library missing from an image
# fails here. The chroot stands in for a container runtime: `podman run`
# needs rights this check does not assume (it mounts the root read-only and
# /proc in the chroot, so it runs as root).
#
# Usage: scripts/check_images.sh [small|torch|all] [--no-build]   (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
source scripts/image_lib.sh

which=all
build=1
for arg in "$@"; do
  case "$arg" in
    small | torch | all) which="$arg" ;;
    --no-build) build=0 ;;
    *) die "usage: scripts/check_images.sh [small|torch|all] [--no-build]" ;;
  esac
done
[ "$which" = all ] && kinds=(small torch) || kinds=("$which")
[ "$(id -u)" = 0 ] || die "the check chroots into the exported images: run it as root"

[ "$build" = 0 ] || bash scripts/build_images.sh "$which"
require_podman

ROOT=""
cleanup() {
  if [ -n "$ROOT" ]; then
    mountpoint -q "$ROOT/proc" && umount "$ROOT/proc"
    mountpoint -q "$ROOT" && umount "$ROOT"
    rm -rf "$ROOT"
  fi
  return 0
}
trap cleanup EXIT

check_image() {
  local kind="$1" name tag ref container started
  name=$(image_name "$kind")
  tag=$(cat "target/images/$name/TAG" 2>/dev/null) || die "no $name image built (scripts/build_images.sh $kind)"
  ref="$name:$tag"
  started=$(date +%s)
  step "exporting $ref to a root file system"
  ROOT=$(mktemp -d "${TMPDIR:-/tmp}/narsil-image-XXXXXX")
  chmod 755 "$ROOT" # the root directory of the image, entered by its user
  container=$(podman create "$ref")
  podman export "$container" | tar -x -C "$ROOT"
  podman rm "$container" >/dev/null

  local env=() entrypoint=() cmd=() user
  mapfile -t env < <(podman image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$ref" | sed '/^$/d')
  mapfile -t entrypoint < <(podman image inspect --format '{{range .Config.Entrypoint}}{{println .}}{{end}}' "$ref" | sed '/^$/d')
  mapfile -t cmd < <(podman image inspect --format '{{range .Config.Cmd}}{{println .}}{{end}}' "$ref" | sed '/^$/d')
  user=$(podman image inspect --format '{{.Config.User}}' "$ref")
  [ "${#entrypoint[@]}" -gt 0 ] || die "$ref has no entry point"

  step "serving the check repository from $ref (chroot, user ${user:-root}: ${entrypoint[*]} ${cmd[*]})"
  check_repository "$kind" "$ROOT" >"$ROOT/checks"
  # Read-only from here on, as with Kubernetes' readOnlyRootFilesystem.
  mkdir -p "$ROOT/proc"
  mount --bind "$ROOT" "$ROOT"
  mount -o remount,bind,ro "$ROOT"
  mount -t proc proc "$ROOT/proc"
  local chroot
  chroot=$(command -v chroot)
  VERIFY_CMD=(env -i "${env[@]}" "$chroot" --userspec="${user:-0:0}" "$ROOT" "$IMAGE_BIN" verify)
  GOLDEN_DIR=/golden
  LOG_FILE="target/images/$name/check.log"
  serve_and_verify "$ROOT/checks" - env -i "${env[@]}" "$chroot" --userspec="${user:-0:0}" "$ROOT" "${entrypoint[@]}" "${cmd[@]}"

  cleanup
  ROOT=""
  step "$ref: golden scores served from its exported root file system, stopped cleanly by SIGTERM ($(($(date +%s) - started)) s)"
}

for kind in "${kinds[@]}"; do
  check_image "$kind"
done
step "images checked (${kinds[*]}) in $SECONDS s, build included"
