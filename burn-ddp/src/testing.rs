//! Test support, shared by this crate's unit tests and the workspace's integration tests:
//! skipped tests made visible. `cargo test` hides what a passing test prints, so a test that
//! cannot run here (no root for network namespaces or a tmpfs, no GPU) would look like a pass.
//! [`skip`] instead:
//! - **fails** the test where the run says this kind of test must run
//!   (`TESTS_MUST_RUN=netns,tmpfs`: `.ci/run` sets it when it runs as root, which can do both);
//! - appends `test name: needs KIND: reason` to the file `$TESTS_SKIP_LOG`, which `.ci/run`
//!   counts and prints at the end (`N passed, M skipped` with each reason);
//! - prints the same line.
//!
//! And [`ClosedPort`]: a port that refuses connections without a race; [`formula_weights`]: the
//! same weights in every run and on every thread.

use std::io::Write;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Tensor, TensorData};

/// `module` with every float parameter replaced by values from a formula (in visit order, each
/// requiring a gradient): the same in every run, whatever thread builds it, unlike the
/// backend's generator, whose seed is per device and thread.
pub fn formula_weights<M: Module>(module: M) -> M {
    struct Fill(usize);
    impl ModuleMapper for Fill {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, t, mapper) = p.consume();
            let n = t.shape().num_elements();
            let values: Vec<f32> = (self.0..self.0 + n)
                .map(|i| ((i * 37 % 101) as f32 / 101.0 - 0.5) * 0.6)
                .collect();
            self.0 += n;
            let t =
                Tensor::from_data(TensorData::new(values, t.shape()), &t.device()).require_grad();
            Param::from_mapped_value(id, t, mapper)
        }
    }
    module.map(&mut Fill(0))
}

/// What a skipped test lacked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    /// Network namespaces and veth pairs (root, iproute2).
    Netns,
    /// Mounting a small tmpfs (root).
    Tmpfs,
    /// A GPU with its driver (CUDA, NCCL).
    Gpu,
    /// Open MPI's `mpirun` (Debian's `openmpi-bin`; `.ci/run` installs it).
    Mpi,
    /// Slurm's daemons and `srun` (Debian's `slurm-wlm` and `munge`, started as root by the
    /// test; `.ci/run` installs them).
    Slurm,
    /// Python with the `tensorboard` package, named by `TENSORBOARD_PYTHON` (`.ci/run`
    /// installs it), to read the event files the trainer writes.
    TensorBoard,
    /// PyTorch: its Python, named by `TORCH_PYTHON` (to host a real c10d `TCPStore`), and its
    /// `torchrun`, named by `TORCHRUN`.
    Torch,
}

impl Needs {
    /// The name used in `TESTS_MUST_RUN` and in the skip log.
    pub fn name(self) -> &'static str {
        match self {
            Self::Netns => "netns",
            Self::Tmpfs => "tmpfs",
            Self::Gpu => "gpu",
            Self::TensorBoard => "tensorboard",
            Self::Mpi => "mpi",
            Self::Slurm => "slurm",
            Self::Torch => "torch",
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

/// A local port that refuses connections for as long as it lives: a socket bound to it (without
/// `SO_REUSEADDR`, so nobody else can bind it) that does not listen.
pub struct ClosedPort {
    fd: libc::c_int,
    pub port: u16,
}

impl Default for ClosedPort {
    fn default() -> Self {
        Self::new()
    }
}

impl ClosedPort {
    /// # Panics
    /// When the socket cannot be created or bound (test support: a broken machine).
    pub fn new() -> ClosedPort {
        // SAFETY: plain socket calls on a socket this function owns, with a properly sized
        // sockaddr_in; every result is checked.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
            let mut addr: libc::sockaddr_in = std::mem::zeroed();
            addr.sin_family = libc::AF_INET as libc::sa_family_t;
            addr.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
            let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            let rc = libc::bind(fd, (&addr as *const libc::sockaddr_in).cast(), len);
            assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
            let mut len = len;
            let rc = libc::getsockname(fd, (&mut addr as *mut libc::sockaddr_in).cast(), &mut len);
            assert_eq!(rc, 0, "getsockname: {}", std::io::Error::last_os_error());
            ClosedPort {
                fd,
                port: u16::from_be(addr.sin_port),
            }
        }
    }
}

impl Drop for ClosedPort {
    fn drop(&mut self) {
        // SAFETY: our own descriptor, closed once.
        unsafe {
            libc::close(self.fd);
        }
    }
}
