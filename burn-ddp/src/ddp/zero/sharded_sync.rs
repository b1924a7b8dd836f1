//! ZeRO stage 1 (sharded optimizer state): each parameter's optimizer state lives on exactly
//! one rank, its owner ([`ShardPlan`]).
//!
//! ```text
//!  backward ─▶ GradientsParams (every parameter, this rank's micro-batches)
//!     reduce_to_owners   flat buffer in owner order ─▶ reduce_scatter_v_staged(sum), each
//!                        piece filled from the gradients (NaN check, 16-bit rounding) and
//!                        the own block drained (× 1/world, widening) while others are on
//!                        the wire ─▶ GradientsParams holding only this rank's parameters
//!  optimizer.step        updates only those (Burn's optimizers create state only for
//!                        parameters that received a gradient)
//!     gather_parameters  owned values ─▶ all_gather_v ─▶ every parameter on every rank
//! ```
//! Bytes: the reduce-scatter sends the buffer less the own block, the all-gather the same: the
//! bytes of one all-reduce, as PyTorch's `ZeroRedundancyOptimizer` over DDP does not achieve
//! (it all-reduces, then broadcasts). The mean is the all-reduce path's, operation for
//! operation: the `f32` sum multiplied by `1 / world`, or with compression each gradient
//! multiplied by `1 / world` and rounded to bf16 / fp16 before the sum, the NaN check on the
//! values sent. Parameters always travel as f32, so replicas stay bit-identical.
//!
//! Both collectives run through the host on any [`ProcessGroup`] (the TCP ring with shared
//! memory between ranks of one machine); on a GPU backend the tensors are staged through host
//! memory.
//!
//! Optimizer state for checkpoints: [`gather_state`] merges every rank's state on rank 0
//! (keyed by parameter id, so the result is the state a stage-0 run holds: checkpoints stay
//! independent of the world size and stage), and [`keep_owned_state`] drops what another rank
//! owns after a restore.
//!
//! Burn's [`ModuleOptimizer`] shows its state only as burnpack bytes
//! ([`ModuleOptimizer::into_bytes`] / [`ModuleOptimizer::from_bytes`]), keyed per parameter:
//! tensors named `"{id}.{field}"` that carry the parameter id, scalars `"{id}.{field}"` (among
//! them `"{id}.__rank"`, one per parameter with state, even a state without tensors) and a
//! metadata entry `"{id}"` (the parameter's path). Splitting and merging works on those keys
//! ([`burn_pack::Reader`] / [`burn_pack::Writer`]); [`state_param_ids`] counts parameters by
//! their `__rank` scalars.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::prelude::*;
use burn::tensor::TensorData;
use burn_pack::Bytes;

use crate::ddp::buckets::finite::{FiniteScan, GradientCheck};
use crate::ddp::buckets::host_pieces::{host_slice, HostBucket};
use crate::ddp::buckets::scatter::reduce_scatter_to_owners;
use crate::ddp::buckets::stats::ReducerStats;
use crate::ddp::module::{read_floats, write_floats, FloatSlot};
use crate::ddp::zero::shard_plan::ShardPlan;
use crate::error::DdpError;
use crate::group::ProcessGroup;
use crate::kernels::HalfFormat;

/// The stage-1 gradient and parameter exchange of one rank. Every method is collective.
#[derive(Debug, Clone)]
pub struct ShardedSync {
    compression: Option<HalfFormat>,
    check_finite: bool,
    plan: Option<ShardPlan>,
    /// Elements of one run of the parameters' all-gather.
    gather_segment: usize,
    stats: ReducerStats,
}

impl ShardedSync {
    /// `compression` as for [`crate::ddp::Reducer::new`]; must be the same on every rank.
    pub fn new(compression: Option<HalfFormat>) -> Self {
        Self {
            compression,
            check_finite: true,
            plan: None,
            gather_segment: GATHER_SEGMENT,
            stats: ReducerStats::default(),
        }
    }

    /// The largest run of the parameters' all-gather, in elements ([`GATHER_SEGMENT`] by
    /// default): a rank holds one run's buffer at a time. Must be the same on every rank.
    pub fn with_gather_segment(mut self, elements: usize) -> Self {
        self.gather_segment = elements.max(1);
        self
    }

