//! A gradient bucket's life: planned, packed, summed across ranks and unpacked.
//!
//! - [`plan`]: the pure bucket plan (which parameters share a bucket, in which order).
//! - [`comm`]: [`BucketComm`](comm::BucketComm), how a bucket is summed:
//!   [`HostStaging`](comm::HostStaging) through any host process group (the TCP ring), or
//!   `NcclBuckets` on the GPU ([`nccl`], feature `cuda`).
//! - `host_pieces`: a bucket already in host memory (Burn's CPU backend), staged into the
//!   ring piece by piece so its copies and conversions overlap the wire.
//! - [`finite`]: each rank's gradients checked for NaN / ±Inf on the way to the wire, and
//!   [`GradientCheck`](finite::GradientCheck), which ranks had them.
//! - `scatter`: ZeRO stage 2's bucket, reduce-scattered to its parameters' owners.
//! - [`stats`]: [`ReducerStats`](stats::ReducerStats), the counters of what was sent.
//! - `mapped`: buffers mapped from the kernel and returned on drop (ZeRO's reduce-scatters).

pub mod comm;
pub mod finite;
pub(crate) mod host_pieces;
pub(crate) mod mapped;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod plan;
pub(crate) mod scatter;
pub mod stats;
