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
//! (see [`super::shard_gather`]).
//!
//! [`ShardedForward`] makes [`mark_block`](crate::mark_block) do that gathering for the blocks
//! a model marks, so a model already marked for gradient overlap needs no other change.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Tensor, TensorData};

use super::shard_gather::{gather_shard, shard_len, shard_of, ShardComm};
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
/// same values (the replicas must be equal, as [`prepare_module`](super::prepare_module) makes
/// them). Fails only when a parameter cannot be read back as `f32`.
pub fn shard_module<M: Module>(
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
pub fn gather_module<M: Module>(module: &M, layout: &ShardLayout, comm: &ShardComm) -> M {
    module.clone().map(&mut Gather { layout, comm })
}

struct Gather<'a> {
    layout: &'a ShardLayout,
    comm: &'a ShardComm,
}

impl ModuleMapper for Gather<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(full) = self.layout.full_shape(param.id) else {
            return param;
        };
        let Ok(full) = <[usize; D]>::try_from(full) else {
            return param;
        };
        let len = shard_len(full.iter().product(), self.layout.world_size);
        let dims = param.lazy_shape().to_vec();
        if dims[D - 1] != len || dims[..D - 1].iter().any(|&d| d != 1) {
            // Already whole: a block marked inside a gathered block.
            return param;
        }
        param.map(|shard| gather_shard(shard.reshape([len]), full, self.comm))
    }
}

thread_local! {
    /// What [`mark_block`](crate::mark_block) does on this thread beyond its overlap: gather
    /// (a [`ShardedForward`] alive) or record (inside [`discover_blocks`]).
    static FORWARD: RefCell<Option<Marking>> = const { RefCell::new(None) };
}

enum Marking {
    Gather(ShardLayout, ShardComm),
    Discover(HashSet<ParamId>),
}

/// While it lives, [`mark_block`](crate::mark_block) on this thread returns each marked block
/// with its sharded parameters gathered whole ([`gather_module`]; collective then, in the
/// order the model marks its blocks, the same on every rank). Enter it around a forward of a
/// sharded model; parameters outside marked blocks must not be sharded. Not `Send`: the
/// forward runs on the thread that entered it.
pub struct ShardedForward {
    _not_send: PhantomData<*const ()>,
}

impl ShardedForward {
    /// Installs `layout` and `comm` for this thread's forwards until the guard is dropped (a
    /// second guard replaces the first until it is dropped).
    pub fn enter(layout: &ShardLayout, comm: &ShardComm) -> Self {
        FORWARD.with(|f| *f.borrow_mut() = Some(Marking::Gather(layout.clone(), comm.clone())));
        Self {
            _not_send: PhantomData,
        }
    }
}

impl Drop for ShardedForward {
    fn drop(&mut self) {
        FORWARD.with(|f| *f.borrow_mut() = None);
    }
}

/// The ids of the parameters of every block that [`mark_block`](crate::mark_block) marks
/// while `forward` runs on this thread (a forward of the whole model): what ZeRO stage 3
/// shards. Local; the blocks run as they are.
pub fn discover_blocks(forward: impl FnOnce()) -> HashSet<ParamId> {
    FORWARD.with(|f| *f.borrow_mut() = Some(Marking::Discover(HashSet::new())));
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
        Some(Marking::Discover(ids)) => ids,
        _ => HashSet::new(),
    });
    drop(reset);
    found
}

/// `block` gathered whole where a [`ShardedForward`] is alive on this thread (`None` where
/// not): [`mark_block`](crate::mark_block)'s stage-3 half. Inside [`discover_blocks`] it
/// records the block's parameters and returns `None`.
pub(crate) fn gather_marked<M: Module>(block: &M) -> Option<M> {
    FORWARD.with(|f| match &mut *f.borrow_mut() {
        Some(Marking::Gather(layout, comm)) => Some(gather_module(block, layout, comm)),
        Some(Marking::Discover(ids)) => {
            struct Ids<'a>(&'a mut HashSet<ParamId>);
            impl burn::module::ModuleVisitor for Ids<'_> {
                fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                    self.0.insert(param.id);
                }
            }
            block.visit(&mut Ids(ids));
            None
        }
        None => None,
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
                    let comm = ShardComm::new(group);
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
                                loss(&gathered, x, y, world)
                            }
                            Gathered::ByMarkBlock => {
                                let _forward = ShardedForward::enter(&layout, &comm);
                                loss(&model, x, y, world)
                            }
                        };
                        let mut grads = GradientsParams::from_grads(l.backward(), &model);
                        // The replicated bias: this rank's gradient summed with the others'
                        // (an all-reduce, done here through a gather of its own).
                        let bias = model.b.bias.as_ref().unwrap();
                        let g: Tensor<1> = grads.remove(bias.id).unwrap();
                        let summed = all_ranks_sum(&comm, g);
                        grads.register(bias.id, summed);
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
                    // under checkpointing two once more in the backward: b.weight (b's
                    // matmul needs it for the gradient of its tracked input) and a.bias
                    // (tanh's backward recomputes its input, a's output, whose add gathers
                    // the bias again; a's matmul output is kept, and its input is the batch,
                    // which needs no gradient); then the final gather.
                    let per_step = if checkpointing { 3 + 1 + 2 } else { 3 + 1 };
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
