//! [`Overlap`]: gradient buckets summed while backward runs, for models whose blocks are
//! marked ([`mark_block`](super::ready_op::mark_block)).
//!
//! ```text
//! DataParallel::micro_batch(Last)         arms the next backward (the step's last micro-batch)
//!   backward: block N done ─▶ gradient_ready(params of N) ─▶ bucket full? ─▶ comm thread
//!             block N-1 done ─▶ …                                       (sums it meanwhile)
//! DataParallel::step ─▶ Reducer: buckets not yet sent are queued now; wait for every result
//! ```
//! - **The plan** is learnt at the first armed step (PyTorch DDP rebuilds its buckets after the
//!   first iteration the same way): the parameters in the order their gradients became ready,
//!   then every other one in reverse visit order ([`ready_order`]); a bucket closes at a
//!   block's end once it holds [`first_bucket_cap`] (so a block's gradients go while backward
//!   runs through the ones before it, whatever the cap), or before a parameter that would
//!   take it over the cap. Every rank learns the same plan (checked once
//!   across the ranks), and it does not depend on whether overlap is on: with it off the same
//!   buckets are summed after backward, so the weights are bit-identical either way.
//! - **Accumulation**: only the step's last micro-batch is armed (no communication on the
//!   others: PyTorch's `no_sync`); its gradients are combined with the earlier micro-batches'
//!   as the caller combines them (scaled by the micro-batch's weight, added to the sum so far)
//!   before they are sent, so what is sent is what the caller will hold.
//! - A model that marks nothing keeps today's plan and sync-after-backward.
//! - The plan is kept while the parameters with gradients stay the same; a step with another
//!   set fails with [`DdpError::Overlap`] (as PyTorch requires `find_unused_parameters` for
//!   that).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::backend::tensor::FloatTensor;
use burn::backend::{Dispatch, TensorMetadata};
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Shape, Tensor};

use crate::ddp::buckets::plan::{
    check_bucket_len, first_bucket_cap, plan_buckets_in_order, ready_order, Bucket,
};
use crate::ddp::overlap::comm_thread::{CommThread, Job};
use crate::ddp::zero::shard_plan::ShardPlan;
use crate::error::DdpError;
use crate::group::{ProcessGroup, TcpGroupOptions, TcpProcessGroup};
use crate::kernels::HalfFormat;
use crate::store::Store;

thread_local! {
    /// The armed backward of this thread: Burn runs a backward on the thread that calls it,
    /// the thread that ran the forward, so ranks run as threads of one process (tests) keep
    /// theirs apart.
    static BACKWARD: RefCell<Option<ArmedBackward>> = const { RefCell::new(None) };
}

/// Whether the next ops recorded on this thread belong to an armed backward.
pub(crate) fn is_armed() -> bool {
    BACKWARD.with(|armed| armed.borrow().is_some())
}

/// Called by the marker's backward: `grad` is the final gradient of parameter `id` for this
/// micro-batch; `block` tells the marked block it belongs to (the same for all of a block's
/// parameters, another for the next block).
pub(crate) fn gradient_ready(id: ParamId, block: u64, grad: FloatTensor<Dispatch>) {
    BACKWARD.with(|armed| {
        if let Some(backward) = armed.borrow_mut().as_mut() {
            backward.ready(id, block, grad);
        }
    });
}

/// Whether the armed backward sends buckets as it goes: the lifts then take each gradient out
/// of Burn's container (the bucket then owns it, so the ring drains into it in place) instead
/// of reading a handle to it.
pub(crate) fn takes_gradients() -> bool {
    BACKWARD.with(|armed| {
        armed
            .borrow()
            .as_ref()
            .is_some_and(|backward| backward.launch.is_some())
    })
}

/// Takes this thread's armed backward, disarming it.
fn disarm() -> Option<ArmedBackward> {
    BACKWARD.with(|armed| armed.borrow_mut().take())
}

/// Arms this thread's next backward.
fn arm_with(backward: ArmedBackward) {
    BACKWARD.with(|armed| *armed.borrow_mut() = Some(backward));
}

/// How a micro-batch's gradient becomes what the caller will hold: scaled by its weight and
/// added to the earlier micro-batches' sum, with the caller's own tensor ops (the same bits).
type Combine = Box<dyn FnOnce(FloatTensor<Dispatch>) -> FloatTensor<Dispatch> + Send>;

/// The learnt bucket plan.
#[derive(Debug)]
struct Plan {
    /// The parameters with gradients, in visit order, when the plan was learnt.
    ids: Vec<ParamId>,
    /// Buckets over visit indices into `ids`.
    buckets: Vec<Bucket>,
    /// For each parameter id: (bucket, position in it).
    slot: HashMap<ParamId, (usize, usize)>,
}

