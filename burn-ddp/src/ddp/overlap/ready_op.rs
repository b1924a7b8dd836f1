//! [`mark_block`]: the per-block gradient-ready hook — one call at a block's entry tells the
//! DDP layer when backward has finished that block, so its gradients can go on the wire while
//! backward goes on through the blocks before it (what PyTorch DDP's autograd hooks do).
//!
//! ## Why a call at the block's entry works (burn-autodiff 0.22)
//! The backward tape runs by node *order*, highest first; a node's order is its parents'
//! highest plus one; a parameter is a leaf of order 0. So an op on a parameter alone (the
//! reshape that broadcasts a bias, a norm's scale) has order 1 and its backward runs at the
//! very end: a parameter's gradient is not final before backward ends, whatever the block.
//! `mark_block(&x, &block)` gives the block, for this forward, each parameter *lifted*: an
//! identity of the parameter whose parents are the parameter and the block's input `x`, so
//! its order is `x`'s plus one. Every op of the block then has a higher order (it uses a
//! lifted parameter or depends on `x`), every op of the blocks before it a lower one (they
//! made `x`): the lift's backward runs right after the block's backward, when the gradient it
//! passes to the parameter is final, and hands it to the overlap of [`super::ready_buckets`].
//! Verified by `overlap::tests` (blocks come ready in reverse forward order, biases
//! included). A parameter also used outside the block (tied weights) is not final then: do
//! not mark such a block.
//!
//! ## What it costs
//! Nothing when no [`DataParallel`](crate::DataParallel) has armed this thread's next backward
//! (inference, a job of one, gradient-accumulation micro-steps before the last, a model that
//! is not trained through DDP): `mark_block` returns the block itself. Armed, it returns a
//! copy of the block (tensor handles, not data) with one identity op per parameter.
//!
//! The lift is routed by hand for Burn's CPU backend (Flex) and, with feature `wgpu` or
//! `cuda`, its CubeCL backend; on another backend the block is returned as it is and its
//! gradients are summed after backward, as for a model that marks nothing.

use std::borrow::Cow;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Backend, BackendTensor, Dispatch, DispatchAutodiffContext, DispatchTensor, DispatchTensorKind,
    GradientCheckpointingStrategy,
};
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::kind::{Basic, Kind};
use burn::tensor::Tensor;

use crate::ddp::fsdp::sharded_module;
use crate::ddp::overlap::ready_buckets;

/// Marks `block` as a block entered with `input`: returns the block to run on `input` for
/// this forward, whose parameters' gradients are handed to the gradient overlap as soon as
/// backward has passed the block (module docs). One change per block of a repeated stack (a
/// transformer layer, a residual block, a hidden layer), in forward order:
///
/// ```ignore
/// for layer in &self.layers {
///     x = burn_ddp::mark_block(&x, layer).forward(x);
/// }
/// ```
///
/// Not collective, and never blocking: the communication it enables runs on the DDP
/// layer's thread. It changes no value and no gradient, so a model gives the same results
/// with and without it; every rank must mark the same blocks (the same model everywhere, as
/// DDP requires anyway). A block whose parameters are also used outside it (tied weights)
/// must not be marked. Unarmed (module docs) it returns `block` itself.
///
/// Under ZeRO stage 3 (a [`ShardedForward`](crate::ddp::fsdp::sharded_module::ShardedForward) alive on
/// this thread) it returns the block with its sharded parameters gathered whole instead:
/// collective then, in the order the model marks its blocks.
///
/// `input` may be of any kind: a block entered with token ids (an embedding table) is marked
/// with them, for ZeRO stage 3 to shard it; for gradient overlap such a block is summed after
/// backward (there is no float input to order its hook after, and its gradients are the last
/// to be ready anyway).
pub fn mark_block<'a, M: Module, const D: usize, K: Basic>(
    input: &Tensor<D, K>,
    block: &'a M,
) -> Cow<'a, M> {
    // Under ZeRO stage 3 each shard is lifted onto the input before its gather, so that the
    // gather's backward (the reduce-scatter) runs right after the block's backward and its
    // whole gradient goes then, not when backward ends.
    let anchor = (K::KIND == Kind::Float)
        .then(|| input.clone().into_dispatch())
        .filter(|anchor| matches!(anchor.kind, DispatchTensorKind::Autodiff(_)));
    let order = |id: ParamId, shard: Tensor<1>| match &anchor {
        Some(anchor) => Tensor::from_dispatch(route(id, shard.into_dispatch(), anchor)),
        None => shard,
    };
    if let Some(gathered) = sharded_module::gather_marked(block, &order) {
        return Cow::Owned(gathered);
    }
    // A block entered with token ids (an embedding) has no float input to order its lift
    // after: its gradients are summed after backward, as an unmarked block's.
    if !ready_buckets::is_armed() || K::KIND != Kind::Float {
        return Cow::Borrowed(block);
    }
    let anchor = input.clone().into_dispatch();
    if !matches!(anchor.kind, DispatchTensorKind::Autodiff(_)) {
        return Cow::Borrowed(block);
    }
    Cow::Owned(block.clone().map(&mut Lift { anchor }))
}

