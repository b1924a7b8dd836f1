//! ZeRO stage 2's unit of work: one gradient bucket reduce-scattered to the owners of its
//! parameters ([`ShardPlan`](crate::ddp::ShardPlan)), so that each rank keeps the mean of only the
//! gradients it owns and drops the rest of the bucket as soon as it is sent.
//!
//! ```text
//!  bucket (ready order):   g7 (owner 1)  g6 (owner 0)  g5 (owner 1)  g4 (owner 0)
//!  owner layout:           [ g6 g4 | g7 g5 ]     counts = [|g6|+|g4|, |g7|+|g5|]
//!  reduce_scatter_v_staged(sum): each piece filled from the gradients (NaN check, 16-bit
//!  rounding), the own block drained (× 1/world, widening) ─▶ rank 0 keeps g6 g4, rank 1 g7 g5
//! ```
//! The layout is [`owner_layout`] (pure); the collective is the one ZeRO stage 1 runs on its
//! whole flat buffer ([`reduce_scatter_to_owners`]), here per bucket, so the means are the
//! same operations as stage 1's and stage 0's (the `f32` sum × `1 / world`, or scaled and
//! rounded to 16 bits before the sum). Only the order of the ring's additions can differ
//! from the all-reduce's at more than two ranks (the weights then agree to rounding).

use std::ops::Range;

use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Dispatch, TensorMetadata};
use burn::tensor::{DType, Shape};

use crate::ddp::buckets::finite::FiniteScan;
use crate::ddp::buckets::host_pieces::{host_slice, read_float, F32Pieces, HalfPieces, HostBucket};
use crate::ddp::buckets::mapped::MappedBuffer;
use crate::error::DdpError;
use crate::group::{Element, PieceStaging, ProcessGroup, ReduceOp};
use crate::kernels::HalfFormat;

/// Where each gradient of a bucket lies when the bucket is laid out owner by owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OwnerLayout {
    /// The bucket's gradients (indices into it) in layout order: rank 0's first, each rank's
    /// in bucket order.
    pub order: Vec<usize>,
    /// The range of `order[i]` in the laid-out buffer.
    pub ranges: Vec<Range<usize>>,
    /// Elements each rank owns in the bucket (the blocks of `reduce_scatter_v`; 0 for a rank
    /// that owns none of it).
    pub counts: Vec<usize>,
}

/// The owner layout of a bucket of gradients of `numels` elements owned by `owners` (ranks
/// below `world`). Pure.
pub(crate) fn owner_layout(numels: &[usize], owners: &[usize], world: usize) -> OwnerLayout {
    let mut order: Vec<usize> = (0..numels.len()).collect();
    // Stable: each rank's gradients stay in bucket order.
    order.sort_by_key(|&i| owners[i]);
    let mut counts = vec![0usize; world];
    let mut start = 0;
    let ranges = order
        .iter()
        .map(|&i| {
            counts[owners[i]] += numels[i];
            start += numels[i];
            start - numels[i]..start
        })
        .collect();
    OwnerLayout {
        order,
        ranges,
        counts,
    }
}