/// One armed backward.
struct ArmedBackward {
    /// Parameters in the order their gradients became ready (each once), with their block.
    ready: Vec<(ParamId, u64)>,
    launch: Option<Launch>,
    /// When it was armed (before the forward): the origin of the step's bucket timeline.
    armed_at: Instant,
}

/// Buckets sent while backward runs (overlap on, plan learnt).
struct Launch {
    plan: Arc<Plan>,
    combine: HashMap<ParamId, Combine>,
    filled: Vec<Vec<Option<FloatTensor<Dispatch>>>>,
    /// Every gradient handed over, with its shape and dtype: the caller's `GradientsParams`
    /// no longer holds it (see [`Overlap::take_handed`]).
    handed: HashMap<ParamId, (Shape, DType)>,
    remaining: Vec<usize>,
    /// Buckets before this one have been queued.
    next: usize,
    /// ZeRO stage 2: the owner of each gradient of each bucket (the buckets are
    /// reduce-scattered to them).
    owners: Option<Vec<Vec<usize>>>,
    queue: Sender<Job>,
    settings: Settings,
}

/// How the buckets are summed: the reducer's settings, the same on every rank.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    pub compression: Option<HalfFormat>,
    /// `1 / world`.
    pub scale: f32,
    pub check_finite: bool,
}

impl ArmedBackward {
    fn ready(&mut self, id: ParamId, block: u64, grad: FloatTensor<Dispatch>) {
        if self.ready.iter().any(|(ready, _)| *ready == id) {
            return;
        }
        self.ready.push((id, block));
        if let Some(launch) = &mut self.launch {
            launch.ready(id, grad);
        }
    }
}

impl Launch {
    fn ready(&mut self, id: ParamId, grad: FloatTensor<Dispatch>) {
        let Some(&(bucket, position)) = self.plan.slot.get(&id) else {
            return;
        };
        let grad = match self.combine.remove(&id) {
            Some(combine) => combine(grad),
            None => grad,
        };
        self.handed.insert(id, (grad.shape(), grad.dtype()));
        self.filled[bucket][position] = Some(grad);
        self.remaining[bucket] -= 1;
        while self.next < self.remaining.len() && self.remaining[self.next] == 0 {
            let grads: Vec<_> = self.filled[self.next].drain(..).flatten().collect();
            let shapes = grads.iter().map(TensorMetadata::shape).collect();
            let job = Job {
                grads,
                shapes,
                owners: self.owners.as_ref().map(|owners| owners[self.next].clone()),
                compression: self.settings.compression,
                scale: self.settings.scale,
                check_finite: self.settings.check_finite,
                queued: Instant::now(),
            };
            if self.queue.send(job).is_err() {
                // The thread has stopped: the sync after backward reports it.
                return;
            }
            self.next += 1;
        }
    }
}

/// A gradient the backward handed over ([`Overlap::take_handed`]).
pub(crate) struct Handed {
    /// `None`: its bucket is already on the communication thread.
    pub tensor: Option<FloatTensor<Dispatch>>,
    pub shape: Shape,
    pub dtype: DType,
}

/// What the overlap did over the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OverlapStats {
    /// Steps whose buckets followed a learnt plan.
    pub planned_steps: u64,
    /// Buckets queued while backward was still running.
    pub buckets_during_backward: u64,
    /// Buckets in all.
    pub buckets: u64,
    /// Time the communication thread spent summing buckets.
    pub communication: Duration,
    /// Time the step waited for buckets after backward (the communication not hidden).
    pub exposed: Duration,
}

/// When one bucket of a step went, on one rank, after the step's armed forward began.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketTiming {
    /// Its payload: elements times their size on the wire (2 bytes compressed, else 4).
    pub bytes: usize,
    /// Queued for the communication thread: during backward when its last gradient became
    /// ready, or at the sync after backward.
    pub queued: Duration,
    /// The thread began summing it (after the buckets before it).
    pub started: Duration,
    /// Summed: its means were there.
    pub finished: Duration,
}

/// The buckets of the last step whose buckets went on the communication thread, on this rank
/// ([`DataParallel::overlap_timeline`](crate::DataParallel::overlap_timeline)): where the
/// time of an overlapped step goes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepTimeline {
    /// Backward had finished and the sync began, after the armed forward began.
    pub sync_began: Duration,
    /// The step had every bucket's means.
    pub all_done: Duration,
    /// In plan order (the order they were summed).
    pub buckets: Vec<BucketTiming>,
}

