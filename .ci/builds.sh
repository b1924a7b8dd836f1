# The cargo builds CI makes, in one place: `.ci/run` runs them and `scripts/gpu-checklist.sh pack`
# reuses their output, so both must ask cargo for exactly the same units (same packages,
# features, profile and compiler wrapper), or the second compiles everything again.
# Sourced, not run.

# Clippy lints the workspace's crates while they are compiled for the tests. clippy-driver is
# rustc with clippy's lints added: as cargo's workspace wrapper it compiles the workspace's own
# crates (lints, then code) and leaves the dependencies to plain rustc. `cargo test --no-run`
# under it lints what `cargo clippy --all-targets -- -D warnings` lints (the library, the
# binaries and both in test mode, the integration tests, the examples) and fails the same way,
# while the dependencies are compiled once for the tests instead of also being checked apart
# (two `cargo clippy` runs cost about 6 minutes of CI, almost all of it checking Burn).
# CLIPPY_ARGS is how `cargo clippy` hands its arguments to clippy-driver.
lint_while_building() {
  local driver
  driver="$(command -v clippy-driver || echo "$(rustc --print sysroot)/bin/clippy-driver")"
  if [ ! -x "$driver" ]; then
    echo "error: clippy-driver not found: run 'rustup component add clippy'" >&2
    return 1
  fi
  export RUSTC_WORKSPACE_WRAPPER="$driver"
  export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
}

# CI's two builds of the workspace, each of every target (what clippy lints) in the release
# profile, with trainer's `ci-shared-build` feature (see trainer/Cargo.toml): the default
# features, and burn-ddp and trainer with wgpu and cuda (unfused, as the workspace builds them).
# The two GPU builds (this one and the user crate's) take .ci/gpu-compilers.toml: CubeCL's kernel
# compilers at opt-level 1.
CI_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GPU_COMPILERS=(--config "$CI_ROOT/.ci/gpu-compilers.toml")
CPU_PACKAGES=(--workspace --features trainer/ci-shared-build)
GPU_PACKAGES=(-p burn-ddp -p trainer --features trainer/wgpu,trainer/cuda,trainer/ci-shared-build
  "${GPU_COMPILERS[@]}")

# A user's crate outside the workspace (examples/custom-model: Burn's default features, so fused;
# trainer without its default features) with --features cuda: the build a GPU user makes, plus
# trainer's `ci-shared-build` (no code: the low-level features the workspace's builds have, so
# the units below Burn are shared; see trainer/Cargo.toml). It shares the workspace's target
# directory; extra arguments go to `cargo build`.
build_user_crate() {
  (cd examples/custom-model &&
    CARGO_TARGET_DIR=../../target cargo build --release --locked --features cuda,trainer/ci-shared-build "${GPU_COMPILERS[@]}" "$@")
}