/// Averages one bucket of gradients over the ranks of `group`, keeping only this rank's:
/// `owners[i]` is the rank that keeps gradient `i`. Returns, in bucket order, the mean of
/// each gradient this rank owns (an `f32` tensor of `shapes[i]` on the gradient's device) and
/// `None` for the others, whose memory is released here. Collective: every rank passes the
/// same bucket (sizes, owners, `compression`), in the same order.
///
/// # Errors
/// An owner that is not a rank of the group ([`DdpError::Mismatch`]), a device read that
/// failed, and what the group reports.
pub(crate) fn mean_to_owners<G: ProcessGroup>(
    group: &mut G,
    grads: Vec<FloatTensor<Dispatch>>,
    shapes: &[Shape],
    owners: &[usize],
    compression: Option<HalfFormat>,
    scale: f32,
    scan: &mut FiniteScan,
) -> Result<Vec<Option<FloatTensor<Dispatch>>>, DdpError> {
    let (rank, world) = (group.rank(), group.world_size());
    if let Some(bad) = owners.iter().find(|&&o| o >= world) {
        return Err(DdpError::Mismatch(format!(
            "a gradient bucket names rank {bad} as an owner in a group of {world}"
        )));
    }
    let numels: Vec<usize> = shapes.iter().map(Shape::num_elements).collect();
    let layout = owner_layout(&numels, owners, world);
    let mut host = Vec::with_capacity(grads.len());
    for grad in grads {
        let n = grad.shape().num_elements();
        // One device-to-host copy per gradient (Burn's CPU backend hands its buffer over).
        let flat = Dispatch::float_reshape(grad, Shape::new([n]));
        let (device, data) = read_float(flat)?;
        let data = if data.dtype() == DType::F32 {
            data
        } else {
            data.convert::<f32>()
        };
        host.push(Some((device, data)));
    }
    // The fills walk the owner layout, so the slices go in its order.
    let mut laid_out: Vec<_> = layout.order.iter().map(|&i| (i, host[i].take())).collect();
    let slices = laid_out
        .iter_mut()
        .filter_map(|(_, h)| h.as_mut().map(|(_, data)| host_slice::<f32>(data)))
        .collect::<Result<Vec<_>, _>>()?;
    let bucket = HostBucket::at(slices, layout.ranges.clone(), scale, scan);
    reduce_scatter_to_owners(group, &layout.counts, bucket, compression)?;

    let mut out: Vec<Option<FloatTensor<Dispatch>>> = (0..owners.len()).map(|_| None).collect();
    for (i, h) in laid_out {
        if owners[i] != rank {
            continue;
        }
        if let Some((device, data)) = h {
            let flat = Dispatch::float_from_data(data, &device);
            out[i] = Some(Dispatch::float_reshape(flat, shapes[i].clone()));
        }
    }
    Ok(out)
}

/// The reduce-scatter (sum) of an owner-ordered buffer of `counts` blocks, filled and drained
/// through `bucket`: in f32, or in 16 bits with `compression`. Only this rank's block is
/// drained. The buffer is mapped for the call and returned after it ([`MappedBuffer`]).
/// Collective. Returns the bytes of one element on the wire.
pub(crate) fn reduce_scatter_to_owners<G: ProcessGroup>(
    group: &mut G,
    counts: &[usize],
    bucket: HostBucket<'_>,
    compression: Option<HalfFormat>,
) -> Result<usize, DdpError> {
    match compression {
        None => reduce_scatter_in::<f32, _>(group, counts, &mut F32Pieces(bucket)).map(|()| 4),
        Some(format) => {
            let mut staging = HalfPieces { bucket, format };
            match format {
                HalfFormat::Bf16 => reduce_scatter_in::<half::bf16, _>(group, counts, &mut staging),
                HalfFormat::F16 => reduce_scatter_in::<half::f16, _>(group, counts, &mut staging),
            }
            .map(|()| 2)
        }
    }
}

/// [`reduce_scatter_to_owners`] in the wire type `T`, through a buffer mapped for the call.
fn reduce_scatter_in<T: Element, G: ProcessGroup>(
    group: &mut G,
    counts: &[usize],
    staging: &mut dyn PieceStaging<T>,
) -> Result<(), DdpError> {
    let mut flat = MappedBuffer::<T>::zeroed(counts.iter().sum()).map_err(no_buffer)?;
    group.reduce_scatter_v_staged(&mut flat, counts, ReduceOp::Sum, staging)?;
    Ok(())
}

/// The error of a reduce-scatter buffer the kernel would not map.
fn no_buffer(e: std::io::Error) -> DdpError {
    DdpError::Device(format!(
        "cannot allocate a gradient reduce-scatter buffer in host memory: {e}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owner_layout_puts_each_ranks_gradients_together_in_bucket_order() {
        let layout = owner_layout(&[10, 3, 5, 7, 2], &[1, 0, 1, 0, 2], 4);
        assert_eq!(layout.order, [1, 3, 0, 2, 4]);
        assert_eq!(layout.ranges, [0..3, 3..10, 10..20, 20..25, 25..27]);
        // Rank 3 owns nothing in this bucket: an empty block.
        assert_eq!(layout.counts, [10, 15, 2, 0]);
    }
}
