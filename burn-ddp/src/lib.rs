//! # burn-ddp: data-parallel training for Burn, one process per device
//!
//! The layers, bottom up (one concept per file):
//!
//! | module | owns |
//! |---|---|
//! | [`env`] | rank, world size and rendezvous address from torchrun / SLURM / Open MPI variables (derived under srun and single-machine mpirun), the launcher's job identity |
//! | [`host_values`] | [`host_values::host_values`]: tensor data read back as a `Vec`, at any alignment of its bytes (a GPU readback's may not be aligned) |
//! | [`hostlist`] | Slurm's host-list syntax expanded (`node[01-04,07]`), pure |
//! | [`store`] | the rendezvous key-value store ([`store::TcpStoreServer`], [`store::TcpStore`]), a client of PyTorch's c10d `TCPStore` for torchrun's agent store ([`store::C10dStore`]), who hosts it ([`store::StoreHost`]), and per-group namespaces ([`store::PrefixStore`]) |
//! | [`call`] | one collective call's description (operation, element type, kind, sequence number): what groups check across ranks and errors name |
//! | [`group`] | the [`group::ProcessGroup`] trait and its conformance suite; the rendezvous and stall reporter every group shares; the ring plan (pure); the TCP ring backend with shared-memory links for same-host neighbours; NCCL (feature `cuda`) |
//! | [`init`] | [`init::Distributed::init`]: store + group from the environment |
//! | [`joining`] | [`Distributed::join`]: a process that joins a job while it trains (asks through the store, beats a heartbeat, forms the grown group) |
//! | [`sampler`] | [`sampler::DistributedSampler`]: which samples each rank takes, per epoch |
//! | [`rng`] | [`rng::SplitMix64`], the one random generator: sample orders, splits, synthetic data (platform-stable) |
//! | [`hash`] | [`hash::fnv1a64`], the one hash: checkpoint checksums, config fingerprints, replica checksums |
//! | [`kernels`] | [`kernels::BucketOps`]: pack, unpack + scale, bf16/fp16 compression — CubeCL kernels on wgpu/CUDA, Burn ops elsewhere |
//! | [`data_parallel`] | [`DataParallel`], the one home of the DDP step: join, prepare, what runs before each micro-batch's backward ([`DataParallel::micro_batch`]), sync gradients (host ring or NCCL; ZeRO stages 1 to 3), buffers, shard, sums, rank-0 actions, barrier — used by the engine, the burn-train strategy and own loops |
//! | [`ddp`] | the DDP layer, a folder per way of stepping: plain DDP (parameter broadcast, the reducer, the gradient path, buffers), [`ddp::options`] ([`DdpOptions`], [`GradientTransport`], [`ZeroStage`], the process groups a rank forms), [`ddp::buckets`] (plan, host staging or NCCL, the finite check), [`ddp::overlap`] (buckets summed during backward), [`ddp::zero`] (stages 1 and 2), [`ddp::fsdp`] (stage 3), [`ddp::sync_batch_norm`] ([`SyncBatchNorm`]); [`ddp::sharding::Sharding`] and [`MicroBatch`] are what `DataParallel` holds and takes. Threads and groups: `docs/concurrency.md` |
//! | [`elastic`] | a job that goes on when ranks leave or die and grows when processes join: the survivors' agreement through the store (who carries on, at which step), the join plan, heartbeats; [`DataParallel::regroup`] re-forms the groups among them, [`DataParallel::admit_joiners`] with the joiners |
//! | [`pipeline`] | pipeline parallelism (so far): the stages × replicas layout, GPipe and 1F1B schedules with a simulation of their bubble, the point-to-point links between neighbouring stages, `PipelineStage` and the pipeline step, the `PipelineParallel` handle |
//! | `learner` (feature `burn-train`) | burn-train's `SupervisedTraining` across processes: `DdpStrategy`, `DistributedDataLoaderBuilder`, outputs gathered for metrics |
//! | `cuda` (feature `cuda`) | run-time checks for the CUDA driver and NCCL, GPU selection from the local rank |
//! | [`fault`] | fault points: the one seam through which a test injects a fault (a program installs one handler; without one a point does nothing) |
//! | [`error`] | typed errors per layer |
//! | [`testing`] | test support: skipped tests recorded and counted, never silent |
//!
//! ## How a gradient travels
//! `loss.backward()` gives Burn's gradients; `GradientsParams::from_grads` keys them by
//! parameter; [`ddp::Reducer::sync`] walks the model's parameters in visit order (the same on
//! every rank), packs the gradients into buckets of at most `bucket_cap_mb` on their device,
//! sums each bucket across ranks ([`ddp::BucketComm`]: the TCP ring through the host, or NCCL on
//! the GPU), unpacks it with the `1 / world_size` scale fused in, and puts the averaged
//! gradients back; the optimizer step then sees the same gradients on every rank, so replicas
//! stay equal.

pub mod call;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data_parallel;
pub mod ddp;
pub mod elastic;
pub mod env;
pub mod error;
pub mod fault;
pub mod group;
pub mod hash;
pub mod host_values;
pub mod hostlist;
pub mod init;
pub mod joining;
pub mod kernels;
#[cfg(feature = "burn-train")]
pub mod learner;
pub mod pipeline;
pub mod rng;
pub mod sampler;
pub mod store;
pub mod testing;

pub use data_parallel::{DataParallel, StepOutcome};
pub use ddp::{
    mark_block, parameter_count, BucketTiming, DdpOptions, GradientTransport, MicroBatch,
    MicroBatchScope, OverlapStats, StepTimeline, SyncBatchNorm, SyncBatchNormConfig, ZeroStage,
};
pub use env::DistEnv;
pub use error::{CollectiveError, DdpError, InitError, StoreError, SyncBatchNormError};
pub use group::{
    ProcessGroup, ReduceOp, TcpGroupOptions, TcpProcessGroup, DEFAULT_FAILURE_DETECTION,
};
pub use init::Distributed;
pub use joining::PendingJoin;
