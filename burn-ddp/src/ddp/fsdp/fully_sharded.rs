//! ZeRO stage 3 inside the DDP step ([`FullyShardedState`]): which parameters are sharded
//! (those of the blocks a model marks), the group their gathers and reduce-scatters run on,
//! and what the step does with their gradients.
//!
//! ```text
//! fully_shard   one forward of the whole model records the marked blocks' parameters
//!               (discover_blocks), then each rank keeps its flat shard of them (shard_module)
//! forward       the blocks all-gathered ahead, one collective each, on a thread of their own
//!               (shard_prefetch); mark_block takes each block whole (ShardedForward); a
//!               block's memory is given back when the forward enters the next one, and
//!               gathered again when its backward reads it (block_storage; on a device
//!               backend, Burn's recompute)
//! backward      each gathered parameter's gradient is reduce-scattered into its shard: the
//!               mean (× 1/world, summed; in 16 bits with gradient compression)
//! step          the shards' gradients checked for NaN/Inf; the whole
//!               parameters' gradients through the reducer as at stage 0; one verdict
//! optimizer     steps the shards (its state is shard-shaped) and the whole parameters
//! ```
//! The shards' collectives run on a TCP group of their own (store prefix `…/shard`), formed
//! beside the job's, because they run inside Burn's forward and backward.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

use crate::ddp::buckets::finite::{probe, FiniteScan, GradientCheck};
use crate::ddp::fsdp::block_storage::RestoreReport;
use crate::ddp::fsdp::shard_gather::ShardComm;
use crate::ddp::fsdp::shard_prefetch::{BlockShards, Prefetcher};
use crate::ddp::fsdp::sharded_module::{
    discover_blocks, gather_module, shard_module, ShardLayout, ShardedForward,
};
use crate::ddp::module::param_checksum_where;
use crate::ddp::options::groups::ProcessGroupRole;
use crate::error::{DdpError, ShardGatherError};
use crate::group::{ProcessGroup, TcpProcessGroup};
use crate::init::Distributed;
use crate::kernels::HalfFormat;

/// One rank's stage-3 state (module docs). `pub` as the payload of the public
/// [`Sharding::Full`](crate::ddp::sharding::Sharding::Full); its module and methods are the
/// crate's.
pub struct FullyShardedState {
    comm: ShardComm,
    layout: Option<ShardLayout>,
    /// The marked blocks' sharded parameters, in the forward's order.
    blocks: Vec<Vec<ParamId>>,
    prefetcher: Prefetcher,
}

impl FullyShardedState {
    /// Forms the stage-3 groups beside `dist`'s (the shards' own, and the prefetch thread's);
    /// the gradients travel in `compression`'s format ([`ShardComm::new`]). Collective: every
    /// rank calls it at the same point, with the same `compression` (deadline: the job group's
    /// timeout).
    pub(crate) fn form(
        dist: &Distributed,
        compression: Option<HalfFormat>,
    ) -> Result<Self, DdpError> {
        let options = ProcessGroupRole::ShardGather.options(dist.group.options());
        let (rank, world) = (dist.env.rank, dist.env.world_size);
        let group = TcpProcessGroup::new(dist.store.clone(), rank, world, options)?;
        let comm = ShardComm::new(group, compression);
        let gathered = comm.gathered_bytes().clone();
        let report: RestoreReport = {
            let comm = comm.clone();
            Arc::new(move |restore| match restore {
                Ok(bytes) => comm.count_restored_block(bytes),
                Err(e) => comm.record(ShardGatherError::Prefetch(e)),
            })
        };
        let prefetcher = Prefetcher::start(
            dist.store.clone(),
            rank,
            world,
            dist.group.options(),
            gathered,
            report,
        )?;
        Ok(Self {
            comm,
            layout: None,
            blocks: Vec::new(),
            prefetcher,
        })
    }

    /// The group of the gathers and reduce-scatters (its counters).
    pub(crate) fn comm(&self) -> &ShardComm {
        &self.comm
    }

    /// The sharded parameters' full shapes, once [`shard`](Self::shard) has run.
    pub(crate) fn layout(&self) -> Option<&ShardLayout> {
        self.layout.as_ref()
    }