impl OverlapStats {
    /// The fraction of the communication time hidden under backward (0 without any).
    pub fn hidden_fraction(&self) -> f64 {
        let total = self.communication.as_secs_f64();
        if total <= 0.0 {
            return 0.0;
        }
        (1.0 - self.exposed.as_secs_f64() / total).clamp(0.0, 1.0)
    }
}

/// What forms the communication thread's group.
pub(crate) struct GroupRecipe {
    pub store: Arc<dyn Store>,
    pub rank: usize,
    pub world_size: usize,
    pub options: TcpGroupOptions,
}

/// The overlap of one rank (module docs); owned by its gradient path.
pub struct Overlap {
    /// `gradient_overlap`: send buckets during backward (else only the plan is followed).
    enabled: bool,
    recipe: Option<GroupRecipe>,
    plan: Option<Arc<Plan>>,
    thread: Option<CommThread>,
    /// The armed backward's state, taken at the sync.
    taken: Option<ArmedBackward>,
    stats: OverlapStats,
    last_timeline: Option<StepTimeline>,
}

impl Overlap {
    /// `recipe`: `None` where nothing is summed across ranks (a job of one); then nothing is
    /// ever armed.
    pub(crate) fn new(enabled: bool, recipe: Option<GroupRecipe>) -> Self {
        Self {
            enabled,
            recipe,
            plan: None,
            thread: None,
            taken: None,
            stats: OverlapStats::default(),
            last_timeline: None,
        }
    }

    pub fn stats(&self) -> OverlapStats {
        self.stats
    }

    /// The last step's buckets, when they went on the communication thread.
    pub fn last_timeline(&self) -> Option<&StepTimeline> {
        self.last_timeline.as_ref()
    }

    /// Whether gradient overlap is on (it acts only where blocks are marked).
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// Arms the next backward (module docs): `earlier`, the sum of the step's earlier
    /// micro-batches' gradients, if any; `weight`, what this micro-batch's gradients are
    /// multiplied by (1 when they are taken as they are); `owners`, at ZeRO stage 2, who keeps
    /// each parameter's gradient.
    pub(crate) fn arm<M: Module>(
        &mut self,
        model: &M,
        earlier: Option<&GradientsParams>,
        weight: f32,
        settings: Settings,
        owners: Option<&ShardPlan>,
    ) {
        if self.recipe.is_none() {
            return;
        }
        let launch = match (&self.plan, &self.thread, self.enabled) {
            (Some(plan), Some(thread), true) => thread.queue().map(|queue| Launch {
                owners: owners.map(|shards| bucket_owners(plan, shards)),
                plan: plan.clone(),
                combine: combiners(model, earlier, weight),
                filled: plan
                    .buckets
                    .iter()
                    .map(|b| (0..b.params.len()).map(|_| None).collect())
                    .collect(),
                handed: HashMap::new(),
                remaining: plan.buckets.iter().map(|b| b.params.len()).collect(),
                next: 0,
                queue,
                settings,
            }),
            _ => None,
        };
        arm_with(ArmedBackward {
            ready: Vec::new(),
            launch,
            armed_at: Instant::now(),
        });
    }

    /// After backward, before the sum: disarms, and learns the plan at the first armed step
    /// where blocks were marked. Collective then (the plan's fingerprint is compared across
    /// `group`, and the communication thread's group is formed); nothing is sent otherwise.
    pub(crate) fn after_backward<M: Module>(
        &mut self,
        group: &mut TcpProcessGroup,
        model: &M,
        grads: &GradientsParams,
        bucket_cap: usize,
    ) -> Result<(), DdpError> {
        self.taken = disarm();
        let Some(armed) = &self.taken else {
            return Ok(());
        };
        if self.plan.is_some() || armed.ready.is_empty() {
            return Ok(());
        }
        let (ids, numels) = with_gradients(model, grads);
        let position: HashMap<ParamId, usize> =
            ids.iter().enumerate().map(|(i, id)| (*id, i)).collect();
        let ready: Vec<(usize, u64)> = armed
            .ready
            .iter()
            .filter_map(|(id, block)| Some((*position.get(id)?, *block)))
            .collect();
        // A parameter ends its block when the next one ready belongs to another (or none is).
        let mut block_ends = vec![false; ids.len()];
        for (i, (index, block)) in ready.iter().enumerate() {
            block_ends[*index] = ready.get(i + 1).is_none_or(|(_, next)| next != block);
        }
        let ready: Vec<usize> = ready.iter().map(|(index, _)| *index).collect();
        let buckets = plan_buckets_in_order(
            ready_order(&ready, ids.len()),
            &numels,
            &block_ends,
            first_bucket_cap(bucket_cap),
            bucket_cap,
        );
        for bucket in &buckets {
            check_bucket_len(bucket)?;
        }
        same_plan_everywhere(group, &buckets)?;
        let mut slot = HashMap::new();
        for (b, bucket) in buckets.iter().enumerate() {
            for (p, &index) in bucket.params.iter().enumerate() {
                slot.insert(ids[index], (b, p));
            }
        }
        self.plan = Some(Arc::new(Plan { ids, buckets, slot }));
        if let (true, Some(recipe)) = (self.enabled, &self.recipe) {
            self.thread = Some(CommThread::start(
                recipe.store.clone(),
                recipe.rank,
                recipe.world_size,
                recipe.options.clone(),
            )?);
        }
        tracing::info!(
            overlap = self.enabled,
            "gradient buckets follow the order in which marked blocks' gradients became ready"
        );
        Ok(())
    }

