//! ZeRO stages 1 and 2: each rank owns a share of the parameters, keeps their optimizer
//! state (and at stage 2 only their gradients), steps them, and sends them to the others.
//!
//! - [`shard_plan`]: [`ShardPlan`](shard_plan::ShardPlan), which rank owns each parameter
//!   (pure).
//! - [`sharded_sync`]: [`ShardedSync`](sharded_sync::ShardedSync): gradients reduced to their
//!   owner, parameters gathered back from it; the optimizer-state helpers for checkpoints
//!   (stages 1 and 2).
//!
//! Stage 2's reduce-scatter of each bucket lives with the buckets
//! ([`crate::ddp::buckets`]); stage 3 is [`crate::ddp::fsdp`].

pub mod shard_plan;
pub mod sharded_sync;