    /// `model` with the parameters of the blocks that `forward` (a forward of the whole model)
    /// marks replaced by this rank's shards. Local: every rank cuts equal replicas the same
    /// way. Fails ([`DdpError::Options`]) when `forward` marks no block.
    pub(crate) fn shard<M: Module>(
        &mut self,
        model: M,
        forward: impl FnOnce(&M),
    ) -> Result<M, DdpError> {
        let blocks = discover_blocks(|| forward(&model));
        if blocks.is_empty() {
            return Err(DdpError::Options(
                "ZeRO stage 3 shards the parameters of the blocks a model marks with burn_ddp::mark_block, and this model's forward marked none: mark each repeated block (a transformer layer, a residual block, a hidden layer) at its entry, or use ZeRO stage 2".into(),
            ));
        }
        let ids: HashSet<ParamId> = blocks.iter().flatten().copied().collect();
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let (model, layout) = shard_module(model, rank, world, |id| ids.contains(&id))
            .map_err(|e| DdpError::Unsupported(e.to_string()))?;
        self.layout = Some(layout);
        self.blocks = blocks;
        Ok(model)
    }

    fn layout_or_error(&self) -> Result<&ShardLayout, DdpError> {
        self.layout.as_ref().ok_or_else(|| {
            DdpError::Options(
                "ZeRO stage 3: the model is not sharded yet; call DataParallel::fully_shard after prepare, before the first step".into(),
            )
        })
    }

    /// The guard under which `mark_block` gathers (`None` before [`shard`](Self::shard)),
    /// with every block of `model` queued for the prefetch thread (the shards' tensor
    /// handles: the thread reads each block's when its turn comes).
    pub(crate) fn forward<M: Module>(&self, model: &M) -> Option<ShardedForward> {
        let layout = self.layout.as_ref()?;
        // The peak of whole parameters held at once is taken over this forward and backward
        // (the guard ends the window).
        self.comm.gathered_bytes().begin_window();
        let mut shards = shard_handles(model, layout);
        let blocks: Option<Vec<BlockShards>> = self
            .blocks
            .iter()
            .map(|ids| {
                let mut block = BlockShards {
                    ids: ids.clone(),
                    shards: Vec::with_capacity(ids.len()),
                    numels: Vec::with_capacity(ids.len()),
                };
                for id in ids {
                    block.shards.push(shards.remove(id)?);
                    block.numels.push(layout.full_shape(*id)?.iter().product());
                }
                Some(block)
            })
            .collect();
        Some(match blocks.and_then(|b| self.prefetcher.prefetch(b)) {
            Some(stream) => ShardedForward::enter_prefetched(layout, &self.comm, stream),
            None => ShardedForward::enter(layout, &self.comm),
        })
    }

    /// `model` with its shards gathered whole (for validation, or to save the whole model).
    /// Collective over the stage-3 group.
    pub(crate) fn gathered<M: Module>(&self, model: &M) -> Result<M, DdpError> {
        let whole = gather_module(model, self.layout_or_error()?, &self.comm);
        self.check()?;
        Ok(whole)
    }

    /// The first gather or reduce-scatter failure since the last look.
    pub(crate) fn check(&self) -> Result<(), DdpError> {
        match self.comm.take_error() {
            Some(e) => Err(DdpError::Unsupported(e.to_string())),
            None => Ok(()),
        }
    }

    /// Takes the shards' gradients out of `grads`, each the mean over the ranks (the
    /// reduce-scatter's), as the reducer gives the others. Returns
    /// them and whether this rank's shard of the mean holds a NaN or an infinity (when
    /// `check_finite`). Local; fails when a gather or reduce-scatter of this step failed.
    pub(crate) fn take_shard_gradients<M: Module>(
        &self,
        model: &M,
        grads: &mut GradientsParams,
        check_finite: bool,
    ) -> Result<(GradientsParams, bool), DdpError> {
        self.check()?;
        let layout = self.layout_or_error()?;
        struct Take<'a> {
            layout: &'a ShardLayout,
            grads: &'a mut GradientsParams,
            taken: GradientsParams,
            probe: Option<Tensor<1>>,
            check: bool,
        }
        impl ModuleVisitor for Take<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if self.layout.full_shape(param.id).is_none() {
                    return;
                }
                let Some(g) = self.grads.remove::<D>(param.id) else {
                    return;
                };
                if self.check {
                    let p = probe(g.clone());
                    self.probe = Some(match self.probe.take() {
                        Some(sum) => sum + p,
                        None => p,
                    });
                }
                self.taken.register(param.id, g);
            }
        }
        let mut take = Take {
            layout,
            grads,
            taken: GradientsParams::new(),
            probe: None,
            check: check_finite,
        };
        model.visit(&mut take);
        let mut scan = FiniteScan::new(check_finite);
        if let Some(probe) = take.probe {
            scan.device_probe(probe)?;
        }
        Ok((take.taken, scan.found_nonfinite()))
    }

    /// A checksum of the parameters every rank holds whole (the shards differ by rank).
    pub(crate) fn replicated_checksum<M: Module>(&self, model: &M) -> u64 {
        let layout = self.layout.as_ref();
        param_checksum_where(model, |id| {
            layout.is_none_or(|layout| layout.full_shape(id).is_none())
        })
    }
}

