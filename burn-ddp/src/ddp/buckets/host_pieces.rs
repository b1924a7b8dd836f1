//! A bucket of gradients that already lives in host memory (Burn's CPU backend), staged into
//! the ring piece by piece ([`PieceStaging`]) instead of packed before and unpacked after it.
//! ZeRO stage 1 stages its owner-ordered flat buffer the same way (drained for its own block
//! only), and stage 2 each owner-ordered bucket. Also the host reads they share: a tensor read
//! into host memory ([`read_float`]) and its values as a slice ([`host_slice`]).
//!
//! ```text
//!   gradients (host)  ──fill: copy, or × 1/world and round to 16 bits; NaN check──▶ ring piece
//!   ring piece (sum)  ──drain: × 1/world, or widen──▶ the same gradients, in place
//! ```
//! Each element goes through the same operations in the same order as the whole-bucket path
//! (`pack_bucket`, [`host16::round_scaled`], the ring's sum, [`host16::widen`] or the
//! `1/world` multiply, `unpack_bucket`), so the bits are the same; only *when* each piece is
//! done changes: while the ring's other pieces are on the wire.

use std::ops::Range;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Dispatch, DispatchDevice, TensorMetadata};
use burn::tensor::{Tensor, TensorData};

use crate::ddp::buckets::finite::FiniteScan;
use crate::ddp::buckets::plan::segments;
use crate::error::DdpError;
use crate::group::PieceStaging;
use crate::kernels::{host16, HalfFormat};

/// One bucket's gradients on the host, with where each lies in the bucket.
pub(crate) struct HostBucket<'g> {
    /// Each gradient's values; the drains write the means back into them.
    pub grads: Vec<&'g mut [f32]>,
    /// Each gradient's range in the bucket: sorted and disjoint (consecutive from 0 in a
    /// bucket, with gaps in ZeRO's layout where a parameter has no gradient).
    pub ranges: Vec<Range<usize>>,
    /// The `1 / world` of the mean.
    pub scale: f32,
    pub scan: &'g mut FiniteScan,
}

impl<'g> HostBucket<'g> {
    pub fn new(grads: Vec<&'g mut [f32]>, scale: f32, scan: &'g mut FiniteScan) -> Self {
        let mut start = 0;
        let ranges = grads
            .iter()
            .map(|g| {
                start += g.len();
                start - g.len()..start
            })
            .collect();
        Self {
            grads,
            ranges,
            scale,
            scan,
        }
    }

    /// Gradients at the given `ranges` of a layout (sorted, disjoint; gaps are left as the
    /// collective's buffer holds them): ZeRO's owner-ordered flat buffer.
    pub fn at(
        grads: Vec<&'g mut [f32]>,
        ranges: Vec<Range<usize>>,
        scale: f32,
        scan: &'g mut FiniteScan,
    ) -> Self {
        Self {
            grads,
            ranges,
            scale,
            scan,
        }
    }

    /// Elements in the bucket.
    pub fn len(&self) -> usize {
        self.ranges.last().map_or(0, |r| r.end)
    }
}

/// `f32` buckets: fill copies (and checks), drain multiplies by `1 / world`.
pub(crate) struct F32Pieces<'g>(pub HostBucket<'g>);

impl PieceStaging<f32> for F32Pieces<'_> {
    fn fill(&mut self, range: Range<usize>, piece: &mut [f32]) {
        let bucket = &mut self.0;
        for (g, within, at) in segments(&bucket.ranges, range) {
            piece[at].copy_from_slice(&bucket.grads[g][within]);
        }
        bucket.scan.host_f32(piece);
    }

    fn drain(&mut self, range: Range<usize>, piece: &[f32]) {
        let bucket = &mut self.0;
        let scale = bucket.scale;
        for (g, within, at) in segments(&bucket.ranges, range) {
            for (d, &s) in bucket.grads[g][within].iter_mut().zip(&piece[at]) {
                *d = s * scale;
            }
        }
    }
}

/// Compressed buckets: fill multiplies by `1 / world` and rounds to `format` (and checks the
/// 16-bit values), drain widens the 16-bit sums.
pub(crate) struct HalfPieces<'g> {
    pub bucket: HostBucket<'g>,
    pub format: HalfFormat,
}

impl HalfPieces<'_> {
    fn fill_bits(&mut self, range: Range<usize>, piece: &mut [u16]) {
        let bucket = &mut self.bucket;
        for (g, within, at) in segments(&bucket.ranges, range) {
            host16::round_scaled(
                self.format,
                &bucket.grads[g][within],
                bucket.scale,
                &mut piece[at],
            );
        }
        bucket.scan.host_half(piece, self.format);
    }

    fn drain_bits(&mut self, range: Range<usize>, piece: &[u16]) {
        let bucket = &mut self.bucket;
        for (g, within, at) in segments(&bucket.ranges, range) {
            host16::widen(self.format, &piece[at], &mut bucket.grads[g][within]);
        }
    }
}

/// The ring reduces `half`'s types; the staging works on their bits.
macro_rules! half_pieces {
    ($t:ty) => {
        impl PieceStaging<$t> for HalfPieces<'_> {
            fn fill(&mut self, range: Range<usize>, piece: &mut [$t]) {
                self.fill_bits(range, bytemuck::cast_slice_mut(piece));
            }
            fn drain(&mut self, range: Range<usize>, piece: &[$t]) {
                self.drain_bits(range, bytemuck::cast_slice(piece));
            }
        }
    };
}
half_pieces!(half::bf16);
half_pieces!(half::f16);

/// A 1-D float bucket read into host memory (one device-to-host copy), and its device.
pub(crate) fn read_float(
    bucket: FloatTensor<Dispatch>,
) -> Result<(DispatchDevice, TensorData), DdpError> {
    let device = bucket.device();
    let data = Tensor::<1>::from_dispatch(bucket)
        .try_into_data()
        .map_err(read_error)?;
    Ok((device, data))
}

pub(crate) fn read_error(e: impl std::fmt::Debug) -> DdpError {
    DdpError::Device(format!("reading a gradient bucket failed: {e:?}"))
}

/// `data`'s values as a mutable slice of `T`, or an error naming both types.
pub(crate) fn host_slice<T: bytemuck::Pod + burn::tensor::Element>(
    data: &mut TensorData,
) -> Result<&mut [T], DdpError> {
    let dtype = data.dtype();
    data.as_mut_slice::<T>().map_err(|e| {
        DdpError::Unsupported(format!(
            "a gradient bucket read back as {dtype:?}, not {}: {e:?}",
            std::any::type_name::<T>()
        ))
    })
}
