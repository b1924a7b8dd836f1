#!/usr/bin/env bash
# The GPU checklist (what the CUDA build must show on a real GPU), in two halves:
#
#   bash scripts/gpu-checklist.sh pack   # here (no GPU): build the CUDA binaries as .ci/run
#                                        # does, strip them and compress them into .bin/gpu/
#                                        # (git-ignored), to carry
#   bash scripts/gpu-checklist.sh run [checks | speed | all]
#                                        # on the GPU machine (no Rust, no network), in the
#                                        # repository root: items 1-4, item 5 or both (each
#                                        # group fits one 10-minute call); figures in $OUT
#
# The three binaries (the trainer, the library's unit tests, the user's crate of
# examples/custom-model) link LLVM statically (Burn 0.22's CUDA compiler) and share most of
# their bytes, so they travel as one xz stream whose dictionary spans them all. `run` needs
# only a CUDA driver and NCCL (found in a Python `nvidia-nccl-*` package if not on the library
# path); libdevice (the CUDA math library the kernels link) is taken from a toolkit, from
# Triton, or from the copy `pack` carried. Each check has a time limit and the run goes on past
# a failure: the summary says which check failed, the log keeps its output.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=.bin/gpu
LIMIT_MIB=60

pack() {
  bash scripts/offline-llvm.sh
  # The build of .ci/run's GPU step, with its flags from .ci/builds.sh (so after `bash .ci/run`
  # nothing compiles): the trainer and the library's unit tests (kernels, NCCL group, device
  # reducer) with CUDA and wgpu.
  source .ci/builds.sh
  lint_while_building
  local tests
  tests=$(cargo test --release --locked "${GPU_PACKAGES[@]}" --no-run --message-format=json |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "burn_ddp" and m.get("executable"):
        print(m["executable"])')
  [ -n "$tests" ] || { echo "error: the burn-ddp test binary was not built" >&2; exit 1; }
  local stage
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' RETURN
  # The user's crate with Burn's default features (fused CUDA), as .ci/run builds it.
  build_user_crate
  strip -o "$stage/trainer" target/release/trainer
  strip -o "$stage/custom-model" target/release/custom-model
  strip -o "$stage/burn_ddp_tests" "$tests"
  # Triton (PyTorch's wheel, which .ci/run caches) ships libdevice: a fallback for a GPU
  # machine without a CUDA toolkit.
  local libdevice
  libdevice=$(find "${BURN_DDP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/burn-ddp}" \
    -name libdevice.10.bc 2>/dev/null | head -n 1 || true)
  if [ -n "$libdevice" ]; then
    mkdir -p "$stage/cuda/nvvm/libdevice"
    cp "$libdevice" "$stage/cuda/nvvm/libdevice/"
  fi
  mkdir -p "$BUNDLE"
  tar -C "$stage" -cf - . | xz -T1 --lzma2=preset=6,dict=512MiB > "$BUNDLE/bundle.tar.xz"
  local mib=$(($(stat -c %s "$BUNDLE/bundle.tar.xz") / 1048576))
  echo "$BUNDLE/bundle.tar.xz: $mib MiB (limit $LIMIT_MIB; carry: [\"$BUNDLE\"])"
  [ "$mib" -le "$LIMIT_MIB" ] || { echo "error: the bundle is over $LIMIT_MIB MiB" >&2; exit 1; }
}

# The first file called $1 where CUDA libraries live: the linker's cache, Python's packages
# (PyTorch's wheels carry NCCL and Triton's libdevice), then the usual prefixes.
find_first() {
  local found
  found=$(ldconfig -p 2>/dev/null | awk -v name="$1" '$1 ~ "^"name && !found { found = $NF } END { if (found) print found }' || true)
  if [ -z "$found" ]; then
    local site
    site=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null || true)
    # shellcheck disable=SC2086 # a list of folders
    found=$(find $site /usr/local /usr/lib /opt "$HOME" -xdev -name "$1" 2>/dev/null |
      grep -v "^$WORK/" | head -n 1 || true)
  fi
  echo "$found"
}

# One check: its name, a time limit in seconds, a command; its output goes to the log, the
# verdict (with a training run's final validation line) to the summary. Never stops the run.
check() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name" >>"$LOG"
  local started=$SECONDS rc=0 output="$WORK/check.out"
  timeout --kill-after=10 "$limit" "$@" >"$output" 2>&1 || rc=$?
  cat "$output" >>"$LOG"
  local verdict=ok
  [ "$rc" -eq 0 ] || verdict="FAILED (exit $rc)"
  [ "$rc" -ne 124 ] || verdict="TIMED OUT after ${limit}s"
  echo "$name: $verdict in $((SECONDS - started))s" | tee -a "$SUMMARY"
  grep -h "^final validation" "$output" | sed 's/^/    /' | tee -a "$SUMMARY" || true
}

# A copy of the digits config on the GPU, with `key = value` lines replaced.
digits_config() {
  local name=$1
  shift
  local config="$WORK/$name.toml"
  sed -e 's/^device = .*/device = "cuda"/' \
    -e "s#^dir = \"runs/digits-mlp#dir = \"$WORK/$name#" configs/digits-mlp.toml >"$config"
  for setting in "$@"; do
    sed -i "s/^${setting%% =*} = .*/$setting/" "$config"
  done
  echo "$config"
}