    /// Whether [`reduce_to_owners`](Self::reduce_to_owners) looks for NaN and ±Inf (on by
    /// default). Must be the same on every rank.
    pub fn with_finite_check(mut self, check: bool) -> Self {
        self.check_finite = check;
        self
    }

    /// Synchronisations so far; `bucket_all_reduces` counts the reduce-scatters and
    /// all-gathers, `bytes_reduced` their buffers (gradients at 4 or 2 bytes an element,
    /// parameters at 4).
    pub fn stats(&self) -> ReducerStats {
        self.stats
    }

    /// The plan for `model` on `world` ranks (made on first use; the model's parameters must
    /// not change afterwards).
    pub fn plan<M: Module>(&mut self, model: &M, world: usize) -> &ShardPlan {
        let plan = self.plan.take().filter(|p| p.world_size() == world);
        self.plan
            .insert(plan.unwrap_or_else(|| plan_for(model, world)))
    }

    /// Replaces `grads` by the mean over the ranks of this rank's own parameters' gradients
    /// (the others are removed). Collective; which parameters have gradients must be the same
    /// on every rank. Returns which ranks' own gradients were not finite, as the all-reduce
    /// path does; every rank gets the same verdict.
    pub fn reduce_to_owners<M, G>(
        &mut self,
        group: &mut G,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<GradientCheck, DdpError>
    where
        M: Module,
        G: ProcessGroup,
    {
        let (rank, world) = (group.rank(), group.world_size());
        let plan = self.plan(model, world).clone();
        let mut taken = take_gradients(&plan, model, grads);
        let ranges = taken.iter().map(|t| t.range.clone()).collect();
        let slices = taken
            .iter_mut()
            .map(|t| host_slice::<f32>(&mut t.data))
            .collect::<Result<Vec<_>, _>>()?;

        // The flat buffer is filled piece by piece from the gradients (zeros where a parameter
        // has none) and this rank's block drained back into its own gradients, as the
        // all-reduce path stages its buckets (`host_pieces.rs`): the same mean (`× 1/world`,
        // or scaled before rounding to 16 bits) and the same NaN check as stage 0.
        let mut scan = FiniteScan::new(self.check_finite);
        let bucket = HostBucket::at(slices, ranges, 1.0 / world as f32, &mut scan);
        let element_bytes =
            reduce_scatter_to_owners(group, plan.counts(), bucket, self.compression)?;
        let nonfinite = scan.found_nonfinite();
        let owned = taken
            .into_iter()
            .filter(|t| plan.owner(t.id) == Some(rank))
            .map(|t| (t.id, (t.data, t.dtype)))
            .collect();
        model.visit(&mut PutOwned { grads, owned });
        self.stats.syncs += 1;
        self.stats.bucket_all_reduces += 1;
        self.stats.bytes_reduced += (plan.len() * element_bytes) as u64;

        if !self.check_finite {
            return Ok(GradientCheck::default());
        }
        nonfinite_ranks(group, nonfinite)
    }

    /// Sends this rank's (just stepped) parameters to every rank and takes every other rank's:
    /// afterwards the replicas are equal again, bit for bit. Collective.
    ///
    /// The all-gather runs over runs of the plan of at most
    /// [`with_gather_segment`](Self::with_gather_segment) elements, one after the other
    /// ([`ShardPlan::segments`]), so a rank holds one run's buffer at a time, not a copy of
    /// the whole model.
    pub fn gather_parameters<M, G>(&mut self, group: &mut G, model: M) -> Result<M, DdpError>
    where
        M: Module,
        G: ProcessGroup,
    {
        let (rank, world) = (group.rank(), group.world_size());
        if world == 1 {
            return Ok(model);
        }
        let mut model = model;
        let segment = self.gather_segment;
        for run in self.plan(&model, world).segments(segment) {
            let mut flat = vec![0.0f32; run.len()];
            read_floats(&model, &mut flat, owned_by(&run, |owner| owner == rank));
            group.all_gather_v(&mut flat, run.counts())?;
            model = write_floats(model, &flat, owned_by(&run, |owner| owner != rank));
            self.stats.bucket_all_reduces += 1;
            self.stats.bytes_reduced += (run.len() * 4) as u64;
        }
        Ok(model)
    }
}

/// Elements of one run of the parameters' all-gather (4 MiB of f32).
pub const GATHER_SEGMENT: usize = 1 << 20;

/// The slots of the parameters whose owner passes `keep`.
fn owned_by<'a>(plan: &'a ShardPlan, keep: impl Fn(usize) -> bool + 'a) -> impl FloatSlot + 'a {
    move |id, _, _| {
        plan.slot(id)
            .filter(|s| keep(s.owner))
            .map(|s| s.range.clone())
    }
}

/// The plan of `model`'s trained float parameters (visit order) over `world` ranks.
pub fn plan_for<M: Module>(model: &M, world: usize) -> ShardPlan {
    struct Sizes(Vec<(ParamId, usize)>);
    impl ModuleVisitor for Sizes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            // Buffers (no gradient: BatchNorm statistics, frozen parameters) have no
            // optimizer state to own; `buffers::sync_buffers` keeps them equal.
            let value = param.val();
            if value.is_require_grad() {
                self.0.push((param.id, value.shape().num_elements()));
            }
        }
    }
    let mut sizes = Sizes(Vec::new());
    model.visit(&mut sizes);
    ShardPlan::new(&sizes.0, world)
}

