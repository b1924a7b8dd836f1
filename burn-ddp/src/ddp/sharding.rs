//! [`Sharding`]: how a rank holds the model, as the ZeRO stage says — the one value
//! [`DataParallel`](crate::DataParallel) keeps for it, and the stage-specific parts of the
//! DDP step (which gradients a rank keeps, who sends what after the optimizer) dispatched on
//! it in one place each.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

use crate::ddp::fsdp::fully_sharded::FullyShardedState;
use crate::ddp::options::zero_stage::ZeroStage;
use crate::ddp::zero::sharded_sync::ShardedSync;
use crate::error::DdpError;
use crate::init::Distributed;
use crate::kernels::HalfFormat;

/// How this rank holds the parameters, their gradients and their optimizer state.
pub enum Sharding {
    /// ZeRO stage 0 (plain DDP): every rank holds and steps every parameter.
    Replicated,
    /// ZeRO stages 1 and 2: each rank owns a share of the parameters, keeps their optimizer
    /// state, steps them and sends them to the others (`sync`: the owners and the
    /// parameters' all-gather). `gradients` (stage 2): it keeps only their gradients too,
    /// reduce-scattered bucket by bucket.
    Owners { sync: ShardedSync, gradients: bool },
    /// ZeRO stage 3 (FSDP): the marked blocks' weights cut into shards, one per rank.
    Full(FullyShardedState),
}

impl Sharding {
    /// The sharding of `stage`. Collective at stage 3 (its groups are formed through `dist`'s
    /// store, within the job group's deadline); local otherwise.
    pub fn form(
        stage: ZeroStage,
        compression: Option<HalfFormat>,
        dist: &Distributed,
    ) -> Result<Self, DdpError> {
        Ok(match stage {
            ZeroStage::Off => Self::Replicated,
            ZeroStage::OptimizerState | ZeroStage::Gradients => Self::Owners {
                sync: ShardedSync::new(compression),
                gradients: stage == ZeroStage::Gradients,
            },
            ZeroStage::Parameters => Self::Full(FullyShardedState::form(dist, compression)?),
        })
    }

    /// The ZeRO stage it implements.
    pub fn stage(&self) -> ZeroStage {
        match self {
            Self::Replicated => ZeroStage::Off,
            Self::Owners {
                gradients: false, ..
            } => ZeroStage::OptimizerState,
            Self::Owners {
                gradients: true, ..
            } => ZeroStage::Gradients,
            Self::Full(_) => ZeroStage::Parameters,
        }
    }

    /// Stages 1 and 2: the owners and the parameters' all-gather.
    pub fn owners(&mut self) -> Option<&mut ShardedSync> {
        match self {
            Self::Owners { sync, .. } => Some(sync),
            _ => None,
        }
    }

    /// Stage 3: the shards' groups and layout.
    pub fn full(&self) -> Option<&FullyShardedState> {
        match self {
            Self::Full(state) => Some(state),
            _ => None,
        }
    }
}

/// Moves every gradient of `from` that `model` has a parameter for into `grads` (stage 3:
/// the shards' gradients back beside the whole parameters').
pub fn grads_extend<M: Module>(model: &M, grads: &mut GradientsParams, mut from: GradientsParams) {
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
