//! The contract of the gradient-bucket operations: the [`BucketOps`] trait, its error and the
//! bucket length limit every implementation checks.

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, ExecutionError, Shape};

use super::half_format::HalfFormat;

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