/// `optim` with only the state of the parameters `rank` owns (after loading a full,
/// consolidated state). Local.
///
/// The state goes through Burn's burnpack bytes, the only public door to it; the state kept is
/// materialised again on Burn's default device (`ModuleOptimizer::load_record`) and moves to
/// each parameter's device at its next step.
///
/// # Errors
/// [`DdpError::State`] when the state cannot be serialised or read back.
pub fn keep_owned_state(
    optim: ModuleOptimizer,
    plan: &ShardPlan,
    rank: usize,
) -> Result<ModuleOptimizer, DdpError> {
    let bytes = optim.into_bytes().map_err(|e| {
        DdpError::State(format!(
            "cannot serialise rank {rank}'s optimizer state: {e}"
        ))
    })?;
    let mut state = StateParts::read(bytes, rank)?;
    state.retain(|id| plan.owner(ParamId::from(id)) == Some(rank));
    let bytes = state.into_bytes()?;
    optim.from_bytes(bytes).map_err(|e| {
        DdpError::State(format!(
            "cannot load rank {rank}'s own optimizer state: {e}"
        ))
    })
}

/// Every rank's optimizer state merged on `root`, as burnpack bytes (what
/// [`ModuleOptimizer::into_bytes`] gives for the state a stage-0 run holds, every parameter
/// with state; `None` on the other ranks). Collective. Every rank's state travels through the
/// group once (an all-gather of the serialised state: each rank briefly holds all of it as
/// bytes). The merged bytes load with [`ModuleOptimizer::from_bytes`] at any world size and
/// stage.
///
/// # Errors
/// What the group reports, and [`DdpError::State`] when a rank's state cannot be serialised or
/// read.
pub fn gather_state<G: ProcessGroup>(
    optim: &ModuleOptimizer,
    group: &mut G,
    root: usize,
) -> Result<Option<Bytes>, DdpError> {
    let (rank, world) = (group.rank(), group.world_size());
    let ours = optim
        .into_bytes()
        .map_err(|e| DdpError::State(format!("cannot serialise rank {rank}'s state: {e}")))?;
    let mut lengths = vec![0i64; world];
    group.all_gather(&[ours.len() as i64], &mut lengths)?;
    let counts: Vec<usize> = lengths.iter().map(|&n| n.max(0) as usize).collect();
    let blocks = crate::group::ring::block_ranges(&counts);
    let mut all = vec![0u8; counts.iter().sum()];
    all[blocks[rank].clone()].copy_from_slice(&ours);
    drop(ours);
    group.all_gather_v(&mut all, &counts)?;
    if rank != root {
        return Ok(None);
    }
    let mut merged = StateParts::default();
    for (r, block) in blocks.into_iter().enumerate() {
        let part = StateParts::read(Bytes::from_bytes_vec(all[block].to_vec()), r)?;
        merged.extend(part);
    }
    merged.into_bytes().map(Some)
}

/// The ids of the parameters `optim` holds state for (one `"{id}.__rank"` scalar each: Burn
/// writes it for every parameter with state, tensors or not). Local.
///
/// # Errors
/// [`DdpError::State`] when the state cannot be serialised or read.
pub fn state_param_ids(optim: &ModuleOptimizer) -> Result<BTreeSet<ParamId>, DdpError> {
    let bytes = optim
        .into_bytes()
        .map_err(|e| DdpError::State(format!("cannot serialise the optimizer state: {e}")))?;
    state_param_ids_of(bytes)
}

