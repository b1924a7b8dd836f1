//! [`Sharding`]: how a rank holds the model, as the ZeRO stage says — the one value
//! [`DataParallel`](crate::DataParallel) keeps for it — and every part of the DDP step that
//! depends on the stage, as its methods: what sharding the model and its forward take, which
//! gradients a rank keeps and how they reach it, who sends what after the optimizer, what a
//! checkpoint keeps and gathers of the optimizer state, the counters, which checksum compares
//! the replicas, whether the job can be re-formed. `DataParallel` delegates to them and never
//! matches on the stage itself. Each method dispatches on the mode in one `match`; what is
//! specific to a mode is in its own folder: stages 1 and 2 in [`crate::ddp::zero`], stage 3 in
//! [`crate::ddp::fsdp`].

use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Bytes;

use crate::ddp::buckets::finite::GradientCheck;
use crate::ddp::buckets::stats::ReducerStats;
use crate::ddp::fsdp::fully_sharded::{join_shard_gradients, FullyShardedState};
use crate::ddp::fsdp::shard_gather::ShardComm;
use crate::ddp::fsdp::sharded_module::{ShardLayout, ShardedForward};
use crate::ddp::gradient_sync::GradientSync;
use crate::ddp::module::param_checksum;
use crate::ddp::options::zero_stage::ZeroStage;
use crate::ddp::sync_batch_norm::sync_group;
use crate::ddp::zero::sharded_sync::{self, ShardedSync};
use crate::error::DdpError;
use crate::group::{ProcessGroup, TcpProcessGroup};
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

    /// Stage 3: the shards' groups and layout.
    fn full(&self) -> Option<&FullyShardedState> {
        match self {
            Self::Full(state) => Some(state),
            _ => None,
        }
    }

    /// Stage 3: `model` with the parameters of the blocks that `forward` (one forward of the
    /// model) marks cut into shards, this rank's kept
    /// ([`FullyShardedState::shard`]); at stages 0 to 2, `model` as it is, `forward` not run.
    /// Local (every rank cuts its equal replica the same way).
    pub(crate) fn shard<M: Module>(
        &mut self,
        model: M,
        forward: impl FnOnce(&M),
    ) -> Result<M, DdpError> {
        match self {
            Self::Full(state) => state.shard(model, forward),
            _ => Ok(model),
        }
    }

    /// Stage 3, once sharded: the guard under which the marked blocks of `model` are gathered
    /// whole for a forward, queued for the prefetch thread. `None` otherwise. Collective over
    /// the stage-3 group (it queues this forward's gathers on every rank).
    pub(crate) fn forward<M: Module>(&self, model: &M) -> Option<ShardedForward> {
        self.full()?.forward(model)
    }

    /// Stage 3, once sharded: a copy of `model` with every shard gathered whole; otherwise a
    /// clone. Collective over the stage-3 group when it gathers; local otherwise.
    pub(crate) fn gathered<M: Module>(&self, model: &M) -> Result<M, DdpError> {
        match self.full() {
            Some(state) if state.layout().is_some() => state.gathered(model),
            _ => Ok(model.clone()),
        }
    }

    /// Stage 3: the group of the gathers and reduce-scatters (its counters). Local.
    pub(crate) fn comm(&self) -> Option<&ShardComm> {
        self.full().map(FullyShardedState::comm)
    }

    /// Stage 3, once sharded: the sharded parameters' full shapes. Local.
    pub(crate) fn layout(&self) -> Option<&ShardLayout> {
        self.full().and_then(FullyShardedState::layout)
    }

    /// Arms the next backward for `path`'s gradient overlap ([`GradientSync::arm_overlap`]:
    /// `earlier`, the step's earlier micro-batches' gradients; `weight`, this one's factor) at
    /// stage 0, and at stage 2 with each bucket reduce-scattered to its owners (the plan for
    /// `world` ranks). A no-op at stage 1 (its flat buffer is reduced after backward) and
    /// stage 3 (its gradients are reduce-scattered by the backward itself). Local.
    pub(crate) fn arm_overlap<M: Module>(
        &mut self,
        path: &mut GradientSync,
        model: &M,
        earlier: Option<&GradientsParams>,
        weight: f32,
        world: usize,
    ) {
        let owners = match self {
            Self::Replicated => None,
            Self::Owners {
                sync,
                gradients: true,
            } => Some(sync.plan(model, world)),
            Self::Owners {
                gradients: false, ..
            }
            | Self::Full(_) => return,
        };
        path.arm_overlap(model, earlier, weight, owners);
    }

    /// What the optimizer step needs from the other ranks over `group`, as the stage says.
    /// Stage 0: [`average_gradients`] through `path`. Stage 1: `grads` keeps only the
    /// gradients of the parameters this rank owns, each the mean over the ranks (one
    /// reduce-scatter of the whole gradient after backward). Stage 2: the same through
    /// `path`, one reduce-scatter per bucket of its plan (during backward for marked blocks).
    /// Stage 3: the shards' gradients (reduce-scattered by the backward; checked for NaN /
    /// ±Inf when `check_finite`) taken out, the whole parameters' averaged as at stage 0, then
    /// one verdict on both over `group`. Collective, once per optimizer step; every rank gets
    /// the same verdict.
    ///
    /// # Errors
    /// A collective's failure; [`DdpError::SyncBatchNorm`] when synchronised BatchNorm failed
    /// in this step's forward or backward (before any gradient is sent); at stage 3 a failed
    /// gather or reduce-scatter of this step, or a model not sharded yet.
    pub(crate) fn sync_gradients<M: Module>(
        &mut self,
        path: &mut GradientSync,
        group: &mut TcpProcessGroup,
        model: &M,
        grads: &mut GradientsParams,
        check_finite: bool,
    ) -> Result<GradientCheck, DdpError> {
        let world = group.world_size();
        match self {
            Self::Replicated => average_gradients(path, group, model, grads),
            Self::Owners {
                sync,
                gradients: false,
            } => {
                check_sync_batch_norm()?;
                sync.reduce_to_owners(group, model, grads)
            }
            Self::Owners {
                sync,
                gradients: true,
            } => {
                check_sync_batch_norm()?;
                let owners = sync.plan(model, world);
                path.sync(group, model, grads, Some(owners))
            }
            Self::Full(state) => {
                let taken = state.take_shard_gradients(model, grads, check_finite)?;
                let check = average_gradients(path, group, model, grads)?;
                join_shard_gradients(group, model, grads, check, taken)
            }
        }
    }

    /// After the optimizer step. Stages 1 and 2: every rank sends the parameters it stepped
    /// over `group` and receives the others' (the replicas are bit-identical again); other
    /// stages: `model` as it is. Collective at stages 1 and 2; only after a step that was taken.
    pub(crate) fn finish_step<M: Module>(
        &mut self,
        group: &mut TcpProcessGroup,
        model: M,
    ) -> Result<M, DdpError> {
        match self {
            Self::Owners { sync, .. } => sync.gather_parameters(group, model),
            _ => Ok(model),
        }
    }

    /// Stages 1 and 2: `optim` without the state of the parameters that another rank than
    /// `rank` (of `world`) owns; other stages: `optim` as it is. Local.
    ///
    /// # Errors
    /// [`DdpError::State`] when the state cannot be split (stages 1 and 2 only).
    pub(crate) fn keep_owned_state<M: Module>(
        &mut self,
        model: &M,
        optim: ModuleOptimizer,
        rank: usize,
        world: usize,
    ) -> Result<ModuleOptimizer, DdpError> {
        match self {
            Self::Owners { sync, .. } => {
                sharded_sync::keep_owned_state(optim, sync.plan(model, world), rank)
            }
            _ => Ok(optim),
        }
    }

    /// Stages 1 and 2: every rank's optimizer state merged on `group`'s rank 0 as burnpack
    /// bytes (`Some` there, `None` elsewhere; [`sharded_sync::gather_state`]). Other stages:
    /// `None`. Collective over `group` at stages 1 and 2; local otherwise.
    ///
    /// # Errors
    /// What the group reports, and [`DdpError::State`] when a rank's state cannot be
    /// serialised or read.
    pub(crate) fn gather_optimizer_state(
        &self,
        group: &mut TcpProcessGroup,
        optim: &ModuleOptimizer,
    ) -> Result<Option<Bytes>, DdpError> {
        match self {
            Self::Owners { .. } => sharded_sync::gather_state(optim, group, 0),
            _ => Ok(None),
        }
    }

    /// `path`'s counters with this mode's own added: stages 1 and 2, the owners' reductions
    /// and the parameters' all-gathers; stage 3, the shards' gathers and reduce-scatters.
    /// Local.
    pub(crate) fn gradient_stats(&self, path: ReducerStats) -> ReducerStats {
        match self {
            Self::Replicated => path,
            Self::Owners { sync, .. } => {
                let zero = sync.stats();
                ReducerStats {
                    syncs: path.syncs + zero.syncs,
                    bucket_all_reduces: path.bucket_all_reduces + zero.bucket_all_reduces,
                    bytes_reduced: path.bytes_reduced + zero.bytes_reduced,
                }
            }
            Self::Full(state) => {
                let comm = state.comm();
                ReducerStats {
                    syncs: path.syncs,
                    bucket_all_reduces: path.bucket_all_reduces
                        + comm.gathers()
                        + comm.reduce_scatters(),
                    bytes_reduced: path.bytes_reduced + comm.bytes(),
                }
            }
        }
    }

    /// The checksum of `model` that every replica must share: all its parameters, or at stage
    /// 3 those held whole (the shards differ by rank). Local.
    pub(crate) fn replica_checksum<M: Module>(&self, model: &M) -> u64 {
        match self {
            Self::Full(state) => state.replicated_checksum(model),
            _ => param_checksum(model),
        }
    }

    /// Whether the job's groups may be formed again among other ranks: only at stage 0. At
    /// stages 1 to 3 each rank holds the only live copy of its shard of the training state.
    /// Local.
    ///
    /// # Errors
    /// [`DdpError::Membership`] at stages 1 to 3.
    pub(crate) fn check_regroup(&self) -> Result<(), DdpError> {
        match self {
            Self::Replicated => Ok(()),
            _ => Err(DdpError::Membership(format!(
                "cannot re-form the job at ZeRO stage {}: each rank holds the only live copy of its shard of the training state, so a lost rank's shard is only in the newest checkpoint; restart every rank from it (the launcher's --max-restarts)",
                self.stage()
            ))),
        }
    }
}

/// Replaces every gradient with its mean over `group`'s ranks through `path` (the host, or
/// NCCL; compressed as its options say), whatever the stage: stage 0's step, and stage 3's for
/// the parameters held whole. Collective, once per optimizer step, after all the micro-batches
/// of the step. Returns which ranks' own gradients held a NaN or an infinity (the same on
/// every rank).
///
/// # Errors
/// A collective's failure; [`DdpError::SyncBatchNorm`] when synchronised BatchNorm failed in
/// this step's forward or backward (reported here, before any gradient is sent).
pub(crate) fn average_gradients<M: Module>(
    path: &mut GradientSync,
    group: &mut TcpProcessGroup,
    model: &M,
    grads: &mut GradientsParams,
) -> Result<GradientCheck, DdpError> {
    check_sync_batch_norm()?;
    path.sync(group, model, grads, None)
}

/// The failure synchronised BatchNorm recorded in this step's forward or backward, if any
/// ([`crate::ddp::sync_batch_norm::sync_group`]). Local.
fn check_sync_batch_norm() -> Result<(), DdpError> {
    match sync_group::take_error() {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}
