//! A module whose parameters are flat shards ([`shard_module`]), and the module gathered back
//! for one forward ([`gather_module`]) — ZeRO stage 3's layout of a Burn module.
//!
//! A sharded parameter keeps its [`ParamId`] and its rank (`Param<Tensor<D>>`), so Burn's
//! optimizers, keyed by id and shaped by the gradient, step the shard as they step any
//! parameter: the optimizer state is a shard too. Its tensor is this rank's
//! [`shard_len`] values ([`shard_of`]) in the shape `[1, …, 1, len]`, a leaf that requires a
//! gradient; the [`ShardLayout`] remembers the full shapes.
//!
//! [`gather_module`] returns a copy of the module whose sharded parameters are
//! [`gather_shard`] of the shards: a forward through the copy trains the shards (the backward
//! reduce-scatters into them), and once the copy is dropped, the full parameters live only as
//! long as the forward's graph keeps them — under Burn's gradient checkpointing, not at all
//! (see [`super::shard_gather`]). The blocks gathered ahead on Burn's CPU backend are given
//! back when the forward enters the next block, and gathered again when read
//! ([`super::block_storage`]).
//!
//! [`ShardedForward`] makes [`mark_block`](crate::mark_block) do that gathering for the blocks
//! a model marks, so a model already marked for gradient overlap needs no other change.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;
use std::sync::Arc;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Tensor, TensorData};

use crate::ddp::fsdp::block_storage::{BlockStorage, ParamSlot};
use crate::ddp::fsdp::gathered_bytes::GatheredBytes;
use crate::ddp::fsdp::shard_gather::{
    gather_shard, gather_shard_slot, shard_len, shard_of, ShardComm,
};
use crate::ddp::fsdp::shard_prefetch::PrefetchStream;
use crate::error::ShardGatherError;
use crate::host_values::host_values;

/// The full shapes of a module's sharded parameters, and the world they were cut for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLayout {
    pub rank: usize,
    pub world_size: usize,
    shapes: HashMap<ParamId, Vec<usize>>,
}

impl ShardLayout {
    /// The full shape of parameter `id`, if it is sharded.
    pub fn full_shape(&self, id: ParamId) -> Option<&[usize]> {
        self.shapes.get(&id).map(Vec::as_slice)
    }

    /// How many parameters are sharded.
    pub fn len(&self) -> usize {
        self.shapes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.shapes.is_empty()
    }

    /// Every sharded parameter's full shape.
    pub fn shapes(&self) -> &HashMap<ParamId, Vec<usize>> {
        &self.shapes
    }
}

/// `module` with each float parameter that `sharded` selects replaced by this rank's shard of
/// it (module docs), and the layout to gather them with. Not collective: every rank cuts the
/// same values (the replicas must be equal, as [`prepare_module`](crate::ddp::prepare_module) makes
/// them). Fails only when a parameter cannot be read back as `f32`.
pub(crate) fn shard_module<M: Module>(
    module: M,
    rank: usize,
    world_size: usize,
    sharded: impl Fn(ParamId) -> bool,
) -> Result<(M, ShardLayout), ShardGatherError> {
    let mut cut = Cut {
        rank,
        world_size,
        sharded,
        shapes: HashMap::new(),
        error: None,
    };
    let module = module.map(&mut cut);
    if let Some(error) = cut.error {
        return Err(error);
    }
    Ok((
        module,
        ShardLayout {
            rank,
            world_size,
            shapes: cut.shapes,
        },
    ))
}

struct Cut<F> {
    rank: usize,
    world_size: usize,
    sharded: F,
    shapes: HashMap<ParamId, Vec<usize>>,
    error: Option<ShardGatherError>,
}

impl<F: Fn(ParamId) -> bool> ModuleMapper for Cut<F> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !(self.sharded)(param.id) || self.error.is_some() {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        let (device, shape) = (tensor.device(), tensor.shape());
        let tracked = tensor.is_require_grad();
        let full = match host_values::<f32>(tensor.clone().into_data()) {
            Ok(values) => values,
            Err(e) => {
                self.error = Some(ShardGatherError::Readback(format!("{e:?}")));
                return Param::from_mapped_value(id, tensor, mapper);
            }
        };
        let shard = shard_of(&full, self.rank, self.world_size);
        let mut shard_shape = [1; D];
        shard_shape[D - 1] = shard.len();
        let mut shard = Tensor::from_data(TensorData::new(shard, shard_shape), &device);
        if tracked {
            shard = shard.require_grad();
        }
        self.shapes.insert(id, shape.to_vec());
        Param::from_mapped_value(id, shard, mapper)
    }
}

