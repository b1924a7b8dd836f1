//! [`DdpOptions`]: how one data-parallel job synchronises, as one value — where gradients
//! are summed (host ring or NCCL: [`GradientTransport`]), the ZeRO stage ([`ZeroStage`]), the
//! wire precision, the bucket size, the buffer rule and the deadlines. The engine builds it
//! from `[distributed]` (whose fields are these types: feature `serde`), the burn-train
//! strategy and own-loop programs from code; every rank must use the same options.

use std::time::Duration;

use crate::ddp::buffers::BufferSync;
use crate::ddp::options::groups::{job_ring_bytes, PlannedGroup, ProcessGroupRole};
use crate::ddp::options::transport::GradientTransport;
use crate::ddp::options::zero_stage::ZeroStage;
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
    /// Whether the buckets of marked blocks ([`mark_block`](crate::ddp::overlap::ready_op::mark_block)) are
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
    /// How long a rank that lost a peer waits for the others' failure reports before it names
    /// the silent ones dead ([`TcpGroupOptions::failure_detection`]; default
    /// [`DEFAULT_FAILURE_DETECTION`](crate::group::DEFAULT_FAILURE_DETECTION), 1 s): how long the
    /// survivors of a failure take to know who died.
    pub failure_detection: Duration,
    /// [`TcpGroupOptions::peer_heartbeats`]: a dead, frozen or cut-off peer is named within
    /// about three times `failure_detection` instead of at `timeout`.
    pub peer_heartbeats: bool,
    /// The most ranks the job grows to by admitting joiners
    /// ([`DataParallel::joiners_due`](crate::DataParallel::joiners_due)): rank 0 refuses the
    /// joiners beyond it, telling them why. `None`: no bound. Only rank 0's value counts.
    pub max_world_size: Option<usize>,
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
            failure_detection: TcpGroupOptions::default().failure_detection,
            peer_heartbeats: false,
            max_world_size: None,
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

    /// [`peer_heartbeats`](Self::peer_heartbeats): on for a job whose survivors carry on
    /// after a rank dies, so that a frozen or cut-off peer is named within the failure
    /// detection time.
    pub fn with_peer_heartbeats(mut self, on: bool) -> Self {
        self.peer_heartbeats = on;
        self
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The job group's options: these deadlines, and the ZeRO stage's shared-memory rings
    /// ([`job_ring_bytes`]); the other groups' are made from it
    /// ([`process_groups`](Self::process_groups)).
    pub fn tcp_options(&self) -> TcpGroupOptions {
        TcpGroupOptions {
            timeout: self.timeout,
            stall_warning: self.stall_warning,
            shared_memory_ring_bytes: job_ring_bytes(self.zero_stage),
            failure_detection: self.failure_detection,
            peer_heartbeats: self.peer_heartbeats,
            ..Default::default()
        }
    }

    /// The process groups a rank forms under these options in a job of more than one rank
    /// (a job of one forms none): the job's; the overlap's where overlap is on and can run (the
    /// host path at ZeRO stages 0 and 2, formed at the first step that arms it for a model
    /// that marks blocks; counted unless the transport is NCCL by name, as `Auto` may still
    /// choose the host); stage 3's two; synchronised BatchNorm's, for a model that has the
    /// layer. Pure.
    pub fn process_groups(&self) -> Vec<PlannedGroup> {
        let job_ring = self.tcp_options().shared_memory_ring_bytes;
        let mut roles = vec![ProcessGroupRole::Job];
        let overlap_runs = matches!(self.zero_stage, ZeroStage::Off | ZeroStage::Gradients)
            && self.transport != GradientTransport::Nccl;
        if self.overlap && overlap_runs {
            roles.push(ProcessGroupRole::Overlap);
        }
        if self.zero_stage.shards_parameters() {
            roles.push(ProcessGroupRole::ShardGather);
            roles.push(ProcessGroupRole::ShardPrefetch);
        }
        roles.push(ProcessGroupRole::SyncBatchNorm);
        roles
            .into_iter()
            .map(|role| PlannedGroup {
                role,
                ring_bytes: role.ring_bytes(job_ring),
                on_first_use: role == ProcessGroupRole::SyncBatchNorm,
            })
            .collect()
    }
}