/// The shards' gradients `taken` by [`FullyShardedState::take_shard_gradients`] (with
/// whether this rank's held a NaN or an infinity) joined to `check`, the verdict on the
/// gradients of the parameters held whole (averaged as at stage 0): one verdict over `group`
/// (an all-gather of each rank's flag), and the shards' gradients moved back into `grads`.
/// Collective over `group` (the job's), once per optimizer step; every rank gets the same
/// verdict.
///
/// # Errors
/// The all-gather's failure.
pub(crate) fn join_shard_gradients<M: Module>(
    group: &mut TcpProcessGroup,
    model: &M,
    grads: &mut GradientsParams,
    mut check: GradientCheck,
    (shards, nonfinite): (GradientsParams, bool),
) -> Result<GradientCheck, DdpError> {
    let mut flags = vec![0u8; group.world_size()];
    group.all_gather(&[nonfinite as u8], &mut flags)?;
    let mut ranks: Vec<usize> = check.nonfinite_ranks;
    ranks.extend(
        flags
            .iter()
            .enumerate()
            .filter(|(_, &f)| f != 0)
            .map(|(r, _)| r),
    );
    ranks.sort_unstable();
    ranks.dedup();
    check.nonfinite_ranks = ranks;
    grads_extend(model, grads, shards);
    Ok(check)
}

/// Moves every gradient of `from` that `model` has a parameter for into `grads` (the shards'
/// gradients back beside the whole parameters'). Local.
fn grads_extend<M: Module>(model: &M, grads: &mut GradientsParams, mut from: GradientsParams) {
    struct Move<'a> {
        to: &'a mut GradientsParams,
        from: &'a mut GradientsParams,
    }
    impl ModuleVisitor for Move<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.from.remove::<D>(param.id) {
                self.to.register(param.id, g);
            }
        }
    }
    model.visit(&mut Move {
        to: grads,
        from: &mut from,
    });
}

/// This rank's shard of each sharded parameter of `model`, flat (tensor handles).
fn shard_handles<M: Module>(model: &M, layout: &ShardLayout) -> HashMap<ParamId, Tensor<1>> {
    struct Handles<'a> {
        layout: &'a ShardLayout,
        shards: HashMap<ParamId, Tensor<1>>,
    }
    impl ModuleVisitor for Handles<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.layout.full_shape(param.id).is_some() {
                self.shards
                    .insert(param.id, param.val().detach().flatten(0, D - 1));
            }
        }
    }
    let mut handles = Handles {
        layout,
        shards: HashMap::new(),
    };
    model.visit(&mut handles);
    handles.shards
}

#[cfg(test)]
mod tests {
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::{Device, Tensor};

    use super::*;

    #[derive(Module, Debug)]
    struct Net {
        a: Linear,
        b: Linear,
    }

    /// A forward that marks no block is refused as bad input naming `mark_block`; one that
    /// marks `b` gets `b`'s weight and bias sharded and `a` left whole.
    #[test]
    fn only_the_blocks_the_forward_marks_are_sharded_and_none_is_refused() {
        let dist = Distributed::standalone();
        let mut state = FullyShardedState::form(&dist, None).unwrap();
        let device = Device::flex().autodiff();
        let net = || Net {
            a: LinearConfig::new(3, 4).init(&device),
            b: LinearConfig::new(4, 2).init(&device),
        };
        let x = || Tensor::<2>::zeros([1, 3], &device);
        let refused = state
            .shard(net(), |m| {
                let _ = m.b.forward(m.a.forward(x()));
            })
            .unwrap_err();
        assert!(
            refused.is_usage() && refused.to_string().contains("mark_block"),
            "{refused}"
        );
        assert!(state.layout().is_none());
        let sharded = state
            .shard(net(), |m| {
                let h = m.a.forward(x());
                let _ = crate::mark_block(&h, &m.b).forward(h);
            })
            .unwrap();
        let layout = state.layout().unwrap();
        assert_eq!(layout.len(), 2);
        assert_eq!(layout.full_shape(sharded.b.weight.id), Some(&[4, 2][..]));
        assert_eq!(layout.full_shape(sharded.a.weight.id), None);
    }
}
