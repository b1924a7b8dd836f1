//! [`gather_shard`]: the differentiable all-gather of one parameter from its flat shards — the
//! building block of ZeRO stage 3 (FSDP's unshard and reshard), where no rank holds the
//! parameter whole between uses.
//!
//! ```text
//! forward:   full = all_gather(shard)[..numel], shaped as the parameter   (same on every rank)
//! backward:  d shard = block `rank` of Σ_ranks pad(d full)                (reduce-scatter, sum)
//! ```
//! Rank `r` holds values `[r·S, (r+1)·S)` of the flattened parameter, `S = ⌈numel / world⌉`, the
//! last shards padded with zeros ([`shard_len`], [`shard_of`]). The backward sums the ranks'
//! gradients (each rank's `full` feeds its own loss, and the job's loss is their sum), so a
//! data-parallel mean divides by the world size afterwards, as the DDP step does.
//!
//! ## Dropped after the forward, gathered again for the backward
//! A parameter gathered on the spot is registered *memory-bound* with a retro-forward,
//! whatever the device's checkpointing strategy: a consumer that needs the parameter in its
//! backward (a matmul whose other input is tracked) records how to recompute it instead of
//! keeping it, so the full parameter is freed once the forward no longer uses it, and Burn
//! runs the gather again when that consumer's backward asks for it (the tests count both
//! gathers). A consumer behind another op keeps that op's output instead (Burn's linear on a
//! batched input reshapes the weight before its matmul), unless the device checkpoints too
//! (`Device::autodiff().gradient_checkpointing()`, Burn's `Balanced` strategy: every
//! memory-bound op is recomputed): ZeRO stage 3 trains on such a device on a GPU.
//!
//! ## Gathered ahead
//! [`gather_shard_prefetched`] is the same op with the forward's values already gathered
//! (by [`super::shard_prefetch`], block by block, ahead of the forward); its backward and its
//! recompute run the collectives here. On Burn's CPU backend a block gathered ahead is in a
//! block's storage ([`super::block_storage`]): the op is then registered *compute-bound*,
//! so whatever needs the parameter in backward keeps its tensor, whose memory the block
//! gives back after the forward and gathers again when it is read: no recompute, on any
//! device strategy.
//!
//! ## Contract
//! Collective over the [`ShardComm`]'s group: every rank gathers the same parameters in the
//! same order, and runs the backward (which reduce-scatters, and under checkpointing gathers
//! again, in the tape's order, the same on every rank of the same model). Each collective has
//! the group's deadline. A failure cannot be returned from a forward or a backward: it is kept
//! ([`ShardComm::take_error`]) and the result is zeros of the right shape; the group is aborted
//! by it, so the other ranks fail at once instead of at their deadline.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Backend, Dispatch, TensorMetadata};
use burn::tensor::{Shape, Tensor, TensorData};

use crate::ddp::fsdp::block_storage::ParamSlot;
use crate::ddp::fsdp::gathered_bytes::{GatheredBytes, GatheredValues};
use crate::error::{CollectiveError, ShardGatherError};
use crate::group::{Element, ProcessGroup, ReduceOp, TcpProcessGroup};
use crate::host_values::host_values;
use crate::kernels::{host16, HalfFormat};

/// Values of a parameter of `numel` values that each of `world` ranks holds (the shards are
/// equal; the last ones end in zeros).
pub(crate) fn shard_len(numel: usize, world: usize) -> usize {
    numel.div_ceil(world.max(1))
}

/// Rank `rank`'s shard of the flattened parameter `full`: [`shard_len`] values, zeros past the
/// end of `full`.
pub(crate) fn shard_of(full: &[f32], rank: usize, world: usize) -> Vec<f32> {
    let len = shard_len(full.len(), world);
    let start = (rank * len).min(full.len());
    let end = (start + len).min(full.len());
    let mut shard = full[start..end].to_vec();
    shard.resize(len, 0.0);
    shard
}

/// The reduce-scatter (sum) of 16-bit values kept as their bits, in the ring's type `T`.
fn reduce_scatter_16<T: Element>(
    group: &mut TcpProcessGroup,
    input: &[u16],
    output: &mut [u16],
) -> Result<(), CollectiveError> {
    let input: &[T] = bytemuck::cast_slice(input);
    group.reduce_scatter(input, bytemuck::cast_slice_mut(output), ReduceOp::Sum)
}

