//! [`DdpOptions`]: how one data-parallel job synchronises, as one value — where gradients
//! are summed (host ring or NCCL: [`GradientTransport`]), the ZeRO stage ([`ZeroStage`]), the
//! wire precision, the bucket size, the buffer rule and the deadlines. The engine builds it
//! from `[distributed]` (whose fields are these types: feature `serde`), the burn-train
//! strategy and own-loop programs from code; every rank must use the same options.

use std::time::Duration;

use super::buffers::BufferSync;
use super::transport::GradientTransport;
use super::zero_stage::ZeroStage;
use crate::group::TcpGroupOptions;
use crate::kernels::HalfFormat;

/// The synchronisation of a data-parallel job. `Default` is PyTorch DDP's: 25 MiB buckets,
/// f32 on the wire, gradient overlap on (for marked blocks), rank 0's buffers broadcast after every step, ZeRO off, NCCL where the
/// backend allows it, 300 s deadlines.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DdpOptions {
    /// Where gradients are summed; `Auto` is resolved from the training device and the world
    /// size by [`GradientTransport::choose`].
    pub transport: GradientTransport,
    /// Whether each parameter's optimizer state lives on one rank (stage 1, which runs over
    /// the host) or on every rank (stage 0, plain DDP).
    pub zero_stage: ZeroStage,
    /// The precision of gradient buckets on the wire: `None` (f32), bf16 or fp16 (PyTorch's
    /// `bf16_compress_hook` / `fp16_compress_hook`).
    pub compression: Option<HalfFormat>,
    /// Largest gradient bucket in MiB.
    pub bucket_cap_mb: f64,
    /// Whether the buckets of marked blocks ([`mark_block`](super::ready_op::mark_block)) are
    /// summed while backward runs (on the host path of plain DDP). Off, the same buckets are
    /// summed after backward, giving the same bits; a model that marks nothing is not
    /// affected either way.
    pub overlap: bool,
    /// How buffers (BatchNorm statistics, frozen parameters) are made equal after every
    /// optimizer step; `None` leaves each rank its own.
    pub buffers: Option<BufferSync>,
    /// Deadline of set-up and of every collective.
    pub timeout: Duration,
    /// Warn about ranks that have not arrived after this long in one collective.
    pub stall_warning: Duration,
}

impl Default for DdpOptions {
    fn default() -> Self {
        Self {
            transport: GradientTransport::Auto,
            zero_stage: ZeroStage::Off,
            compression: None,
            bucket_cap_mb: 25.0,
            overlap: true,
            buffers: Some(BufferSync::Broadcast { root: 0 }),
            timeout: Duration::from_secs(300),
            stall_warning: Duration::from_secs(60),
        }
    }
}

impl DdpOptions {
    pub fn with_transport(mut self, transport: GradientTransport) -> Self {
        self.transport = transport;
        self
    }

    pub fn with_zero_stage(mut self, stage: ZeroStage) -> Self {
        self.zero_stage = stage;
        self
    }

    pub fn with_compression(mut self, compression: Option<HalfFormat>) -> Self {
        self.compression = compression;
        self
    }

    pub fn with_bucket_cap_mb(mut self, mib: f64) -> Self {
        self.bucket_cap_mb = mib;
        self
    }

    pub fn with_overlap(mut self, overlap: bool) -> Self {
        self.overlap = overlap;
        self
    }

    pub fn with_buffers(mut self, rule: Option<BufferSync>) -> Self {
        self.buffers = rule;
        self
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The TCP group's options with these deadlines.
    pub fn tcp_options(&self) -> TcpGroupOptions {
        TcpGroupOptions {
            timeout: self.timeout,
            stall_warning: self.stall_warning,
            ..Default::default()
        }
    }
}