/// A copy of `module` (tensor handles) whose sharded parameters are gathered whole, for one
/// forward (module docs). Collective over `comm`'s group: every rank gathers the same
/// parameters in the same order (the module's), and its backward reduce-scatters them.
pub(crate) fn gather_module<M: Module>(module: &M, layout: &ShardLayout, comm: &ShardComm) -> M {
    module.clone().map(&mut Gather {
        layout,
        comm,
        given: None,
        order: &|_, shard| shard,
    })
}

/// What a gather does to each shard before gathering it: ties it to the block's input, so
/// that its backward (the reduce-scatter) runs right after the block's (see
/// [`mark_block`](crate::mark_block)), or nothing.
pub(crate) type OrderShard<'a> = &'a dyn Fn(ParamId, Tensor<1>) -> Tensor<1>;

struct Gather<'a> {
    layout: &'a ShardLayout,
    comm: &'a ShardComm,
    order: OrderShard<'a>,
    /// The parameters' values gathered ahead, by id (taken as they are used).
    given: Option<HashMap<ParamId, Arc<ParamSlot>>>,
}

/// The full shape of `param` when it is a shard under `layout` (its shape `[1, …, 1, len]`);
/// `None` for a parameter that is not sharded, or already whole (a block marked inside a
/// gathered block).
fn is_shard<const D: usize>(param: &Param<Tensor<D>>, layout: &ShardLayout) -> Option<[usize; D]> {
    let full = <[usize; D]>::try_from(layout.full_shape(param.id)?).ok()?;
    let len = shard_len(full.iter().product(), layout.world_size);
    let dims = param.lazy_shape().to_vec();
    (dims[D - 1] == len && dims[..D - 1].iter().all(|&d| d == 1)).then_some(full)
}

impl ModuleMapper for Gather<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(full) = is_shard(&param, self.layout) else {
            return param;
        };
        let len = shard_len(full.iter().product(), self.layout.world_size);
        let given = self
            .given
            .as_mut()
            .and_then(|given| given.remove(&param.id));
        let id = param.id;
        param.map(|shard| match given {
            Some(slot) => gather_shard_slot(
                (self.order)(id, shard.reshape([len])),
                full,
                self.comm,
                slot,
            ),
            None => gather_shard((self.order)(id, shard.reshape([len])), full, self.comm),
        })
    }
}

thread_local! {
    /// What [`mark_block`](crate::mark_block) does on this thread beyond its overlap: gather
    /// (a [`ShardedForward`] alive) or record (inside [`discover_blocks`]).
    static FORWARD: RefCell<Option<Marking>> = const { RefCell::new(None) };
}

enum Marking {
    Gather {
        layout: ShardLayout,
        comm: ShardComm,
        /// The blocks gathered ahead, in the forward's order; `None` once a block did not
        /// match (the rest of this forward gathers on the spot).
        prefetched: Option<PrefetchStream>,
        /// The storage of the block gathered ahead that the forward entered last: evicted
        /// when the forward enters the next block ([`super::block_storage`]).
        entered: Option<Arc<BlockStorage>>,
    },
    /// The blocks marked so far, in order, each with the parameters no earlier block has.
    Discover(Vec<Vec<ParamId>>),
}

/// While it lives, [`mark_block`](crate::mark_block) on this thread returns each marked block
/// with its sharded parameters gathered whole (collective then, in the order the model marks
/// its blocks, the same on every rank). Enter it around a forward of a sharded model (and its
/// backward); parameters outside marked blocks must not be sharded. Not `Send`: the forward
/// runs on the thread that entered it.
pub(crate) struct ShardedForward {
    /// Where the peak of whole parameters held is taken; its window ends with the guard.
    gathered: Arc<GatheredBytes>,
    _not_send: PhantomData<*const ()>,
}

impl ShardedForward {
    /// Installs `layout` and `comm` for this thread's forwards until the guard is dropped (a
    /// second guard replaces the first until it is dropped): each block gathered when it is
    /// marked ([`gather_module`]).
    pub(crate) fn enter(layout: &ShardLayout, comm: &ShardComm) -> Self {
        Self::install(layout, comm, None)
    }