/// Lifts each trainable float parameter onto the block's input (module docs).
struct Lift {
    anchor: DispatchTensor,
}

impl ModuleMapper for Lift {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let id = param.id;
        param.map(|value| {
            if !value.is_require_grad() {
                return value;
            }
            Tensor::from_dispatch(route(id, value.into_dispatch(), &self.anchor))
        })
    }
}

/// Records the lift on the parameter's backend, or returns the parameter (module docs).
fn route(id: ParamId, param: DispatchTensor, anchor: &DispatchTensor) -> DispatchTensor {
    let context = param.autodiff;
    let balanced = matches!(
        context,
        DispatchAutodiffContext::Enabled(GradientCheckpointingStrategy::Balanced)
    );
    let DispatchTensorKind::Autodiff(inner) = param.kind else {
        return param;
    };
    let DispatchTensorKind::Autodiff(anchor) = &anchor.kind else {
        return rewrap(*inner, context);
    };
    let kind = match (*inner, &**anchor) {
        (
            DispatchTensorKind::Flex(BackendTensor::Autodiff(p)),
            DispatchTensorKind::Flex(BackendTensor::Autodiff(x)),
        ) => DispatchTensorKind::Flex(BackendTensor::Autodiff(lift::<burn::backend::Flex>(
            id, p, x, balanced,
        ))),
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        (
            DispatchTensorKind::Cube(BackendTensor::Autodiff(p)),
            DispatchTensorKind::Cube(BackendTensor::Autodiff(x)),
        ) => DispatchTensorKind::Cube(BackendTensor::Autodiff(lift::<burn::backend::Cube>(
            id, p, x, balanced,
        ))),
        (other, _) => other,
    };
    rewrap(kind, context)
}

fn rewrap(kind: DispatchTensorKind, autodiff: DispatchAutodiffContext) -> DispatchTensor {
    DispatchTensor {
        kind: DispatchTensorKind::Autodiff(Box::new(kind)),
        autodiff,
    }
}

type AdTensor<B> = FloatTensor<Autodiff<B>>;

fn lift<B: Backend + HandOff>(
    id: ParamId,
    param: AdTensor<B>,
    input: &AdTensor<B>,
    balanced: bool,
) -> AdTensor<B> {
    if balanced {
        record::<B, BalancedCheckpointing>(id, param, input)
    } else {
        record::<B, NoCheckpointing>(id, param, input)
    }
}

/// The lift's backward: the incoming gradient goes to the parameter, whose gradient is then
/// final; it is handed to the overlap.
#[derive(Debug)]
struct Lifted<B: Backend> {
    id: ParamId,
    /// The block's input node: the same for all of the block's lifts.
    block: u64,
    param: AdTensor<B>,
}

impl<B: Backend + HandOff> Backward<B, 2> for Lifted<B> {
    type State = ();

    fn backward(self, ops: Ops<(), 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [param, _input] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(param) = param {
            grads.register::<B>(param.id, grad);
        }
        // Sending as it goes, the bucket takes the gradient out of Burn's container (it owns
        // it, so the ring drains into it in place; the DDP step puts the mean back).
        let total = if ready_buckets::takes_gradients() {
            grads.remove::<B>(&self.param)
        } else {
            grads.get::<B>(&self.param)
        };
        if let Some(total) = total {
            ready_buckets::gradient_ready(self.id, self.block, B::to_dispatch(total));
        }
    }
}

/// Records the identity of `param` with parents (`param`, `input`).
fn record<B: Backend + HandOff, C: CheckpointStrategy>(
    id: ParamId,
    param: AdTensor<B>,
    input: &AdTensor<B>,
) -> AdTensor<B> {
    let leaf = param.clone();
    let block = input.id().value;
    let (primitive, node) = param.into_parts();
    // Compute-bound: a checkpointing strategy keeps the output instead of recomputing it.
    match (Lifted {
        id,
        block,
        param: leaf,
    })
    .prepare::<C>([node, input.node()])
    .compute_bound()
    .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((), primitive),
        OpsKind::UnTracked(prep) => prep.finish(primitive),
    }
}

/// How a gradient of an inner backend becomes a tensor of Burn's `Dispatch` backend, which
/// the reducer works with (the same handle: nothing is copied).
trait HandOff: Backend {
    fn to_dispatch(tensor: FloatTensor<Self>) -> FloatTensor<Dispatch>;
}

impl HandOff for burn::backend::Flex {
    fn to_dispatch(tensor: FloatTensor<Self>) -> FloatTensor<Dispatch> {
        DispatchTensor {
            kind: DispatchTensorKind::Flex(BackendTensor::Float(tensor)),
            autodiff: DispatchAutodiffContext::Disabled,
        }
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl HandOff for burn::backend::Cube {
    fn to_dispatch(tensor: FloatTensor<Self>) -> FloatTensor<Dispatch> {
        DispatchTensor {
            kind: DispatchTensorKind::Cube(BackendTensor::Float(tensor)),
            autodiff: DispatchAutodiffContext::Disabled,
        }
    }
}