    /// The learnt plan's buckets, when there is one and `ids` (the parameters with gradients
    /// now, in visit order) are those it was learnt for.
    pub(crate) fn planned_buckets(&self, ids: &[ParamId]) -> Result<Option<&[Bucket]>, DdpError> {
        let Some(plan) = &self.plan else {
            return Ok(None);
        };
        if plan.ids != ids {
            return Err(DdpError::Overlap(format!(
                "the parameters with gradients changed since the bucket plan was learnt ({} \
                 then, {} now): every step must give gradients to the same parameters when \
                 blocks are marked (mark no block for a model that leaves parameters unused in \
                 some steps)",
                plan.ids.len(),
                ids.len()
            )));
        }
        Ok(Some(&plan.buckets))
    }

    /// The gradient of `id` if this step's backward handed it over (the caller's
    /// `GradientsParams` then lacks it, or holds only the earlier micro-batches' sum): its
    /// shape and dtype, and the tensor unless its bucket is already queued. Call it for each
    /// parameter before [`in_flight`](Self::in_flight).
    pub(crate) fn take_handed(&mut self, id: ParamId) -> Option<Handed> {
        let launch = self.taken.as_mut()?.launch.as_mut()?;
        let (shape, dtype) = launch.handed.get(&id)?.clone();
        let &(bucket, position) = launch.plan.slot.get(&id)?;
        let tensor = if bucket < launch.next {
            None
        } else {
            launch.filled[bucket][position].take()
        };
        Some(Handed {
            tensor,
            shape,
            dtype,
        })
    }

    /// How many of the plan's buckets were queued during backward (in plan order), when the
    /// step was armed (if it was), and the thread to queue the rest on and wait for; `None`
    /// when the buckets are summed here.
    pub(crate) fn in_flight(&mut self) -> Option<(usize, Option<Instant>, &CommThread)> {
        let thread = self.thread.as_ref()?;
        let armed = self.taken.take();
        let armed_at = armed.as_ref().map(|armed| armed.armed_at);
        let queued = armed
            .and_then(|armed| armed.launch)
            .map_or(0, |launch| launch.next);
        Some((queued, armed_at, thread))
    }

    pub(crate) fn record(
        &mut self,
        queued: usize,
        buckets: usize,
        done: (Duration, Duration),
        timeline: Option<StepTimeline>,
    ) {
        self.stats.planned_steps += 1;
        self.stats.buckets_during_backward += queued as u64;
        self.stats.buckets += buckets as u64;
        self.stats.communication += done.0;
        self.stats.exposed += done.1;
        if timeline.is_some() {
            self.last_timeline = timeline;
        }
    }
}

/// The per-parameter combination of `arm` (module docs): `g * weight` (when `weight != 1`),
/// added to the earlier sum — `scale_gradients` and burn's `GradientsAccumulator` of the
/// caller, op for op.
fn combiners<M: Module>(
    model: &M,
    earlier: Option<&GradientsParams>,
    weight: f32,
) -> HashMap<ParamId, Combine> {
    struct Visit<'a> {
        earlier: Option<&'a GradientsParams>,
        weight: f32,
        out: HashMap<ParamId, Combine>,
    }
    impl ModuleVisitor for Visit<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let before = self.earlier.and_then(|g| g.get::<D>(param.id));
            let weight = self.weight;
            if before.is_none() && weight == 1.0 {
                return;
            }
            let combine: Combine = Box::new(move |grad| {
                let mut grad = Tensor::<D>::from_dispatch(grad);
                if weight != 1.0 {
                    grad = grad.mul_scalar(weight);
                }
                match before {
                    Some(before) => before.add(grad).into_dispatch(),
                    None => grad.into_dispatch(),
                }
            });
            self.out.insert(param.id, combine);
        }
    }
    let mut visit = Visit {
        earlier,
        weight,
        out: HashMap::new(),
    };
    model.visit(&mut visit);
    visit.out
}

