//! The DDP layer: what turns N copies of a Burn training loop into one data-parallel job.
//! Plain DDP, and what `DataParallel` holds and takes (its sharding, a micro-batch's position),
//! are the files here; each way of stepping beyond plain DDP has a folder of its own.
//! Which thread issues which collective on which process group, and why their order depends
//! only on the model's order: [docs/concurrency.md](../../../docs/concurrency.md).
//!
//! | here | owns |
//! |---|---|
//! | [`module`] | [`prepare_module`]: deterministic parameter ids and rank 0's values broadcast, so every replica starts equal; replica checksums |
//! | [`buffers`] | [`sync_buffers`]: BatchNorm running statistics and other buffers made equal across ranks (rank 0's, or the mean) |
//! | [`reducer`] | [`Reducer`]: `GradientsParams` averaged across ranks bucket by bucket (packed, optionally compressed to bf16 / fp16, on the device), in the overlap's plan where it has one |
//! | [`gradient_sync`] | [`GradientSync`]: the job's gradient path (host ring or NCCL, overlap or not) chosen once from the options |
//! | [`sharding`] | [`Sharding`](sharding::Sharding): how a rank holds the model at its ZeRO stage, the one value `DataParallel` keeps for it |
//! | [`micro_batch`] | [`MicroBatch`], [`MicroBatchScope`]: what `DataParallel::micro_batch` sets up before a micro-batch's forward and backward |
//! | [`options`] | [`DdpOptions`], [`GradientTransport`], [`ZeroStage`] and the process groups a rank forms ([`options::groups`]): what the user chooses, pure |
//! | [`buckets`] | a bucket's life: the pure plan, how it is summed ([`BucketComm`]: [`HostStaging`] through the TCP ring, `NcclBuckets` on the GPU), the finite check on the way to the wire, ZeRO stage 2's reduce-scatter of a bucket |
//! | [`overlap`] | [`mark_block`] and the buckets summed while backward runs, on a communication thread of their own |
//! | [`zero`] | ZeRO stages 1 and 2: [`ShardPlan`] (which rank owns each parameter, pure), [`ShardedSync`] (gradients reduced to owners, parameters gathered back), the optimizer state cut and joined for checkpoints |
//! | [`fsdp`] | ZeRO stage 3 (FSDP): the differentiable gather of a parameter from its shards, a module cut into shards, the blocks gathered ahead on a prefetch thread, the blocks' storage given back, resharding for checkpoints |
//! | [`sync_batch_norm`] | [`SyncBatchNorm`]: BatchNorm over the global batch, its differentiable all-reduce and its process group |

pub mod buckets;
pub mod buffers;
pub mod fsdp;
pub mod gradient_sync;
pub mod micro_batch;
pub mod module;
pub mod options;
pub mod overlap;
pub mod reducer;
pub mod sharding;
pub mod sync_batch_norm;
pub mod zero;

pub use buckets::comm::{BucketComm, HostStaging};
pub use buckets::finite::GradientCheck;
#[cfg(feature = "cuda")]
pub use buckets::nccl::{cuda_ordinal, NcclBuckets};
pub use buffers::{sync_buffers, BufferSync};
pub use gradient_sync::GradientSync;
pub use micro_batch::{MicroBatch, MicroBatchScope};
pub use module::{param_checksum, parameter_count, prepare_module};
pub use options::ddp_options::DdpOptions;
pub use options::transport::{GradientTransport, TransportError};
pub use options::zero_stage::{UnsupportedZeroStage, ZeroStage};
pub use overlap::ready_buckets::{BucketTiming, OverlapStats, StepTimeline};
pub use overlap::ready_op::mark_block;
pub use reducer::{Reducer, ReducerStats};
pub use sync_batch_norm::layer::{SyncBatchNorm, SyncBatchNormConfig};
pub use zero::shard_plan::ShardPlan;
pub use zero::sharded_sync::ShardedSync;