    /// [`enter`](Self::enter), the blocks taken from `prefetched` in order (gathered ahead
    /// by [`super::shard_prefetch`]); a block that does not match the next one there is
    /// gathered on the spot, as is every later block of this forward.
    pub(crate) fn enter_prefetched(
        layout: &ShardLayout,
        comm: &ShardComm,
        prefetched: PrefetchStream,
    ) -> Self {
        Self::install(layout, comm, Some(prefetched))
    }

    fn install(layout: &ShardLayout, comm: &ShardComm, prefetched: Option<PrefetchStream>) -> Self {
        FORWARD.with(|f| {
            *f.borrow_mut() = Some(Marking::Gather {
                layout: layout.clone(),
                comm: comm.clone(),
                prefetched,
                entered: None,
            })
        });
        Self {
            gathered: comm.gathered_bytes().clone(),
            _not_send: PhantomData,
        }
    }
}

impl Drop for ShardedForward {
    fn drop(&mut self) {
        FORWARD.with(|f| *f.borrow_mut() = None);
        self.gathered.end_window();
    }
}

/// The blocks that [`mark_block`](crate::mark_block) marks while `forward` runs on this
/// thread (a forward of the whole model), in order, each with the ids of its float parameters
/// that no earlier block has (blocks with none left out): what ZeRO stage 3 shards, and the
/// order its prefetch follows. Local; the blocks run as they are.
pub(crate) fn discover_blocks(forward: impl FnOnce()) -> Vec<Vec<ParamId>> {
    FORWARD.with(|f| *f.borrow_mut() = Some(Marking::Discover(Vec::new())));
    // Reset even if `forward` panics, so that a caught panic leaves no recording behind.
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            FORWARD.with(|f| *f.borrow_mut() = None);
        }
    }
    let reset = Reset;
    forward();
    let found = FORWARD.with(|f| match f.borrow_mut().take() {
        Some(Marking::Discover(blocks)) => blocks,
        _ => Vec::new(),
    });
    drop(reset);
    found
}

/// The ids of `module`'s float parameters, in visit order.
pub(crate) fn param_ids<M: Module>(module: &M) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl burn::module::ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// The ids of `block`'s parameters that are still shards under `layout`, in visit order.
fn shard_ids<M: Module>(block: &M, layout: &ShardLayout) -> Vec<ParamId> {
    struct Shards<'a> {
        layout: &'a ShardLayout,
        ids: Vec<ParamId>,
    }
    impl burn::module::ModuleVisitor for Shards<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if is_shard(param, self.layout).is_some() {
                self.ids.push(param.id);
            }
        }
    }
    let mut shards = Shards {
        layout,
        ids: Vec::new(),
    };
    block.visit(&mut shards);
    shards.ids
}

/// `block` gathered whole where a [`ShardedForward`] is alive on this thread (`None` where
/// not): [`mark_block`](crate::mark_block)'s stage-3 half. Inside [`discover_blocks`] it
/// records the block's parameters and returns `None`.
pub(crate) fn gather_marked<M: Module>(block: &M, order: OrderShard<'_>) -> Option<M> {
    FORWARD.with(|f| match &mut *f.borrow_mut() {
        Some(Marking::Gather {
            layout,
            comm,
            prefetched,
            entered,
        }) => Some(gather_next(block, layout, comm, prefetched, entered, order)),
        Some(Marking::Discover(blocks)) => {
            let seen: HashSet<ParamId> = blocks.iter().flatten().copied().collect();
            let ids: Vec<ParamId> = param_ids(block)
                .into_iter()
                .filter(|id| !seen.contains(id))
                .collect();
            if !ids.is_empty() {
                blocks.push(ids);
            }
            None
        }
        None => None,
    })
}

