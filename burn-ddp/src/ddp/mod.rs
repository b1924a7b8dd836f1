//! The DDP layer: what turns N copies of a Burn training loop into one data-parallel job.
//!
//! - [`module`]: [`prepare_module`] gives parameters deterministic ids and broadcasts rank 0's
//!   values, so every replica starts equal (and optimizer state is keyed the same everywhere).
//! - [`bucket`]: the pure bucket plan.
//! - [`reducer`]: [`Reducer`], which averages `GradientsParams` across ranks, bucket by bucket.
//! - `device` (feature `cuda`): `DeviceReducer`, the same on the GPU with NCCL, no host copies.

pub mod bucket;
#[cfg(feature = "cuda")]
pub mod device;
pub mod module;
pub mod reducer;

#[cfg(feature = "cuda")]
pub use device::{CudaBuffers, DeviceReducer};
pub use module::{param_checksum, prepare_module};
pub use reducer::{Reducer, ReducerStats};
