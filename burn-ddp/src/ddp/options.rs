//! [`DdpOptions`]: how one data-parallel job synchronises, as one value — where gradients
//! are summed (host ring or NCCL), the ZeRO stage, the wire precision, the bucket size, the
//! buffer rule and the deadlines. The engine builds it from `[distributed]`, the burn-train
//! strategy and own-loop programs from code; every rank must use the same options.

use std::time::Duration;

use super::BufferSync;
use crate::group::TcpGroupOptions;
use crate::kernels::HalfFormat;

/// Where gradients are summed (PyTorch's choice of backend for the DDP process group).
/// Metrics, checkpoints and the start-up broadcast always use the TCP group.
///
/// With feature `serde`: `"auto"`, `"host"`, `"nccl"` (the trainer's
/// `distributed.gradient_sync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum GradientTransport {
    /// NCCL on Burn's plain CUDA backend with more than one rank, the host otherwise.
    #[default]
    Auto,
    /// Through host memory and the TCP ring (shared memory between ranks of one machine).
    Host,
    /// On the GPU with NCCL (Burn's plain CUDA backend, a build with feature `cuda`).
    Nccl,
}

/// The synchronisation of a data-parallel job. `Default` is PyTorch DDP's: 25 MiB buckets,
/// f32 on the wire, rank 0's buffers broadcast after every step, ZeRO off, NCCL where the
/// backend allows it, 300 s deadlines.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DdpOptions {
    pub transport: GradientTransport,
    /// 0: every rank holds the whole optimizer state (plain DDP). 1: each parameter's state
    /// lives on one rank, which steps it and sends the new values to the others (DeepSpeed's
    /// stage 1, PyTorch's `ZeroRedundancyOptimizer`). Stage 1 runs over the host.
    pub zero_stage: u8,
    /// The precision of gradient buckets on the wire: `None` (f32), bf16 or fp16 (PyTorch's
    /// `bf16_compress_hook` / `fp16_compress_hook`).
    pub compression: Option<HalfFormat>,
    /// Largest gradient bucket in MiB.
    pub bucket_cap_mb: f64,
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
            zero_stage: 0,
            compression: None,
            bucket_cap_mb: 25.0,
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

    pub fn with_zero_stage(mut self, stage: u8) -> Self {
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

    /// Where gradients go for a backend with (`cuda`) or without Burn's CUDA and `world`
    /// ranks, before the checks of [`super::GradientSync::new`]. Pure.
    pub fn resolved_transport(&self, cuda: bool, world: usize) -> GradientTransport {
        match self.transport {
            GradientTransport::Auto if cuda && world > 1 => GradientTransport::Nccl,
            GradientTransport::Auto => GradientTransport::Host,
            explicit => explicit,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_means_nccl_only_for_cuda_with_several_ranks() {
        let auto = DdpOptions::default();
        assert_eq!(auto.resolved_transport(true, 2), GradientTransport::Nccl);
        assert_eq!(auto.resolved_transport(true, 1), GradientTransport::Host);
        assert_eq!(auto.resolved_transport(false, 4), GradientTransport::Host);
        let host = auto.with_transport(GradientTransport::Host);
        assert_eq!(host.resolved_transport(true, 2), GradientTransport::Host);
        let nccl = auto.with_transport(GradientTransport::Nccl);
        assert_eq!(nccl.resolved_transport(false, 2), GradientTransport::Nccl);
    }
}