/// The process group the gathers and reduce-scatters run on, shared by every parameter's op
/// (a clone is the same group). Its collectives run inside Burn's forward and backward, so it
/// must be a group that nothing else uses meanwhile.
#[derive(Clone)]
pub struct ShardComm {
    inner: Arc<Mutex<Inner>>,
    /// Bytes of whole parameters alive on this rank (read without the group's lock).
    gathered: Arc<GatheredBytes>,
}

struct Inner {
    group: TcpProcessGroup,
    /// The first failure since [`ShardComm::take_error`] last looked.
    error: Option<ShardGatherError>,
    /// The gradients' wire format: `f32`, or 16 bits (`gradient_compression`).
    compression: Option<HalfFormat>,
    gathers: u64,
    reduce_scatters: u64,
    /// Bytes of the collectives' buffers (padded whole parameters: f32, the gradients' in
    /// their wire format).
    bytes: u64,
    /// Blocks taken gathered ahead (prefetched) in forwards.
    prefetched: u64,
    /// Blocks gathered again after their forward.
    restored: u64,
}

impl fmt::Debug for ShardComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = self.lock();
        f.debug_struct("ShardComm")
            .field("rank", &inner.group.rank())
            .field("world_size", &inner.group.world_size())
            .field("gathers", &inner.gathers)
            .field("reduce_scatters", &inner.reduce_scatters)
            .finish()
    }
}

