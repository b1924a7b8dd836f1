//! [`DdpOptions`]: how one data-parallel job synchronises, as one value — where gradients
//! are summed (host ring or NCCL: [`GradientTransport`]), the ZeRO stage ([`ZeroStage`]), the
//! wire precision, the bucket size, the buffer rule and the deadlines. The engine builds it
//! from `[distributed]` (whose fields are these types: feature `serde`), the burn-train
//! strategy and own-loop programs from code; every rank must use the same options.

use std::time::Duration;

use super::buffers::BufferSync;
use super::transport::GradientTransport;
use super::zero_stage::ZeroStage;
use crate::group::{shm, TcpGroupOptions};
use crate::kernels::HalfFormat;

/// Bytes of each shared-memory ring of the job's group at ZeRO stages 2 and 3: a quarter of
/// a piece instead of four pieces. Those stages are chosen to save memory, and every rank
/// maps its own ring and its neighbour's, both counted in its resident memory (8 MiB at the
/// default size). Their gradients mostly go through groups of their own (the communication
/// thread's for marked blocks at stage 2, the shards' at stage 3), so the job's group
/// carries little in bulk: stage 2's all-gather of the parameters, and its gradients where no
/// block is marked. Through a ring smaller than a piece those run at about half the speed
/// (`trainer bench-allreduce` on this project's 2-core machine: 1.3 to 2.5 GB/s against 2.2
/// to 4.2 between 1 and 32 MiB).
pub const SHARDED_JOB_RING_BYTES: usize = 256 << 10;

/// Bytes of each shared-memory ring of the job's group at ZeRO stage `stage`.
pub fn job_ring_bytes(stage: ZeroStage) -> usize {
    match stage {
        ZeroStage::Off | ZeroStage::OptimizerState => shm::DEFAULT_CAPACITY,
        ZeroStage::Gradients | ZeroStage::Parameters => SHARDED_JOB_RING_BYTES,
    }
}

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

    /// The job group's options: these deadlines, and the ZeRO stage's shared-memory rings
    /// ([`job_ring_bytes`]).
    pub fn tcp_options(&self) -> TcpGroupOptions {
        TcpGroupOptions {
            timeout: self.timeout,
            stall_warning: self.stall_warning,
            shared_memory_ring_bytes: job_ring_bytes(self.zero_stage),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ddp::comm_thread::overlap_ring_bytes;

    #[test]
    fn zero_stages_2_and_3_give_the_job_and_overlap_groups_smaller_rings() {
        let rings = |stage| {
            let job = DdpOptions::default()
                .with_zero_stage(stage)
                .tcp_options()
                .shared_memory_ring_bytes;
            (job, overlap_ring_bytes(job))
        };
        assert_eq!(rings(ZeroStage::Off), (4 << 20, 1 << 20));
        assert_eq!(rings(ZeroStage::OptimizerState), (4 << 20, 1 << 20));
        assert_eq!(rings(ZeroStage::Gradients), (256 << 10, 256 << 10));
        assert_eq!(rings(ZeroStage::Parameters), (256 << 10, 256 << 10));
    }
}