/// The owner of every gradient of every planned bucket (a parameter unknown to `shards`, which
/// the sync after backward reports, counts as rank 0's here).
fn bucket_owners(plan: &Plan, shards: &ShardPlan) -> Vec<Vec<usize>> {
    plan.buckets
        .iter()
        .map(|bucket| {
            bucket
                .params
                .iter()
                .map(|&p| shards.owner(plan.ids[p]).unwrap_or(0))
                .collect()
        })
        .collect()
}

/// The float parameters with a gradient, in visit order, and their sizes.
fn with_gradients<M: Module>(model: &M, grads: &GradientsParams) -> (Vec<ParamId>, Vec<usize>) {
    struct Visit<'a> {
        grads: &'a GradientsParams,
        ids: Vec<ParamId>,
        numels: Vec<usize>,
    }
    impl ModuleVisitor for Visit<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(param.id) {
                self.ids.push(param.id);
                self.numels.push(g.shape().num_elements());
            }
        }
    }
    let mut visit = Visit {
        grads,
        ids: Vec::new(),
        numels: Vec::new(),
    };
    model.visit(&mut visit);
    (visit.ids, visit.numels)
}

/// Fails on every rank when the ranks learnt different plans (their models differ, or mark
/// different blocks). Collective over `group`.
fn same_plan_everywhere(group: &mut TcpProcessGroup, buckets: &[Bucket]) -> Result<(), DdpError> {
    let mut shape: Vec<u64> = Vec::new();
    for bucket in buckets {
        shape.push(u64::MAX);
        shape.extend(bucket.params.iter().map(|&p| p as u64));
    }
    let ours = crate::hash::fnv1a64(bytemuck::cast_slice(&shape)) as i64;
    let mut all = vec![0i64; group.world_size()];
    group.all_gather(&[ours], &mut all)?;
    if all.iter().any(|&h| h != ours) {
        return Err(DdpError::Mismatch(format!(
            "the ranks learnt different gradient bucket plans from their marked blocks (plan \
             fingerprints {all:x?}): every rank must train the same model, with the same \
             blocks marked by burn_ddp::mark_block"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::Device;

    use super::*;
    use crate::ddp::overlap::ready_op::mark_block;

    fn ids(layer: &Linear) -> Vec<ParamId> {
        let bias = layer.bias.as_ref().map(|b| b.id);
        std::iter::once(layer.weight.id).chain(bias).collect()
    }

    /// The reading of burn-autodiff's tape order this overlap is built on: each block's
    /// lifts run right after that block's backward, so blocks come ready in reverse forward
    /// order (biases, which Linear reshapes, included), the first block (fed with untracked
    /// data) last; unarmed, nothing is recorded.
    #[test]
    fn marked_blocks_come_ready_in_reverse_forward_order() {
        let device = Device::flex().autodiff();
        let layers: Vec<Linear> = (0..3)
            .map(|_| LinearConfig::new(4, 4).init(&device))
            .collect();
        let forward = |layers: &[Linear]| {
            let mut x = Tensor::<2>::ones([2, 4], &device);
            for layer in layers {
                x = mark_block(&x, layer).forward(x).tanh();
            }
            x.sum().backward()
        };
        arm_with(ArmedBackward {
            ready: Vec::new(),
            launch: None,
            armed_at: Instant::now(),
        });
        let _grads = forward(&layers);
        let armed = disarm().expect("armed");
        // Block by block (within a block, in the tape's order of its lifts), each block's
        // parameters under one tag, another for each block.
        let tags: Vec<u64> = armed.ready.iter().map(|(_, tag)| *tag).collect();
        assert!(tags.chunks(2).all(|block| block[0] == block[1]), "{tags:?}");
        assert!(tags[0] != tags[2] && tags[2] != tags[4], "{tags:?}");
        let got: Vec<Vec<ParamId>> = armed
            .ready
            .chunks(2)
            .map(|block| {
                let mut block: Vec<ParamId> = block.iter().map(|(id, _)| *id).collect();
                block.sort_by_key(|id| id.val());
                block
            })
            .collect();
        let expected: Vec<Vec<ParamId>> = layers
            .iter()
            .rev()
            .map(|layer| {
                let mut block = ids(layer);
                block.sort_by_key(|id| id.val());
                block
            })
            .collect();
        assert_eq!(got, expected);
        assert!(!is_armed());
        // Unarmed, the markers are identities and record nothing.
        let _grads = forward(&layers);
        assert!(disarm().is_none());
    }
}
