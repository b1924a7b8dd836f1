//! Test support, shared by this crate's unit tests and the workspace's integration tests:
//! skipped tests made visible. `cargo test` hides what a passing test prints, so a test that
//! cannot run here (no root for network namespaces or a tmpfs, no GPU) would look like a pass.
//! [`skip`] instead:
//! - **fails** the test where the run says this kind of test must run
//!   (`TESTS_MUST_RUN=netns,tmpfs`: `.ci/run` sets it when it runs as root, which can do both);
//! - appends `test name: needs KIND: reason` to the file `$TESTS_SKIP_LOG`, which `.ci/run`
//!   counts and prints at the end (`N passed, M skipped` with each reason);
//! - prints the same line.

use std::io::Write;

/// What a skipped test lacked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    /// Network namespaces and veth pairs (root, iproute2).
    Netns,
    /// Mounting a small tmpfs (root).
    Tmpfs,
    /// A GPU with its driver (CUDA, NCCL).
    Gpu,
}

impl Needs {
    /// The name used in `TESTS_MUST_RUN` and in the skip log.
    pub fn name(self) -> &'static str {
        match self {
            Self::Netns => "netns",
            Self::Tmpfs => "tmpfs",
            Self::Gpu => "gpu",
        }
    }
}

/// Records that the calling test skips (part of) its work because the machine lacks `needs`,
/// for `reason`; panics instead where `TESTS_MUST_RUN` names that kind. The caller then
/// returns.
///
/// # Panics
/// As above, and when the skip cannot be written to `$TESTS_SKIP_LOG`.
pub fn skip(needs: Needs, reason: &str) {
    let test = std::thread::current()
        .name()
        .unwrap_or("unnamed test")
        .to_owned();
    let must_run = std::env::var("TESTS_MUST_RUN").unwrap_or_default();
    if must_run.split(',').any(|k| k.trim() == needs.name()) {
        panic!(
            "{test} may not skip here (TESTS_MUST_RUN={must_run}), but the machine lacks {}: {reason}",
            needs.name()
        );
    }
    let line = format!("{test}: needs {}: {reason}", needs.name());
    eprintln!("SKIPPED {line}");
    if let Ok(path) = std::env::var("TESTS_SKIP_LOG") {
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = written {
            panic!("cannot record the skip in TESTS_SKIP_LOG={path}: {e}");
        }
    }
}