impl ShardComm {
    /// Wraps `group` (which the gathers then own). The gradients are reduce-scattered in
    /// `compression`'s 16 bits when given (scaled by `1 / world` before rounding, as stages 0
    /// to 2's buckets), else in `f32`; the parameters are always gathered in `f32`. Every rank
    /// must pass the same `compression`.
    pub(crate) fn new(group: TcpProcessGroup, compression: Option<HalfFormat>) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                group,
                compression,
                error: None,
                gathers: 0,
                reduce_scatters: 0,
                bytes: 0,
                prefetched: 0,
                restored: 0,
            })),
            gathered: Arc::default(),
        }
    }

    /// Live and peak bytes of the whole parameters this rank's gathers made (a block gathered
    /// ahead, one gathered on the spot or again for a backward), while tensors use them.
    pub fn gathered_bytes(&self) -> &Arc<GatheredBytes> {
        &self.gathered
    }

    pub(crate) fn rank(&self) -> usize {
        self.lock().group.rank()
    }

    pub(crate) fn world_size(&self) -> usize {
        self.lock().group.world_size()
    }

    /// Gathers run so far, forward and recomputed ones alike.
    pub fn gathers(&self) -> u64 {
        self.lock().gathers
    }

    /// Reduce-scatters (backward steps) run so far.
    pub fn reduce_scatters(&self) -> u64 {
        self.lock().reduce_scatters
    }

    /// Blocks the forwards took gathered ahead ([`super::shard_prefetch`]) so far.
    pub fn prefetched_blocks(&self) -> u64 {
        self.lock().prefetched
    }

    /// Counts a block taken gathered ahead, of `values` whole values across its parameters
    /// (its collective's buffer: those values padded to whole shards).
    pub(crate) fn count_prefetched_block(&self, values: u64) {
        let mut inner = self.lock();
        inner.prefetched += 1;
        inner.bytes += 4 * values;
    }

    /// Blocks gathered again for a read after their forward had moved on (their backward,
    /// on Burn's CPU backend: [`super::block_storage`]) so far.
    pub fn restored_blocks(&self) -> u64 {
        self.lock().restored
    }

    /// Counts a block gathered again, its collective's buffer of `bytes`.
    pub(crate) fn count_restored_block(&self, bytes: u64) {
        let mut inner = self.lock();
        inner.restored += 1;
        inner.bytes += bytes;
    }

    /// Bytes of the gathers' and reduce-scatters' buffers so far (each a padded whole
    /// parameter in `f32`, the blocks gathered ahead and again included; a ring sends
    /// `(world - 1) / world` of each).
    pub(crate) fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    /// The first failure of a gather or reduce-scatter since the last call, if any. A step taken
    /// after one would use zeros for a parameter or its gradient: callers check before stepping.
    pub(crate) fn take_error(&self) -> Option<ShardGatherError> {
        self.lock().error.take()
    }

    /// A panic elsewhere while holding the lock leaves the counters and the group as they were;
    /// the group itself reports a broken collective.
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The full parameter (`numel` values) from this rank's `shard`; zeros on failure.
    fn all_gather(&self, shard: &[f32], numel: usize) -> Vec<f32> {
        let mut inner = self.lock();
        inner.gathers += 1;
        let world = inner.group.world_size();
        let mut full = vec![0.0; shard.len() * world];
        inner.bytes += 4 * full.len() as u64;
        if let Err(e) = inner.group.all_gather(shard, &mut full) {
            full.fill(0.0);
            inner.error.get_or_insert(e.into());
        }
        full.truncate(numel);
        full.resize(numel, 0.0);
        full
    }

    /// This rank's block of the ranks' mean of `grad` (each rank's gradient of the whole
    /// parameter), [`shard_len`] values: summed over the ranks in `f32` and × `1 / world`, or
    /// with compression × `1 / world`, rounded to 16 bits and summed in them, then widened
    /// (the same operations, in the same order, as stages 0 to 2's buckets). Zeros on
    /// failure.
    fn reduce_scatter(&self, mut grad: Vec<f32>) -> Vec<f32> {
        let mut inner = self.lock();
        inner.reduce_scatters += 1;
        let world = inner.group.world_size();
        let (numel, scale) = (grad.len(), 1.0 / world as f32);
        let len = shard_len(numel, world);
        let mut shard = vec![0.0; len];
        // Heap buffers, not mapped ones: a reduce-scatter per parameter per step on this
        // thread, whose freed buffers the next ones reuse, where a fresh mapping would fault
        // its pages in every time (slower in alternating runs, measured).
        let summed = match inner.compression {
            None => {
                grad.resize(len * world, 0.0);
                inner.bytes += 4 * grad.len() as u64;
                let summed = inner.group.reduce_scatter(&grad, &mut shard, ReduceOp::Sum);
                shard.iter_mut().for_each(|v| *v *= scale);
                summed
            }
            Some(format) => {
                let mut rounded = vec![0u16; len * world];
                host16::round_scaled(format, &grad, scale, &mut rounded[..numel]);
                drop(grad);
                inner.bytes += 2 * rounded.len() as u64;
                let mut sums = vec![0u16; len];
                let summed = match format {
                    HalfFormat::Bf16 => {
                        reduce_scatter_16::<half::bf16>(&mut inner.group, &rounded, &mut sums)
                    }
                    HalfFormat::F16 => {
                        reduce_scatter_16::<half::f16>(&mut inner.group, &rounded, &mut sums)
                    }
                };
                host16::widen(format, &sums, &mut shard);
                summed
            }
        };
        if let Err(e) = summed {
            shard.fill(0.0);
            inner.error.get_or_insert(e.into());
        }
        shard
    }

    pub(crate) fn record(&self, error: ShardGatherError) {
        self.lock().error.get_or_insert(error);
    }
}

/// The backend operation under [`gather_shard`]: Burn's CPU backend (Flex), its CubeCL backend
/// (features `wgpu` / `cuda`) and autodiff over any of them, through the host (as
/// [`all_reduce_sum`](crate::ddp::sync_batch_norm::all_reduce_op::all_reduce_sum); on another backend the generated
/// routing panics, "Backend not supported for custom op").
#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")), Autodiff)]
pub(crate) trait GatherShard: Backend {
    /// The parameter of `shape` gathered from every rank's `shard` (module docs); `given`: its
    /// values, when they were gathered ahead.
    fn gather_shard(
        shard: FloatTensor<Self>,
        shape: Shape,
        comm: ShardComm,
        given: Given,
    ) -> FloatTensor<Self>;
}

/// A parameter's whole values gathered ahead of the forward ([`gather_shard_prefetched`]), or
/// none.
#[derive(Clone, Default)]
pub(crate) struct Given(GivenValues);

#[derive(Clone, Default)]
enum GivenValues {
    #[default]
    None,
    Values(Arc<GatheredValues>),
    /// In a block's storage, evicted after the forward and gathered again when read
    /// ([`super::block_storage`]).
    Slot(Arc<ParamSlot>),
}

