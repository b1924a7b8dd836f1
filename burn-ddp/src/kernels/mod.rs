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
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube;
pub mod fallback;
pub mod host16;
pub mod wire16;

pub use wire16::HalfFormat;

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch, DispatchDevice, ExecutionError, Shape};

/// Gradient-bucket operations, one launch each on CubeCL backends (pack: see its launch count).
///
/// All of them are local (not collective): they touch only this process's device. None of them
/// blocks: like any Burn op they enqueue work, and errors of the device surface at the next
/// synchronisation (`Device::sync`, a read) — except where a method says it reads back to the host.
///
/// Buckets are always `f32`: inputs of another float dtype are converted by
/// [`pack_bucket`](BucketOps::pack_bucket), and [`unpack_bucket`](BucketOps::unpack_bucket)
/// produces `f32` tensors. Lengths are limited to [`MAX_BUCKET_LEN`] (2^31 - 1) elements, as the
/// kernels index with 32 bits; a bucket is megabytes, so going past that is a bug of the caller
/// and panics.
pub trait BucketOps: Backend {
    /// Concatenates the flattened `tensors`, in order, into one new 1-D `f32` tensor whose length
    /// is the sum of their element counts.
    ///
    /// - `tensors`: any shapes and ranks, contiguous or not, float of any dtype (converted to
    ///   `f32`), empty tensors allowed (they contribute nothing); all on `device`.
    /// - `device`: where the bucket lives; it is needed when `tensors` is empty (the result is
    ///   then an empty 1-D tensor).
    ///
    /// On CubeCL backends the result is always a freshly allocated buffer that nothing else
    /// refers to, so it may be all-reduced in place. The [`fallback`] may return a view of the
    /// input when there is exactly one non-empty tensor.
    ///
    /// Launches on CubeCL backends: one per group of at most `max_bindings - 3` (capped at 32)
    /// non-empty tensors, since each input is its own buffer binding; plus one copy for each
    /// input that is not contiguous or not `f32`.
    ///
    /// # Panics
    /// If the total length exceeds [`MAX_BUCKET_LEN`], or (CubeCL) a tensor is on another device.
    fn pack_bucket(tensors: Vec<FloatTensor<Self>>, device: &Self::Device) -> FloatTensor<Self>;

    /// Splits a 1-D bucket back into tensors of `shapes` (in order), each element multiplied by
    /// `scale` (fused: the `1 / world_size` of an average; pass `1.0` for a plain split).
    ///
    /// The multiply is one IEEE `f32` multiply per element, so results are bit-identical to
    /// `x * scale` on the host, except that devices which flush subnormals to zero do so here,
    /// and that the [`fallback`] skips a multiply by 1 (a signalling NaN then stays signalling).
    ///
    /// # Panics
    /// If `bucket` is not 1-D `f32`, or its length differs from the sum of the element counts of
    /// `shapes`: the bucket plan and the bucket disagree, a bug of the caller.
    ///
    /// On CubeCL backends this is one launch (plus the upload of two small offset tables); the
    /// outputs are views into one new buffer (each view starting at the device's offset
    /// alignment), which stays allocated until the last of them is dropped. Empty shapes get
    /// empty tensors. The fallback multiplies the whole bucket once and slices it.
    fn unpack_bucket(
        bucket: FloatTensor<Self>,
        shapes: &[Shape],
        scale: f32,
    ) -> Vec<FloatTensor<Self>>;

    /// Multiplies each element of a 1-D `f32` bucket by `scale` (one `f32` multiply: the
    /// `1 / world_size` of an average, applied before the rounding so a sum of the results
    /// cannot overflow where the mean does not) and rounds it to `format` for communication:
    /// round to nearest, ties to even; NaN stays NaN (quiet, sign kept); ±inf and ±0 are kept;
    /// finite values past the format's range round to ±inf; subnormals are rounded, not flushed
    /// (except by devices that flush `f32` subnormals). Bit-exact with [`wire16::compress`],
    /// except that with `scale != 1` a device's multiply may replace a NaN's payload by its
    /// canonical NaN (tested bit for bit on wgpu; the CUDA build has not run on a GPU yet).
    ///
    /// Returns the packed words described in [`wire16`]: a 1-D `U32` int tensor of
    /// `ceil(len / 2)` elements, half the bytes of the bucket.
    ///
    /// # Errors
    /// Backends without kernels (the [`fallback`]) round on the host and return
    /// [`BucketOpsError::Read`] if the device cannot be read. CubeCL backends never fail here.
    ///
    /// # Panics
    /// If `bucket` is not 1-D `f32`.
    fn compress_bucket(
        bucket: FloatTensor<Self>,
        format: HalfFormat,
        scale: f32,
    ) -> Result<IntTensor<Self>, BucketOpsError>;

