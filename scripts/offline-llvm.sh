#!/usr/bin/env bash
# Lays a static LLVM 23 (with NVPTX) where Burn 0.22's CUDA backend looks for it, so that a
# `--features cuda` build links without downloading anything.
#
# Why: Burn 0.22's `cuda` feature pulls cubecl-cuda → cubecl-llvm → tracel-llvm-bundler
# 23.1.0-4, whose build script downloads a prebuilt LLVM into
#   ${XDG_DATA_HOME:-~/.local/share}/tracel/tracel-llvm-23.1.0-4/
# unless the marker file `.tracel-llvm-installed` is there (it does not check the contents).
# Machines with internet need none of this: the bundler downloads LLVM itself. Air-gapped
# machines (and this project's CI, which reaches the package registries only) run this script
# once: it takes PyPI's `mlc-llvm-static` and `mlc-llvm-static-extra-targets` wheels (a
# relocatable static LLVM 23.1 with NVPTX, its headers and a Python `llvm-config`) and lays
# their trees there. `python3` must stay on PATH for the build (`llvm-config` is a script).
#
# Idempotent: does nothing when the tree is already in place. The wheels (92 MB) are cached
# outside the clone, in ${BURN_DDP_CACHE:-~/.cache/burn-ddp}. After moving the tree, run
# `cargo clean -p cubecl-llvm -p tracel-llvm-bundler` (Cargo does not track that folder).
set -euo pipefail

VERSION="23.1.1.post0"
LLVM_DIR="${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-23.1.0-4"
CACHE="${BURN_DDP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/burn-ddp}/llvm-wheels-$VERSION"
MARKER="$LLVM_DIR/.tracel-llvm-installed"

if [ -f "$MARKER" ] && "$LLVM_DIR/bin/llvm-config" --version >/dev/null 2>&1; then
  echo "offline LLVM: already in $LLVM_DIR ($("$LLVM_DIR/bin/llvm-config" --version))"
  exit 0
fi

if ! command -v python3 >/dev/null 2>&1; then
  echo "error: python3 is needed (to fetch the wheels, and by llvm-config at build time)" >&2
  exit 2
fi

mkdir -p "$CACHE"
if ! ls "$CACHE"/mlc_llvm_static-*.whl "$CACHE"/mlc_llvm_static_extra_targets-*.whl >/dev/null 2>&1; then
  echo "offline LLVM: fetching mlc-llvm-static $VERSION from PyPI into $CACHE"
  if ! python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$CACHE" \
      "mlc-llvm-static==$VERSION" "mlc-llvm-static-extra-targets==$VERSION"; then
    echo "error: could not download the wheels; copy mlc_llvm_static-$VERSION and" \
      "mlc_llvm_static_extra_targets-$VERSION (manylinux x86_64 .whl) into $CACHE and run again" >&2
    exit 1
  fi
fi

unpacked="$(mktemp -d)"
trap 'rm -rf "$unpacked"' EXIT
for wheel in "$CACHE"/mlc_llvm_static-*.whl "$CACHE"/mlc_llvm_static_extra_targets-*.whl; do
  python3 -m zipfile -e "$wheel" "$unpacked"
done
tree="$unpacked/mlc_llvm_static/static"
if [ ! -f "$tree/bin/llvm-config" ] || [ ! -d "$tree/lib" ]; then
  echo "error: the wheels in $CACHE do not hold mlc_llvm_static/static/{bin/llvm-config,lib}" >&2
  exit 1
fi

# Laid next to its final place and renamed, so an interrupted run leaves no half tree.
mkdir -p "$(dirname "$LLVM_DIR")"
staging="$LLVM_DIR.partial"
rm -rf "$staging"
cp -a "$tree" "$staging"
chmod +x "$staging/bin/llvm-config"
rm -rf "$LLVM_DIR"
mv "$staging" "$LLVM_DIR"
touch "$MARKER"

version="$("$LLVM_DIR/bin/llvm-config" --version)"
if ! "$LLVM_DIR/bin/llvm-config" --targets-built | grep -w NVPTX >/dev/null; then
  echo "error: the LLVM in $LLVM_DIR has no NVPTX target" >&2
  exit 1
fi
echo "offline LLVM: $version with NVPTX in $LLVM_DIR"
