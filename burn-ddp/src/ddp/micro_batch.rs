//! [`MicroBatch`]: where a micro-batch stands in its optimizer step, and
//! [`MicroBatchScope`], what [`DataParallel::micro_batch`](crate::DataParallel::micro_batch)
//! sets up before its forward and keeps until its backward has run.

use std::marker::PhantomData;

use burn::optim::GradientsParams;

use crate::ddp::fsdp::sharded_module::ShardedForward;

/// Where a micro-batch stands in its optimizer step (with gradient accumulation a step has
/// several; without, one, [`MicroBatch::ONLY`]).
#[derive(Debug, Clone, Copy)]
pub enum MicroBatch<'a> {
    /// One of the step's earlier micro-batches: its gradients stay on this rank until the
    /// last one's (PyTorch's `no_sync`).
    Accumulating,
    /// The step's last micro-batch: its backward may put the marked blocks' gradients on the
    /// wire as it passes them. `earlier`: the sum of the step's earlier micro-batches'
    /// gradients, if any; `weight`: the factor this micro-batch's gradients are multiplied by
    /// before they are added to it (1 to take them as they are). What is sent is what the
    /// caller will hold.
    Last {
        earlier: Option<&'a GradientsParams>,
        weight: f32,
    },
}

impl MicroBatch<'static> {
    /// The only micro-batch of its step (no accumulation): the last, with nothing earlier
    /// and a weight of 1.
    pub const ONLY: Self = Self::Last {
        earlier: None,
        weight: 1.0,
    };
}

/// Held over one micro-batch's forward and backward; drop it after the backward, before
/// validation or the next micro-batch. At ZeRO stage 3 it is the guard under which
/// [`mark_block`](crate::mark_block) gathers each marked block whole; at other stages it
/// holds nothing. Bind it to a name (`let scope = ...`), not to `_`, which drops it at once.
/// It borrows the `DataParallel` that made it, so `step` cannot run before it is dropped.
#[must_use = "hold it over the micro-batch's forward and backward (`let scope = ...`), then drop it"]
pub struct MicroBatchScope<'a> {
    /// Held for its drop: the gathers end with the scope.
    pub(crate) _gather: Option<ShardedForward>,
    pub(crate) handle: PhantomData<&'a mut ()>,
}