/// [`state_param_ids`] of optimizer state already serialised (`optimizer.bpk` bytes, or what
/// [`gather_state`] returns).
///
/// # Errors
/// [`DdpError::State`] when the bytes are not burnpack optimizer state.
pub fn state_param_ids_of(bytes: Bytes) -> Result<BTreeSet<ParamId>, DdpError> {
    let reader = burn_pack::Reader::from_bytes(bytes)
        .map_err(|e| DdpError::State(format!("cannot read optimizer state: {e}")))?;
    Ok(reader
        .scalars()
        .keys()
        .filter_map(|key| key.strip_suffix(RANK_SUFFIX))
        .filter_map(|id| id.parse::<u64>().ok())
        .map(ParamId::from)
        .collect())
}

/// Bytes of `model`'s float parameters as this rank holds them (shards at ZeRO stage 3).
/// Local.
pub fn parameter_bytes<M: Module>(model: &M) -> u64 {
    struct Count(u64);
    impl ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let shape = param.lazy_shape();
            self.0 += (shape.num_elements() * param.val().dtype().size()) as u64;
        }
    }
    let mut count = Count(0);
    model.visit(&mut count);
    count.0
}

/// Bytes of the tensors in `optim`'s state (for Adam, its two moments of every parameter it
/// holds state for). Local.
///
/// # Errors
/// [`DdpError::State`] when the state cannot be serialised or read.
pub fn state_bytes(optim: &ModuleOptimizer) -> Result<u64, DdpError> {
    let bytes = optim
        .into_bytes()
        .map_err(|e| DdpError::State(format!("cannot serialise the optimizer state: {e}")))?;
    let reader = burn_pack::Reader::from_bytes(bytes)
        .map_err(|e| DdpError::State(format!("cannot read optimizer state: {e}")))?;
    let tensors = reader
        .into_tensors()
        .map_err(|e| DdpError::State(format!("cannot read optimizer state: {e}")))?;
    Ok(tensors
        .iter()
        .map(|t| (t.shape.num_elements() * t.dtype.size()) as u64)
        .sum())
}

/// Bytes of the float gradients `grads` holds for `model`'s parameters. Local.
pub fn gradient_bytes<M: Module>(model: &M, grads: &GradientsParams) -> u64 {
    struct Count<'a> {
        grads: &'a GradientsParams,
        bytes: u64,
    }
    impl ModuleVisitor for Count<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(param.id) {
                self.bytes += (g.shape().num_elements() * g.dtype().size()) as u64;
            }
        }
    }
    let mut count = Count { grads, bytes: 0 };
    model.visit(&mut count);
    count.bytes
}

/// The key suffix of the scalar Burn writes once per parameter with optimizer state.
const RANK_SUFFIX: &str = ".__rank";

/// One optimizer state read apart into its burnpack entries, each belonging to a parameter.
#[derive(Default)]
pub(crate) struct StateParts {
    pub(crate) tensors: Vec<burn_pack::Tensor>,
    scalars: BTreeMap<String, burn_pack::Scalar>,
    metadata: BTreeMap<String, String>,
}

impl StateParts {
    /// Reads `bytes` (rank `rank`'s state, for error messages).
    pub(crate) fn read(bytes: Bytes, rank: usize) -> Result<Self, DdpError> {
        let bad = |e: burn_pack::Error| {
            DdpError::State(format!("cannot read rank {rank}'s optimizer state: {e}"))
        };
        let reader = burn_pack::Reader::from_bytes(bytes).map_err(bad)?;
        let scalars = reader.scalars().clone();
        let metadata = reader.metadata().clone();
        let tensors = reader.into_tensors().map_err(bad)?;
        Ok(Self {
            tensors,
            scalars,
            metadata,
        })
    }

    /// Keeps the entries of the parameters whose id passes `keep`, and entries that name no
    /// parameter.
    fn retain(&mut self, keep: impl Fn(u64) -> bool) {
        self.tensors
            .retain(|t| t.param_id.or_else(|| key_id(&t.name)).is_none_or(&keep));
        self.scalars.retain(|k, _| key_id(k).is_none_or(&keep));
        self.metadata.retain(|k, _| key_id(k).is_none_or(&keep));
    }