# A copy of the user crate's config on `device` (its file names no device: the CPU), with
# `extra` (printf format) appended.
circles_config() {
  local device=$1 extra=${2:-} config="$WORK/circles-$1.toml"
  sed -e "s#^dir = \"runs/circles#dir = \"$WORK/circles-$device#" \
    examples/custom-model/circles.toml >"$config"
  [ "$device" = cpu ] || printf "device = \"$device\"\n" >>"$config"
  # shellcheck disable=SC2059 # extra is a format of our own
  printf "$extra" >>"$config"
  echo "$config"
}

run() {
  OUT=${OUT:-$PWD/gpu-checklist-out}
  mkdir -p "$OUT"
  WORK=$(mktemp -d)
  GROUP=${1:-all}
  LOG="$OUT/gpu-checklist-$GROUP.log"
  SUMMARY="$OUT/gpu-checklist-$GROUP-summary.txt"
  : >"$LOG"
  : >"$SUMMARY"
  if command -v xz >/dev/null; then
    xz -dc "$BUNDLE/bundle.tar.xz" | tar -C "$WORK" -xf -
  else
    python3 -c 'import lzma,sys,tarfile; tarfile.open(fileobj=lzma.open(sys.argv[1])).extractall(sys.argv[2])' \
      "$BUNDLE/bundle.tar.xz" "$WORK"
  fi
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader ||
    echo "nvidia-smi failed"; } | tee -a "$SUMMARY"
  # cudarc opens libnccl.so; Python's NCCL package has only libnccl.so.2.
  local nccl
  nccl=$(find_first 'libnccl.so.2*')
  if [ -n "$nccl" ]; then
    mkdir -p "$WORK/lib"
    ln -sf "$nccl" "$WORK/lib/libnccl.so"
    export LD_LIBRARY_PATH="$WORK/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  echo "NCCL: ${nccl:-not found}" | tee -a "$SUMMARY"
  # cubecl looks for $CUDA_PATH/nvvm/libdevice/libdevice.10.bc, then under /usr/local/cuda.
  if [ -z "${CUDA_PATH:-}" ] && [ ! -d /usr/local/cuda/nvvm/libdevice ]; then
    local libdevice
    libdevice=$(find_first libdevice.10.bc)
    libdevice=${libdevice:-$WORK/cuda/nvvm/libdevice/libdevice.10.bc}
    mkdir -p "$WORK/toolkit/nvvm/libdevice"
    ln -sf "$libdevice" "$WORK/toolkit/nvvm/libdevice/libdevice.10.bc"
    export CUDA_PATH="$WORK/toolkit"
  fi
  echo "libdevice: $(readlink -f "${CUDA_PATH:-/usr/local/cuda}/nvvm/libdevice/libdevice.10.bc")" |
    tee -a "$SUMMARY"
  export TESTS_MUST_RUN=gpu
  local tests="$WORK/burn_ddp_tests" trainer="$WORK/trainer"

  if [ "$GROUP" != speed ]; then
    correctness "$tests" "$trainer"
  fi
  if [ "$GROUP" != checks ]; then
    speed "$tests" "$trainer"
  fi
  echo "summary: $SUMMARY, every check's output: $LOG"
}

# Items 1-4 of the checklist.
correctness() {
  local tests=$1 trainer=$2
  # 1, 2: the kernels bit for bit on CUDA; the one-rank NCCL group and reducer.
  check "kernels, NCCL group, device reducer" 150 \
    "$tests" kernels cuda nccl --skip wgpu --test-threads=1
  # 3: the digits MLP on the GPU (the trainer's build: unfused, the CubeCL bucket kernels),
  # against the CPU run's accuracy in the same call.
  local sync
  for sync in 'gradient_sync = "nccl"' 'gradient_sync = "host"'; do
    check "digits on cuda, $sync" 90 "$trainer" --config "$(digits_config "${sync//[^a-z]/}" "$sync")"
  done
  check 'digits on cuda, gradient_compression = "bf16"' 90 \
    "$trainer" --config "$(digits_config bf16 'gradient_sync = "nccl"' 'gradient_compression = "bf16"')"
  check "digits on the CPU" 90 "$trainer" --config "$(digits_config cpu 'device = "cpu"')"
  # 4: a user's crate with Burn's default features (fusion on) through NCCL.
  check "user crate (fused) on cuda, NCCL" 90 "$WORK/custom-model" --config "$(
    circles_config cuda '\n[distributed]\ngradient_sync = "nccl"\n'
  )"
  check "user crate on the CPU" 90 "$WORK/custom-model" --config "$(circles_config cpu)"
}

# Item 5: speed, as ratios within one run.
speed() {
  local tests=$1 trainer=$2
  check "pack/unpack against a device copy" 90 \
    "$tests" --ignored cuda_pack_unpack_against_device_copy --nocapture --test-threads=1
  check "NCCL one-rank all-reduce sweep" 90 \
    "$tests" --ignored nccl_one_rank_all_reduce_sweep --nocapture --test-threads=1
  check "bench-train MLP" 150 \
    "$trainer" bench-train --device cuda --rounds 2 --config configs/bench-mlp.toml
  check "bench-train transformer" 150 \
    "$trainer" bench-train --device cuda --rounds 2 --config configs/bench-transformer.toml
}

case "${1:-}" in
  pack) pack ;;
  run) run "${2:-all}" ;;
  *)
    echo "usage: bash scripts/gpu-checklist.sh pack | run [checks | speed | all]" >&2
    exit 2
    ;;
esac
