//! The one implementation of [`BucketOps`] callers use, on Burn's `Dispatch` backend: CubeCL
//! kernels where the tensors live on a CubeCL device, Burn ops and host code elsewhere.

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Dispatch, DispatchDevice, Shape};

use super::bucket_ops::{BucketOps, BucketOpsError};
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use super::cube;
use super::fallback;
use super::half_format::HalfFormat;

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