/// `block` gathered: from the prefetched stream where its next block is this one, else on the
/// spot (and the stream given up for this forward). The block gathered ahead before it is
/// evicted: the forward has moved past it.
fn gather_next<M: Module>(
    block: &M,
    layout: &ShardLayout,
    comm: &ShardComm,
    prefetched: &mut Option<PrefetchStream>,
    entered: &mut Option<Arc<BlockStorage>>,
    order: OrderShard<'_>,
) -> M {
    let ids = shard_ids(block, layout);
    if ids.is_empty() {
        return block.clone();
    }
    let before = entered.take();
    if let Some(before) = &before {
        before.evict();
    }
    if let Some(stream) = prefetched {
        match stream.take_next() {
            Ok(gathered) if gathered.ids == ids => {
                let world = layout.world_size;
                let values = gathered
                    .storage
                    .numels
                    .iter()
                    .map(|&numel| (shard_len(numel, world) * world) as u64)
                    .sum();
                comm.count_prefetched_block(values);
                if let Some(before) = before {
                    gathered.storage.set_before(before);
                }
                *entered = Some(gathered.storage);
                let slots: HashMap<ParamId, Arc<ParamSlot>> =
                    gathered.ids.into_iter().zip(gathered.slots).collect();
                return block.clone().map(&mut Gather {
                    layout,
                    comm,
                    given: Some(slots),
                    order,
                });
            }
            Ok(_) => {}
            Err(e) => comm.record(ShardGatherError::Prefetch(e)),
        }
        *prefetched = None;
    }
    block.clone().map(&mut Gather {
        layout,
        comm,
        given: None,
        order,
    })
}

#[cfg(test)]
mod tests {
    //! Ranks as threads over real loopback sockets, trained with Adam through gathered copies
    //! of a sharded model, against one process training the whole model on the ranks' mean
    //! loss.
    use std::sync::Arc;

    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::{AdamConfig, GradientsParams};
    use burn::tensor::{Device, Tensor, TensorData};

    use super::*;
    use crate::group::{TcpGroupOptions, TcpProcessGroup};
    use crate::store::{MemoryStore, Store};
    use crate::testing::formula_weights;

    #[derive(Module, Debug)]
    struct Net {
        a: Linear,
        b: Linear,
    }

    impl Net {
        /// Both layers marked, as a model marked for gradient overlap is.
        fn forward(&self, x: Tensor<2>) -> Tensor<2> {
            let h = crate::mark_block(&x, &self.a).forward(x).tanh();
            crate::mark_block(&h, &self.b).forward(h)
        }
    }

    /// The same weights in every run.
    fn net(device: &Device) -> Net {
        formula_weights(Net {
            a: LinearConfig::new(5, 7).init(device),
            b: LinearConfig::new(7, 3).init(device),
        })
    }

    fn batch(rank: usize, step: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let x: Vec<f32> = (0..20)
            .map(|i| ((i * 13 + rank * 7 + step * 3) % 17) as f32 / 17.0 - 0.5)
            .collect();
        let y: Vec<f32> = (0..12)
            .map(|i| ((i * 5 + rank + step) % 11) as f32 / 11.0)
            .collect();
        (
            Tensor::from_data(TensorData::new(x, [4, 5]), device),
            Tensor::from_data(TensorData::new(y, [4, 3]), device),
        )
    }

    fn loss(net: &Net, x: Tensor<2>, y: Tensor<2>, world: usize) -> Tensor<1> {
        (net.forward(x) - y).powf_scalar(2.0).mean() / world as f32
    }

