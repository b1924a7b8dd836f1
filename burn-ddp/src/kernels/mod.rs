//! Gradient-bucket operations on the device: pack, unpack + scale, bf16 / fp16 compress and
//! decompress.
//!
//! The DDP reducer copies many gradient tensors into one contiguous **bucket**, all-reduces the
//! bucket (one collective instead of one per parameter), and copies the result back out, scaled
//! by `1 / world_size`. Done with plain Burn ops that is one launch per tensor each way (a `cat`
//! is a `slice_assign` per input); [`BucketOps`] does each step in one launch (pack: a few, see
//! below) on Burn's CubeCL backends.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | the [`BucketOps`] trait and its contracts, [`BucketOpsError`] |
//! | [`wire16`] | the 16-bit wire formats ([`HalfFormat`]): rounding on the host, packing two per `u32` (pure) |
//! | [`host16`] | 16-bit rounding, widening and sums over host slices, vectorised, bit for bit the `half` crate's (pure) |
//! | [`fallback`] | a generic implementation with Burn backend ops (any [`Backend`]) |
//! | `cube` (features `wgpu` / `cuda`) | the `#[cube]` kernels; [`BucketOps`] for `CubeBackend` and `Fusion` |
//! | [`bench`] | [`bench::measure_pack_unpack`]: pack + unpack throughput on a device |
//!
//! ## Which tensor gets what
//! Burn 0.22 has one runtime backend, [`Dispatch`]; callers write `Dispatch::pack_bucket(..)`.
//! [`BucketOps`] for [`Dispatch`] looks at the primitives at run time:
//! - tensors of Burn's CubeCL backend (wgpu, CUDA, ...; features `wgpu` / `cuda`), not tracked
//!   by autodiff: handed to `burn_cubecl::Cube`'s [`BucketOps`]. That type is the plain
//!   `CubeBackend` (the kernels) unless some crate of the build turns on `burn-cubecl`'s `fusion`
//!   feature (Burn's default features do); it is then `Fusion<CubeBackend>`, which gets the
//!   [`fallback`] ops, recorded lazily by the fusion stream (the kernels cannot be registered as
//!   a fusion operation without Burn's IR types).
//! - everything else ([`Flex`], Burn's CPU backend, above all): the [`fallback`] over
//!   [`Dispatch`].
//!
//! ## The 16-bit wire formats
//! [`BucketOps::compress_bucket`] returns a 1-D int tensor of dtype `U32` holding two bf16 or
//! f16 values a word; read as bytes that is a dense 16-bit array a collective can reduce
//! ([`wire16`] has the layout). `u32` words rather than Burn's `BF16` / `F16` dtypes because most
//! Vulkan drivers have neither 16-bit floats nor 16-bit storage, while `u32` works on every
//! CubeCL runtime.
//!
//! [`Flex`]: burn::backend::Flex
//! [`Dispatch`]: burn::backend::Dispatch
//! [`Backend`]: burn::backend::Backend

pub mod bench;
pub mod bucket_ops;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube;
mod dispatch;
pub mod fallback;
pub mod half_format;
pub mod host16;
pub mod wire16;

pub use bucket_ops::{BucketOps, BucketOpsError, MAX_BUCKET_LEN};
pub use dispatch::host_memory;
pub use half_format::HalfFormat;
