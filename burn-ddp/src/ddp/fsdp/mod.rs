//! ZeRO stage 3 (PyTorch's FSDP): the weights, gradients and optimizer state of the marked
//! blocks cut into flat shards, one per rank, each block gathered whole only while it runs.
//! The modules the crate's users name are public (a shard group's counters, a layout, the
//! resharding of checkpoints); the rest is the crate's.
//!
//! - [`shard_gather`]: `gather_shard`, the differentiable all-gather of a parameter from its
//!   flat shards (backward: reduce-scatter), re-run in backward under Burn's gradient
//!   checkpointing; [`ShardComm`](shard_gather::ShardComm), the group it runs on.
//! - [`sharded_module`]: a module's parameters cut into those shards
//!   ([`ShardLayout`](sharded_module::ShardLayout)), and the module gathered back for a
//!   forward.
//! - `fully_sharded`: stage 3 in the DDP step: which blocks are sharded, the shards' groups,
//!   their gradients' mean and verdict (what [`Sharding`](crate::ddp::sharding::Sharding)
//!   does at stage 3).
//! - `shard_prefetch`: the blocks' forward gathers run ahead on a thread of their own.
//! - `block_storage`: a block's gathered values as the tensors' storage, given back when the
//!   forward leaves the block and gathered again when read.
//! - [`gathered_bytes`]: how many bytes of whole parameters a rank holds at once.
//! - [`reshard`]: shards joined whole or re-cut for another world size (sharded checkpoints),
//!   pure.

mod block_storage;
pub(crate) mod fully_sharded;
pub mod gathered_bytes;
pub mod reshard;
pub mod shard_gather;
pub(crate) mod shard_prefetch;
pub mod sharded_module;