    fn flat(net: &Net) -> Vec<f32> {
        struct Collect(Vec<f32>);
        impl burn::module::ModuleVisitor for Collect {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                self.0
                    .extend(p.val().into_data().try_to_vec::<f32>().unwrap_or_default());
            }
        }
        let mut c = Collect(Vec::new());
        net.visit(&mut c);
        c.0
    }

    const STEPS: usize = 4;

    /// One process, the whole model, the ranks' mean loss.
    fn reference(world: usize, device: &Device) -> Vec<f32> {
        let mut model = net(device);
        let mut optim = AdamConfig::new().init();
        for step in 0..STEPS {
            let total = (0..world)
                .map(|rank| {
                    let (x, y) = batch(rank, step, device);
                    loss(&model, x, y, world)
                })
                .reduce(|a, b| a + b)
                .unwrap();
            let grads = GradientsParams::from_grads(total.backward(), &model);
            model = optim.step(1e-2, model, grads);
        }
        flat(&model)
    }

    /// How each step's forward reaches the whole parameters.
    #[derive(Debug, Clone, Copy)]
    enum Gathered {
        /// The test gathers a copy of the model ([`gather_module`]).
        Copy,
        /// The model's own `mark_block` calls gather each block ([`ShardedForward`]).
        ByMarkBlock,
    }

    /// Each rank: the model sharded but for `b`'s bias (kept whole, its gradient summed as
    /// DDP's would be), Adam on the shards; the final model gathered whole.
    fn sharded(world: usize, checkpointing: bool, how: Gathered) -> Vec<(Vec<f32>, u64, usize)> {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let device = if checkpointing {
                        Device::flex().autodiff().gradient_checkpointing()
                    } else {
                        Device::flex().autodiff()
                    };
                    let group =
                        TcpProcessGroup::new(store, rank, world, TcpGroupOptions::default())
                            .unwrap();
                    let comm = ShardComm::new(group, None);
                    let whole = net(&device);
                    let kept = whole.b.bias.as_ref().map(|b| b.id);
                    let (mut model, layout) =
                        shard_module(whole, rank, world, |id| Some(id) != kept).unwrap();
                    let mut optim = AdamConfig::new().init();
                    for step in 0..STEPS {
                        let (x, y) = batch(rank, step, &device);
                        let l = match how {
                            Gathered::Copy => {
                                let gathered = gather_module(&model, &layout, &comm);
                                loss(&gathered, x, y, 1)
                            }
                            Gathered::ByMarkBlock => {
                                let _forward = ShardedForward::enter(&layout, &comm);
                                loss(&model, x, y, 1)
                            }
                        };
                        let mut grads = GradientsParams::from_grads(l.backward(), &model);
                        // The replicated bias: the mean of the ranks' gradients, as the
                        // reduce-scatters give the shards' (an all-reduce, done here through a
                        // gather of its own).
                        let bias = model.b.bias.as_ref().unwrap();
                        let g: Tensor<1> = grads.remove(bias.id).unwrap();
                        let mean = all_ranks_sum(&comm, g) / world as f32;
                        grads.register(bias.id, mean);
                        model = optim.step(1e-2, model, grads);
                    }
                    assert!(comm.take_error().is_none());
                    let gathered = gather_module(&model, &layout, &comm);
                    (flat(&gathered), comm.gathers(), layout.len())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// Σ over ranks of `t`: each rank's `t` gathered whole from one-value shards, then added.
    fn all_ranks_sum(comm: &ShardComm, t: Tensor<1>) -> Tensor<1> {
        let n = t.shape().num_elements();
        let world = comm.world_size();
        let device = t.device();
        let mut sum = Tensor::<1>::zeros([n], &device);
        // Each rank's vector is a parameter of n · world values, this rank's shard its own.
        let gathered = gather_shard(t.detach(), [world, n], comm).detach();
        for r in 0..world {
            sum = sum + gathered.clone().slice([r..r + 1, 0..n]).reshape([n]);
        }
        sum
    }

    #[test]
    fn a_sharded_model_trained_through_gathered_copies_or_mark_block_matches_the_whole_model() {
        let device = Device::flex().autodiff();
        for world in [2, 3] {
            let want = reference(world, &device);
            for (checkpointing, how) in [
                (false, Gathered::Copy),
                (true, Gathered::Copy),
                (false, Gathered::ByMarkBlock),
                (true, Gathered::ByMarkBlock),
            ] {
                let outcomes = sharded(world, checkpointing, how);
                for (rank, (got, gathers, sharded)) in outcomes.into_iter().enumerate() {
                    assert_eq!(sharded, 3, "a.weight, a.bias, b.weight");
                    assert_eq!(got.len(), want.len());
                    let worst = got
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0f32, f32::max);
                    assert!(
                        worst < 1e-5,
                        "world {world} rank {rank} checkpointing {checkpointing} {how:?}: max |Δw| {worst}"
                    );
                    // Per step: 3 parameters gathered in the forward and the bias's sum;
                    // b.weight once more in the backward (b's matmul needs it for the
                    // gradient of its tracked input, and takes it as gathered: it keeps the
                    // recompute rule, not the tensor); under checkpointing a.bias too
                    // (tanh's backward recomputes its input, a's output, whose add gathers
                    // the bias again; a's matmul output is kept, and its input is the batch,
                    // which needs no gradient); then the final gather.
                    let per_step = if checkpointing { 3 + 1 + 2 } else { 3 + 1 + 1 };
                    assert_eq!(
                        gathers,
                        (STEPS * per_step + 3) as u64,
                        "world {world} rank {rank} checkpointing {checkpointing} {how:?}"
                    );
                }
            }
        }
    }
}