impl Given {
    pub(crate) fn slot(slot: Arc<ParamSlot>) -> Self {
        Self(GivenValues::Slot(slot))
    }

    /// Whether the values are a block's storage (kept by the tensors that use them, given
    /// back and gathered again by the block rather than recomputed by Burn).
    fn is_slot(&self) -> bool {
        matches!(self.0, GivenValues::Slot(_))
    }
}

impl fmt::Debug for Given {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.0 {
            GivenValues::None => "none",
            GivenValues::Values(_) => "values",
            GivenValues::Slot(_) => "slot",
        };
        f.debug_tuple("Given").field(&kind).finish()
    }
}

impl GatherShard for burn::backend::Flex {
    fn gather_shard(
        shard: FloatTensor<Self>,
        shape: Shape,
        comm: ShardComm,
        given: Given,
    ) -> FloatTensor<Self> {
        host_gather::<Self>(shard, &shape, &comm, given)
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl GatherShard for burn::backend::Cube {
    fn gather_shard(
        shard: FloatTensor<Self>,
        shape: Shape,
        comm: ShardComm,
        given: Given,
    ) -> FloatTensor<Self> {
        host_gather::<Self>(shard, &shape, &comm, given)
    }
}

impl<B: Backend, C: CheckpointStrategy> GatherShard for Autodiff<B, C> {
    fn gather_shard(
        shard: FloatTensor<Self>,
        shape: Shape,
        comm: ShardComm,
        given: Given,
    ) -> FloatTensor<Self> {
        let input = shard.id();
        // Only Burn's CPU backend uses the values as the tensor's storage; a device backend
        // copies them, and its copy would be kept whole.
        let slot = given.is_slot() && is_cpu::<B>();
        let output = host_gather::<B>(shard.primitive().clone(), &shape, &comm, given);
        let backward = ReduceScatterBackward { comm: comm.clone() };
        if slot {
            // Values in a block's storage: whoever keeps them keeps the storage, which the
            // block gives back after the forward and gathers again when read.
            return backward
                .prepare::<C>([shard.node()])
                .compute_bound()
                .stateless(output);
        }
        let retro = RetroGather::<B> {
            input,
            shape,
            comm,
            backend: std::marker::PhantomData,
        };
        // Memory-bound with a recompute rule whatever the device's strategy: a consumer that
        // takes the gathered parameter as it is keeps the rule, not the tensor.
        backward
            .prepare::<BalancedCheckpointing>([shard.node()])
            .memory_bound()
            .retro_forward(retro)
            .parents([&shard])
            .stateless(output)
    }
}

/// The backward step: the incoming gradient of the whole parameter, reduce-scattered.
#[derive(Debug)]
struct ReduceScatterBackward {
    comm: ShardComm,
}

impl<B: Backend> Backward<B, 1> for ReduceScatterBackward {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let comm = self.comm;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            host_reduce_scatter::<B>(grad, &comm)
        });
    }
}

/// The gather again, run by Burn's checkpointing when a backward needs the full parameter.
struct RetroGather<B> {
    input: NodeId,
    shape: Shape,
    comm: ShardComm,
    backend: std::marker::PhantomData<fn() -> B>,
}

impl<B> fmt::Debug for RetroGather<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetroGather")
            .field("input", &self.input)
            .field("shape", &self.shape)
            .finish()
    }
}

impl<B: Backend> RetroForward for RetroGather<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let shard = states.get_state::<FloatTensor<B>>(&self.input);
        let gathered = host_gather::<B>(shard, &self.shape, &self.comm, Given::default());
        states.save(out_node, gathered);
    }
}

/// The parameter of `shape` gathered from every rank's `shard` (module docs).
///
/// Collective over `comm`'s group (every rank, same parameters, same order; the backward
/// reduce-scatters, and re-gathers under gradient checkpointing); deadline: the group's
/// timeout. `shard` holds [`shard_len`]`(shape's elements, world)` values.
pub(crate) fn gather_shard<const D: usize>(
    shard: Tensor<1>,
    shape: [usize; D],
    comm: &ShardComm,
) -> Tensor<D> {
    gather_given(shard, shape, comm, Given::default())
}

