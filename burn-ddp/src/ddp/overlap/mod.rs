//! Gradient buckets summed while backward runs (PyTorch DDP's overlap), for models whose
//! blocks are marked.
//!
//! - [`ready_op`]: [`mark_block`](ready_op::mark_block), the per-block hook a model calls at
//!   each block's entry: its gradients are final once backward has run past it (and at ZeRO
//!   stage 3, the block gathered whole for its forward).
//! - [`ready_buckets`]: [`Overlap`](ready_buckets::Overlap), buckets planned in the order
//!   gradients become ready and handed to the communication thread as they fill.
//! - [`comm_thread`]: the thread that sums them, on a process group of its own.

pub mod comm_thread;
pub mod ready_buckets;
pub mod ready_op;