    /// The inverse of [`compress_bucket`](BucketOps::compress_bucket) (without its scale):
    /// widens `len` values of `format` (packed as it returns them) to a new 1-D `f32` tensor of
    /// `len` elements. Exact: every bf16 and f16 is an `f32`, NaN payloads included.
    ///
    /// # Errors
    /// As for [`compress_bucket`](BucketOps::compress_bucket): only host-side fallbacks fail.
    ///
    /// # Panics
    /// If `words` is not a 1-D `U32` tensor of exactly `ceil(len / 2)` elements.
    fn decompress_bucket(
        words: IntTensor<Self>,
        len: usize,
        format: HalfFormat,
    ) -> Result<FloatTensor<Self>, BucketOpsError>;
}

/// Whether tensors on `device` live in host memory (Burn's CPU backend, [`Flex`]): reading one
/// to the host is a copy, not a transfer, so a host communicator may as well do the 16-bit
/// rounding itself on the way ([`crate::ddp::BucketComm::all_reduce_compressed`]), which saves the
/// copies in and out of the device between the steps. `false` for every other device.
///
/// [`Flex`]: burn::backend::Flex
pub fn host_memory(device: &DispatchDevice) -> bool {
    match device {
        DispatchDevice::Flex(_) => true,
        DispatchDevice::Autodiff(device) => host_memory(device),
        #[allow(unreachable_patterns)]
        _ => false,
    }
}

/// The one implementation callers use: routes each call by the primitives it is given (module
/// docs, "Which tensor gets what").
impl BucketOps for Dispatch {
    fn pack_bucket(tensors: Vec<FloatTensor<Self>>, device: &DispatchDevice) -> FloatTensor<Self> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        let tensors = match cube::pack_bucket(tensors, device) {
            Ok(bucket) => return bucket,
            Err(tensors) => tensors,
        };
        fallback::pack_bucket::<Self>(tensors, device)
    }

    fn unpack_bucket(
        bucket: FloatTensor<Self>,
        shapes: &[Shape],
        scale: f32,
    ) -> Vec<FloatTensor<Self>> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        let bucket = match cube::unpack_bucket(bucket, shapes, scale) {
            Ok(tensors) => return tensors,
            Err(bucket) => bucket,
        };
        fallback::unpack_bucket::<Self>(bucket, shapes, scale)
    }

    fn compress_bucket(
        bucket: FloatTensor<Self>,
        format: HalfFormat,
        scale: f32,
    ) -> Result<IntTensor<Self>, BucketOpsError> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        let bucket = match cube::compress_bucket(bucket, format, scale) {
            Ok(words) => return words,
            Err(bucket) => bucket,
        };
        fallback::compress_bucket::<Self>(bucket, format, scale)
    }

    fn decompress_bucket(
        words: IntTensor<Self>,
        len: usize,
        format: HalfFormat,
    ) -> Result<FloatTensor<Self>, BucketOpsError> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        let words = match cube::decompress_bucket(words, len, format) {
            Ok(bucket) => return bucket,
            Err(words) => words,
        };
        fallback::decompress_bucket::<Self>(words, len, format)
    }
}

/// Why a bucket operation failed. Only host-side fallbacks fail; kernels report device errors at
/// the next synchronisation, like any Burn op.
#[derive(Debug, thiserror::Error)]
pub enum BucketOpsError {
    /// Reading a tensor back to the host failed (device lost, out of memory, ...).
    #[error("{op}: reading the tensor back from the device failed: {source}")]
    Read {
        /// The bucket operation, e.g. `"compress_bucket"`.
        op: &'static str,
        /// Burn's report.
        #[source]
        source: ExecutionError,
    },
    /// The data read back did not have the element type the operation works on.
    #[error("{op}: unexpected tensor data: {reason}")]
    Data {
        /// The bucket operation.
        op: &'static str,
        /// What was wrong.
        reason: String,
    },
}

/// Most elements a bucket may hold: the kernels index with 32 bits, and keeping lengths below
/// 2^31 leaves room for `index + grid stride` without wrapping.
pub const MAX_BUCKET_LEN: usize = i32::MAX as usize;

/// Checks [`MAX_BUCKET_LEN`]; every operation does, on every backend, so a bucket plan that works
/// on the CPU also works on a GPU.
pub(crate) fn check_len(op: &str, len: usize) {
    assert!(
        len <= MAX_BUCKET_LEN,
        "{op}: {len} elements exceed the {MAX_BUCKET_LEN} a bucket may hold (32-bit indexing); \
         use smaller buckets"
    );
}