/// [`gather_shard`] with the forward's values already gathered (`full`, the parameter's
/// values in order): no collective in the forward; the backward reduce-scatters, and a
/// recompute gathers, over `comm` as [`gather_shard`]'s do.
pub fn gather_shard_prefetched<const D: usize>(
    shard: Tensor<1>,
    shape: [usize; D],
    comm: &ShardComm,
    full: Vec<f32>,
) -> Tensor<D> {
    let full = GatheredValues::new(full, comm.gathered_bytes());
    let given = Given(GivenValues::Values(Arc::new(full)));
    gather_given(shard, shape, comm, given)
}

/// [`gather_shard_prefetched`] with the values in a block's storage (the prefetch thread's).
pub(crate) fn gather_shard_slot<const D: usize>(
    shard: Tensor<1>,
    shape: [usize; D],
    comm: &ShardComm,
    slot: Arc<ParamSlot>,
) -> Tensor<D> {
    gather_given(shard, shape, comm, Given::slot(slot))
}

/// The gather op over `shard` with what its forward is given (nothing: it gathers).
fn gather_given<const D: usize>(
    shard: Tensor<1>,
    shape: [usize; D],
    comm: &ShardComm,
    given: Given,
) -> Tensor<D> {
    Tensor::from_dispatch(Dispatch::gather_shard(
        shard.into_dispatch(),
        Shape::from(shape),
        comm.clone(),
        given,
    ))
}

/// Reads `tensor` back as `f32` values, or records why not.
fn read_values<B: Backend>(tensor: FloatTensor<B>, comm: &ShardComm) -> Option<Vec<f32>> {
    let read = match burn::tensor::try_read_sync(B::float_into_data(tensor)) {
        Some(Ok(data)) => host_values::<f32>(data).map_err(|e| format!("{e:?}")),
        Some(Err(e)) => Err(e.to_string()),
        None => Err("this platform cannot block on a read".into()),
    };
    read.map_err(|e| comm.record(ShardGatherError::Readback(e)))
        .ok()
}

fn host_gather<B: Backend>(
    shard: FloatTensor<B>,
    shape: &Shape,
    comm: &ShardComm,
    given: Given,
) -> FloatTensor<B> {
    let (device, dtype) = (shard.device(), shard.dtype());
    let numel = shape.num_elements();
    let full = match given.0 {
        // The values become the tensor's storage as they are (on Burn's CPU backend).
        GivenValues::Slot(slot) if is_cpu::<B>() => {
            return B::float_from_data(
                slot.into_tensor_data(shape.clone()).convert_dtype(dtype),
                &device,
            )
        }
        // A device backend may read its upload's source later, from a thread of its own,
        // after the block was given back: it gets values of their own, and the slot goes.
        GivenValues::Slot(slot) => GatheredValues::new(slot.to_vec(), comm.gathered_bytes()),
        GivenValues::Values(full) => Arc::try_unwrap(full).unwrap_or_else(|shared| {
            GatheredValues::new(shared.values().to_vec(), comm.gathered_bytes())
        }),
        GivenValues::None => {
            let full = match read_values::<B>(shard, comm) {
                Some(values) => comm.all_gather(&values, numel),
                // Every rank must still enter the collective the others are in.
                None => comm.all_gather(&vec![0.0; shard_len(numel, comm.world_size())], numel),
            };
            GatheredValues::new(full, comm.gathered_bytes())
        }
    };
    // The values become the tensor's storage (counted while it lives, on Burn's CPU backend;
    // a device backend copies them and they go at once).
    B::float_from_data(
        full.into_tensor_data(shape.clone()).convert_dtype(dtype),
        &device,
    )
}

/// Whether `B` is Burn's CPU backend, whose tensors use host values as their storage.
fn is_cpu<B: Backend>() -> bool {
    std::any::TypeId::of::<B>() == std::any::TypeId::of::<burn::backend::Flex>()
}

fn host_reduce_scatter<B: Backend>(grad: FloatTensor<B>, comm: &ShardComm) -> FloatTensor<B> {
    let (device, dtype) = (grad.device(), grad.dtype());
    let numel = grad.shape().num_elements();
    let values = read_values::<B>(grad, comm).unwrap_or_else(|| vec![0.0; numel]);
    let shard = comm.reduce_scatter(values);
    let len = shard.len();
    B::float_from_data(TensorData::new(shard, [len]).convert_dtype(dtype), &device)
}

#[cfg(test)]
mod tests;
