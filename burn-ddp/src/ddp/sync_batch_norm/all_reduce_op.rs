//! [`all_reduce_sum`]: a differentiable sum of a small float tensor across the ranks — what
//! `torch.distributed.nn.functional.all_reduce` is to PyTorch, and the building block of
//! [`crate::ddp::SyncBatchNorm`].
//!
//! ```text
//! forward:   y = Σ_ranks x                 (every rank gets the same y)
//! backward:  dL/dx = Σ_ranks dL/dy         (the incoming gradient, all-reduced the same way)
//! ```
//! The backward is right for data parallelism: the job's loss is the sum of the ranks' losses,
//! and each rank's `y` feeds every rank's loss, so the gradient that reaches this rank's `x` is
//! the sum of what every rank's `y` received.
//!
//! ## How Burn 0.22 lets a crate outside Burn register a backward
//! `#[backend_extension(.., Autodiff)]` generates the `Dispatch` routing of the trait
//! [`SumAcrossRanks`]: untracked tensors go to the backend's own implementation, tracked ones to
//! the implementation for `Autodiff<B, C>` written here, which records a step with
//! burn-autodiff's `Backward` / `OpsPrep` / `OpsKind` machinery (as burn-autodiff's own
//! `all_reduce` does). Both the forward and the backward run [`host_sum`]: read the tensor back,
//! sum it across the ranks of the synchronised-BatchNorm group ([`super::sync_group`]), write it
//! back. A host round trip, which is fine for per-channel statistics of a few hundred values,
//! and the same code for every backend (Flex; CubeCL's, fused or not).
//!
//! ## Contract
//! Collective over the installed group (the contract of [`super::sync_group`]): every rank calls
//! it in the same order, with tensors of the same number of elements; the backward pass runs
//! the collective again, so every rank must run its backward too. Each collective has the
//! group's deadline. Without a group of more than one rank, `y = x` and `dL/dx = dL/dy`. On
//! failure the result is this rank's own `x` (or gradient) and the error is recorded for the
//! next DDP step (see [`super::sync_group`]).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Backend, Dispatch, TensorMetadata};
use burn::tensor::{Tensor, TensorData};

use crate::ddp::sync_batch_norm::sync_group;
use crate::error::SyncBatchNormError;
use crate::host_values::host_values;

/// The backend operation under [`all_reduce_sum`]. Implemented for Burn's CPU backend (Flex),
/// its CubeCL backend (features `wgpu` / `cuda`) and autodiff over any of them. On a CubeCL
/// device (wgpu, CUDA, or CubeCL's CPU runtime) without one of those features of this crate, the
/// generated routing panics ("Backend not supported for custom op"): the `cfg` of a selector is
/// evaluated in this crate, which cannot see Burn's own backend features.
#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")), Autodiff)]
pub trait SumAcrossRanks: Backend {
    /// `tensor` summed element-wise across the ranks (the module docs' contract).
    fn sum_across_ranks(tensor: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl SumAcrossRanks for burn::backend::Flex {
    fn sum_across_ranks(tensor: FloatTensor<Self>) -> FloatTensor<Self> {
        host_sum::<Self>(tensor)
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl SumAcrossRanks for burn::backend::Cube {
    fn sum_across_ranks(tensor: FloatTensor<Self>) -> FloatTensor<Self> {
        host_sum::<Self>(tensor)
    }
}

impl<B: Backend, C: CheckpointStrategy> SumAcrossRanks for Autodiff<B, C> {
    fn sum_across_ranks(tensor: FloatTensor<Self>) -> FloatTensor<Self> {
        /// The backward step: the incoming gradient, summed across the ranks.
        #[derive(Debug)]
        struct SumBackward;

        impl<B: Backend> Backward<B, 1> for SumBackward {
            type State = ();

            fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _: &mut Checkpointer) {
                unary::<B, _>(ops.parents, ops.node, grads, host_sum::<B>);
            }
        }

        let (primitive, node) = tensor.into_parts();
        let output = host_sum::<B>(primitive);
        // Compute-bound: a checkpointing strategy must keep the output rather than recompute
        // it, since recomputing would run the collective again on this rank only.
        match SumBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }
}

/// `tensor` summed element-wise across the ranks of the synchronised-BatchNorm group, in the
/// forward pass, and its gradient summed the same way in the backward pass (module docs).
///
/// Collective (every rank, same order, same element count; the backward too); deadline: the
/// group's timeout. Without a group of more than one rank it returns `tensor`.
pub fn all_reduce_sum<const D: usize>(tensor: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(Dispatch::sum_across_ranks(tensor.into_dispatch()))
}

/// Reads `tensor` back, sums it across the ranks through the host, and writes the sums to a new
/// tensor of the same shape, dtype and device. Without a group of more than one rank, or on a
/// failure (recorded for the next DDP step), `tensor` itself.
fn host_sum<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    if !sync_group::is_active() {
        return tensor;
    }
    let shape = tensor.shape();
    let dtype = tensor.dtype();
    let device = tensor.device();
    let data = match burn::tensor::try_read_sync(B::float_into_data(tensor.clone())) {
        Some(Ok(data)) => data,
        Some(Err(e)) => return failed(tensor, e.to_string()),
        None => return failed(tensor, "this platform cannot block on a read".into()),
    };
    let mut values = match host_values::<f32>(data) {
        Ok(values) => values,
        Err(e) => return failed(tensor, format!("{e:?}")),
    };
    if !sync_group::sum_in_place(&mut values) {
        return tensor;
    }
    let summed = TensorData::new(values, shape).convert_dtype(dtype);
    B::float_from_data(summed, &device)
}

/// `tensor` unchanged, with the read-back failure recorded. This rank then skips the collective
/// the others are in: they fail at their deadline naming it, and it fails at its next DDP step.
fn failed<T>(tensor: T, message: String) -> T {
    sync_group::record_error(SyncBatchNormError::Readback(message));
    tensor
}