    /// Adds `other`'s entries; where both hold a key (only entries that name no parameter can,
    /// as each parameter's state is on one rank) the first one stays.
    pub(crate) fn extend(&mut self, other: Self) {
        let names: BTreeSet<String> = self.tensors.iter().map(|t| t.name.clone()).collect();
        self.tensors.extend(
            other
                .tensors
                .into_iter()
                .filter(|t| !names.contains(&t.name)),
        );
        for (k, v) in other.scalars {
            self.scalars.entry(k).or_insert(v);
        }
        for (k, v) in other.metadata {
            self.metadata.entry(k).or_insert(v);
        }
    }

    pub(crate) fn into_bytes(self) -> Result<Bytes, DdpError> {
        let mut writer = burn_pack::Writer::new(self.tensors);
        for (key, value) in &self.scalars {
            writer = writer.with_scalar(key, *value);
        }
        for (key, value) in &self.metadata {
            writer = writer.with_metadata(key, value);
        }
        writer
            .into_bytes()
            .map_err(|e| DdpError::State(format!("cannot write optimizer state: {e}")))
    }
}

/// The parameter id a burnpack key of optimizer state starts with (`"{id}"` or `"{id}.…"`).
pub(crate) fn key_id(key: &str) -> Option<u64> {
    key.split('.').next().and_then(|id| id.parse().ok())
}

/// A gradient taken out of `GradientsParams` into host memory, as `f32`, with its range in
/// the flat layout.
struct TakenGrad {
    id: ParamId,
    range: std::ops::Range<usize>,
    data: TensorData,
    dtype: burn::tensor::DType,
}

/// Every planned float gradient, removed from `grads` into host memory, in the flat layout's
/// (owner) order.
fn take_gradients<M: Module>(
    plan: &ShardPlan,
    model: &M,
    grads: &mut GradientsParams,
) -> Vec<TakenGrad> {
    let mut take = TakeHost {
        plan,
        grads,
        taken: Vec::new(),
    };
    model.visit(&mut take);
    let mut taken = take.taken;
    // The fills walk the flat layout (owner order), not the visit order.
    taken.sort_by_key(|t| t.range.start);
    taken
}

/// Which ranks found a non-finite value in the gradients they sent (`nonfinite` is this
/// rank's finding): all-gathered, so every rank gets the same verdict. Collective.
fn nonfinite_ranks<G: ProcessGroup>(
    group: &mut G,
    nonfinite: bool,
) -> Result<GradientCheck, DdpError> {
    let world = group.world_size();
    let mut flags = vec![0u8; world];
    group.all_gather(&[u8::from(nonfinite)], &mut flags)?;
    Ok(GradientCheck {
        nonfinite_ranks: (0..world).filter(|&r| flags[r] != 0).collect(),
    })
}

/// Removes every planned float gradient into host memory.
struct TakeHost<'a> {
    plan: &'a ShardPlan,
    grads: &'a mut GradientsParams,
    taken: Vec<TakenGrad>,
}

impl ModuleVisitor for TakeHost<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let (Some(slot), Some(grad)) = (self.plan.slot(param.id), self.grads.remove::<D>(param.id))
        else {
            return;
        };
        let dtype = grad.dtype();
        self.taken.push(TakenGrad {
            id: param.id,
            range: slot.range.clone(),
            // Burn's CPU backend hands its buffer over; other devices copy it to the host.
            data: grad.into_data().convert::<f32>(),
            dtype,
        });
    }
}

/// Registers this rank's own parameters' reduced gradients (those that had one).
struct PutOwned<'a> {
    grads: &'a mut GradientsParams,
    owned: HashMap<ParamId, (TensorData, burn::tensor::DType)>,
}

impl ModuleVisitor for PutOwned<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some((data, dtype)) = self.owned.remove(&param.id) else {
            return;
        };
        // Gradients are plain (non-autodiff) tensors on the parameter's device.
        let device = param.val().device().without_autodiff();
        let grad = Tensor::<D>::from_data(data.convert_dtype(dtype), &device);
        self.grads.register(param.id, grad);
    }
}

#[cfg(test)]
mod tests;
