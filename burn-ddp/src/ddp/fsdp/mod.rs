//! ZeRO stage 3 (PyTorch's FSDP): the weights, gradients and optimizer state of the marked
//! blocks cut into flat shards, one per rank, each block gathered whole only while it runs.
//!
//! - [`shard_gather`]: [`gather_shard`](shard_gather::gather_shard), the differentiable
//!   all-gather of a parameter from its flat shards (backward: reduce-scatter), re-run in
//!   backward under Burn's gradient checkpointing.
//! - [`sharded_module`]: a module's parameters cut into those shards, and the module gathered
//!   back for a forward.
//! - [`fully_sharded`]: stage 3 in the DDP step: which blocks are sharded, the shards'
//!   groups, their gradients' mean and verdict.
//! - [`shard_prefetch`]: the blocks' forward gathers run ahead on a thread of their own.
//! - `block_storage`: a block's gathered values as the tensors' storage, given back when the
//!   forward leaves the block and gathered again when read.
//! - [`gathered_bytes`]: how many bytes of whole parameters a rank holds at once.
//! - [`reshard`]: shards joined whole or re-cut for another world size (sharded checkpoints),
//!   pure.

mod block_storage;
pub mod fully_sharded;
pub mod gathered_bytes;
pub mod reshard;
pub mod shard_gather;
pub mod shard_prefetch;
pub mod sharded_module;
