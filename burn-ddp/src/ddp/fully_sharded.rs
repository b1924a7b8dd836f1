//! ZeRO stage 3 inside the DDP step ([`FullyShardedState`]): which parameters are sharded
//! (those of the blocks a model marks), the group their gathers and reduce-scatters run on,
//! and what the step does with their gradients.
//!
//! ```text
//! fully_shard   one forward of the whole model records the marked blocks' parameters
//!               (discover_blocks), then each rank keeps its flat shard of them (shard_module)
//! forward       mark_block gathers each block whole (ShardedForward); under Burn's gradient
//!               checkpointing the whole parameters are dropped after use, gathered again
//!               for the block's backward
//! backward      each gathered parameter's gradient is reduce-scattered (summed) into its shard
//! step          the shards' gradients × 1/world (the mean), checked for NaN/Inf; the whole
//!               parameters' gradients through the reducer as at stage 0; one verdict
//! optimizer     steps the shards (its state is shard-shaped) and the whole parameters
//! ```
//! The shards' collectives run on a TCP group of their own (store prefix `…/shard`), formed
//! beside the job's, because they run inside Burn's forward and backward.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

use super::finite::{probe, FiniteScan};
use super::module::param_checksum_where;
use super::shard_gather::ShardComm;
use super::sharded_module::{
    discover_blocks, gather_module, shard_module, ShardLayout, ShardedForward,
};
use crate::error::DdpError;
use crate::group::TcpProcessGroup;
use crate::init::Distributed;

/// The suffix of the stage-3 group's store prefix.
pub const STORE_SUFFIX: &str = "/shard";

/// One rank's stage-3 state (module docs).
pub struct FullyShardedState {
    comm: ShardComm,
    layout: Option<ShardLayout>,
}

impl FullyShardedState {
    /// Forms the stage-3 group beside `dist`'s. Collective: every rank calls it at the same
    /// point (deadline: the job group's timeout).
    pub fn form(dist: &Distributed) -> Result<Self, DdpError> {
        let mut options = dist.group.options().clone();
        options.store_prefix.push_str(STORE_SUFFIX);
        let group = TcpProcessGroup::new(
            dist.store.clone(),
            dist.env.rank,
            dist.env.world_size,
            options,
        )?;
        Ok(Self {
            comm: ShardComm::new(group),
            layout: None,
        })
    }

    /// The group of the gathers and reduce-scatters (its counters).
    pub fn comm(&self) -> &ShardComm {
        &self.comm
    }

    /// The sharded parameters' full shapes, once [`shard`](Self::shard) has run.
    pub fn layout(&self) -> Option<&ShardLayout> {
        self.layout.as_ref()
    }

    /// `model` with the parameters of the blocks that `forward` (a forward of the whole model)
    /// marks replaced by this rank's shards. Local: every rank cuts equal replicas the same
    /// way. Fails ([`DdpError::Options`]) when `forward` marks no block.
    pub fn shard<M: Module>(&mut self, model: M, forward: impl FnOnce(&M)) -> Result<M, DdpError> {
        let ids = discover_blocks(|| forward(&model));
        if ids.is_empty() {
            return Err(DdpError::Options(
                "ZeRO stage 3 shards the parameters of the blocks a model marks with burn_ddp::mark_block, and this model's forward marked none: mark each repeated block (a transformer layer, a residual block, a hidden layer) at its entry, or use ZeRO stage 2".into(),
            ));
        }
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let (model, layout) = shard_module(model, rank, world, |id| ids.contains(&id))
            .map_err(|e| DdpError::Unsupported(e.to_string()))?;
        self.layout = Some(layout);
        Ok(model)
    }

    fn layout_or_error(&self) -> Result<&ShardLayout, DdpError> {
        self.layout.as_ref().ok_or_else(|| {
            DdpError::Options(
                "ZeRO stage 3: the model is not sharded yet; call DataParallel::fully_shard after prepare, before the first step".into(),
            )
        })
    }

    /// The guard under which `mark_block` gathers (`None` before [`shard`](Self::shard)).
    pub fn forward(&self) -> Option<ShardedForward> {
        self.layout
            .as_ref()
            .map(|layout| ShardedForward::enter(layout, &self.comm))
    }

    /// `model` with its shards gathered whole (for validation, or to save the whole model).
    /// Collective over the stage-3 group.
    pub fn gathered<M: Module>(&self, model: &M) -> Result<M, DdpError> {
        let whole = gather_module(model, self.layout_or_error()?, &self.comm);
        self.check()?;
        Ok(whole)
    }

    /// The first gather or reduce-scatter failure since the last look.
    pub fn check(&self) -> Result<(), DdpError> {
        match self.comm.take_error() {
            Some(e) => Err(DdpError::Unsupported(e.to_string())),
            None => Ok(()),
        }
    }

    /// Takes the shards' gradients out of `grads`, each the sum over the ranks (the
    /// reduce-scatter's) times `1 / world`: the mean, as the reducer gives the others. Returns
    /// them and whether this rank's shard of the mean holds a NaN or an infinity (when
    /// `check_finite`). Local; fails when a gather or reduce-scatter of this step failed.
    pub fn take_shard_gradients<M: Module>(
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
            scale: f32,
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
                let g = g.mul_scalar(self.scale);
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
            scale: 1.0 / layout.world_size as f32,
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
    pub fn replicated_checksum<M: Module>(&self, model: &M) -> u64 {
        let layout = self.layout.as_ref();
        param_checksum_where(model, |id| {
            layout.is_none_or(|layout| layout.full_shape(id).is_none())
        })
    }
}
